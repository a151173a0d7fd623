"""HTTP/2 abuse of the gateway's public port, in short (``bench/h2_abuse.py`` runs each attack
for 30 s): under each attack, at least 95 % of the legitimate calls sent beside it succeed, the
gateway's RSS grows at most 100 MiB and comes back within 50 MiB, and it serves normally after.

Every attack goes to a gateway this test starts, on loopback, from a child process it kills."""

from __future__ import annotations

import pathlib

import pytest

from bench import h2_abuse

ATTACK_S = 6.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with h2_abuse.target_gateway(tmp_path_factory.mktemp("h2-abuse")) as target:
        yield target


@pytest.mark.parametrize("attack", h2_abuse.ATTACKS)
def test_the_gateway_keeps_serving_under_http2_abuse(gateway, attack):
    target, pid = gateway
    (result,) = h2_abuse.measure(target, pid, (attack,), seconds=ATTACK_S)
    # The attack ran: it sent frames or held its connections.
    assert result["attacker"]["frames"] > 0 or result["attacker"]["connections"] >= h2_abuse.SLOW_CONNECTIONS, result["attacker"]
    assert result["legit_sent"] >= ATTACK_S * h2_abuse.LEGIT_PER_S * 0.6
    assert result["success_ratio"] >= h2_abuse.GOAL_SUCCESS, result
    assert result["rss_peak_mib"] - result["rss_baseline_mib"] <= h2_abuse.GOAL_GROWTH_MIB, result
    assert result["rss_after_mib"] - result["rss_baseline_mib"] <= h2_abuse.GOAL_LEFT_MIB, result
    assert result["after_ok"] == result["after_sent"] > 0, result
    assert result["met"]


def test_the_report_renders_an_h2_abuse_result(tmp_path: pathlib.Path):
    from bench.common import write_result
    from bench.report import write_report

    result = {
        "attack": "rapid_reset", "seconds": 1.0, "attacker": {"frames": 10, "connections": 1, "closed_by_server": 0},
        "legit_sent": 4, "legit_ok": 4, "legit_ms": {"count": 4, "mean": 5.0, "median": 5.0, "p99": 6.0},
        "rss_baseline_mib": 200.0, "rss_peak_mib": 210.0, "rss_after_mib": 201.0, "cpu_s": 1.0, "after_ok": 8, "after_sent": 8,
        "errors": {}, "success_ratio": 1.0, "met": True,
    }
    goals = {"success": h2_abuse.GOAL_SUCCESS, "growth_mib": h2_abuse.GOAL_GROWTH_MIB, "left_mib": h2_abuse.GOAL_LEFT_MIB}
    payload = {"attack_s": 1.0, "legit_per_s": 4.0, "legit_timeout_s": 10.0, "goals": goals, "results": [result]}
    write_result("h2_abuse", payload, command="pytest", results_dir=tmp_path)
    report = write_report(tmp_path, tmp_path / "BENCHMARKS.md").read_text()
    assert "## HTTP/2 abuse of the gateway's public port" in report
    assert "| rapid_reset | 10 frames on 1 connections (0 closed by the gateway) | 4 / 4 | 5.0 / 6.0 | 200 / 210 / 201 | 1.0 | 8 / 8 | met |" in report

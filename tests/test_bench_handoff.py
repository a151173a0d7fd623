"""The handoff benchmark (bench/handoff.py): a quick run through the real EC connector pieces (a
producer process with the arena and NIXL publisher, ConsumerScheduler, NixlReader and a raw READ
here) writes a complete, well-formed result with every byte verified and every lease ended, and a
corrupted payload is caught rather than timed."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
from typing import Any

import pytest
import torch

from bench import handoff
from bench.report import write_report

pytestmark = pytest.mark.timeout(120)

SUMMARY_KEYS = {"count", "mean", "median", "p99"}
ENVELOPE_KEYS = {"schema_version", "name", "command", "finished_at", "machine"}
PAYLOAD_KEYS = {"experiment", "config", "results", "batched", "first_contact_ms", "ratios", "goals", "fixed_cost_us"}


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_summary(summary: Any, count: int) -> None:
    assert isinstance(summary, dict) and set(summary) == SUMMARY_KEYS
    assert summary["count"] == count
    assert all(positive(summary[key]) for key in ("mean", "median", "p99")), summary
    assert summary["p99"] >= summary["median"]


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    results_dir = tmp_path_factory.mktemp("handoff")
    path = handoff.run(quick=True, results_dir=results_dir, command="test")
    return path, json.loads(path.read_text())


def test_quick_run_writes_the_documented_schema(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    path, doc = quick_result
    assert path.name == "handoff.json"
    assert set(doc) == ENVELOPE_KEYS | PAYLOAD_KEYS
    assert (doc["name"], doc["experiment"], doc["command"]) == ("handoff", "handoff", "test")

    config = doc["config"]
    assert config["sizes"] == handoff.QUICK_SIZES
    assert config["iterations"] == {str(size): handoff.QUICK_ITERATIONS for size in handoff.QUICK_SIZES}
    assert config["skipped"] == []  # every quick size fits a gRPC message
    assert config["leases_left"] == 0  # every READ's notification ended its lease

    results = doc["results"]
    assert [(r["method"], r["bytes"]) for r in results] == [(m, size) for size in handoff.QUICK_SIZES for m in handoff.METHODS]
    for result in results:
        assert set(result) == {"method", "bytes", "latency_us", "gb_per_s"}
        check_summary(result["latency_us"], handoff.QUICK_ITERATIONS)
        assert positive(result["gb_per_s"])
        assert result["gb_per_s"] == pytest.approx(result["bytes"] / result["latency_us"]["median"] / 1e3)

    batched = doc["batched"]
    assert [(b["method"], b["items"], b["item_bytes"]) for b in batched] == [
        (method, items, item_bytes) for items, item_bytes in handoff.BATCHES for method in handoff.BATCHED_METHODS
    ]
    for entry in batched:
        assert set(entry) == {"method", "items", "item_bytes", "one_transfer_us", "per_item_transfers_us", "speedup"}
        check_summary(entry["one_transfer_us"], config["batched_iterations"])
        check_summary(entry["per_item_transfers_us"], config["batched_iterations"])
        assert entry["speedup"] == pytest.approx(entry["per_item_transfers_us"]["median"] / entry["one_transfer_us"]["median"])

    assert set(doc["first_contact_ms"]) == {"ec_consumer", "nixl_reader", "raw_read", "grpc_inline"}
    assert all(positive(v) for v in doc["first_contact_ms"].values())
    ratios = doc["ratios"]
    assert set(ratios) == {"ec_consumer_over_memcpy", "raw_read_over_memcpy", "ec_consumer_over_memcpy_fresh", "ec_consumer_over_raw_read", "ec_consumer_over_grpc_inline_at_1MiB"}
    assert all(set(ratios[key]) == {str(handoff.MIB)} and positive(ratios[key][str(handoff.MIB)]) for key in ratios if not key.endswith("1MiB"))
    assert positive(ratios["ec_consumer_over_grpc_inline_at_1MiB"])
    assert [set(goal) for goal in doc["goals"]] == [{"goal", "value", "target", "met"}] * 4
    assert set(doc["fixed_cost_us"]) == {str(size) for size in handoff.QUICK_SIZES}


def test_quick_run_verified_every_size(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    _, doc = quick_result
    item_sizes = {item_bytes for _, item_bytes in handoff.BATCHES}
    verified = doc["config"]["verified"]
    sizes = set(handoff.QUICK_SIZES)
    assert {method: set(v) for method, v in verified.items()} == {
        "ec_consumer": sizes | item_sizes,
        "nixl_reader": sizes,
        "raw_read": sizes | item_sizes,
        "grpc_inline": sizes | item_sizes,
        "memcpy": sizes,
        "memcpy_fresh": sizes,
    }


def test_quick_run_renders_in_the_report(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    path, _ = quick_result
    text = write_report(path.parent, out=path.parent / "BENCHMARKS.md").read_text()
    assert "## Embedding handoff" in text and "Command: `test`" in text and "| ec_consumer | 1 MiB |" in text and "Goals:" in text


def test_goals_compare_the_consumer_path_with_memcpy_grpc_and_a_raw_read() -> None:
    def row(method: str, nbytes: int, median_us: float) -> dict[str, Any]:
        return {"method": method, "bytes": nbytes, "latency_us": {"median": median_us}}

    mib = handoff.MIB
    results = [row("ec_consumer", mib, 100.0), row("raw_read", mib, 80.0), row("nixl_reader", mib, 90.0), row("memcpy", mib, 60.0), row("memcpy_fresh", mib, 70.0)]
    results += [row("grpc_inline", mib, 1500.0), row("ec_consumer", 4 * mib, 400.0), row("memcpy", 4 * mib, 100.0), row("raw_read", 4 * mib, 300.0)]
    kib = mib // 1024
    results += [row("ec_consumer", kib, 60.0), row("raw_read", kib, 40.0), row("ec_consumer", 64 * kib, 64.0), row("raw_read", 64 * kib, 40.0)]
    analysis = handoff.analyze(results)
    memcpy_goal, grpc_goal, raw_goal, fixed_goal = analysis["goals"]
    assert memcpy_goal["value"] == pytest.approx(0.25) and not memcpy_goal["met"]  # the worst size >= 1 MiB decides
    assert grpc_goal["value"] == pytest.approx(15.0) and grpc_goal["met"]
    assert raw_goal["value"] == pytest.approx(0.75) and not raw_goal["met"]  # 300 / 400 µs at 4 MiB; 80 / 100 at 1 MiB
    assert fixed_goal["value"] == pytest.approx(24.0) and fixed_goal["met"]  # the worst size <= 64 KiB; 1 MiB's 20 µs is not held to it
    assert analysis["fixed_cost_us"][str(mib)] == {"ec_consumer_minus_raw_read_us": 20.0, "nixl_reader_minus_raw_read_us": 10.0}


def test_quick_run_plots_when_matplotlib_is_installed(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    path, _ = quick_result
    plot = path.with_name("handoff.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert not plot.exists()
    else:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_check_bytes_catches_corruption_and_stale_slots() -> None:
    base = handoff.payload(4096)
    assert torch.equal(base, handoff.payload(4096)), "both processes must derive the same payload"
    fresh = base.clone()
    fresh[:8] = handoff.stamp_bytes(7)
    handoff.check_bytes("nixl_read", fresh, base, 7)

    flipped = fresh.clone()
    flipped[-1] ^= 1
    with pytest.raises(handoff.HandoffMismatchError, match="nixl_read"):
        handoff.check_bytes("nixl_read", flipped, base, 7)
    with pytest.raises(handoff.HandoffMismatchError, match="stamp 8"):  # an older publish's bytes
        handoff.check_bytes("nixl_read", fresh, base, 8)
    with pytest.raises(handoff.HandoffMismatchError):
        handoff.check_bytes("grpc_inline", base[:-1], base)

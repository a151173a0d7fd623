"""The gateway-overhead benchmark (bench/gateway_overhead.py): a quick run of the real gateway
against stand-in stages writes a complete result, and the report renders it."""

from __future__ import annotations

import json

import pytest

from bench import gateway_overhead
from bench.report import write_report

pytestmark = pytest.mark.timeout(300)


def test_quick_run_writes_a_complete_result(tmp_path):
    # 60 requests: CPU time counts in 10 ms clock ticks, and the grpc-go relay spends about 1 ms a
    # request, so fewer could read as 0.
    path = gateway_overhead.run(quick=True, num_requests=60, results_dir=tmp_path, command="python -m bench --only gateway_overhead --quick")
    doc = json.loads(path.read_text())
    assert doc["requests"] == 60 and doc["output_tokens"] == gateway_overhead.OUTPUT_TOKENS
    for key in ("latency_ms", "relay_ms", "direct_ms", "added_ms", "added_by_epd_ms"):
        assert doc[key]["count"] == 60 and doc[key]["p99"] >= doc[key]["median"]
    # Through the gateway, or the bare relay, is three hops and a stream: never faster than the
    # one-hop floor.
    assert doc["latency_ms"]["median"] > doc["direct_ms"]["median"] > 0
    assert doc["relay_ms"]["median"] > doc["direct_ms"]["median"]
    assert doc["cpu_ms_per_request"] > 0 and doc["relay_cpu_ms_per_request"] > 0
    report = write_report(tmp_path, tmp_path / "BENCHMARKS.md").read_text()
    assert "## Gateway overhead, alone" in report and "Goals: EPD's own work ≤ 0.5 ms p50 over the grpc.aio relay: " in report
    for key in ("go_relay_ms", "relay_added_ms", "go_relay_added_ms"):
        assert doc[key]["count"] == 60
    assert doc["go_relay_ms"]["median"] > doc["direct_ms"]["median"] and doc["go_relay_cpu_ms_per_request"] > 0
    assert "the bare grpc-go relay" in report
    # The added time splits into the first token's and the later tokens': three hops come before
    # the first token, so it grows on every path; relaying adds to each later token.
    for path in ("", "relay_", "go_relay_"):
        assert doc[f"{path}first_token_added_ms"]["count"] == doc[f"{path}per_token_added_ms"]["count"] == 60
        assert doc[f"{path}first_token_added_ms"]["median"] > 0
    assert doc["per_token_added_ms"]["median"] > 0 and doc["relay_per_token_added_ms"]["median"] > 0
    assert "| the gateway | " in report and "added per later token" in report

"""A seconds-long smoke run of the serving benchmark on the shared stack: every arm answers,
the result has the schema BENCHMARKS.md is built from, and the report renders it."""

from __future__ import annotations

import json

from bench.common import write_result
from bench.report import write_report
from bench.serving import ARMS, LOADS, ServingConfig, build_payload, end_state, measure, peak_rss_mib
from bench.workload import STAGES, WorkloadSpec, build_requests
from epd.launcher import gateway_args

SUMMARY_KEYS = {
    "request_throughput",
    "output_throughput",
    "ttft_ms_median",
    "tpot_ms_median",
    "e2el_ms_mean",
    "e2el_ms_median",
    "e2el_ms_p99",
    "gateway_overhead_ms_median",
    "gateway_overhead_ms_p99",
    "stage_ms_median",
}


async def test_serving_smoke_run_has_the_report_schema(family_stack, tmp_path):
    import asyncio

    s = family_stack
    workload = WorkloadSpec("image", num_requests=2, items_per_request=(1, 1), image_edge_px=(448, 560), max_tokens=4)
    config = ServingConfig(model=s.model, rate=50.0, repeats=1, workload=workload, caches="on")
    forward = gateway_args(s.model, "epd", encoders=[s.encoder.address], prefills=[s.prefill.address], decodes=[s.decode.address], extra=["--forward-media"])
    with s.stack.temporary("gateway-bench-forward-media", forward) as forward_gateway:
        gateways = {"monolithic": s.gateways["monolithic"].address, "epd-combined": s.gateways["epd-combined"].address, "epd": s.gateways["epd"].address}
        gateways["epd-forward-media"] = forward_gateway.address
        # measure() drives its own event loops; keep them off the test's loop.
        runs = await asyncio.to_thread(measure, gateways, build_requests(workload), rate=config.rate, repeats=config.repeats)
    services = {"encoder": s.encoder, "prefill": s.prefill, "decode": s.decode, "combined": s.combined, "gateway-monolithic": s.gateways["monolithic"]}
    payload = build_payload(runs, config, end_state(services), {name: {"peak_rss_mib": peak_rss_mib(p)} for name, p in services.items()})
    path = write_result("serving", payload, command="pytest smoke", results_dir=tmp_path)

    doc = json.loads(path.read_text())
    assert {"schema_version", "name", "command", "machine", "experiment", "config", "summary", "ratios", "outputs_identical_to_monolithic", "end_state", "resources", "runs"} <= doc.keys()
    assert doc["outputs_identical_to_monolithic"] == {arm: True for arm in ARMS}
    for arm in ARMS:
        for load in LOADS:
            summary = doc["summary"][arm][load]
            assert summary.keys() == SUMMARY_KEYS and summary["stage_ms_median"].keys() == set(STAGES)
            assert summary["request_throughput"] > 0 and summary["e2el_ms_p99"] >= summary["e2el_ms_median"] > 0
            (only_run,) = doc["runs"][arm][load]
            assert only_run["completed"] == workload.num_requests and only_run["failed"] == 0
    assert doc["summary"]["epd"]["poisson"]["stage_ms_median"]["prefill"] > 0
    assert doc["ratios"]["metadata_only_over_media_forwarding"]["saturation"]["request_throughput"] > 0
    assert doc["end_state"]["arena_leases"] == 0
    assert all(e["requests_running"] == 0 and e["kv_cache_usage"] >= 0 for e in doc["end_state"]["engines"].values())

    report = write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    assert "## Serving (image)" in report and "Command: `pytest smoke`" in report and "| epd-forward-media | saturation |" in report

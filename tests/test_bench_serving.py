"""A seconds-long smoke run of the serving benchmark on the shared stacks (images on Qwen2.5-VL,
and the Omni thinker's audio workload on the suite's Qwen2.5-Omni stack, in bf16): every arm,
the compiled relay's included, answers with monolithic's tokens, the end state
(read with the EC connector's metrics) is back to zero, the result has the schema BENCHMARKS.md
is built from, and the report renders it."""

from __future__ import annotations

import json

import pytest

from bench.common import write_result
from bench.compiled import go_relay
from bench.report import write_report
from bench.serving import ARM_SERVICES, ARMS, EXPERIMENTS, LOADS, ServingConfig, build_payload, counters, end_state, measure, peak_rss_mib
from bench.workload import STAGES, WorkloadSpec, build_requests
from cli.launcher import gateway_args
from tests.conftest import BF16, stack_key

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
    "gateway_own_ms_median",
    "stage_ms_median",
}


# By stack key; the benchmark's experiment is named by the key's family.
SMOKE_WORKLOADS = {
    "qwen2_5_vl": ("serving", WorkloadSpec("image", num_requests=2, items_per_request=(1, 1), image_edge_px=(448, 560), max_tokens=4)),
    stack_key("qwen2_5_omni", BF16): ("serving_omni", WorkloadSpec("audio", num_requests=2, items_per_request=(1, 1), clip_seconds=(1.0, 1.5), max_tokens=4)),
}


@pytest.mark.parametrize("family", list(SMOKE_WORKLOADS))
async def test_serving_smoke_run_has_the_report_schema(family_stack, family, tmp_path):
    import asyncio

    s = family_stack
    name, workload = SMOKE_WORKLOADS[family]
    model_family = family.partition("@")[0]
    assert EXPERIMENTS[name].family == model_family and EXPERIMENTS[name].workload.modality == workload.modality
    config = ServingConfig(model=s.model, rate=50.0, repeats=1, workload=workload, caches="on", family=model_family)
    forward = gateway_args(s.model, "epd", encoders=[s.encoder.address], prefills=[s.prefill.address], decodes=[s.decode.address], extra=["--forward-media"])
    services = {"encoder": s.encoder, "prefill": s.prefill, "decode": s.decode, "combined": s.combined, "gateway-monolithic": s.gateways["monolithic"]}
    before = await asyncio.to_thread(counters, services, workload.modality)  # the stack is shared with other tests
    with s.stack.temporary("gateway-bench-forward-media", forward) as forward_gateway, go_relay(s.encoder.address, s.prefill.address, s.decode.address) as relay:
        gateways = {"monolithic": s.gateways["monolithic"].address, "epd-combined": s.gateways["epd-combined"].address, "epd": s.gateways["epd"].address}
        gateways["epd-forward-media"] = forward_gateway.address
        gateways["epd-go-relay"] = relay.address
        # measure() drives its own event loops; keep them off the test's loop.
        accounted = {**services, "combined": s.combined, "gateway-epd-combined": s.gateways["epd-combined"], "gateway-epd": s.gateways["epd"]}
        accounted |= {"gateway-epd-forward-media": forward_gateway, "gateway-epd-go-relay": relay}
        runs = await asyncio.to_thread(measure, gateways, build_requests(workload), rate=config.rate, repeats=config.repeats, services=accounted)
    state = await asyncio.to_thread(end_state, services, workload.modality, before)
    payload = build_payload(runs, config, state, {name: {"peak_rss_mib": peak_rss_mib(p)} for name, p in services.items()})
    path = write_result(name, payload, command="pytest smoke", results_dir=tmp_path)

    doc = json.loads(path.read_text())
    assert {"schema_version", "name", "command", "machine", "experiment", "config", "summary", "ratios", "outputs_identical_to_monolithic", "end_state", "resources", "runs"} <= doc.keys()
    assert doc["outputs_identical_to_monolithic"] == {arm: True for arm in ARMS}
    for arm in ARMS:
        for load in LOADS:
            summary = doc["summary"][arm][load]
            assert summary.keys() == SUMMARY_KEYS | ({"cpu_ms_per_request"} if load == "saturation" else set())
            assert summary["stage_ms_median"].keys() == set(STAGES)
            assert summary["request_throughput"] > 0 and summary["e2el_ms_p99"] >= summary["e2el_ms_median"] > 0
            (only_run,) = doc["runs"][arm][load]
            assert only_run["completed"] == workload.num_requests and only_run["failed"] == 0
    assert doc["summary"]["epd"]["poisson"]["stage_ms_median"]["prefill"] > 0
    for arm in ("epd", "epd-combined", "epd-forward-media", "epd-go-relay"):
        # Inside the gateway (or the compiled relay) is part of what its client sees.
        for load in LOADS:
            summary = doc["summary"][arm][load]
            assert 0 < summary["gateway_own_ms_median"] <= summary["gateway_overhead_ms_median"], (arm, load, summary)
    assert doc["ratios"]["metadata_only_over_media_forwarding"]["saturation"]["request_throughput"] > 0
    # Each arm's saturation requests cost CPU in every process they run through, engine cores included.
    for arm, names in ARM_SERVICES.items():
        cpu = doc["summary"][arm]["saturation"]["cpu_ms_per_request"]
        owners = {next(process.removesuffix(f" {role}") for role in ("service", "engine core", "helper") if process.endswith(f" {role}")) for process in cpu}
        assert owners <= set(names), (arm, cpu)
        # CPU time comes in clock ticks (10 ms): a compiled relay's few requests may show none.
        assert all(ms >= 0 for ms in cpu.values()) and sum(cpu.values()) > 0, (arm, cpu)
    assert all(cpu_ratio > 0 for cpu_ratio in doc["ratios"]["cpu_per_request_over_monolithic"].values())

    end = doc["end_state"]
    assert end["drained"] and end["arena_leases"] == 0
    # Every engine is idle and has freed every KV block (prefix-cached blocks count as free).
    assert all(e["requests_running"] == 0 and e["requests_waiting"] == 0 and e["kv_cache_usage"] == 0 for e in end["engines"].values()), end["engines"]
    assert set(end["consumers"]) == {"prefill", "combined"}
    for consumer in end["consumers"].values():
        # Every embedding came over NIXL (the default transport) and none failed to load.
        assert consumer["embedding_load_failures"] == 0 and consumer["nixl_bytes_loaded"] > 0
    assert end["encoder"]["items_encoded"] > 0 and end["encoder"]["mean_items_per_step"] >= 1

    report = write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    heading = f"## Serving ({workload.modality}, {model_family})"
    assert heading in report and "Command: `pytest smoke`" in report and "| epd-forward-media | saturation |" in report
    assert "End state (all back to zero)" in report and "Of that overhead, the gateway's own time" in report


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_salted_media_decode_to_the_same_content_under_a_new_hash(modality):
    """Each pass's copy of the workload: new bytes (and so new content hashes, which key vLLM's
    encoder cache), but the very same pixels, frames and samples."""
    import numpy as np

    from bench.workload import salted
    from epd import wire
    from epd.domain import VideoSampling
    from epd.media import MediaLimits
    from epd.media.audio import decode_audio_file
    from epd.media.image import decode_image
    from epd.media.video import VideoLoading, decode_video_file

    spec = WorkloadSpec(modality, num_requests=1, items_per_request=(2, 2), image_edge_px=(448, 476), video_edge_px=(224, 224), clip_seconds=(1.0, 1.0))
    (original,) = build_requests(spec)
    (copy,) = salted([original], "pass 1")
    (other,) = salted([original], "pass 2")
    items = [wire.generate_request_from_wire(request).media for request in (original, copy, other)]
    assert len({item.content_hash for media in items for item in media}) == 6  # every item, every pass: a hash of its own

    def decoded(item):
        data = item.source.data
        if modality == "image":
            return np.asarray(decode_image(data, max_pixels=MediaLimits().max_image_pixels))
        if modality == "audio":
            return decode_audio_file(data, item.source.mime_type, 16000).samples
        return decode_video_file(data, VideoSampling(), VideoLoading("qwen3_vl"), MediaLimits()).frames

    for first, second in zip(items[0], items[1], strict=True):
        assert np.array_equal(decoded(first), decoded(second))

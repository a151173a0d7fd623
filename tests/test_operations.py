"""Operational contract: standard health (liveness "" and readiness by service name), server
reflection, and Prometheus metrics named epd_* on every service."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli.launcher import Stack, gateway_args
from devkit.media import synthetic_image_png
from epd import wire
from epd.client import chat_request, generate
from epd.domain import ChatMessage, Role, TextPart
from epd.server import EXIT_ENGINE_DIED, release_freed_heap
from epd.telemetry import scrape
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.helpers import SMALL_KV_CACHE, gateway_stub, wait_for_metric

SERVICES = {
    "encoder": "epd.v1.EncoderService",
    "prefill": "epd.v1.PrefillService",
    "decode": "epd.v1.DecodeService",
}


async def _reflected_services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def requests():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for response in stub.ServerReflectionInfo(requests()):
        return [s.name for s in response.list_services_response.service]
    return []


async def test_health_reflection_and_metrics(family_stack):
    targets = {name: (getattr(family_stack, name), service) for name, service in SERVICES.items()}
    targets["gateway"] = (family_stack.gateways["epd"], "epd.v1.GatewayService")
    for name, (process, service) in targets.items():
        async with grpc.aio.insecure_channel(process.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for probe in ("", service):
                response = await health.Check(health_pb2.HealthCheckRequest(service=probe), timeout=5)
                assert response.status == health_pb2.HealthCheckResponse.SERVING, (name, probe)
            assert {service, "grpc.health.v1.Health"} <= set(await _reflected_services(channel)), name
        if process.metrics_port is not None:
            names = [n for n in scrape(process.metrics_port) if n.startswith("epd_")]
            assert names, name
            assert not [n for n in names if ":" in n.partition("{")[0]]  # label values may hold host:port


async def test_the_gateway_counts_its_own_time_outside_the_stages(family_stack):
    """epd_gateway_own_seconds observes, per request, what the reply's timings give as the total
    (from the call's arrival, parsing included) minus the stage calls."""
    gateway = family_stack.gateways["epd"]
    before = scrape(gateway.metrics_port)
    png = synthetic_image_png(120, 80, seed=63)
    timings = (await generate(family_stack.gateway_stub("epd"), chat_request([(png, "image/png"), "Hi"], max_tokens=4), timeout=120)).finished.timings
    after = scrape(gateway.metrics_port)
    total = timings.total.ToNanoseconds() / 1e9
    own = total - sum(getattr(timings, stage).ToNanoseconds() / 1e9 for stage in ("encode", "prefill", "decode"))
    assert 0 < own < total
    assert after["epd_gateway_own_seconds_count"] == before.get("epd_gateway_own_seconds_count", 0.0) + 1
    assert after["epd_gateway_own_seconds_sum"] - before.get("epd_gateway_own_seconds_sum", 0.0) == pytest.approx(own, abs=1e-5)


async def test_one_trace_spans_every_hop(family_stack, otlp_receiver):
    """W3C trace context crosses client -> gateway -> encoder -> prefill -> decode: the caller's
    trace id on every hop, the gateway's Generate span a child of the caller's span."""
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    png = synthetic_image_png(130, 100, seed=61)
    stream = family_stack.gateway_stub("epd").Generate(
        chat_request([(png, "image/png"), "Trace me."], max_tokens=4), metadata=(("traceparent", f"00-{trace_id}-{caller_span}-01"),), timeout=120
    )
    assert [response async for response in stream][-1].HasField("finished")
    wanted = {"gateway", "encoder", "prefill", "decode-decode"}
    deadline = asyncio.get_running_loop().time() + 20  # exporters flush in batches every few seconds
    while True:
        spans = [s for s in otlp_receiver.spans() if s.trace_id == trace_id]
        if wanted <= {s.service for s in spans} or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    assert wanted <= {s.service for s in spans}, spans
    (generate_span,) = [s for s in spans if s.service == "gateway" and s.name.endswith("GatewayService/Generate")]
    assert generate_span.parent_span_id == caller_span
    # Each stage's server span hangs off one of the gateway's spans (its call to that stage).
    gateway_spans = {s.span_id for s in spans if s.service == "gateway"}
    for service in wanted - {"gateway"}:
        assert any(s.parent_span_id in gateway_spans for s in spans if s.service == service), service


async def test_streamed_calls_leave_no_trace_context_errors(family_stack):
    """OpenTelemetry once logged "Failed to detach context" on streamed calls, most of all on
    streams a client drops: the server span must be current only inside the handler's steps."""
    png = synthetic_image_png(110, 90, seed=62)
    for mode in ("epd", "epd-combined"):
        await generate(family_stack.gateway_stub(mode), chat_request([(png, "image/png"), "Hi"], max_tokens=4), timeout=120)
        dropped = family_stack.gateway_stub(mode).Generate(chat_request([(png, "image/png"), "Hi"], max_tokens=64, min_tokens=64), timeout=120)
        async for _ in dropped:
            break  # the first delta, then the client goes away
        dropped.cancel()
    await asyncio.sleep(2)  # the stages see the cancellation
    for service in family_stack.stack.services:
        assert "Failed to detach context" not in service.log_path.read_text(errors="replace"), service.name


async def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(family_stack):
    args = gateway_args(
        family_stack.model,
        "epd-combined",
        encoders=[family_stack.encoder.address],
        decodes=[family_stack.combined.address],
        extra=["--drain-grace-s", "60"],
    )
    decode_calls = "epd_requests_total{{code={},method=Decode,service=decode}}"
    before = scrape(family_stack.combined.metrics_port)
    with family_stack.stack.temporary("gateway-draining", args) as gateway:
        stub = gateway_stub(gateway.address)
        request = chat_request([(synthetic_image_png(120, 120, seed=71), "image/png"), "Drain."], max_tokens=32, min_tokens=32)
        stream = stub.Generate(request, timeout=120)
        first = await stream.read()
        assert first.HasField("delta")
        gateway.terminate()
        await asyncio.sleep(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        tokens = len(first.delta.token_ids)
        while (response := await stream.read()) is not grpc.aio.EOF:
            tokens += len(response.delta.token_ids)
            last = response
        assert last.HasField("finished") and tokens == 32
        assert gateway.process.wait(60) == 0
    # The stopping gateway read the drained stream's decode call to its end: a success there too.
    ok = decode_calls.format("OK")
    assert await wait_for_metric(family_stack.combined.metrics_port, ok, before.get(ok, 0.0) + 1, timeout=10, absent=0.0) == before.get(ok, 0.0) + 1
    cancelled = decode_calls.format("CANCELLED")
    assert scrape(family_stack.combined.metrics_port).get(cancelled, 0.0) == before.get(cancelled, 0.0)


async def test_a_service_whose_engine_dies_leaves_and_is_started_again(family_stack):
    """When a service's vLLM engine core dies, the service stops claiming to serve: readiness and
    liveness go NOT_SERVING instead of failing every call, and a call that still reaches it is
    UNAVAILABLE. Then it exits with EXIT_ENGINE_DIED, and ``epd up``'s supervisor starts it
    again at its address, where it serves the monolithic tokens.

    The engine core runs in vLLM's own process here, so that the test can kill it alone; an
    engine core on a thread of the service reports its death through the same ``Engine.alive``
    (tests/test_engine_thread.py)."""
    import os
    import signal
    import threading

    import psutil

    stack = Stack(family_stack.stack.log_dir)
    stop_supervising = threading.Event()
    supervisor = None
    try:
        service = stack.start("combined-doomed", ["decode", "--model", family_stack.model, "--mode", "combined", "--engine-core", "process", *SMALL_KV_CACHE])
        stack.wait_ready([service], timeout=600)
        supervisor = threading.Thread(target=stack.supervise, args=(stop_supervising,), daemon=True)
        supervisor.start()
        (engine_core,) = [p for p in psutil.Process(service.process.pid).children() if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM")]
        os.kill(engine_core.pid, signal.SIGKILL)
        async with grpc.aio.insecure_channel(service.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = asyncio.get_running_loop().time() + 30
            statuses = {}
            while asyncio.get_running_loop().time() < deadline:
                statuses = {
                    probe: (await health.Check(health_pb2.HealthCheckRequest(service=probe), timeout=5)).status for probe in ("", "epd.v1.DecodeService")
                }
                if all(s == health_pb2.HealthCheckResponse.NOT_SERVING for s in statuses.values()):
                    break
                await asyncio.sleep(0.5)
            # A call that still reaches it is UNAVAILABLE (retried elsewhere by a gateway), not
            # INTERNAL: the instance failed, not the request.
            request = decode_pb2.DecodeRequest(
                request_id="to-a-dead-engine",
                prompt=wire.engine_prompt_to_wire(chat=[ChatMessage(Role.USER, (TextPart("Hello"),))]),
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in decode_pb2_grpc.DecodeServiceStub(channel).Decode(request, timeout=30):
                    pass
        assert all(s == health_pb2.HealthCheckResponse.NOT_SERVING for s in statuses.values()), statuses
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert "engine core has died" in refused.value.details()
        assert await asyncio.to_thread(service.process.wait, 60) == EXIT_ENGINE_DIED

        deadline = asyncio.get_running_loop().time() + 30
        while stack.services == [service] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        (again,) = stack.services
        assert again is not service and again.args[-2:] == ["--port", str(service.port)]
        await asyncio.to_thread(stack.wait_ready, [again], 600)
        parts = [(synthetic_image_png(96, 96, seed=77), "image/png"), "Hello"]
        oracle = await generate(family_stack.gateway_stub("monolithic"), chat_request(parts, max_tokens=6), timeout=120)
        args = gateway_args(family_stack.model, "epd-combined", encoders=[family_stack.encoder.address], decodes=[service.address])
        with family_stack.stack.temporary("gateway-to-the-restarted", args) as gateway:
            gateway.wait_serving()
            assert (await generate(gateway_stub(gateway.address), chat_request(parts, max_tokens=6), timeout=120)).token_ids == oracle.token_ids
    finally:
        stop_supervising.set()
        if supervisor is not None:
            supervisor.join(5)
        stack.stop()


async def test_idle_services_leave_the_cpu_idle(family_stack):
    """An engine with nothing to do takes no core: vLLM's KV agent (prefill, decode) once polled
    UCX without sleeping, a full core each, which starved every engine that had work."""
    import psutil

    assert await wait_for_metric(family_stack.prefill.metrics_port, "vllm:kv_cache_usage_perc", 0.0, timeout=30) == 0.0  # no KV waiting to be read
    roots = {name: psutil.Process(getattr(family_stack, name).process.pid) for name in SERVICES}
    trees = {name: [root, *root.children(recursive=True)] for name, root in roots.items()}

    def cpu_seconds() -> dict[str, float]:
        return {name: sum(sum(p.cpu_times()[:2]) for p in tree) for name, tree in trees.items()}

    before, window_s = cpu_seconds(), 3.0
    await asyncio.sleep(window_s)
    share = {name: (used - before[name]) / window_s for name, used in cpu_seconds().items()}
    assert all(used < 0.3 for used in share.values()), share  # of one core; a polling thread is ~1.0


def test_the_heap_freed_between_live_blocks_goes_back_to_the_os():
    """What a flood leaves: most of the C heap free, but held by glibc between the blocks still
    live, which no ``free`` gives back and the gateway's periodic release does."""
    process = psutil.Process()
    blocks = [bytearray(1000) for _ in range(100_000)]  # over pymalloc's 512 bytes: glibc's heap
    live = blocks[::100]
    del blocks
    held = process.memory_info().rss
    assert release_freed_heap()
    assert process.memory_info().rss < held - 50 * 2**20
    assert len(live) == 1000

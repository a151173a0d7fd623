"""Losing one instance of a stage loses no request (issue 9's kill tests, short form).

Next to the shared Qwen2.5-VL stack, the tests start a second encoder, prefill and decode and
kill them with SIGKILL under load: requests in flight on a killed encoder or prefill are retried
on the survivors before their first token, so none fails and all tokens equal monolithic; the
gateway stops routing to the dead instance, says NOT_SERVING when a stage has none left, and
takes a restarted instance (same address) back by itself. (A decode killed mid-stream costs no
stream either: test_resume.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cli.launcher import ServiceProcess, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.telemetry import scrape
from epd.v1 import decode_pb2, decode_pb2_grpc
from gateway.router import HashRing
from tests.conftest import DEFAULT_FAMILY
from tests.helpers import SMALL_KV_CACHE, affinity_key_flags, encode_then_prefill, gateway_stub, image_affinity_key, prefill_directly, wait_for_metric

_IMAGES = [synthetic_image_png(96 + 16 * i, 96, seed=500 + i) for i in range(4)]
_REQUESTS = 24
_CONCURRENCY = 8
_KV_LEASE_S = 10  # the prefill's --kv-lease-s default
_REBIRTH_IMAGES = 8  # new images sent once a reborn encoder is back


def _request(index: int, max_tokens: int = 8):
    return chat_request([(_IMAGES[index % len(_IMAGES)], "image/png"), f"Picture {index % len(_IMAGES)}."], max_tokens=max_tokens, min_tokens=max_tokens)


async def _oracle(family_stack) -> list[list[int]]:
    stub = family_stack.gateway_stub("monolithic")
    return [(await generate(stub, _request(i), timeout=120)).token_ids for i in range(len(_IMAGES))]


async def _readiness(address: str, service: str = "epd.v1.GatewayService") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def _wait_readiness(address: str, wanted: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (status := await _readiness(address)) != wanted and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return status


def _counter(metrics_port: int, name: str) -> float:
    return scrape(metrics_port).get(name, 0.0)


@dataclasses.dataclass(frozen=True)
class Spares:
    encoder: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess


@pytest.fixture(scope="module")
def spares(stacks):
    """A second encoder, prefill and decode beside the shared stack, for the tests to kill:
    started together, since engine start-up is most of these tests' time."""
    family = stacks.get(DEFAULT_FAMILY)
    stack, model = family.stack, family.model
    started = {
        "encoder": stack.start("encoder-spare", ["encoder", "--model", model, "--metrics-port", "0"]),
        "prefill": stack.start("prefill-spare", ["prefill", "--model", model, *SMALL_KV_CACHE, *family.sealed]),
        "decode": stack.start("decode-doomed", ["decode", "--model", model, "--mode", "decode", "--metrics-port", "0", *SMALL_KV_CACHE, *family.sealed]),
    }
    try:
        stack.wait_ready(list(started.values()), timeout=600)
        yield Spares(**started)
    finally:
        for service in started.values():
            service.stop()
            stack.services.remove(service)


async def test_killing_an_encoder_and_a_prefill_under_load_fails_no_request(family_stack, spares, tmp_path):
    oracle = await _oracle(family_stack)
    stack, model = family_stack.stack, family_stack.model
    spare_encoder, spare_prefill = spares.encoder, spares.prefill
    extra = []
    keyed, secret = affinity_key_flags(tmp_path)
    try:
        both = gateway_args(
            model,
            "epd",
            encoders=[family_stack.encoder.address, spare_encoder.address],
            prefills=[family_stack.prefill.address, spare_prefill.address],
            decodes=[family_stack.decode.address],
            extra=["--metrics-port", "0", *keyed],
        )
        # A gateway whose only encoder and prefill are the spares: its readiness must follow them.
        spare_only = gateway_args(
            model, "epd", encoders=[spare_encoder.address], prefills=[spare_prefill.address], decodes=[family_stack.decode.address]
        )
        gateway, lonely = stack.start("gateway-failover", both), stack.start("gateway-spare-only", spare_only)
        extra += [gateway, lonely]
        stack.wait_ready([gateway, lonely], timeout=120)
        stub = gateway_stub(gateway.address)

        done = 0
        kills = {4: spare_encoder, 10: spare_prefill}  # after this many completions, SIGKILL

        async def one(index: int) -> list[int]:
            nonlocal done
            result = await generate(stub, _request(index), timeout=120)
            done += 1
            if done in kills:
                kills.pop(done).kill()  # the whole instance: the service and its EngineCore
            return result.token_ids

        semaphore = asyncio.Semaphore(_CONCURRENCY)

        async def bounded(index: int):
            async with semaphore:
                return await one(index)

        outcomes = await asyncio.gather(*(bounded(i) for i in range(_REQUESTS)), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        assert not failures, failures[:3]
        assert all(tokens == oracle[i % len(_IMAGES)] for i, tokens in enumerate(outcomes))
        assert not kills  # both instances were killed while requests were running
        # Out of the rotation: by its health watch or by a failed call, whichever saw it first.
        seen = scrape(gateway.metrics_port)
        assert seen[f"epd_stage_instance_up{{address={spare_encoder.address},stage=encoder}}"] == 0
        assert seen[f"epd_stage_instance_up{{address={spare_prefill.address},stage=prefill}}"] == 0

        # The gateway with live instances of every stage stays ready; the one without is not.
        assert await _readiness(gateway.address) == health_pb2.HealthCheckResponse.SERVING
        assert await _wait_readiness(lonely.address, health_pb2.HealthCheckResponse.NOT_SERVING) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(gateway_stub(lonely.address), _request(0), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no live encoder" in refused.value.details()

        # A restarted encoder and prefill (new processes, same addresses) rejoin without touching
        # the gateways; the decode pulls KV from the new prefill process, not a stale NIXL agent.
        spare_encoder.process.wait(30)
        spare_prefill.process.wait(30)
        reborn = stack.start("encoder-reborn", ["encoder", "--model", model, "--port", str(spare_encoder.port), "--metrics-port", "0"])
        reborn_prefill = stack.start("prefill-reborn", ["prefill", "--model", model, "--port", str(spare_prefill.port), *SMALL_KV_CACHE, *family_stack.sealed])
        extra += [reborn, reborn_prefill]
        stack.wait_ready([reborn, reborn_prefill], timeout=600)
        assert await _wait_readiness(lonely.address, health_pb2.HealthCheckResponse.SERVING) == health_pb2.HealthCheckResponse.SERVING
        through_lonely = 2  # one image each, new to the reborn encoder
        for i in range(through_lonely):
            assert (await generate(gateway_stub(lonely.address), _request(i), timeout=120)).token_ids == oracle[i]
        # The shared gateway sends the reborn encoder its own share of the items again: each new
        # image goes to the encoder its affinity key points to on the ring (one at a time, so
        # no load bound interferes).
        images = [synthetic_image_png(80, 96 + 16 * i, seed=600 + i) for i in range(_REBIRTH_IMAGES)]
        survivor_items = _counter(family_stack.encoder.metrics_port, "epd_encoder_items_total")
        for image in images:
            await generate(stub, chat_request([(image, "image/png"), "What is it?"], max_tokens=2), timeout=120)
        reborn_items = _counter(reborn.metrics_port, "epd_encoder_items_total") - through_lonely
        assert reborn_items + _counter(family_stack.encoder.metrics_port, "epd_encoder_items_total") - survivor_items == len(images)
        ring = HashRing([family_stack.encoder.address, reborn.address], secret)
        assert reborn_items == sum(ring.walk(image_affinity_key(image))[0] == reborn.address for image in images)
    finally:
        for service in extra:
            service.stop()
            stack.services.remove(service)


async def test_a_killed_decode_leaves_the_rotation_and_a_reborn_one_rejoins(family_stack, spares):
    """(A decode killed mid-stream costs no stream: test_resume.)"""
    oracle = await _oracle(family_stack)
    stack, model = family_stack.stack, family_stack.model
    doomed = spares.decode
    gateway = reborn = None
    try:
        args = gateway_args(model, "epd", encoders=[family_stack.encoder.address], prefills=[family_stack.prefill.address], decodes=[doomed.address, family_stack.decode.address])
        gateway = stack.start("gateway-decode-failover", [*args, "--metrics-port", "0"])
        stack.wait_ready([gateway], timeout=120)
        stub = gateway_stub(gateway.address)
        doomed.kill()
        assert await wait_for_metric(gateway.metrics_port, f"epd_stage_instance_up{{address={doomed.address},stage=decode}}", 0.0, timeout=30) == 0.0
        for i in range(2):
            assert (await generate(stub, _request(i), timeout=120)).token_ids == oracle[i]

        # A new decode process at the dead one's address is taken back and decodes correctly:
        # it handshakes with the prefill afresh (the prefill's KV agent never saw this process).
        doomed.process.wait(30)
        reborn = stack.start(
            "decode-reborn", ["decode", "--model", model, "--mode", "decode", "--port", str(doomed.port), "--metrics-port", "0", *SMALL_KV_CACHE, *family_stack.sealed]
        )
        stack.wait_ready([reborn], timeout=600)
        assert await wait_for_metric(gateway.metrics_port, f"epd_stage_instance_up{{address={doomed.address},stage=decode}}", 1.0, timeout=30) == 1.0
        for i in range(len(_IMAGES)):  # ties rotate between the two decodes: the reborn one gets some
            assert (await generate(stub, _request(i), timeout=120)).token_ids == oracle[i]
        assert scrape(reborn.metrics_port).get("epd_requests_total{code=OK,method=Decode,service=decode}", 0.0) >= 1
    finally:
        for service in (reborn, gateway):
            if service is not None:
                service.stop()
                stack.services.remove(service)


async def test_prefills_never_decoded_free_their_kv_within_the_lease(family_stack):
    """A peer that calls Prefill and never decodes cannot pin the KV cache: vLLM frees the
    blocks once the handoff's lease (``--kv-lease-s``, 10 s by default) runs out."""
    port = family_stack.prefill.metrics_port
    usage = "vllm:kv_cache_usage_perc"
    assert await wait_for_metric(port, usage, 0.0, timeout=30) == 0.0
    long_text = " ".join(f"word{i}" for i in range(300))  # about 2000 tokens: well inside max_model_len (4096)
    for seed in range(4):
        assert await encode_then_prefill(family_stack, [(synthetic_image_png(128, 128, seed=700 + seed), "image/png"), long_text]) is None
    held = scrape(port)[usage]
    assert held > 0  # the finished prefills' KV waits for a decode...
    started = time.monotonic()
    assert await wait_for_metric(port, usage, 0.0, timeout=40) == 0.0  # ...but not for long
    assert time.monotonic() - started < 25


async def test_a_released_handoff_frees_the_prefills_kv_at_once(family_stack):
    """DecodeService.ReleaseKv frees a handoff's KV well before its lease (10 s) would."""
    port = family_stack.prefill.metrics_port
    usage = "vllm:kv_cache_usage_perc"
    assert await wait_for_metric(port, usage, 0.0, timeout=30) == 0.0
    long_text = " ".join(f"word{i}" for i in range(300))
    _, response = await prefill_directly(family_stack, [(synthetic_image_png(128, 128, seed=720), "image/png"), long_text])
    prefilled = time.monotonic()
    assert scrape(port)[usage] > 0
    async with grpc.aio.insecure_channel(family_stack.decode.address) as channel:
        await decode_pb2_grpc.DecodeServiceStub(channel).ReleaseKv(decode_pb2.ReleaseKvRequest(request_id="released", kv_handoff=response.kv_handoff), timeout=10)
    assert await wait_for_metric(port, usage, 0.0, timeout=15) == 0.0
    assert time.monotonic() - prefilled < _KV_LEASE_S / 2


@pytest.mark.parametrize("ending", ["max_tokens_of_1", "a_stop_string_in_the_first_token"])
async def test_a_reply_that_ends_with_its_first_token_frees_the_prefills_kv_at_once(family_stack, ending):
    """The prefill samples the reply's first token; when the reply ends there (max_tokens 1, or a
    stop string the token's text holds), no decode runs: the gateway streams that token, ends the
    reply as the monolithic engine does (tokens, text, finish reason, usage), and releases the
    prefill's KV at once rather than at the end of its lease."""
    parts = [(_IMAGES[1], "image/png"), "One word."]
    request = chat_request(parts, max_tokens=1)
    if ending == "a_stop_string_in_the_first_token":
        deltas = []
        await generate(family_stack.gateway_stub("monolithic"), chat_request(parts, max_tokens=4), on_delta=deltas.append, timeout=120)
        assert len(deltas[0].token_ids) == 1 and deltas[0].text.strip(), "the chosen request's first token must have text to stop on"
        request = chat_request(parts, max_tokens=4)
        request.sampling.stop.append(deltas[0].text)
    port = family_stack.prefill.metrics_port
    usage = "vllm:kv_cache_usage_perc"
    assert await wait_for_metric(port, usage, 0.0, timeout=30) == 0.0
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)
    assert len(oracle.token_ids) == 1
    result = await generate(family_stack.gateway_stub("epd"), request, timeout=120)
    ended = time.monotonic()
    assert (result.token_ids, result.text, result.finished.finish_reason) == (oracle.token_ids, oracle.text, oracle.finished.finish_reason)
    assert result.finished.usage == oracle.finished.usage
    assert await wait_for_metric(port, usage, 0.0, timeout=15) == 0.0
    assert time.monotonic() - ended < _KV_LEASE_S / 2


class _FailingDecode(decode_pb2_grpc.DecodeServiceServicer):
    """A decode instance that says it serves, then fails every call as an instance that breaks
    between the health check and the call does: the gateway's cue to retry elsewhere."""

    calls = 0

    async def Decode(self, request, context):
        _FailingDecode.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode engine failed")
        yield  # a server-streaming handler

    async def ReleaseKv(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode engine failed")


async def test_a_decode_failing_before_it_answers_frees_the_prefills_kv_at_once(family_stack):
    """The prefill's KV for a request whose decode failed is released at once, through the
    other decode instance, not at the end of its lease (with no retry here, so that no later
    attempt's decode frees it instead); the next request is served exactly."""
    oracle = await _oracle(family_stack)
    stack, model = family_stack.stack, family_stack.model
    _FailingDecode.calls = 0
    failing = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_FailingDecode(), failing)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("epd.v1.DecodeService", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, failing)
    failing_address = f"127.0.0.1:{failing.add_insecure_port('127.0.0.1:0')}"
    await failing.start()
    gateway = None
    try:
        # The failing decode is listed first: ties rotate from the first address.
        decodes = [failing_address, family_stack.decode.address]
        args = gateway_args(model, "epd", encoders=[family_stack.encoder.address], prefills=[family_stack.prefill.address], decodes=decodes, extra=["--max-attempts", "1"])
        gateway = stack.start("gateway-decode-release", args)
        stack.wait_ready([gateway], timeout=120)
        port = family_stack.prefill.metrics_port
        usage = "vllm:kv_cache_usage_perc"
        assert await wait_for_metric(port, usage, 0.0, timeout=30) == 0.0
        stub = gateway_stub(gateway.address)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await generate(stub, _request(3), timeout=120)
        failed_at = time.monotonic()
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "decode engine failed" in failed.value.details()
        assert _FailingDecode.calls == 1  # its prefill's KV was orphaned there...
        assert await wait_for_metric(port, usage, 0.0, timeout=15) == 0.0  # ...and freed
        assert time.monotonic() - failed_at < _KV_LEASE_S / 2
        # Once the broken instance says so, the next request goes to the other and is exact.
        await health_servicer.set("epd.v1.DecodeService", health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(0.5)  # the gateway's health watch hears of it
        assert (await generate(stub, _request(2), timeout=120)).token_ids == oracle[2]
    finally:
        if gateway is not None:
            gateway.stop()
            stack.services.remove(gateway)
        await failing.stop(None)


async def test_with_no_live_prefill_the_fallback_prefills_on_decode(family_stack):
    """--local-prefill-fallback: an E/P/D gateway whose only prefill is gone stays ready and
    serves each request as E+PD on the decode instance, with the monolithic tokens, instead of
    failing it. The first request tries the prefill (its health not yet known), which fails and
    is ejected; the retry and every later request skip it."""
    from epd.ports import free_port

    oracle = await _oracle(family_stack)
    gone = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    args = gateway_args(
        family_stack.model,
        "epd",
        encoders=[family_stack.encoder.address],
        prefills=[gone],
        decodes=[family_stack.decode.address],
        extra=["--local-prefill-fallback", "--metrics-port", "0"],
    )
    with family_stack.stack.temporary("gateway-local-prefill", args) as gateway:
        assert await _wait_readiness(gateway.address, health_pb2.HealthCheckResponse.SERVING) == health_pb2.HealthCheckResponse.SERVING
        for index in range(2):
            result = await generate(gateway_stub(gateway.address), _request(index), timeout=120)
            assert result.token_ids == oracle[index]
            assert result.finished.timings.prefill.ToNanoseconds() == 0 and result.finished.timings.decode.ToNanoseconds() > 0
        seen = scrape(gateway.metrics_port)
        assert seen["epd_gateway_local_prefills_total"] == 2
        assert seen[f"epd_stage_instance_up{{address={gone},stage=prefill}}"] == 0

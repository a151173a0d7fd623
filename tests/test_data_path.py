"""What crosses each hop: no media bytes after the encoder, embeddings over NIXL, and the
embeddings really decide the output."""

from __future__ import annotations

import shutil
from typing import NamedTuple

import grpc
import pytest

from cli.launcher import ServiceProcess, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.telemetry import scrape
from epd.v1 import decode_pb2, prefill_pb2
from tests.conftest import DEFAULT_FAMILY, checkpoint
from tests.helpers import gateway_stub
from tests.tap import generate_through_taps


class OddEncoders(NamedTuple):
    """Encoders unlike the stack's, each with the gateways its test uses."""

    other_tower: ServiceProcess  # different vision weights; its language-model shards are garbage
    other_tower_epd: ServiceProcess
    inline: ServiceProcess  # --embedding-transport inline
    inline_combined: ServiceProcess
    inline_epd: ServiceProcess


@pytest.fixture(scope="module")
def odd_encoders(stacks, tmp_path_factory):
    """Started together: one engine start keeps one core of two busy, so two side by side take
    little longer than one."""
    s = stacks.get(DEFAULT_FAMILY)
    other = tmp_path_factory.mktemp("other-tower") / "checkpoint"
    shutil.copytree(checkpoint(s.family, vision_seed=1), other)
    for shard in ("model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        (other / shard).write_bytes(b"not a safetensors file" * 100)
    other_tower = s.stack.start("encoder-other-tower", ["encoder", "--model", str(other)])
    inline = s.stack.start("encoder-inline", ["encoder", "--model", s.model, "--embedding-transport", "inline"])
    services = [other_tower, inline]
    try:
        s.stack.wait_listening(services)
        epd = {"prefills": [s.prefill.address], "decodes": [s.decode.address]}
        gateways = {
            "other_tower_epd": s.stack.start("gateway-other-tower", gateway_args(s.model, "epd", encoders=[other_tower.address], **epd)),
            "inline_combined": s.stack.start(
                "gateway-inline-combined", gateway_args(s.model, "epd-combined", encoders=[inline.address], decodes=[s.combined.address])
            ),
            "inline_epd": s.stack.start("gateway-inline-epd", gateway_args(s.model, "epd", encoders=[inline.address], **epd)),
        }
        services += gateways.values()
        s.stack.wait_ready(services, timeout=600)
        for gateway in gateways.values():
            gateway.wait_serving()
        yield OddEncoders(other_tower=other_tower, inline=inline, **gateways)
    finally:
        for service in services:
            service.terminate()  # all drain at once, as in Stack.stop
        for service in services:
            service.stop()
            s.stack.services.remove(service)


@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
async def test_no_media_bytes_reach_prefill_or_decode(family_stack, mode):
    png = synthetic_image_png(150, 130, seed=21)
    request = chat_request([(png, "image/png"), "What is this?"], max_tokens=16)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)

    # The E+PD gateway's decode is the stack's combined instance (its decode).
    result, prefill_bodies, decode_bodies = await generate_through_taps(family_stack, request, mode, timeout=120)

    assert result.token_ids == oracle.token_ids
    assert len(decode_bodies) == 1 and len(prefill_bodies) == (1 if mode == "epd" else 0)
    for body in decode_bodies + prefill_bodies:
        assert png not in body and png[:64] not in body, "media bytes crossed a hop after the encoder"

    decode_request = decode_pb2.DecodeRequest.FromString(decode_bodies[0])
    (item,) = decode_request.items
    assert item.metadata.grid_thw.h > 0 and item.metadata.placeholder_count > 0
    if mode == "epd":
        # Decode gets the KV, so not even an embedding handle.
        assert not item.HasField("embedding") and decode_request.HasField("kv_handoff")
        (prefill_item,) = prefill_pb2.PrefillRequest.FromString(prefill_bodies[0]).items
        assert prefill_item.embedding.WhichOneof("transport") == "nixl"
    else:
        assert item.embedding.WhichOneof("transport") == "nixl" and not decode_request.HasField("kv_handoff")


async def test_embeddings_travel_over_nixl_and_decide_the_tokens(family_stack, odd_encoders):
    """An encoder with different vision weights (same language model) changes the tokens. It
    reads only its tower's shard: its checkpoint's language-model shards are garbage."""
    png = synthetic_image_png(170, 110, seed=33)  # unique: no engine has cached this image
    request = chat_request([(png, "image/png"), "Describe."], max_tokens=16)
    loaded = "epd_embedding_bytes_loaded{transport=nixl}"
    before = scrape(family_stack.prefill.metrics_port).get(loaded, 0.0)
    normal = await generate(family_stack.gateway_stub("epd"), request, timeout=120)
    read = scrape(family_stack.prefill.metrics_port)[loaded] - before
    assert read > 0, "prefill read no embedding bytes over NIXL"

    # A new image: the engines key their caches by content hash, so a hash they have seen
    # would bring back KV computed from the first encoder's embeddings.
    other_request = chat_request([(synthetic_image_png(170, 110, seed=34), "image/png"), "Describe."], max_tokens=16)
    assert "read 1 of 3 safetensors shards" in odd_encoders.other_tower.log_tail(400)
    changed = await generate(gateway_stub(odd_encoders.other_tower_epd.address), other_request, timeout=120)
    oracle = await generate(family_stack.gateway_stub("monolithic"), other_request, timeout=120)

    assert normal.token_ids == (await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)).token_ids
    assert len(changed.token_ids) == len(oracle.token_ids) == 16
    assert changed.token_ids != oracle.token_ids


async def test_inline_transport_only_where_explicitly_allowed(family_stack, odd_encoders):
    """An encoder configured for inline embeddings gives the same tokens where the consumer
    allows inline bytes (combined, started with --allow-inline-embeddings), and
    FAILED_PRECONDITION where it does not (prefill)."""
    request = chat_request([(synthetic_image_png(144, 120, seed=81), "image/png"), "Inline?"], max_tokens=16, min_tokens=16)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)
    result = await generate(gateway_stub(odd_encoders.inline_combined.address), request, timeout=120)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(gateway_stub(odd_encoders.inline_epd.address), request, timeout=120)
    assert result.token_ids == oracle.token_ids
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "inline" in refused.value.details()


async def test_media_forwarding_baseline_sends_media_and_keeps_the_tokens(family_stack):
    """The benchmarks' baseline (gateway --forward-media): prefill and decode do get the media,
    re-derive the layout, and the tokens stay those of the monolithic run."""
    png = synthetic_image_png(150, 110, seed=23)
    request = chat_request([(png, "image/png"), "What is this?"], max_tokens=16)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)

    result, prefill_bodies, decode_bodies = await generate_through_taps(family_stack, request, "epd", extra=["--forward-media"], timeout=120)

    assert result.token_ids == oracle.token_ids
    for body in decode_bodies + prefill_bodies:
        assert png in body

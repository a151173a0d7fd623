"""Encoder behaviour under load: cross-request batching (with identical results), arena
exhaustion as RESOURCE_EXHAUSTED with RetryInfo, and explicit lease release."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from epd.telemetry import scrape
from epd.testing import synthetic_image_png
from epd.v1 import encoder_pb2, encoder_pb2_grpc, multimodal_pb2

SLOTS = 4


def _encode_request(seed: int) -> encoder_pb2.EncodeRequest:
    png = synthetic_image_png(112, 112, seed=seed)  # 8x8 patches -> 16 rows x 128 floats = 8 KiB: one slot
    return encoder_pb2.EncodeRequest(request_id=f"r{seed}", items=[multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=png, mime_type="image/png"))])


@pytest.fixture
def small_encoder(family_stack):
    """An encoder with a 4-slot arena and a long batching window."""
    args = ["encoder", "--model", family_stack.model, "--metrics-port", "0", "--batch-wait-ms", "500"]
    args += ["--arena-slots", str(SLOTS), "--arena-slot-bytes", "16384", "--lease-ttl-s", "120"]
    with family_stack.stack.temporary("encoder-small-arena", args) as encoder:
        yield encoder


async def test_batching_arena_exhaustion_and_release(small_encoder, family_stack):
    async with grpc.aio.insecure_channel(small_encoder.address) as channel, grpc.aio.insecure_channel(family_stack.encoder.address) as reference_channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        before = scrape(small_encoder.metrics_port)
        batched = await asyncio.gather(*(stub.Encode(_encode_request(seed), timeout=60) for seed in range(SLOTS)))
        after = scrape(small_encoder.metrics_port)
        # Four concurrent requests went through the tower as one batch.
        assert after["epd_encoder_batch_items_count"] - before.get("epd_encoder_batch_items_count", 0) == 1
        assert after["epd_encoder_batch_items_sum"] - before.get("epd_encoder_batch_items_sum", 0) == SLOTS
        # Batching changes nothing: the shared encoder, encoding each alone, gives the same metadata.
        reference = encoder_pb2_grpc.EncoderServiceStub(reference_channel)
        for seed, response in enumerate(batched):
            alone = await reference.Encode(_encode_request(seed), timeout=60)
            assert response.items[0].metadata == alone.items[0].metadata
            assert response.items[0].embedding.WhichOneof("transport") == "nixl"
            await reference.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[alone.items[0].embedding.nixl.lease_id]))

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(_encode_request(99), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in rpc_status.from_call(info.value).details)

        leases = [r.items[0].embedding.nixl.lease_id for r in batched]
        released = await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=leases + ["unknown"]))
        assert released.released_count == SLOTS
        again = await stub.Encode(_encode_request(99), timeout=60)
        assert again.items[0].metadata.placeholder_count == 16
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[again.items[0].embedding.nixl.lease_id]))

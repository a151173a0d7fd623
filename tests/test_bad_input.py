"""Bad input fails only its own request, with a precise status, and leaks nothing."""

from __future__ import annotations

import grpc
import pytest

from epd.client import chat_request, generate
from epd.testing import synthetic_image_png
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, engine_pb2, gateway_pb2, multimodal_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers import violations, wait_for_metric

PNG = synthetic_image_png(120, 90, seed=5)


def _empty_prompt() -> gateway_pb2.GenerateRequest:
    return chat_request([""], max_tokens=8)


BAD_REQUESTS = {
    "corrupt_image": (lambda: chat_request([(PNG[:40] + b"\x00garbage" * 20, "image/png"), "Hi"], max_tokens=8), "messages[0].parts[0].image.data"),
    "unsupported_mime": (lambda: chat_request([(PNG, "image/tiff"), "Hi"], max_tokens=8), "messages[0].parts[0].image.mime_type"),
    "empty_prompt": (_empty_prompt, "messages"),
    "zero_max_tokens": (lambda: chat_request([(PNG, "image/png"), "Hi"], max_tokens=0), "sampling.max_tokens"),
}


@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_request_gets_invalid_argument_with_field(family_stack, mode, case):
    build, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(family_stack.gateway_stub(mode), build(), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in violations(info.value), info.value.details()
    assert field in info.value.details()


async def test_embedding_rows_not_matching_metadata_fail_only_that_request(family_stack):
    async with grpc.aio.insecure_channel(family_stack.encoder.address) as enc_channel, grpc.aio.insecure_channel(family_stack.prefill.address) as pre_channel:
        encoded = await encoder_pb2_grpc.EncoderServiceStub(enc_channel).Encode(
            encoder_pb2.EncodeRequest(request_id="rows", items=[multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=PNG, mime_type="image/png"))])
        )
        (item,) = encoded.items
        # Consistent metadata for a taller image than the one encoded: only the bytes disagree.
        item.metadata.grid_thw.h += 2
        rows = item.metadata.grid_thw.t * item.metadata.grid_thw.h * item.metadata.grid_thw.w // 4
        item.metadata.placeholder_count = rows
        item.metadata.embedding_shape[0] = rows
        image_token = item.metadata.placeholder_token_id
        request = prefill_pb2.PrefillRequest(
            request_id="rows-mismatch",
            prompt=engine_pb2.EnginePrompt(token_ids=[1, 2, image_token, 3]),
            items=[item],
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_pb2_grpc.PrefillServiceStub(pre_channel).Prefill(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].metadata.embedding_shape" in violations(info.value)
    assert "rows" in info.value.details()


async def test_service_keeps_serving_and_leaks_no_slot_after_bad_input(family_stack):
    """Runs after the bad-input tests (file order): the stack still serves the monolithic tokens,
    and every arena lease has been freed."""
    request = chat_request([(PNG, "image/png"), "Describe."], max_tokens=16)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)
    for mode in ("epd", "epd-combined"):
        result = await generate(family_stack.gateway_stub(mode), request, timeout=120)
        assert result.token_ids == oracle.token_ids
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0

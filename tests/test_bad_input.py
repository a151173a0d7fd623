"""Bad input fails only its own request, with a precise status, and leaks nothing."""

from __future__ import annotations

import grpc
import pytest

from epd.client import chat_request, generate
from epd.testing import synthetic_image_png
from epd.v1 import gateway_pb2
from tests.helpers import encode_then_prefill, violations, wait_for_metric

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


async def test_metadata_that_the_model_lays_out_differently_fails_only_that_request(family_stack):
    """A consistent forgery (more rows, with shape and count to match) disagrees with the
    layout the prefill engine's own vLLM derives from the grid: refused before anything runs."""

    def more_rows(items):
        meta = items[0].metadata
        meta.placeholder_count += 4
        meta.embedding_shape[0] += 4

    error = await encode_then_prefill(family_stack, [(PNG, "image/png"), "Hi"], more_rows)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "items[0].metadata" in violations(error)
    assert "embedding rows" in error.details()


async def test_service_keeps_serving_and_leaks_no_slot_after_bad_input(family_stack):
    """Runs after the bad-input tests (file order): the stack still serves the monolithic tokens,
    and every arena lease has been freed."""
    request = chat_request([(PNG, "image/png"), "Describe."], max_tokens=16)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=120)
    for mode in ("epd", "epd-combined"):
        result = await generate(family_stack.gateway_stub(mode), request, timeout=120)
        assert result.token_ids == oracle.token_ids
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0

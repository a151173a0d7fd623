"""The bar: disaggregated greedy tokens equal the monolithic vLLM run of the same request."""

from __future__ import annotations

import asyncio

import pytest

from devkit.checkpoints import FAMILIES
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from tests.conftest import DISAGGREGATED_MODES
from tests.helpers import MIN_TOKENS, assert_matches_monolithic


def _image(width: int, height: int, seed: int) -> tuple[bytes, str]:
    return synthetic_image_png(width, height, seed=seed), "image/png"


CASES = {
    "one_image": lambda: [_image(160, 120, 1), "Describe this image."],
    "two_images_of_different_sizes": lambda: [_image(160, 120, 1), _image(224, 112, 2), "Compare the two pictures."],
    "image_between_text": lambda: ["Look at this:", _image(140, 140, 3), "What is in it?"],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", DISAGGREGATED_MODES)
@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_tokens_match_monolithic(family_stack, family, mode, case):
    result = await assert_matches_monolithic(family_stack, CASES[case](), mode, max_tokens=24)
    timings = result.finished.timings
    assert timings.encode.ToNanoseconds() > 0 and timings.decode.ToNanoseconds() > 0
    assert (timings.prefill.ToNanoseconds() > 0) == (mode == "epd")
    assert 0 < timings.time_to_first_token.ToNanoseconds() <= timings.total.ToNanoseconds()


async def test_eight_concurrent_streams_match_monolithic(family_stack):
    """Half through E/P/D and half through E+PD at once: the one decode instance behind both
    gateways decodes from KV handoffs and prefills whole requests in the same engine steps."""
    requests = [chat_request([_image(112 + 16 * i, 112, 10 + i), f"Request {i}: describe."], max_tokens=20, min_tokens=MIN_TOKENS) for i in range(8)]
    mono = family_stack.gateway_stub("monolithic")
    oracles = [await generate(mono, r, timeout=120) for r in requests]
    modes = ["epd", "epd-combined"] * 4
    results = await asyncio.gather(*(generate(family_stack.gateway_stub(mode), r, timeout=300) for mode, r in zip(modes, requests, strict=True)))
    for oracle, result, mode in zip(oracles, results, modes, strict=True):
        assert result.finished is not None
        assert result.token_ids == oracle.token_ids, mode
        assert (result.finished.timings.prefill.ToNanoseconds() > 0) == (mode == "epd")

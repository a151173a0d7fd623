"""The prefix cache's salt (``GenerateRequest.cache_salt``, vLLM's ``cache_salt``): a request
reuses prompt KV computed for requests with its salt only, through the prefill and the decode
that gets its handoff, and the tokens stay the monolithic run's.

The proof is vLLM's own count of prompt tokens its prefix cache served
(``vllm:prefix_cache_hits``) on the prefill instance.
"""

from __future__ import annotations

import grpc
import pytest

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.telemetry import scrape
from epd.wire import MAX_CACHE_SALT_CHARS

_HITS = "vllm:prefix_cache_hits_total"
# Past two of the engines' 128-token KV blocks, so that a repeat has full blocks to reuse.
_TEXT = "Compare the picture with this list: " + ", ".join(f"item {i}" for i in range(120)) + "."


def _request(salt: str):
    request = chat_request([(synthetic_image_png(96, 96, seed=7711), "image/png"), _TEXT], max_tokens=4, min_tokens=4)
    request.cache_salt = salt
    return request


async def test_a_salted_prompt_reuses_only_kv_computed_under_its_salt(family_stack):
    epd, prefill = family_stack.gateway_stub("epd"), family_stack.prefill
    oracle = (await generate(family_stack.gateway_stub("monolithic"), _request(""), timeout=120)).token_ids

    def hits() -> float:
        return scrape(prefill.metrics_port).get(_HITS, 0.0)

    grown = []
    for salt in ("tenant-a", "tenant-a", "tenant-b", ""):
        before = hits()
        assert (await generate(epd, _request(salt), timeout=120)).token_ids == oracle, salt
        grown.append(hits() - before)
    first_a, second_a, first_b, unsalted = grown
    assert first_a == 0, "the first request under a new salt found KV in the prefix cache"
    assert second_a >= 256, f"a repeat under its salt reused {second_a} prompt tokens, not its full blocks"
    assert first_b == 0, f"another salt reused {first_b} tokens of tenant-a's KV"
    # The unsalted run has its own cache entries: the monolithic oracle's ran on another engine.
    assert unsalted == 0


async def test_a_cache_salt_past_its_bound_is_invalid_argument(family_stack):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(family_stack.gateway_stub("epd"), _request("s" * (MAX_CACHE_SALT_CHARS + 1)), timeout=60)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"cache_salt holds {MAX_CACHE_SALT_CHARS + 1} characters; at most {MAX_CACHE_SALT_CHARS}" in refused.value.details()

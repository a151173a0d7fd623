"""The bar: disaggregated greedy tokens equal the monolithic vLLM run of the same request, and
that run equals vLLM's own chat path (``LLM.chat``, what ``vllm serve`` runs) given the same
messages: EPD's rendering and media decoding are vLLM's, not a copy that shares its quirks."""

from __future__ import annotations

import asyncio

import pytest

from devkit.checkpoints import FAMILIES, MODALITIES
from devkit.media import synthetic_image_png, synthetic_video
from epd.client import chat_request, content_part, generate
from epd.v1 import common_pb2, gateway_pb2
from tests.conftest import DISAGGREGATED_MODES, checkpoint
from tests.helpers import MIN_TOKENS, assert_matches_monolithic
from tests.vllm_chat import chat_messages, run_llm_chat


def _image(width: int, height: int, seed: int) -> tuple[bytes, str]:
    return synthetic_image_png(width, height, seed=seed), "image/png"


CASES = {
    "one_image": lambda: [_image(160, 120, 1), "Describe this image."],
    "two_images_of_different_sizes": lambda: [_image(160, 120, 1), _image(224, 112, 2), "Compare the two pictures."],
    "image_between_text": lambda: ["Look at this:", _image(140, 140, 3), "What is in it?"],
}


_ROLES = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT}
# Chats whose rendering a template could get wrong: text with whitespace at both ends, several
# text parts, items before, between and after text, a system message and earlier turns.
CHATS = {
    "one_image": lambda: [("user", CASES["one_image"]())],
    "image_between_text": lambda: [("user", CASES["image_between_text"]())],
    "whitespace_text_parts_and_items": lambda: [("user", [_image(112, 112, 4), "   First this,  ", _image(140, 112, 5), "\nthen that.\t", "  Compare.  "])],
    "system_message_and_turns": lambda: [
        ("system", ["  You answer in one word. "]),
        ("user", ["Hi ", _image(112, 140, 6)]),
        ("assistant", [" A picture.\n"]),
        ("user", ["\nAnd now?  "]),
    ],
}
# For the families that take video: a clip between texts, which vLLM's chat path loads and samples
# itself (EPD's encoder decodes and samples it with its own decoder).
VIDEO_CHATS = {
    "video_between_text": lambda: [("user", ["Watch this:", (synthetic_video(96, 64, 16, fps=8.0, seed=7), "video/mp4"), "What happens?"])],
}
CHAT_MAX_TOKENS = 24
# The image families whose monolithic oracle is checked against LLM.chat here; LLaVA-NeXT's,
# GLM-4.1V's and InternVL's disaggregated runs are compared with that oracle in test_models.py.
CHAT_FAMILIES = (*FAMILIES, "llava_next", "glm4v", "internvl")


def _chat_request(messages: list[tuple[str, list]]) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=_ROLES[role], parts=[content_part(p) for p in parts]) for role, parts in messages],
        sampling=common_pb2.SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0, min_tokens=MIN_TOKENS),
    )


def _chats_of(family: str) -> dict:
    return CHATS | VIDEO_CHATS if "video" in MODALITIES[family] else CHATS


def _chat_params() -> list:
    return [(family, chat) for family in CHAT_FAMILIES for chat in _chats_of(family)]


@pytest.fixture(scope="module")
def llm_chat(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """Every family's chats through vLLM's LLM.chat, one engine per family, in one process."""

    def job(family: str) -> dict:
        chats = {name: {"messages": chat_messages(build()), "max_tokens": CHAT_MAX_TOKENS, "min_tokens": MIN_TOKENS} for name, build in _chats_of(family).items()}
        limits = {"image": 3} | ({"video": 1} if "video" in MODALITIES[family] else {})
        return {"model": str(checkpoint(family)), "dtype": "float32", "limit_mm_per_prompt": limits, "chats": chats}

    return run_llm_chat([job(family) for family in CHAT_FAMILIES], tmp_path_factory.mktemp("llm-chat"))


@pytest.mark.parametrize(("family", "chat"), _chat_params())
async def test_monolithic_equals_vllm_llm_chat(family_stack, family, chat, llm_chat):
    """The oracle itself against vLLM's chat path: the same prompt ids and greedy tokens."""
    expected = llm_chat[str(checkpoint(family))][chat]
    result = await generate(family_stack.gateway_stub("monolithic"), _chat_request(_chats_of(family)[chat]()), timeout=180)
    assert len(expected["token_ids"]) >= MIN_TOKENS
    assert result.finished.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert result.token_ids == expected["token_ids"]


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

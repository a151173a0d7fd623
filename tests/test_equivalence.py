"""The bar: disaggregated greedy tokens equal the monolithic vLLM run of the same request, and
that run equals vLLM's own chat path (``LLM.chat``, what ``vllm serve`` runs) given the same
messages: EPD's rendering and media decoding are vLLM's, not a copy that shares its quirks."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from devkit.checkpoints import AUDIO_FAMILIES, FAMILIES, MODALITIES, NON_QWEN_FAMILIES
from devkit.media import noise_flac, sine_wav, synthetic_image_png, synthetic_video
from epd.client import chat_request, content_part, generate
from epd.v1 import common_pb2, gateway_pb2
from tests.conftest import BF16, DISAGGREGATED_MODES, checkpoint, stack_key
from tests.helpers import MIN_TOKENS, assert_matches_monolithic
from tests.vllm_chat import chat_messages


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
# For the families that take video: a clip between texts, which vLLM's chat path loads itself.
VIDEO_CHATS = {
    "video_between_text": lambda: [("user", ["Watch this:", _clip(7), "What happens?"])],
}
# For the families that take audio, one clip a prompt (Audio Flamingo 3's limit), at the tower's
# rate (16 kHz): vLLM's chat path would resample another rate with torchaudio, which does not load
# on CPU torch (README: Audio).
AUDIO_CHATS = {
    "audio_between_text": lambda: [("user", ["Listen:", (noise_flac(1.0, seed=1), "audio/flac"), "What do you hear?"])],
    "whitespace_audio_parts_and_turns": lambda: [
        ("system", ["  You answer in one word. "]),
        ("user", ["   First this,  ", (sine_wav(0.6, seed=2), "audio/wav"), "\nthen that.\t"]),
        ("assistant", [" A tone.\n"]),
        ("user", ["\nAnd now?  "]),
    ],
}
# For the Omni thinkers, which take all three in one prompt.
MIXED_CHATS = {
    "audio_image_and_video": lambda: [("user", [(sine_wav(1.0, seed=4), "audio/wav"), _image(112, 112, 8), _clip(9), "What is going on?"])],
}
CHAT_MAX_TOKENS = 24
# Every family, each in a dtype its stack is tested in: its chats through EPD (monolithic, E/P/D,
# E+PD) equal vLLM's LLM.chat, in float32 and, for four families, in bfloat16 too.
CHAT_FAMILIES = (
    *FAMILIES,
    *AUDIO_FAMILIES,
    "qwen3_omni_moe",
    stack_key("qwen2_5_omni", BF16),
    *NON_QWEN_FAMILIES,
    stack_key("llava_next", BF16),
    stack_key("internvl", BF16),
    stack_key("qwen3_omni_moe", BF16),
)
# bfloat16 stacks of families whose every chat is checked in float32 are asked only the chats
# that hold each modality they take (the rendering is the same; the rounding is what is new).
_BF16_CHATS = {
    stack_key("llava_next", BF16): ("whitespace_text_parts_and_items",),
    stack_key("internvl", BF16): ("whitespace_text_parts_and_items", "video_between_text"),
    stack_key("qwen3_omni_moe", BF16): ("audio_image_and_video",),
}


def _clip(seed: int) -> tuple[bytes, str]:
    return synthetic_video(96, 64, 16, fps=8.0, seed=seed), "video/mp4"


def _chat_request(messages: list[tuple[str, list]]) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=_ROLES[role], parts=[content_part(p) for p in parts]) for role, parts in messages],
        sampling=common_pb2.SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0.0, min_tokens=MIN_TOKENS),
    )


def _chats_of(key: str) -> dict:
    modalities = MODALITIES[key.partition("@")[0]]
    chats = {
        **(CHATS if "image" in modalities else {}),
        **(VIDEO_CHATS if "video" in modalities else {}),
        **(AUDIO_CHATS if "audio" in modalities else {}),
        **(MIXED_CHATS if len(modalities) == 3 else {}),
    }
    return {name: chats[name] for name in _BF16_CHATS[key]} if key in _BF16_CHATS else chats


def _chat_params() -> list:
    return [(family, chat) for family in CHAT_FAMILIES for chat in _chats_of(family)]


@pytest.fixture
def llm_chat(llm_chat_oracle, family) -> dict[str, dict]:
    """The family's chats through vLLM's LLM.chat, in the dtype of its stack."""

    def job() -> dict:
        name, _, dtype = family.partition("@")
        chats = {chat: {"messages": chat_messages(build()), "max_tokens": CHAT_MAX_TOKENS, "min_tokens": MIN_TOKENS} for chat, build in _chats_of(family).items()}
        limits = {modality: 3 for modality in MODALITIES[name]}
        return {"model": str(checkpoint(name)), "dtype": dtype or "float32", "limit_mm_per_prompt": limits, "chats": chats}

    return llm_chat_oracle.answers(family, job)


@pytest.mark.parametrize(("family", "chat"), _chat_params())
async def test_every_mode_equals_vllm_llm_chat(family_stack, family, chat, llm_chat):
    """EPD against vLLM's chat path, the same messages: the monolithic oracle, E/P/D and E+PD
    give vLLM's prompt ids and greedy tokens. The three run at once in float32, whose tokens do
    not depend on the batch (test_eight_concurrent_streams_match_monolithic), one by one in
    bfloat16, whose tokens may."""
    expected = llm_chat[chat]
    assert len(expected["token_ids"]) >= MIN_TOKENS
    request = _chat_request(_chats_of(family)[chat]())
    modes = ("monolithic", *DISAGGREGATED_MODES)

    async def answer(mode: str):
        return await generate(family_stack.gateway_stub(mode), request, timeout=180)

    if BF16 in family:
        results = [await answer(mode) for mode in modes]
    else:
        results = await asyncio.gather(*map(answer, modes))
    for mode, result in zip(modes, results, strict=True):
        assert result.finished.usage.prompt_tokens == len(expected["prompt_token_ids"]), mode
        assert result.token_ids == expected["token_ids"], mode


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", DISAGGREGATED_MODES)
@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_tokens_match_monolithic(family_stack, family, mode, case):
    result = await assert_matches_monolithic(family_stack, CASES[case](), mode, max_tokens=24)
    timings = result.finished.timings
    assert timings.encode.ToNanoseconds() > 0 and timings.decode.ToNanoseconds() > 0
    assert (timings.prefill.ToNanoseconds() > 0) == (mode == "epd")
    assert 0 < timings.time_to_first_token.ToNanoseconds() <= timings.total.ToNanoseconds()


@pytest.mark.parametrize("family", ["qwen2_5_vl", stack_key("qwen2_5_omni", BF16)])
@pytest.mark.parametrize("mode", DISAGGREGATED_MODES)
async def test_stop_strings_end_the_reply_and_its_text_as_monolithic(family_stack, family, mode):
    """In E/P/D the first token is the prefill's and the rest the decode's. A stop string that
    spans the two (the last character of the first token's text and the first of the second's)
    still ends the reply where the monolithic engine ends it, and one that never matches still
    leaves its text whole: vLLM holds back the last characters of a reply with stop strings
    until no stop string can start in them, and the decode outputs what the prefill held back."""
    mono = family_stack.gateway_stub("monolithic")
    parts = CASES["one_image"]()
    deltas = []
    await generate(mono, chat_request(parts, max_tokens=8, min_tokens=8), on_delta=deltas.append, timeout=120)
    first, second = deltas[0], deltas[1]
    assert len(first.token_ids) == len(second.token_ids) == 1 and first.text and second.text, "the case needs two tokens with text"
    across = first.text[-1] + second.text[0]
    assert across not in first.text
    for stop, tokens in ((across, 2), ("a stop string never met", 8)):
        request = chat_request(parts, max_tokens=8, min_tokens=0 if tokens == 2 else 8)
        request.sampling.stop.append(stop)
        oracle = await generate(mono, request, timeout=120)
        assert len(oracle.token_ids) == tokens, stop
        result = await generate(family_stack.gateway_stub(mode), request, timeout=120)
        assert (result.token_ids, result.text, result.finished.finish_reason) == (oracle.token_ids, oracle.text, oracle.finished.finish_reason), stop


@pytest.mark.parametrize("family", ["qwen2_5_vl", stack_key("qwen2_5_omni", BF16)])
@pytest.mark.parametrize("mode", DISAGGREGATED_MODES)
async def test_a_reply_continued_inside_a_character_goes_on_as_monolithic(family_stack, family, mode):
    """A resume can break a reply off inside a character: a byte-level tokenizer spells a rare
    one over several tokens. Continued there (as the gateway resumes a stream, and as a client
    may), the reply goes on with the monolithic tokens and text. An E/P/D decode whose
    detokenizer started from the continuation's middle once replied with the whole prompt's text
    in front, when the character went on past the prefill's first token."""
    mono = family_stack.gateway_stub("monolithic")
    request = chat_request(CASES["one_image"](), max_tokens=48, min_tokens=48)
    reply = (await generate(mono, request, timeout=120)).token_ids
    tokenizer = AutoTokenizer.from_pretrained(family_stack.model)

    def inside_a_character(tokens: list[int]) -> bool:
        return tokenizer.decode(tokens).endswith("\N{REPLACEMENT CHARACTER}")

    cut = next((k for k in range(1, len(reply) - 1) if inside_a_character(reply[:k]) and inside_a_character(reply[: k + 1])), None)
    assert cut is not None, "the case needs a character of three tokens or more in its reply"
    request.continuation_token_ids.extend(reply[:cut])
    oracle = await generate(mono, request, timeout=120)
    assert oracle.token_ids == reply[cut:]
    result = await generate(family_stack.gateway_stub(mode), request, timeout=120)
    assert (result.token_ids, result.text) == (oracle.token_ids, oracle.text)
    assert result.finished.usage == oracle.finished.usage


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

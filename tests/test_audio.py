"""Audio through the metadata-only path (Qwen2-Audio): greedy tokens equal the monolithic vLLM
run given the raw audio, and bad audio fails only its own request with the field named."""

from __future__ import annotations

import grpc
import pytest

from devkit.media import noise_flac, noise_samples, pcm_bytes, sine_wav, synthetic_image_png, wav_int16
from epd.client import chat_request, generate
from epd.v1 import multimodal_pb2
from tests.helpers import MIN_TOKENS, assert_matches_monolithic, violations, wait_for_metric

QWEN2_AUDIO = pytest.mark.parametrize("family", ["qwen2_audio"])


def _pcm(seconds: float, rate: int, seed: int, encoding: str = "s16le") -> multimodal_pb2.Audio:
    data = pcm_bytes(noise_samples(seconds, rate, seed=seed), encoding)
    wire_encoding = multimodal_pb2.PCM_ENCODING_S16LE if encoding == "s16le" else multimodal_pb2.PCM_ENCODING_F32LE
    return multimodal_pb2.Audio(pcm=multimodal_pb2.PcmAudio(data=data, sample_rate_hz=rate, channels=1, encoding=wire_encoding))


CASES = {
    "one_clip": lambda: [(sine_wav(1.5, seed=1), "audio/wav"), "What do you hear?"],
    "two_clips_of_different_lengths": lambda: [(sine_wav(0.8, freq=330.0, seed=2), "audio/wav"), (noise_flac(2.6, seed=3), "audio/flac"), "Compare them."],
    "audio_with_text_on_both_sides": lambda: ["Listen to this:", (sine_wav(1.1, 22050, freq=520.0, seed=4), "audio/x-wav"), "and say what it is."],
    "raw_pcm_at_another_rate": lambda: [_pcm(1.3, 8000, 5, "f32le"), "Transcribe."],
}


@QWEN2_AUDIO
@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
@pytest.mark.parametrize("case", list(CASES))
async def test_audio_greedy_tokens_match_monolithic(family_stack, family, mode, case):
    await assert_matches_monolithic(family_stack, CASES[case](), mode)


def _parts(part) -> list:
    return [part, "Hi"]


BAD_AUDIO = {
    "zero_length_wav": (lambda: _parts((wav_int16(noise_samples(0.0), 16000), "audio/wav")), "messages[0].parts[0].audio.file.data"),
    "unsupported_sample_rate": (lambda: _parts(_pcm(0.5, 4000, 6)), "messages[0].parts[0].audio.pcm.sample_rate_hz"),
    "wav_at_an_unsupported_rate": (lambda: _parts((sine_wav(0.5, 96000), "audio/wav")), "messages[0].parts[0].audio.file.data"),
    "longer_than_the_model_takes": (lambda: _parts((sine_wav(31.0, 8000), "audio/wav")), "messages[0].parts[0].audio.file.data"),
    "too_short_for_one_token": (lambda: _parts(_pcm(0.01, 16000, 7)), "messages[0].parts[0].audio.pcm.data"),
    "truncated_flac": (lambda: _parts((noise_flac(1.0, seed=8)[:300], "audio/flac")), "messages[0].parts[0].audio.file.data"),
    "unsupported_codec": (lambda: _parts((b"ID3\x04" + b"\x00" * 200, "audio/mpeg")), "messages[0].parts[0].audio.file.mime_type"),
    "image_for_an_audio_model": (lambda: _parts((synthetic_image_png(64, 64, seed=1), "image/png")), "messages[0].parts[0].image"),
}


@QWEN2_AUDIO
@pytest.mark.parametrize("mode", ["epd", "epd-combined", "monolithic"])
@pytest.mark.parametrize("case", list(BAD_AUDIO))
async def test_bad_audio_gets_invalid_argument_with_field(family_stack, family, mode, case):
    build, field = BAD_AUDIO[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(family_stack.gateway_stub(mode), chat_request(build(), max_tokens=8), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in violations(info.value), info.value.details()


@QWEN2_AUDIO
async def test_audio_stack_serves_and_leaks_nothing_after_bad_input(family_stack, family):
    request = chat_request([(sine_wav(1.0, seed=9), "audio/wav"), "Describe."], max_tokens=16, min_tokens=MIN_TOKENS)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    for mode in ("epd", "epd-combined"):
        assert (await generate(family_stack.gateway_stub(mode), request, timeout=180)).token_ids == oracle.token_ids
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0

"""Qwen2-Audio: layout rules against the HF processor, the audio-only encoder, audio decoding,
and the engine-level equivalence of precomputed embeddings with vLLM's own audio path.

Run directly (``python tests/test_audio_family.py CHECKPOINT_DIR RESULT_JSON``), this file is
the vLLM worker of the engine tests: vLLM's engine spawns processes and holds memory until
exit, so it runs in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from epd.domain import EncodedItem, EngineRequest, ItemMetadata, Modality, Sampling
from epd.errors import InvalidArgument
from epd.media.audio import DecodedAudio, decode_audio_file, decode_pcm
from epd.models.qwen2_audio import AudioEncoder, Qwen2AudioFamily
from epd.testing import noise_flac, noise_samples, pcm_bytes, sine_samples, sine_wav, soundfile_bytes, wav_int16

FAMILY = "qwen2_audio"
RATE = 16000
# Clip lengths in seconds: sub-second, a few seconds, not a whole number of 10 ms frames, and
# over the 30 s window (cut to 3000 frames).
DURATIONS = (0.7, 2.0, 3.3037, 31.0)
MESSAGES_TWO_CLIPS = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Listen:"},
            {"type": "audio"},
            {"type": "text", "text": "then compare it with"},
            {"type": "audio"},
            {"type": "text", "text": "What is different?"},
        ],
    }
]
ENGINE_CLIPS = ((0.7, 1), (2.45, 2))  # (seconds, seed): two clips of different lengths


def clip(seconds: float, seed: int) -> np.ndarray:
    """Even seeds give noise, odd ones a tone: clips that differ in content, not just length."""
    return noise_samples(seconds, RATE, seed=seed) if seed % 2 == 0 else sine_samples(seconds, RATE, 220.0 * seed, seed=seed)


@pytest.fixture(scope="module")
def model() -> pathlib.Path:
    from tests.conftest import checkpoint

    return checkpoint(FAMILY)


@pytest.fixture(scope="module")
def encoder(model: pathlib.Path) -> AudioEncoder:
    return AudioEncoder(model)


def rendered_prompt(model: pathlib.Path, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, tokenizer(text)["input_ids"]


def metadata_of(family: Qwen2AudioFamily, encodings: list, prefix: str = "clip") -> list[ItemMetadata]:
    return [family.item_metadata(Modality.AUDIO, f"{prefix}-{i}", e) for i, e in enumerate(encodings)]


# --- layout ------------------------------------------------------------------------------


def test_family_reads_the_config(model: pathlib.Path, encoder: AudioEncoder) -> None:
    from transformers import AutoTokenizer

    family = encoder.family
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert family.model_type == "qwen2_audio"
    assert family.audio_token_id == tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert family.placeholder_token_ids == frozenset({family.audio_token_id})
    assert family.supported_modalities == frozenset({Modality.AUDIO})
    assert family.embedding_width == 128
    assert family.max_audio_seconds == encoder.processors.max_seconds == 30.0
    assert encoder.processors.sampling_rate == RATE
    with pytest.raises(ValueError, match="qwen2_audio"):
        Qwen2AudioFamily.from_config({"model_type": "qwen2_5_vl"})
    # The released Qwen2-Audio-7B-Instruct config.json leaves the sizes at their defaults.
    released = {
        "model_type": "qwen2_audio",
        "audio_config": {"model_type": "qwen2_audio_encoder"},
        "audio_token_index": 151646,
        "text_config": {"model_type": "qwen2", "intermediate_size": 11008, "vocab_size": 156032},
    }
    assert Qwen2AudioFamily.from_config(released) == Qwen2AudioFamily("qwen2_audio", 151646, 4096, 3000)


def test_token_count_is_the_towers_own_arithmetic(encoder: AudioEncoder) -> None:
    lengths = torch.arange(0, 3001)
    _, expected = encoder.tower._get_feat_extract_output_lengths(lengths)
    assert [encoder.family.audio_token_count(int(n)) for n in lengths] == expected.tolist()
    assert [encoder.family.audio_token_count(n) for n in (1, 2, 3, 4, 5, 70, 3000)] == [0, 0, 1, 1, 1, 17, 750]


def test_placeholders_rebuilt_from_metadata_equal_processor_expansion(model: pathlib.Path, encoder: AudioEncoder) -> None:
    from transformers import AutoProcessor

    clips = [clip(seconds, seed) for seed, seconds in enumerate(DURATIONS)]
    messages = [{"role": "user", "content": [part for _ in clips for part in ({"type": "audio"}, {"type": "text", "text": "and"})]}]
    text, token_ids = rendered_prompt(model, messages)
    assert token_ids.count(encoder.family.audio_token_id) == len(clips), "the template renders one <|AUDIO|> per clip"

    encodings = encoder.encode_clips(clips)
    rebuilt = encoder.family.expand_prompt(token_ids, metadata_of(encoder.family, encodings))

    processed = AutoProcessor.from_pretrained(model)(text=[text], audio=clips, sampling_rate=RATE)
    expected = list(processed["input_ids"][0])
    assert rebuilt.token_ids == expected
    audio_positions = [i for i, t in enumerate(expected) if t == encoder.family.audio_token_id]
    assert [r.offset + k for r in rebuilt.ranges for k in range(r.length)] == audio_positions
    assert [e.audio_feature_length for e in encodings] == [int(m.sum()) for m in processed["feature_attention_mask"]]
    assert [e.audio_feature_length for e in encodings][-1] == 3000  # the 31 s clip, cut to 30 s
    assert [r.length for r in rebuilt.ranges] == [e.embedding.shape[0] for e in encodings] == [17, 50, 83, 750]


def test_layout_mismatches_name_their_fields(encoder: AudioEncoder) -> None:
    family = encoder.family
    (encoding,) = encoder.encode_clips([clip(1.0, 1)])
    good = family.item_metadata(Modality.AUDIO, "h", encoding)
    prompt = [1, family.audio_token_id, 2]
    assert family.expand_prompt(prompt, [good]).token_ids == [1, *[family.audio_token_id] * 25, 2]

    cases = {
        "prompt.token_ids": ([1, 2], [good]),
        "items[0].metadata.audio_token_count": (prompt, [_replace(good, audio_token_count=24)]),
        "items[0].metadata.placeholder_count": (prompt, [_replace(good, placeholder_count=26)]),
        "items[0].metadata.embedding_shape": (prompt, [_replace(good, embedding_shape=(25, 64))]),
        "items[0].metadata.audio_feature_length": (prompt, [_replace(good, audio_feature_length=3001)]),
        "items[0].metadata.modality": (prompt, [_replace(good, modality=Modality.IMAGE)]),
        "items[0].metadata.placeholder_token_id": (prompt, [_replace(good, placeholder_token_id=1)]),
    }
    for field, (token_ids, items) in cases.items():
        with pytest.raises(InvalidArgument) as raised:
            family.expand_prompt(token_ids, items)
        assert [v.field for v in raised.value.violations] == [field], field
    with pytest.raises(InvalidArgument) as raised:
        family.validate_layout(prompt, [_replace(good, audio_feature_length=2)])
    (violation,) = raised.value.violations
    assert violation.field == "items[0].metadata.audio_feature_length" and "too short" in violation.description


def _replace(item: ItemMetadata, **changes: Any) -> ItemMetadata:
    import dataclasses

    return dataclasses.replace(item, **changes)


def test_engine_prompt_with_and_without_embeddings(encoder: AudioEncoder) -> None:
    family = encoder.family
    encodings = encoder.encode_clips([clip(0.7, 1), clip(2.0, 2)])
    metadata = metadata_of(family, encodings)
    request = EngineRequest(
        "r", (1, family.audio_token_id, 2, family.audio_token_id), tuple(EncodedItem(m) for m in metadata), Sampling(max_tokens=4)
    )

    prefill = family.engine_prompt(request, [e.embedding for e in encodings])
    assert prefill["prompt_token_ids"] == list(request.prompt_token_ids)
    audio = prefill["multi_modal_data"]["audio"]
    assert audio["audio_num_tokens"].dtype == torch.int64 and audio["audio_num_tokens"].tolist() == [17, 50]
    assert [tuple(t.shape) for t in audio["audio_embeds"]] == [(17, 128), (50, 128)]
    assert prefill["multi_modal_uuids"] == {"audio": ["clip-0", "clip-1"]}

    decode = family.engine_prompt(request, None)
    assert set(decode["multi_modal_data"]["audio"]) == {"audio_num_tokens"}
    assert decode["multi_modal_uuids"] == prefill["multi_modal_uuids"]

    image = _replace(metadata[0], modality=Modality.IMAGE)
    with pytest.raises(InvalidArgument):
        family.engine_prompt(_replace(request, items=(EncodedItem(image),)), None)


# --- encoder -----------------------------------------------------------------------------


def test_encoder_reads_only_the_audio_shards(model: pathlib.Path, encoder: AudioEncoder, tmp_path: pathlib.Path) -> None:
    """Language-model shards are overwritten with garbage: an encoder that opened them would fail."""
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    weight_map = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    audio_shards = {s for n, s in weight_map.items() if n.startswith(("audio_tower.", "multi_modal_projector."))}
    lm_shards = set(weight_map.values()) - audio_shards
    assert audio_shards and lm_shards
    for shard in lm_shards:
        (broken / shard).write_bytes(b"\0not a safetensors file")

    from_broken = AudioEncoder(broken)
    report = from_broken.load_report
    assert (report.shards_read, report.shards_total) == (len(audio_shards), len(audio_shards) + len(lm_shards))
    assert report.bytes_read < report.bytes_total

    clips = [clip(1.3, 1), clip(0.4, 2)]
    for a, b in zip(from_broken.encode_clips(clips), encoder.encode_clips(clips), strict=True):
        assert torch.equal(a.embedding, b.embedding)


def test_batching_does_not_change_embeddings(encoder: AudioEncoder) -> None:
    clips = [clip(0.5, 1), clip(4.0, 2), clip(1.1, 3)]
    batched = encoder.encode_clips(clips)
    for one, single in zip(batched, [encoder.encode_clips([c])[0] for c in clips], strict=True):
        assert torch.equal(one.embedding, single.embedding)
        assert one.embedding.is_contiguous()


def test_encoder_refuses_what_it_cannot_represent(encoder: AudioEncoder) -> None:
    assert len(encoder.encode_clips([np.zeros(encoder.processors.min_samples, np.float32)])[0].embedding) == 1
    with pytest.raises(ValueError, match="at least 321 give an audio token"):
        encoder.encode_clips([np.zeros(encoder.processors.min_samples - 1, np.float32)])
    with pytest.raises(ValueError, match="8000 Hz"):
        encoder.encode(Modality.AUDIO, [DecodedAudio(np.zeros(8000, np.float32), 8000)])
    with pytest.raises(ValueError, match="audio only"):
        encoder.encode(Modality.IMAGE, [])
    (from_decoded,) = encoder.encode(Modality.AUDIO, [DecodedAudio(clip(1.0, 1), RATE)])
    assert torch.equal(from_decoded.embedding, encoder.encode_clips([clip(1.0, 1)])[0].embedding)


# --- decoding ----------------------------------------------------------------------------


def test_wav_and_flac_decode_to_the_samples_written() -> None:
    mono = sine_samples(0.5, RATE, seed=1)
    quantised = np.round(mono * 32768).clip(-32768, 32767) / 32768
    decoded = decode_audio_file(sine_wav(0.5, RATE, seed=1), "audio/wav", RATE)
    assert decoded.sample_rate == RATE and decoded.samples.dtype == np.float32 and decoded.duration_s == 0.5
    np.testing.assert_array_equal(decoded.samples, quantised.astype(np.float32))

    stereo = sine_samples(0.25, RATE, channels=2, seed=2)
    as_float = decode_audio_file(soundfile_bytes(stereo, RATE, subtype="FLOAT"), "audio/x-wav", RATE)
    np.testing.assert_array_equal(as_float.samples, stereo.mean(axis=1, dtype=np.float32))
    as_24_bit = decode_audio_file(soundfile_bytes(stereo, RATE, subtype="PCM_24"), "audio/wave", RATE)
    np.testing.assert_allclose(as_24_bit.samples, stereo.mean(axis=1), atol=2**-23)

    flac = decode_audio_file(noise_flac(0.3, RATE, seed=3), "audio/flac", RATE)
    np.testing.assert_allclose(flac.samples, noise_samples(0.3, RATE, seed=3), atol=2**-15)


def test_pcm_decodes_like_the_same_wav() -> None:
    stereo = sine_samples(0.2, RATE, channels=2, seed=4)
    from_wav = decode_audio_file(wav_int16(stereo, RATE), "audio/wav", RATE)
    from_pcm = decode_pcm(pcm_bytes(stereo, "s16le"), RATE, 2, "s16le", RATE)
    np.testing.assert_array_equal(from_pcm.samples, from_wav.samples)
    as_f32 = decode_pcm(pcm_bytes(stereo, "f32le"), RATE, 2, "f32le", RATE)
    np.testing.assert_array_equal(as_f32.samples, stereo.mean(axis=1, dtype=np.float32))


@pytest.mark.parametrize("source_rate", [8000, 22050, 44100, 48000])
def test_resampling_to_the_model_rate(source_rate: int) -> None:
    seconds = 1.5
    decoded = decode_audio_file(sine_wav(seconds, source_rate, 440.0, seed=5), "audio/wav", RATE)
    assert decoded.sample_rate == RATE and len(decoded.samples) == round(seconds * RATE)
    assert decoded.samples.dtype == np.float32
    # Still a 440 Hz tone: the spectrum peaks at its bin.
    spectrum = np.abs(np.fft.rfft(decoded.samples))
    assert abs(np.argmax(spectrum) * RATE / len(decoded.samples) - 440.0) < 2.0


@pytest.mark.parametrize(
    ("data", "mime_type", "message"),
    [
        (wav_int16(np.zeros(0, np.float32), RATE), "audio/wav", "has no samples"),
        (sine_wav(0.5, RATE)[:3000], "audio/wav", "is truncated: its data chunk declares 16000 bytes but 2956 follow"),
        (sine_wav(0.5, RATE)[:30], "audio/wav", "cannot be decoded as WAV"),
        (noise_flac(0.5, RATE)[:2000], "audio/flac", "cannot be decoded as FLAC|is truncated"),
        (b"", "audio/wav", "is empty"),
        (b"RIFF garbage, not audio at all" * 4, "audio/wav", "cannot be decoded as WAV: Format not recognised"),
        (sine_wav(0.5, 4000), "audio/wav", "sample rate 4000 Hz is outside the supported 8000–48000 Hz"),
        (sine_wav(0.5, 96000), "audio/wav", "sample rate 96000 Hz is outside"),
        (noise_flac(0.5, RATE), "audio/wav", "is a FLAC file, not the WAV"),
        (soundfile_bytes(np.zeros(100, np.float32), RATE, container="OGG", subtype="VORBIS"), "audio/ogg", "unsupported audio MIME type"),
        (soundfile_bytes(np.full(100, np.nan, np.float32), RATE), "audio/wav", "NaN or infinite"),
    ],
)
def test_bad_audio_files_are_value_errors(data: bytes, mime_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_audio_file(data, mime_type, RATE)


@pytest.mark.parametrize(
    ("data", "rate", "channels", "encoding", "message"),
    [
        (b"", RATE, 1, "s16le", "has no samples"),
        (b"\0" * 7, RATE, 2, "s16le", "holds 7 bytes, not a whole number of 4-byte frames"),
        (b"\0" * 8, 4000, 1, "s16le", "sample rate 4000 Hz is outside"),
        (b"\0" * 8, RATE, 0, "s16le", "has 0 channels"),
        (b"\0" * 8, RATE, 1, "mulaw", "unsupported PCM encoding"),
    ],
)
def test_bad_pcm_is_a_value_error(data: bytes, rate: int, channels: int, encoding: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_pcm(data, rate, channels, encoding, RATE)


# --- vLLM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_result(model: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    result_file = tmp_path_factory.mktemp("vllm") / "result.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    run = subprocess.run([sys.executable, __file__, str(model), str(result_file)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(result_file.read_text())


def test_vllm_embeddings_give_the_tokens_of_raw_audio(vllm_result: dict[str, Any]) -> None:
    """The same engine, the same prompt with two clips: once as raw samples (vLLM runs its own
    tower), once as AudioEncoder embeddings. Greedy tokens must be identical."""
    raw, embeds, ones = vllm_result["raw"], vllm_result["embeds"], vllm_result["ones"]
    assert raw["prompt_token_ids"] == embeds["prompt_token_ids"]
    assert len(raw["token_ids"]) >= 16
    assert embeds["token_ids"] == raw["token_ids"]
    # Control: other embeddings change the output, so the embeddings really are used.
    assert ones["token_ids"] != raw["token_ids"]


def test_vllm_expands_metadata_only_prompts_on_kv_consumers(model: pathlib.Path, vllm_result: dict[str, Any]) -> None:
    """A decode engine (NixlConnector consumer) is given counts and no tensors: vLLM's processor
    lays the prompt out exactly as the family does; anywhere else it refuses such input."""
    family = AudioEncoder(model).family
    _, token_ids = rendered_prompt(model, MESSAGES_TWO_CLIPS)
    counts = vllm_result["counts"]
    items = [
        ItemMetadata(
            Modality.AUDIO,
            f"c{i}",
            family.audio_token_id,
            n,
            (n, family.embedding_width),
            "float32",
            audio_feature_length=length,
            audio_token_count=n,
        )
        for i, (length, n) in enumerate(counts)
    ]
    expanded = family.expand_prompt(token_ids, items)
    assert vllm_result["consumer"]["prompt_token_ids"] == expanded.token_ids == vllm_result["raw"]["prompt_token_ids"]
    assert vllm_result["consumer"]["ranges"] == [[r.offset, r.length] for r in expanded.ranges]
    assert "audio_embeds" in vllm_result["not_consumer"]


def vllm_worker(directory: str) -> dict[str, Any]:
    """Greedy tokens for raw audio, encoder embeddings and a control, from one vLLM engine;
    and how vLLM's processor takes metadata-only audio input with and without a KV consumer."""
    from vllm import LLM, SamplingParams

    encoder = AudioEncoder(directory)
    family = encoder.family
    clips = [clip(seconds, seed) for seconds, seed in ENGINE_CLIPS]
    encodings = encoder.encode_clips(clips)
    metadata = metadata_of(family, encodings)
    _, token_ids = rendered_prompt(pathlib.Path(directory), MESSAGES_TWO_CLIPS)
    request = EngineRequest("r", tuple(token_ids), tuple(EncodedItem(m) for m in metadata), Sampling(max_tokens=20))

    with_embeddings = family.engine_prompt(request, [e.embedding for e in encodings])
    control = family.engine_prompt(request, [torch.ones_like(e.embedding) for e in encodings])
    # Distinct uuids per prompt: vLLM keys its processed-item cache and its prefix KV blocks on
    # them, so a shared key would let one prompt reuse another's features instead of its own.
    control["multi_modal_uuids"] = {"audio": ["control-0", "control-1"]}
    raw = {
        "prompt_token_ids": token_ids,
        "multi_modal_data": {"audio": [(c, RATE) for c in clips]},
        "multi_modal_uuids": {"audio": ["raw-0", "raw-1"]},
    }
    llm = LLM(
        model=directory,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_mm_embeds=True,
        limit_mm_per_prompt={"audio": len(clips)},
        seed=0,
    )
    params = SamplingParams(temperature=0.0, min_tokens=16, max_tokens=20)
    outputs = llm.generate([raw, with_embeddings, control], params)
    result: dict[str, Any] = {
        name: {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids)}
        for name, out in zip(("raw", "embeds", "ones"), outputs, strict=True)
    }
    result["counts"] = [[e.audio_feature_length, e.audio_token_count] for e in encodings]
    metadata_only = family.engine_prompt(request, None)
    result["consumer"] = _process_with_vllm(directory, metadata_only, kv_role="kv_consumer")
    try:
        _process_with_vllm(directory, metadata_only, kv_role=None)
        result["not_consumer"] = "accepted"
    except ValueError as exc:
        result["not_consumer"] = str(exc)
    return result


def _process_with_vllm(directory: str, prompt: dict[str, Any], *, kv_role: str | None) -> dict[str, Any]:
    """Runs vLLM's multimodal processor alone on a prompt dict, configured as the given KV role."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    model_config = ModelConfig(model=directory, dtype="float32", max_model_len=2048, enable_mm_embeds=True, limit_mm_per_prompt={"audio": 2})
    kv_config = KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_buffer_device="cpu") if kv_role else None
    # VllmConfig derives allow_missing_mm_embeddings from the KV role, as an engine does.
    vllm_config = VllmConfig(model_config=model_config, kv_transfer_config=kv_config)
    processor = MULTIMODAL_REGISTRY.create_processor(vllm_config.model_config)
    items = processor.info.parse_mm_data(prompt["multi_modal_data"])
    processed = processor.apply(ProcessorInputs(prompt=prompt["prompt_token_ids"], mm_data_items=items), TimingContext())
    return {
        "prompt_token_ids": list(processed["prompt_token_ids"]),
        "ranges": [[r.offset, r.length] for r in processed["mm_placeholders"]["audio"]],
    }


if __name__ == "__main__":
    checkpoint_dir, result_path = sys.argv[1:3]
    pathlib.Path(result_path).write_text(json.dumps(vllm_worker(checkpoint_dir)))

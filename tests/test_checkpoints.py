"""Tests of the tiny random-weight checkpoints (devkit.checkpoints).

They check that builds are byte-for-byte reproducible, that the tower (vision, or audio plus
projector) has shards of its own, and that transformers and vLLM both load the result and
decode the same greedy tokens. Run directly (``python tests/test_checkpoints.py RESULT_JSON CHECKPOINT_DIR...``), this
file is the vLLM worker of the vLLM tests: one fresh interpreter, apart from pytest's, runs every
checkpoint's engine in turn, so vLLM's imports (most of an engine's start on a 2-core box) are
paid once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devkit.checkpoints import (
    ALL_FAMILIES,
    AUDIO_FAMILIES,
    FAMILIES,
    MODALITIES,
    NON_QWEN_FAMILIES,
    OMNI_FAMILIES,
    build_tiny_checkpoint,
    ensure_tiny_checkpoint,
)
from devkit.media import noise_samples, sine_samples

NEW_TOKENS = 16
IMAGE_SIZE = (200, 150)  # (width, height): a few dozen placeholder tokens
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture."}]}]
AUDIO_MESSAGES = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is this sound?"}]}]
AUDIO_RATE = 16000
# Families with an image, video and audio mix of their own (see MODALITIES); checked by the
# "multimodal" tests below rather than the image-only and Qwen2-Audio ones above them.
MULTIMODAL_FAMILIES = OMNI_FAMILIES + NON_QWEN_FAMILIES
VIDEO_FRAMES = 4  # at 2 fps: two temporal patches


def synthetic_image(seed: int) -> Image.Image:
    """A deterministic RGB test image: a colour gradient plus seeded noise."""
    width, height = IMAGE_SIZE
    y, x = np.mgrid[0:height, 0:width]
    gradient = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1)
    noise = np.random.default_rng(seed).integers(0, 96, size=(height, width, 3))
    return Image.fromarray(((gradient + noise) % 256).astype(np.uint8))


def synthetic_clip(seed: int) -> np.ndarray:
    """A deterministic mono clip at 16 kHz: a tone for seed 0, noise otherwise, lengths differ."""
    if seed == 0:
        return sine_samples(1.3, AUDIO_RATE, 330.0, seed=seed)
    return noise_samples(0.8 + 0.4 * seed, AUDIO_RATE, seed=seed)


def synthetic_video(seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Seeded noise frames ``[T, H, W, 3]`` and the metadata vLLM takes with pre-sampled frames
    (as in ``epd.media.video.DecodedVideo.vllm_input``)."""
    frames = np.random.default_rng(seed).integers(0, 256, size=(VIDEO_FRAMES, IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
    metadata = {
        "total_num_frames": VIDEO_FRAMES,
        "fps": 2.0,
        "duration": VIDEO_FRAMES / 2.0,
        "frames_indices": list(range(VIDEO_FRAMES)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    return frames, metadata


def file_bytes(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def weight_map(directory: pathlib.Path) -> dict[str, str]:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def is_vision(name: str) -> bool:
    return "visual" in name.split(".")


def is_audio_tower(name: str) -> bool:
    return name.startswith(("audio_tower.", "multi_modal_projector."))


def shard_files(directory: pathlib.Path, *, vision: bool) -> set[str]:
    return {shard for name, shard in weight_map(directory).items() if is_vision(name) == vision}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: ensure_tiny_checkpoint(family, root) for family in FAMILIES}


@pytest.fixture(scope="module")
def audio_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    (family,) = AUDIO_FAMILIES
    return ensure_tiny_checkpoint(family, tmp_path_factory.mktemp("audio-checkpoints"))


# --- determinism and layout ------------------------------------------------------------


def test_build_is_byte_identical_across_processes(tmp_path: pathlib.Path) -> None:
    # One build here, one through the CLI in a fresh interpreter: catches anything that
    # depends on process state (hash seeds, thread scheduling in the BPE trainer).
    build_tiny_checkpoint("qwen2_5_vl", tmp_path / "a", seed=3)
    subprocess.run(
        [sys.executable, "-m", "devkit.checkpoints", "--family", "qwen2_5_vl", "--out", str(tmp_path / "b"), "--seed", "3"],
        check=True,
        capture_output=True,
    )
    first, second = file_bytes(tmp_path / "a"), file_bytes(tmp_path / "b")
    assert sorted(first) == sorted(second)
    for name in first:
        assert first[name] == second[name], name


def test_vision_seed_changes_only_vision_shards(tmp_path: pathlib.Path) -> None:
    base = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "base", seed=0)
    other_vision = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "v1", seed=0, vision_seed=1)
    other_lm = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "s1", seed=1, vision_seed=0)
    base_files, vision_files, lm_files = file_bytes(base), file_bytes(other_vision), file_bytes(other_lm)
    vision_shards = shard_files(base, vision=True)
    assert vision_shards
    for name, data in base_files.items():
        # A different vision_seed touches the vision shards and nothing else ...
        assert (vision_files[name] != data) == (name in vision_shards), name
        # ... and a different seed with the same vision seed touches only the LM shards.
        is_lm_shard = name.endswith(".safetensors") and name not in vision_shards
        assert (lm_files[name] != data) == is_lm_shard, name


def test_costly_tower_scale_changes_only_the_tower_and_the_image_size(tmp_path: pathlib.Path) -> None:
    """The reuse benchmark's checkpoint: the tiny language model, byte for byte, behind a bigger
    tower that takes bigger images."""
    tiny = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "tiny", seed=0)
    costly = build_tiny_checkpoint("qwen2_5_vl", tmp_path / "costly", seed=0, scale="costly_tower")
    tiny_files, costly_files = file_bytes(tiny), file_bytes(costly)
    vision_shards = shard_files(tiny, vision=True)
    for name, data in tiny_files.items():
        if name.endswith(".safetensors") and name not in vision_shards:
            assert costly_files[name] == data, name
    tiny_vision, costly_vision = (json.loads((path / "config.json").read_text())["vision_config"] for path in (tiny, costly))
    assert (tiny_vision["depth"], tiny_vision["hidden_size"]) == (2, 64)
    assert (costly_vision["depth"], costly_vision["hidden_size"], costly_vision["intermediate_size"]) == (8, 256, 1024)
    longest = [json.loads((path / "preprocessor_config.json").read_text())["size"]["longest_edge"] for path in (tiny, costly)]
    assert longest == [(8 * 28) ** 2, (32 * 28) ** 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_tower_has_shards_of_its_own(checkpoints: dict[str, pathlib.Path], family: str) -> None:
    directory = checkpoints[family]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    mapping = index["weight_map"]
    assert len(set(mapping.values())) >= 3
    vision, language = shard_files(directory, vision=True), shard_files(directory, vision=False)
    assert vision and language and not vision & language
    _assert_shards_match_the_index(directory, index)
    for shard in set(mapping.values()):
        names = {name for name, where in mapping.items() if where == shard}
        assert len({is_vision(name) for name in names}) == 1, f"{shard} mixes vision and language tensors"


def test_ensure_reuses_and_repairs(tmp_path: pathlib.Path) -> None:
    path = ensure_tiny_checkpoint("qwen3_vl", tmp_path, seed=2, vision_seed=5)
    assert path == tmp_path / "qwen3_vl-s2-v5"
    assert ensure_tiny_checkpoint("qwen3_vl", tmp_path, seed=2, vision_seed=2) == tmp_path / "qwen3_vl-s2"
    before = file_bytes(path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}

    assert ensure_tiny_checkpoint("qwen3_vl", tmp_path, seed=2, vision_seed=5) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes, "complete checkpoint was rebuilt"

    # As if a non-atomic writer had died before its last shard.
    (path / "model-00002-of-00003.safetensors").unlink()
    assert ensure_tiny_checkpoint("qwen3_vl", tmp_path, seed=2, vision_seed=5) == path
    assert file_bytes(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3_vl-s2", "qwen3_vl-s2-v5"], "staging dir left behind"


def test_unknown_family_is_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny_checkpoint("llava", tmp_path)
    assert FAMILIES + AUDIO_FAMILIES == ("qwen2_5_vl", "qwen3_vl", "qwen2_audio")
    assert ALL_FAMILIES == FAMILIES + AUDIO_FAMILIES + OMNI_FAMILIES + NON_QWEN_FAMILIES
    assert OMNI_FAMILIES == ("qwen2_5_omni", "qwen3_omni_moe") and NON_QWEN_FAMILIES == ("audioflamingo3", "llava_next", "glm4v", "internvl", "mistral3", "idefics3", "gemma3")
    assert set(MODALITIES) == set(ALL_FAMILIES)


def test_audio_tower_has_a_shard_of_its_own(audio_checkpoint: pathlib.Path) -> None:
    index = json.loads((audio_checkpoint / "model.safetensors.index.json").read_text())
    mapping = index["weight_map"]
    # The released Qwen2-Audio names, which vLLM and transformers both read.
    assert {name.split(".")[0] for name in mapping} == {"audio_tower", "multi_modal_projector", "language_model"}
    assert "language_model.model.embed_tokens.weight" in mapping and "language_model.lm_head.weight" in mapping
    assert "multi_modal_projector.linear.weight" in mapping and "audio_tower.conv1.weight" in mapping
    tower = {shard for name, shard in mapping.items() if is_audio_tower(name)}
    assert tower == {"model-00001-of-00003.safetensors"}
    assert not tower & {shard for name, shard in mapping.items() if not is_audio_tower(name)}
    _assert_shards_match_the_index(audio_checkpoint, index)


def test_audio_seed_changes_only_the_tower_shard(audio_checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # audio_checkpoint is seed 0; vision_seed seeds the audio tower and projector.
    other_tower = build_tiny_checkpoint("qwen2_audio", tmp_path / "v1", seed=0, vision_seed=1)
    base_files, tower_files = file_bytes(audio_checkpoint), file_bytes(other_tower)
    assert sorted(base_files) == sorted(tower_files)
    assert "video_preprocessor_config.json" not in base_files
    changed = {name for name, data in base_files.items() if tower_files[name] != data}
    assert changed == {"model-00001-of-00003.safetensors"}


# --- transformers ----------------------------------------------------------------------


def hf_greedy(directory: pathlib.Path, images: list[Image.Image]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and NEW_TOKENS greedy tokens per image, from transformers."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(directory)
    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    text = processor.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompts, outputs = [], []
    for image in images:
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        prompt_len = inputs["input_ids"].shape[1]
        prompts.append(inputs["input_ids"][0].tolist())
        outputs.append(generated[0, prompt_len:].tolist())
    return prompts, outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_processes_and_generates(checkpoints: dict[str, pathlib.Path], family: str) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    directory = checkpoints[family]
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    assert config.model_type == family
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.text_config.hidden_size == 128 and config.text_config.num_hidden_layers == 2
    assert config.vision_config.depth == 2 and config.vision_config.spatial_merge_size == 2
    assert config.vision_config.patch_size == processor.image_processor.patch_size == (14 if family == "qwen2_5_vl" else 16)
    if family == "qwen3_vl":
        assert config.vision_config.deepstack_visual_indexes
    for attribute, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert getattr(config, attribute) == tokenizer.convert_tokens_to_ids(token), attribute
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # Ordinary text round-trips through the byte-level BPE.
    sample = "Describe the red square, please! 42 × ünïcode"
    assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample

    video_messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    for render in (processor.apply_chat_template, tokenizer.apply_chat_template):
        text = render(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this picture.<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        video_text = render(video_messages, tokenize=False, add_generation_prompt=False)
        assert "<|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>" in video_text

    inputs = processor(text=[text], images=[synthetic_image(0)], return_tensors="pt")
    grid = inputs["image_grid_thw"][0].tolist()
    placeholders = int((inputs["input_ids"] == config.image_token_id).sum())
    assert placeholders == grid[0] * grid[1] * grid[2] // 4
    assert 10 <= placeholders <= 64

    # Eight 150 x 200 frames; the metadata gives Qwen3-VL the timestamps its prompt needs.
    frames = np.random.default_rng(0).integers(0, 256, size=(8, IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)
    video_inputs = processor(
        text=[video_text],
        videos=[frames],
        do_sample_frames=False,
        video_metadata=[{"fps": 2.0, "total_num_frames": 8, "frames_indices": list(range(8))}],
        return_tensors="pt",
    )
    grid = video_inputs["video_grid_thw"][0].tolist()
    assert grid[0] == 4  # 8 frames / temporal patch 2
    assert int((video_inputs["input_ids"] == config.video_token_id).sum()) == grid[0] * grid[1] * grid[2] // 4

    _, info = AutoModelForImageTextToText.from_pretrained(directory, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    _, (first, second) = hf_greedy(directory, [synthetic_image(0), synthetic_image(1)])
    assert len(first) == NEW_TOKENS
    assert len(set(first)) > 3, f"greedy output barely varies: {first}"
    assert first != second, "the image does not influence the output"


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_names_match_save_pretrained(checkpoints: dict[str, pathlib.Path], family: str, tmp_path: pathlib.Path) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    directory = checkpoints[family]
    # A model built from the config, not loaded from the checkpoint: from_pretrained would
    # remember the names it read and write those same names back.
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(directory))
    model.save_pretrained(tmp_path)
    saved = tmp_path / "model.safetensors.index.json"
    if saved.exists():
        saved_names = set(json.loads(saved.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
            saved_names = set(f.keys())
    assert saved_names == set(weight_map(directory))


def hf_greedy_audio(directory: pathlib.Path, clips: list[np.ndarray]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and NEW_TOKENS greedy tokens per clip, from transformers."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    processor = AutoProcessor.from_pretrained(directory)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(directory).eval()
    text = processor.apply_chat_template(AUDIO_MESSAGES, tokenize=False, add_generation_prompt=True)
    prompts, outputs = [], []
    for clip in clips:
        inputs = processor(text=[text], audio=[clip], sampling_rate=AUDIO_RATE, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        prompt_len = inputs["input_ids"].shape[1]
        prompts.append(inputs["input_ids"][0].tolist())
        outputs.append(generated[0, prompt_len:].tolist())
    return prompts, outputs


def test_transformers_loads_processes_and_generates_audio(audio_checkpoint: pathlib.Path) -> None:
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, Qwen2AudioForConditionalGeneration

    config = AutoConfig.from_pretrained(audio_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(audio_checkpoint)
    processor = AutoProcessor.from_pretrained(audio_checkpoint)
    assert config.model_type == "qwen2_audio" and type(processor).__name__ == "Qwen2AudioProcessor"
    assert config.text_config.vocab_size == len(tokenizer)
    assert config.text_config.hidden_size == 128 and config.text_config.num_hidden_layers == 2
    audio = config.audio_config
    assert (audio.d_model, audio.encoder_layers, audio.encoder_attention_heads, audio.encoder_ffn_dim) == (64, 2, 2, 128)
    assert (audio.num_mel_bins, audio.max_source_positions) == (128, 1500)
    assert config.audio_token_id == processor.audio_token_id == tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    extractor = processor.feature_extractor
    assert type(extractor).__name__ == "WhisperFeatureExtractor"
    # The released Qwen2-Audio preprocessor settings.
    assert (extractor.feature_size, extractor.sampling_rate, extractor.chunk_length) == (128, 16000, 30)
    assert (extractor.hop_length, extractor.n_fft, extractor.n_samples, extractor.nb_max_frames) == (160, 400, 480000, 3000)
    assert extractor.return_attention_mask
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"

    two_clips = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "vs"}, {"type": "audio"}]}]
    for render in (processor.apply_chat_template, tokenizer.apply_chat_template):
        text = render(AUDIO_MESSAGES, tokenize=False, add_generation_prompt=True)
        assert text == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat is this sound?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nvsAudio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\n<|im_end|>" in render(
            two_clips, tokenize=False
        )

    inputs = processor(text=[text], audio=[synthetic_clip(0)], sampling_rate=AUDIO_RATE, return_tensors="pt")
    frames = int(inputs["feature_attention_mask"].sum())
    assert frames == 130  # 1.3 s of 10 ms frames
    assert int((inputs["input_ids"] == config.audio_token_id).sum()) == ((frames - 1) // 2 + 1 - 2) // 2 + 1

    _, info = Qwen2AudioForConditionalGeneration.from_pretrained(audio_checkpoint, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info

    _, (first, second) = hf_greedy_audio(audio_checkpoint, [synthetic_clip(0), synthetic_clip(1)])
    assert len(first) == NEW_TOKENS
    assert len(set(first)) > 3, f"greedy output barely varies: {first}"
    assert first != second, "the audio does not influence the output"


# --- Omni thinkers and Audio Flamingo 3 -------------------------------------------------

# On-disk name prefixes, as in the released checkpoints (vLLM maps them onto its modules):
# the tower's, which alone fill shard 1, and the language model's.
TOWER_PREFIXES = {
    "qwen2_5_omni": ("thinker.visual.", "thinker.audio_tower."),
    "qwen3_omni_moe": ("thinker.visual.", "thinker.audio_tower."),
    "audioflamingo3": ("audio_tower.", "multi_modal_projector."),
    "llava_next": ("vision_tower.vision_model.", "multi_modal_projector.", "image_newline"),
    "glm4v": ("model.visual.",),
    "internvl": ("model.vision_tower.", "model.multi_modal_projector."),
    "mistral3": ("vision_tower.", "multi_modal_projector."),
    "idefics3": ("model.vision_model.", "model.connector."),
    "gemma3": ("vision_tower.vision_model.", "multi_modal_projector."),
}
LM_PREFIXES = {
    "qwen2_5_omni": ("thinker.model.", "thinker.lm_head."),
    "qwen3_omni_moe": ("thinker.model.", "thinker.lm_head."),
    "audioflamingo3": ("language_model.model.", "language_model.lm_head."),
    "llava_next": ("language_model.model.", "language_model.lm_head."),
    "glm4v": ("model.language_model.", "lm_head."),
    "internvl": ("model.language_model.", "lm_head."),
    "mistral3": ("language_model.model.", "language_model.lm_head."),
    "idefics3": ("model.text_model.", "lm_head."),
    "gemma3": ("language_model.model.", "language_model.lm_head."),
}
# What each family's chat template puts in place of an image, video or audio content part.
PLACEHOLDERS = {
    "qwen2_5_omni": {
        "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
        "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
    },
    "qwen3_omni_moe": {
        "image": "<|vision_start|><|image_pad|><|vision_end|>",
        "video": "<|vision_start|><|video_pad|><|vision_end|>",
        "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
    },
    "audioflamingo3": {"audio": "<sound>"},
    "llava_next": {"image": "<image>\n"},
    "glm4v": {"image": "<|begin_of_image|><|image|><|end_of_image|>", "video": "<|begin_of_video|><|video|><|end_of_video|>"},
    "internvl": {"image": "<IMG_CONTEXT>\n", "video": "<video>\n"},
    "mistral3": {"image": "[IMG]"},
    "idefics3": {"image": "<image>"},
    "gemma3": {"image": "<start_of_image>"},
}
# How each family's template renders multimodal_messages ({} for its placeholders): ChatML with a
# default system prompt, or the family's own turns.
RENDERED_CHAT = {
    "glm4v": "[gMASK]<sop><|user|>\n{}Describe this.<|assistant|>\n",
    "idefics3": "<|begin_of_text|>User:{}Describe this.<end_of_utterance>\nAssistant:",
    "gemma3": "<bos><start_of_turn>user\n{}Describe this.<end_of_turn>\n<start_of_turn>model\n",
}
EOS_TOKENS = {"glm4v": "<|endoftext|>", "idefics3": "<end_of_utterance>", "gemma3": "<end_of_turn>"}
CHATML = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}Describe this.<|im_end|>\n<|im_start|>assistant\n"
TOWER_SHARD = "model-00001-of-00003.safetensors"


@pytest.fixture(scope="module")
def multimodal_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("multimodal-checkpoints")
    return {family: ensure_tiny_checkpoint(family, root) for family in MULTIMODAL_FAMILIES}


def released_name(name: str) -> str:
    """The on-disk name of an Audio Flamingo 3, LLaVA-NeXT or Gemma 3 parameter in transformers 5:
    stored as released (``language_model.model.*``, no outer ``model.``; LLaVA's CLIP and Gemma's
    SigLIP tower under ``vision_tower.vision_model.``, which transformers 5 drops)."""
    for module_prefix, disk_prefix in (
        ("model.audio_tower.", "audio_tower."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.image_newline", "image_newline"),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if name.startswith(module_prefix):
            return disk_prefix + name[len(module_prefix) :]
    return name


def multimodal_messages(modalities: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": m} for m in modalities] + [{"type": "text", "text": "Describe this."}]}]


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_tower_is_alone_in_shard_1(multimodal_checkpoints: dict[str, pathlib.Path], family: str) -> None:
    directory = multimodal_checkpoints[family]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    mapping = index["weight_map"]
    tower_prefixes, lm_prefixes = TOWER_PREFIXES[family], LM_PREFIXES[family]
    for prefix in tower_prefixes + lm_prefixes:
        assert any(name.startswith(prefix) for name in mapping), prefix
    assert all(name.startswith(tower_prefixes + lm_prefixes) for name in mapping)
    tower = {name for name in mapping if name.startswith(tower_prefixes)}
    # Shard 1 holds the whole tower and nothing else, so encoder-only engines skip the rest.
    assert {name for name, shard in mapping.items() if shard == TOWER_SHARD} == tower
    assert len(set(mapping.values())) == 3
    if family == "qwen3_omni_moe":
        # Experts one tensor each, as released and as vLLM's loader expects; four of them.
        experts = {name.split(".")[6] for name in mapping if ".mlp.experts." in name}
        assert experts == {"0", "1", "2", "3"}
        assert "thinker.model.layers.1.mlp.experts.3.gate_proj.weight" in mapping
    _assert_shards_match_the_index(directory, index)


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_build_is_deterministic_and_seeds_the_tower_alone(
    multimodal_checkpoints: dict[str, pathlib.Path], family: str, tmp_path: pathlib.Path
) -> None:
    base = file_bytes(multimodal_checkpoints[family])
    assert file_bytes(build_tiny_checkpoint(family, tmp_path / "again")) == base
    other_tower = file_bytes(build_tiny_checkpoint(family, tmp_path / "v1", seed=0, vision_seed=1))
    assert sorted(other_tower) == sorted(base)
    assert {name for name, data in base.items() if other_tower[name] != data} == {TOWER_SHARD}
    assert ("video_preprocessor_config.json" in base) == ("video" in MODALITIES[family])


def media_item(modality: str, seed: int) -> Any:
    """A seeded test item of ``modality`` as vLLM takes it."""
    if modality == "image":
        return synthetic_image(seed)
    if modality == "audio":
        return (synthetic_clip(seed), AUDIO_RATE)
    return synthetic_video(seed)


def hf_inputs(processor: Any, text: str, modality: str, seed: int) -> Any:
    """The processor's model inputs for ``text`` with one seeded item of ``modality``."""
    if modality == "image":
        return processor(text=[text], images=[synthetic_image(seed)], return_tensors="pt")
    if modality == "audio":
        return processor(text=[text], audio=[synthetic_clip(seed)], sampling_rate=AUDIO_RATE, return_tensors="pt")
    frames, metadata = synthetic_video(seed)
    video_metadata = {key: metadata[key] for key in ("fps", "total_num_frames", "frames_indices")}
    return processor(text=[text], videos=[frames], video_metadata=[video_metadata], do_sample_frames=False, return_tensors="pt")


# Gemma 3 attends bidirectionally within each image (transformers reads the image positions from
# the processor's token_type_ids; vLLM calls it an "mm prefix LM"). vLLM's CPU attention backend
# has no such mode and attends causally (it does not refuse the model), so vLLM on this host is
# compared with transformers attending causally too: with token_type_ids, transformers' tokens
# differ from the first one for some images. A GPU host's backends (FlashAttention, Triton, Flex)
# take the bidirectional mask and are compared with token_type_ids kept.
CAUSAL_IMAGE_ATTENTION_ON_CPU = frozenset({"gemma3"})


def hf_greedy_multimodal(directory: pathlib.Path) -> dict[str, dict[str, list[int]]]:
    """Expanded prompt ids and NEW_TOKENS greedy tokens, from transformers, per request
    ``"<modality>-<seed>"``: one item of each of the family's modalities, seeds 0 and 1."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(directory)
    config = AutoConfig.from_pretrained(directory)
    model = getattr(transformers, config.architectures[0]).from_pretrained(directory).eval()
    model = getattr(model, "thinker", model)  # an Omni model generates text with its thinker
    results = {}
    # One intra-op thread: these models run thousands of tiny kernels (Qwen3-Omni's experts
    # one by one), and on a loaded 2-core box two threads that must meet at every kernel were
    # ten times slower than one (2 s instead of 0.2 s per generate).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for modality in MODALITIES[config.model_type]:
            text = processor.apply_chat_template(multimodal_messages([modality]), tokenize=False, add_generation_prompt=True)
            for seed in (0, 1):
                inputs = hf_inputs(processor, text, modality, seed)
                if config.model_type in CAUSAL_IMAGE_ATTENTION_ON_CPU:
                    inputs.pop("token_type_ids")
                with torch.no_grad():
                    # No stop token, as vLLM's ignore_eos: all NEW_TOKENS are compared (GLM-4.1V's
                    # tiny model says "<|user|>", one of its stop tokens, within them).
                    generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
                prompt_len = inputs["input_ids"].shape[1]
                results[f"{modality}-{seed}"] = {
                    "prompt_token_ids": inputs["input_ids"][0].tolist(),
                    "token_ids": generated[0, prompt_len:].tolist(),
                }
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_transformers_loads_processes_and_generates(multimodal_checkpoints: dict[str, pathlib.Path], family: str) -> None:
    import transformers
    from safetensors import safe_open
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    directory = multimodal_checkpoints[family]
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    processor = AutoProcessor.from_pretrained(directory)
    text_config = config.get_text_config()
    assert config.model_type == family
    assert text_config.vocab_size == len(tokenizer)
    assert text_config.hidden_size == 128 and text_config.num_hidden_layers == 2
    # The field is the text config's, or (GLM-4.1V) the model config's.
    assert not getattr(text_config, "tie_word_embeddings", None) and not getattr(config, "tie_word_embeddings", None)
    assert type(processor).__name__ == json.loads((directory / "processor_config.json").read_text())["processor_class"]
    if "audio" in MODALITIES[family]:
        assert type(processor.feature_extractor).__name__ == "WhisperFeatureExtractor"
        assert processor.feature_extractor.sampling_rate == AUDIO_RATE
    assert tokenizer.eos_token == EOS_TOKENS.get(family, "<|im_end|>") and tokenizer.pad_token == "<|endoftext|>"
    token_id = tokenizer.convert_tokens_to_ids
    if family in OMNI_FAMILIES:
        thinker = config.thinker_config
        assert not config.enable_audio_output
        # The processor reads its placeholders from tokenizer attributes (extra_special_tokens).
        image, video, audio = (PLACEHOLDERS[family][m] for m in ("image", "video", "audio"))
        assert image == processor.vision_bos_token + processor.image_token + processor.vision_eos_token
        assert video == processor.vision_bos_token + processor.video_token + processor.vision_eos_token
        assert audio == processor.audio_bos_token + processor.audio_token + processor.audio_eos_token
        assert thinker.image_token_id == token_id(processor.image_token)
        assert thinker.video_token_id == token_id(processor.video_token)
        assert thinker.audio_token_id == token_id(processor.audio_token)
        assert thinker.audio_start_token_id == token_id(processor.audio_bos_token)
        assert thinker.audio_end_token_id == token_id(processor.audio_eos_token)
        assert thinker.vision_start_token_id == token_id(processor.vision_bos_token)
        assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
        assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
        if family == "qwen3_omni_moe":
            vision = thinker.vision_config
            # What vLLM sizes its position grid from, consistent with transformers' count.
            assert vision.apply_vit_abs_pos_embed
            assert (vision.image_size // vision.patch_size) ** 2 == vision.num_position_embeddings
            assert (text_config.num_experts, text_config.num_experts_per_tok) == (4, 2)
    elif family == "audioflamingo3":
        assert config.audio_token_id == processor.audio_token_id == token_id("<sound>")
    elif family == "glm4v":
        assert config.image_token_id == processor.image_token_id == token_id("<|image|>")
        assert (config.image_start_token_id, config.image_end_token_id) == (token_id("<|begin_of_image|>"), token_id("<|end_of_image|>"))
        assert type(processor.image_processor).__name__ == "Glm4vImageProcessor"
        # GLM-4's rotary embedding turns half of each head, so M-RoPE's sections cover a quarter.
        rope = text_config.rope_parameters
        head_dim = text_config.hidden_size // text_config.num_attention_heads
        assert rope["partial_rotary_factor"] == 0.5 and sum(rope["mrope_section"]) == head_dim // 4
    elif family == "internvl":
        assert config.image_token_id == processor.image_token_id == token_id("<IMG_CONTEXT>")
        assert (processor.start_image_token, processor.end_image_token, processor.video_token) == ("<img>", "</img>", "<video>")
        assert type(processor.image_processor).__name__ == "GotOcr2ImageProcessor"
        # Each tile's patches, pixel-shuffled 2 x 2, are the context tokens the processor puts per tile.
        patches = config.vision_config.image_size[0] // config.vision_config.patch_size[0]
        assert processor.image_seq_length == config.image_seq_length == (patches // 2) ** 2
    elif family == "mistral3":
        assert config.image_token_index == processor.image_token_id == token_id("[IMG]")
        assert (processor.image_break_token, processor.image_end_token) == ("[IMG_BREAK]", "[IMG_END]")
        assert type(processor.image_processor).__name__ == "PixtralImageProcessor"
        # Pixtral fits an image within the tower's edge, in whole patches merged 2 x 2.
        assert processor.image_processor.size == {"longest_edge": config.vision_config.image_size}
        assert processor.patch_size == config.vision_config.patch_size and processor.spatial_merge_size == config.spatial_merge_size == 2
    elif family == "gemma3":
        # The processor's "image token" is the one a prompt holds, each expanded to the soft tokens.
        assert config.image_token_index == processor.tokenizer.image_token_id == token_id("<image_soft_token>")
        assert config.boi_token_index == processor.image_token_id == token_id("<start_of_image>")
        assert config.eoi_token_index == token_id("<end_of_image>")
        assert type(processor.image_processor).__name__ == "Gemma3ImageProcessor"
        # The tower's patches, average-pooled to the soft tokens the processor puts per image.
        assert processor.image_seq_length == config.mm_tokens_per_image == 4
        # vLLM's Gemma 3 processor merges newline runs into these single tokens.
        assert all(newlines in tokenizer.get_vocab() for newlines in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"))
        assert text_config.layer_types == ["sliding_attention", "full_attention"]
    elif family == "idefics3":
        assert config.image_token_id == processor.image_token_id == token_id("<image>")
        assert (processor.fake_image_token, processor.global_image_tag) == ("<fake_token_around_image>", "<global-img>")
        assert type(processor.image_processor).__name__ == "Idefics3ImageProcessor"
        # Tiles of the tower's edge, each tile's patches pixel-shuffled 2 x 2 into its features.
        tile = config.vision_config.image_size
        assert processor.image_processor.max_image_size == {"longest_edge": tile}
        assert processor.image_seq_len == (tile // config.vision_config.patch_size // config.scale_factor) ** 2
    else:
        assert config.image_token_index == processor.image_token_id == token_id("<image>")
        assert type(processor.image_processor).__name__ == "LlavaNextImageProcessor"
        # Tall, wide and large images get different tile grids: 1 x 2, 2 x 1, 2 x 2 tiles of the tower's edge.
        tile = config.vision_config.image_size
        assert config.image_grid_pinpoints == [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]

    expected_parts = "".join(PLACEHOLDERS[family][m] for m in MODALITIES[family])
    for render in (processor.apply_chat_template, tokenizer.apply_chat_template):
        text = render(multimodal_messages(MODALITIES[family]), tokenize=False, add_generation_prompt=True)
        assert text == RENDERED_CHAT.get(family, CHATML).format(expected_parts)

    # Every parameter is read from the checkpoint (none left at a fresh init). Qwen3-Omni's
    # experts are fused in memory; save_pretrained's own conversion splits them again.
    model = getattr(transformers, config.architectures[0]).from_pretrained(directory)
    if family in ("audioflamingo3", "llava_next", "gemma3"):
        state = {released_name(name): tensor for name, tensor in model.state_dict().items()}
    elif family == "internvl":
        state = model.state_dict()  # saved by transformers itself, as the "-hf" releases are
    else:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, model.state_dict())
    mapping = weight_map(directory)
    assert set(state) == set(mapping)
    for shard in sorted(set(mapping.values())):
        with safe_open(directory / shard, framework="pt") as f:
            for name in f.keys():
                assert bool((state[name] == f.get_tensor(name)).all()), name

    results = hf_greedy_multimodal(directory)
    for modality in MODALITIES[family]:
        first, second = results[f"{modality}-0"]["token_ids"], results[f"{modality}-1"]["token_ids"]
        assert len(first) == NEW_TOKENS
        assert len(set(first)) > 3, f"{modality}: greedy output barely varies: {first}"
        assert first != second, f"the {modality} does not influence the output"


# --- vLLM ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_results(checkpoints, audio_checkpoint, multimodal_checkpoints, tmp_path_factory) -> dict[str, Any]:
    """What this module's ``__main__`` worker returns, per checkpoint directory: vLLM in a
    process of its own, its engine core in that process (starts much faster than a spawned one
    on a loaded 2-core box), one checkpoint after another."""
    directories = [*checkpoints.values(), audio_checkpoint, *multimodal_checkpoints.values()]
    result_file = tmp_path_factory.mktemp("vllm-results") / "vllm.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    command = [sys.executable, __file__, str(result_file), *map(str, directories)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(result_file.read_text())


def _vllm_result(results: dict[str, Any], directory: pathlib.Path) -> dict[str, Any]:
    result = results[str(directory)]
    assert "error" not in result, f"vLLM failed on {directory.name}:\n{result.get('error')}"
    return result


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_matches_transformers_greedy(checkpoints: dict[str, pathlib.Path], family: str, vllm_results: dict[str, Any]) -> None:
    directory = checkpoints[family]
    vllm_result = _vllm_result(vllm_results, directory)
    hf_prompts, hf_outputs = hf_greedy(directory, [synthetic_image(seed) for seed in (0, 1)])
    # Same prompt after placeholder expansion, then the same greedy tokens (float32).
    assert vllm_result["prompt_token_ids"] == hf_prompts
    assert vllm_result["token_ids"] == hf_outputs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_matches_transformers_greedy_audio(audio_checkpoint: pathlib.Path, vllm_results: dict[str, Any]) -> None:
    vllm_result = _vllm_result(vllm_results, audio_checkpoint)
    hf_prompts, hf_outputs = hf_greedy_audio(audio_checkpoint, [synthetic_clip(seed) for seed in (0, 1)])
    assert vllm_result["prompt_token_ids"] == hf_prompts
    assert vllm_result["token_ids"] == hf_outputs


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("family", MULTIMODAL_FAMILIES)
def test_multimodal_vllm_matches_transformers_greedy(multimodal_checkpoints: dict[str, pathlib.Path], family: str, vllm_results: dict[str, Any]) -> None:
    directory = multimodal_checkpoints[family]
    vllm_result = _vllm_result(vllm_results, directory)
    hf_result = hf_greedy_multimodal(directory)
    assert sorted(vllm_result) == sorted(hf_result)
    for request, expected in hf_result.items():
        # Same prompt after placeholder expansion, then the same greedy tokens (float32).
        assert _features_marked_alike(family, vllm_result[request]["prompt_token_ids"], directory) == expected["prompt_token_ids"], request
        assert vllm_result[request]["token_ids"] == expected["token_ids"], request


def _features_marked_alike(family: str, prompt_ids: list[int], directory: pathlib.Path) -> list[int]:
    """vLLM's expanded prompt with InternVL's video frame features marked as transformers marks
    them: vLLM puts ``<video>`` where transformers puts ``<IMG_CONTEXT>``. Neither id reaches the
    model (the features replace both), so only the marking differs."""
    if family != "internvl":
        return prompt_ids
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids
    video, context = token_id("<video>"), token_id("<IMG_CONTEXT>")
    return [context if token == video else token for token in prompt_ids]


def tiny_llm(directory: str, *, max_model_len: int, limit_mm_per_prompt: dict[str, int]) -> Any:
    """vLLM's offline engine on a tiny checkpoint, in float32, with a KV cache of 64 MiB: room
    for the few short requests each checkpoint runs (vLLM's 1 GiB CPU default took seconds of
    each engine's start to allocate and zero)."""
    from vllm import LLM

    return LLM(
        model=directory,
        max_model_len=max_model_len,
        enforce_eager=True,
        limit_mm_per_prompt=limit_mm_per_prompt,
        dtype="float32",
        kv_cache_memory_bytes=64 * 2**20,
    )


def vllm_greedy(directory: str) -> dict[str, Any]:
    """Prompt ids and NEW_TOKENS greedy tokens per test image, from vLLM."""
    from transformers import AutoProcessor
    from vllm import SamplingParams

    text = AutoProcessor.from_pretrained(directory).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    llm = tiny_llm(directory, max_model_len=2048, limit_mm_per_prompt={"image": 2})
    requests = [{"prompt": text, "multi_modal_data": {"image": synthetic_image(seed)}} for seed in (0, 1)]
    # ignore_eos: compare all NEW_TOKENS even if one side would stop early.
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return {
        "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
    }


def vllm_greedy_audio(directory: str) -> dict[str, Any]:
    """Prompt ids and NEW_TOKENS greedy tokens per test clip, from vLLM given the raw samples."""
    from transformers import AutoProcessor
    from vllm import SamplingParams

    text = AutoProcessor.from_pretrained(directory).apply_chat_template(AUDIO_MESSAGES, tokenize=False, add_generation_prompt=True)
    llm = tiny_llm(directory, max_model_len=2048, limit_mm_per_prompt={"audio": 1})
    requests = [{"prompt": text, "multi_modal_data": {"audio": (synthetic_clip(seed), AUDIO_RATE)}} for seed in (0, 1)]
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return {
        "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
    }


def vllm_greedy_multimodal(directory: str) -> dict[str, Any]:
    """What :func:`hf_greedy_multimodal` returns, from vLLM given the raw media and the
    tokenized (not yet expanded) chat prompt."""
    from transformers import AutoConfig, AutoTokenizer
    from vllm import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(directory)
    modalities = MODALITIES[AutoConfig.from_pretrained(directory).model_type]
    llm = tiny_llm(directory, max_model_len=4096, limit_mm_per_prompt={modality: 1 for modality in modalities})
    names, requests = [], []
    for modality in modalities:
        text = tokenizer.apply_chat_template(multimodal_messages([modality]), tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        for seed in (0, 1):
            names.append(f"{modality}-{seed}")
            requests.append({"prompt_token_ids": prompt_ids, "multi_modal_data": {modality: media_item(modality, seed)}})
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return {
        name: {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.outputs[0].token_ids)}
        for name, out in zip(names, outputs, strict=True)
    }


def vllm_worker(checkpoint_dir: str) -> Callable[[str], dict[str, Any]]:
    model_type = json.loads((pathlib.Path(checkpoint_dir) / "config.json").read_text())["model_type"]
    if model_type in MULTIMODAL_FAMILIES:
        return vllm_greedy_multimodal
    return vllm_greedy_audio if model_type in AUDIO_FAMILIES else vllm_greedy


def run_vllm_workers(result_path: str, checkpoint_dirs: list[str]) -> None:
    """Each checkpoint's result, or its error, so that one family's failure fails only its test.
    Every engine is torn down before the next starts."""
    import gc
    import traceback

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    results: dict[str, Any] = {}
    for checkpoint_dir in checkpoint_dirs:
        try:
            results[checkpoint_dir] = vllm_worker(checkpoint_dir)(checkpoint_dir)
        except Exception:
            results[checkpoint_dir] = {"error": traceback.format_exc()}
        gc.collect()
        cleanup_dist_env_and_memory()
    pathlib.Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
    run_vllm_workers(sys.argv[1], sys.argv[2:])


def test_cli_offers_every_family_the_builder_knows():
    from cli.commands import TINY_FAMILIES
    from devkit.checkpoints import ALL_FAMILIES

    assert TINY_FAMILIES == ALL_FAMILIES


def _assert_shards_match_the_index(directory: pathlib.Path, index: dict) -> None:
    """Each shard holds exactly the tensors the index gives it, all float32, and the index's
    total is their size, under 8 MiB (a tiny checkpoint)."""
    from safetensors import safe_open

    mapping = index["weight_map"]
    total = 0
    for shard in sorted(set(mapping.values())):
        with safe_open(directory / shard, framework="pt") as f:
            assert set(f.keys()) == {name for name, where in mapping.items() if where == shard}
            for name in f.keys():
                tensor = f.get_tensor(name)
                assert str(tensor.dtype) == "torch.float32", name
                total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total
    assert total < 8 * 2**20

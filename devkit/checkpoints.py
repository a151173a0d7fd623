"""Tiny random-weight multimodal checkpoints (Qwen-VL, Qwen2-Audio, Qwen Omni thinkers, Audio
Flamingo 3, LLaVA-NeXT, GLM-4.1V, InternVL 3), built offline and deterministically.

No vision- or audio-language weights can be downloaded here, so tests, benchmarks and the
demo run on checkpoints that this module builds from a seed: a byte-level BPE tokenizer
trained on a made-up corpus, Hugging Face configs for the model, tokenizer and processors, and
random float32 weights in sharded safetensors. The result loads in transformers and in vLLM
exactly like a real Qwen2.5-VL, Qwen3-VL, Qwen2-Audio, Qwen2.5-Omni, Qwen3-Omni (MoE), Audio
Flamingo 3, LLaVA-NeXT, GLM-4.1V or InternVL 3 checkpoint, only a few MB large. The Omni
checkpoints hold the thinker only (image, video and audio in, text out;
``enable_audio_output`` false), which is all vLLM serves of them.

Layout of a built checkpoint::

    config.json                         model config (transformers' own config class)
    generation_config.json              eos / pad ids
    tokenizer.json, tokenizer_config.json
    chat_template.jinja                 read by both AutoTokenizer and AutoProcessor
    preprocessor_config.json            image processor and/or Whisper feature extractor
    video_preprocessor_config.json      video processor (families that take video)
    processor_config.json               processor class
    spk_dict.pt                         Qwen2.5-Omni only: no talker voices (an empty dict)
    model-00001-of-00003.safetensors    the tower only (vision and/or audio tower + projector)
    model-00002-of-00003.safetensors    embeddings + first half of the decoder layers
    model-00003-of-00003.safetensors    second half of the layers + final norm + lm_head
    model.safetensors.index.json

The tower sits alone in its shard so that encoder-only workers can load just that file.
Every tensor is drawn from a generator seeded by ``(seed, tensor name)``; tower tensors use
``vision_seed`` instead (the name is kept for the audio tower too), so checkpoints that differ
only in ``vision_seed`` share byte-identical language-model shards and tokenizer.

``scale="bench"`` builds the same tokenizer and tower around a much wider and deeper language
model (about 0.9 GB of float32 in 16 shards, one decoder layer per shard after the tower's),
so that encoder-only loading can be compared with loading the whole checkpoint at a ratio
like a real one's (vLLM read 2 of Qwen2.5-VL-72B's 96 shards for the vision tower alone).
``scale="costly_tower"`` keeps the tiny language model but builds a wider and deeper vision
tower (8 blocks of width 256, about 10M parameters) and lets images keep up to 32 x 32 tokens,
so that encoding an image costs real time (0.2 to 0.8 s for a 448 to 896 px image on the one
thread vLLM gives it on a 2-core CPU), as a reuse benchmark needs.

Heavy imports (torch, transformers, tokenizers) happen inside the functions that need them,
so importing this module stays cheap for the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers
    import torch
    from transformers import PreTrainedConfig

# Vision-language families; tests parametrize their image checks over exactly these.
FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
AUDIO_FAMILIES: tuple[str, ...] = ("qwen2_audio",)
# Qwen Omni thinkers (text out only): a vision tower and an audio tower in front of one LM.
OMNI_FAMILIES: tuple[str, ...] = ("qwen2_5_omni", "qwen3_omni_moe")
# Families from outside Qwen: NVIDIA's Audio Flamingo 3 (Whisper-style tower, Qwen2 LM),
# LLaVA-NeXT (a CLIP tower over "anyres" tiles, a Llama LM), Zhipu's GLM-4.1V (a Qwen2-VL-like
# patch-grid tower, a GLM-4 LM) and OpenGVLab's InternVL (InternViT over tiles, a Qwen2 LM).
NON_QWEN_FAMILIES: tuple[str, ...] = ("audioflamingo3", "llava_next", "glm4v", "internvl", "mistral3", "idefics3", "gemma3")
ALL_FAMILIES: tuple[str, ...] = FAMILIES + AUDIO_FAMILIES + OMNI_FAMILIES + NON_QWEN_FAMILIES
# The media each family takes, as vLLM names the modalities.
MODALITIES: dict[str, tuple[str, ...]] = {
    "qwen2_5_vl": ("image", "video"),
    "qwen3_vl": ("image", "video"),
    "qwen2_audio": ("audio",),
    "qwen2_5_omni": ("image", "video", "audio"),
    "qwen3_omni_moe": ("image", "video", "audio"),
    "audioflamingo3": ("audio",),
    "llava_next": ("image",),
    "glm4v": ("image", "video"),
    "internvl": ("image", "video"),
    "mistral3": ("image",),
    "idefics3": ("image",),
    "gemma3": ("image",),
}

# Language-model and vision-tower sizes are per scale (see _SCALES) and shared by every
# family. Every scale keeps the language model's head_dim at 64, because the M-RoPE sections
# (temporal, height, width) must add up to head_dim / 2.
_MROPE_SECTION = [8, 12, 12]
_MAX_POSITIONS = 32768
_SPATIAL_MERGE = 2
_TEMPORAL_PATCH = 2

# Initialisation std of weight matrices, larger than the usual 0.02. With so few, so narrow
# layers a 0.02 init makes attention nearly uniform, so every new position sees about the
# same mixture and greedy decoding repeats one token whatever the image shows. The token
# embeddings get the largest std so that the current token steers the next one, while the
# attended context (the image included) still changes the result.
_TEXT_INIT_STD = 0.08
_EMBED_INIT_STD = 0.25
_VISION_INIT_STD = 0.05
_AUDIO_INIT_STD = 0.05

# Qwen2-Audio's Whisper-style audio tower, narrowed. The mel bins, the 1500 positions (30 s of
# 10 ms frames after the stride-2 convolution) and the feature extractor settings below are
# the released model's, so clip lengths map to the same token counts as on the real model.
_AUDIO_D_MODEL = 64
_AUDIO_LAYERS = 2
_AUDIO_HEADS = 2
_AUDIO_FFN = 128
_AUDIO_MEL_BINS = 128
_AUDIO_MAX_SOURCE_POSITIONS = 1500
_AUDIO_SAMPLING_RATE = 16000
_AUDIO_CHUNK_SECONDS = 30
_AUDIO_HOP_LENGTH = 160
_AUDIO_N_FFT = 400
# Qwen2-Audio's language model is a plain Qwen2 (1-D RoPE); 10000 is the released base.
_AUDIO_ROPE_THETA = 10_000.0

# Qwen3-Omni's audio tower first shrinks the mel spectrogram with three stride-2 2-D
# convolutions of this many channels (480 in the released model).
_QWEN3_OMNI_AUDIO_DOWNSAMPLE = 32
# Qwen3-Omni's vision tower learns a square grid of absolute position embeddings, this many
# patches a side, interpolated to each image (48 in the released model).
_QWEN3_OMNI_POSITION_GRID = 24
# Qwen3-Omni's MoE language model, shrunk: few experts, top-2 routing. Each expert's MLP is
# a quarter of the scale's dense MLP width.
_MOE_EXPERTS = 4
_MOE_EXPERTS_PER_TOKEN = 2

# Byte-level BPE vocabulary size before special tokens: the 256-byte alphabet plus merges.
_BPE_VOCAB_SIZE = 512

# Qwen's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines and whitespace, as in the released Qwen2 tokenizer.json.
_QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens of the released Qwen2.5-VL tokenizer, in id order, as (content, special).
# The tool-call and fill-in-the-middle markers are added but not "special" there, so they
# survive skip_special_tokens; we keep that distinction.
_QWEN2_5_VL_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
# Qwen3-VL appends the tool-response and thinking markers.
_QWEN3_VL_ADDED_TOKENS = _QWEN2_5_VL_ADDED_TOKENS + (
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# The released Qwen2-Audio tokenizer: Qwen's first three specials, then the audio markers in
# the ids where Qwen2 has its object-ref / box markers. Only these six matter here.
_QWEN2_AUDIO_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
)

# The released Qwen2.5-Omni tokenizer: Qwen2.5-VL's layout, with the audio markers in the ids
# of the first three object-ref / box markers and the vision markers renamed *_bos / *_eos.
_QWEN2_5_OMNI_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|AUDIO|>", True),
    ("<|audio_bos|>", True),
    ("<|audio_eos|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_bos|>", True),
    ("<|vision_eos|>", True),
    ("<|vision_pad|>", True),
    ("<|IMAGE|>", True),
    ("<|VIDEO|>", True),
) + _QWEN2_5_VL_ADDED_TOKENS[14:]
# Qwen3-Omni: Qwen3-VL's tokens, then the audio markers, the talker's TTS markers (unused by
# the thinker, kept so the ids line up with the released ones) and the audio placeholder.
_QWEN3_OMNI_ADDED_TOKENS = _QWEN3_VL_ADDED_TOKENS + (
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
# Audio Flamingo 3 (nvidia/audio-flamingo-3-hf): the Qwen2.5 tokenizer as extended for Qwen3,
# plus its sound placeholder, which lands on the released id (151669, the 27th added token).
_AUDIOFLAMINGO3_ADDED_TOKENS = _QWEN3_VL_ADDED_TOKENS + (("<sound>", True),)

# LLaVA-NeXT on a ChatML tokenizer (as llava-hf's Qwen-based LLaVA releases): the turn markers
# and the image placeholder, which the processor expands to one token per embedding row.
_LLAVA_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<image>", True),
)

# Idefics3 (and SmolVLM v1, the same architecture): Llama 3's text start, the turn end, the image
# placeholder (one per feature), the marker around each tile, the whole image's tag, and a tag
# per tile position (up to 2 x 2 tiles here).
_IDEFICS3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|begin_of_text|>", True),
    ("<end_of_utterance>", True),
    ("<image>", True),
    ("<fake_token_around_image>", True),
    ("<global-img>", True),
    *((f"<row_{row}_col_{col}>", True) for row in (1, 2) for col in (1, 2)),
)

# Gemma 3: its turn and image tokens, the image's soft token (one per feature), and the newline
# runs its SentencePiece vocabulary holds as single tokens (vLLM's Gemma 3 processor merges the
# newlines around an image into them).
_GEMMA3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<bos>", True),
    ("<eos>", True),
    ("<start_of_turn>", True),
    ("<end_of_turn>", True),
    ("<start_of_image>", True),
    ("<end_of_image>", True),
    ("<image_soft_token>", True),
    *((newlines, False) for newlines in ("\n", "\n\n", "\n\n\n", "\n\n\n\n")),
)
_GEMMA3_TOKEN_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("boi_token", "<start_of_image>"),
    ("eoi_token", "<end_of_image>"),
    ("image_token", "<image_soft_token>"),
)

# Mistral 3 (Mistral-Small-3.1's HF release) on a ChatML tokenizer: the turn markers, then
# Pixtral's image placeholder (one per feature), its row break and its end.
_MISTRAL3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("[IMG]", True),
    ("[IMG_BREAK]", True),
    ("[IMG_END]", True),
)

# InternVL3 ("-hf" releases): Qwen2.5's ChatML tokens, then the image markers, the image context
# placeholder (repeated per feature) and the video placeholder.
_INTERNVL_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<img>", True),
    ("</img>", True),
    ("<IMG_CONTEXT>", True),
    ("<video>", True),
)
# InternVL's processor reads its tokens from tokenizer attributes (extra_special_tokens).
_INTERNVL_TOKEN_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("start_image_token", "<img>"),
    ("end_image_token", "</img>"),
    ("context_image_token", "<IMG_CONTEXT>"),
    ("video_token", "<video>"),
)

# GLM-4.1V (zai-org/GLM-4.1V-9B-Thinking): GLM-4's turn and mask tokens, then its image and video
# markers and placeholders, in the released order.
_GLM4V_ADDED_TOKENS: tuple[tuple[str, bool], ...] = tuple(
    (token, True)
    for token in (
        "<|endoftext|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
        "<|image|>",
        "<|video|>",
    )
)

# The Omni processors read their placeholder and marker tokens from tokenizer attributes,
# which transformers 5 sets from ``extra_special_tokens`` in tokenizer_config.json.
_QWEN2_5_OMNI_TOKEN_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("image_token", "<|IMAGE|>"),
    ("audio_token", "<|AUDIO|>"),
    ("video_token", "<|VIDEO|>"),
    ("vision_bos_token", "<|vision_bos|>"),
    ("vision_eos_token", "<|vision_eos|>"),
    ("audio_bos_token", "<|audio_bos|>"),
    ("audio_eos_token", "<|audio_eos|>"),
)
_QWEN3_OMNI_TOKEN_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("image_token", "<|image_pad|>"),
    ("audio_token", "<|audio_pad|>"),
    ("video_token", "<|video_pad|>"),
    ("vision_bos_token", "<|vision_start|>"),
    ("vision_eos_token", "<|vision_end|>"),
    ("audio_bos_token", "<|audio_start|>"),
    ("audio_eos_token", "<|audio_end|>"),
)

# The Qwen2-VL chat template: a default system prompt, ChatML turns, and a
# <|vision_start|><pad><|vision_end|> triple per image or video content part.
_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-Audio's chat template, as in transformers' Qwen2AudioProcessor: ChatML turns with a
# default system prompt, and "Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>\n" per audio part,
# so a rendered prompt holds exactly one <|AUDIO|> per clip. The released template tests only
# for an "audio" / "audio_url" key; {"type": "audio"} parts are recognised too, as here.
_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _content(placeholders: Mapping[str, str]) -> str:
    """A message's content: its text as is, or its parts, each text as is and each item as its
    modality's placeholder (``placeholders``; an item is recognised like the other templates: by
    ``type``, or by a ``<modality>`` or ``<modality>_url`` key)."""
    branches = [f"content['type'] == '{m}' or '{m}' in content or '{m}_url' in content %}}{p}" for m, p in placeholders.items()]
    return (
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if " + "{% elif ".join(branches) + "{% elif 'text' in content %}{{ content['text'] }}"
        "{% endif %}{% endfor %}{% endif %}"
    )


def _chatml_template(placeholders: Mapping[str, str]) -> str:
    """ChatML turns with a default system prompt, each message's content as :func:`_content`
    renders it."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n" + _content(placeholders) + "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Audio Flamingo 3: a bare <sound> per audio part, which its processor (and vLLM) expand to one
# placeholder per audio frame.
_AUDIOFLAMINGO3_CHAT_TEMPLATE = _chatml_template({"audio": "<sound>"})
# LLaVA (llava-hf's LLaVA-OneVision and interleave releases): "<image>\n" per image part.
_LLAVA_CHAT_TEMPLATE = _chatml_template({"image": "<image>\n"})
# Mistral 3: a bare [IMG] per image part, which its processor (and vLLM) expand to the feature rows.
_MISTRAL3_CHAT_TEMPLATE = _chatml_template({"image": "[IMG]"})
# InternVL (OpenGVLab's "-hf" releases): its image context token and "<video>", each on a line.
_INTERNVL_CHAT_TEMPLATE = _chatml_template({"image": "<IMG_CONTEXT>\n", "video": "<video>\n"})


# GLM-4.1V's template: a "[gMASK]<sop>" prefix, <|role|> turns without end markers, and a
# marker-wrapped placeholder per image or video part.
_GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    + _content({"image": "<|begin_of_image|><|image|><|end_of_image|>", "video": "<|begin_of_video|><|video|><|end_of_video|>"})
    + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# Idefics3's (and SmolVLM v1's) template: "<|begin_of_text|>", then "Role:" turns (a space after
# the colon unless the turn opens with an image) ended by "<end_of_utterance>", an "<image>" per
# image part, and "Assistant:" to prompt the answer.
_IDEFICS3_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is not string and message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    + _content({"image": "<image>"})
    + "<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


# Gemma 3's template, as released: "<bos>", a system message's text (not trimmed) prefixed to the
# first user turn, "<start_of_turn>role" turns ("model" for the assistant) ended by
# "<end_of_turn>", "<start_of_image>" per image, and every text part trimmed.
_GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _omni_chat_template(image: str, video: str, audio: str) -> str:
    """A Qwen Omni chat template: ChatML turns with a default system prompt, and the given
    marker-wrapped placeholder per image, video or audio content part (recognised like the
    other templates: by ``type`` or by an ``image`` / ``video`` / ``audio`` key)."""
    return (
        "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
        "{% set audio_count = namespace(value=0) %}"
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
        "{% set image_count.value = image_count.value + 1 %}"
        "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
        f"{image}"
        "{% elif content['type'] == 'video' or 'video' in content %}"
        "{% set video_count.value = video_count.value + 1 %}"
        "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
        f"{video}"
        "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
        "{% set audio_count.value = audio_count.value + 1 %}"
        "{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
        f"{audio}"
        "{% elif 'text' in content %}{{ content['text'] }}"
        "{% endif %}{% endfor %}<|im_end|>\n"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


_QWEN2_5_OMNI_CHAT_TEMPLATE = _omni_chat_template(
    "<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_bos|><|VIDEO|><|vision_eos|>", "<|audio_bos|><|AUDIO|><|audio_eos|>"
)
_QWEN3_OMNI_CHAT_TEMPLATE = _omni_chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "<|audio_start|><|audio_pad|><|audio_end|>",
)



# ChatML's end of turn, and what ends a reply (the turn's end, or the text's).
_CHATML_EOS = "<|im_end|>"
_CHATML_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# How the tiled families' processors prepare a tile (or frame): resized bicubically, scaled to
# [0, 1] and normalised as CLIP's.
_CLIP_IMAGE_PROCESSING: dict[str, Any] = {
    "image_mean": _CLIP_MEAN,
    "image_std": _CLIP_STD,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,  # bicubic
}


@dataclass(frozen=True)
class _Family:
    """What differs between the Qwen-VL (vision) families.

    Attributes:
        architecture: transformers model class name, written to ``config.architectures``.
        processor_class: transformers processor class name.
        video_processor_type: transformers video processor class name.
        added_tokens: tokenizer added tokens in id order, as (content, special).
        patch_size: vision patch edge in pixels.
        image_mean: per-channel normalisation mean.
        image_std: per-channel normalisation std.
        rope_theta: base of the language model's rotary embedding.
        chat_template: the Jinja chat template.
        image_processor_type: transformers image processor class name.
        eos_token: the tokenizer's end-of-sequence token.
        stop_tokens: the tokens that end a reply (generation_config's eos ids).
    """

    architecture: str
    processor_class: str
    video_processor_type: str
    added_tokens: tuple[tuple[str, bool], ...]
    patch_size: int
    image_mean: list[float]
    image_std: list[float]
    rope_theta: float
    chat_template: str = _CHAT_TEMPLATE
    image_processor_type: str = "Qwen2VLImageProcessor"
    eos_token: str = _CHATML_EOS
    stop_tokens: tuple[str, ...] = _CHATML_STOP_TOKENS

    @property
    def merged_patch(self) -> int:
        """Edge in pixels of the image area behind one placeholder token."""
        return self.patch_size * _SPATIAL_MERGE

    @property
    def min_pixels(self) -> int:
        """Smallest resized image: 2 x 2 placeholder tokens."""
        return (2 * self.merged_patch) ** 2

    def max_pixels(self, sizes: _Scale) -> int:
        """Largest resized image: ``sizes.image_max_side`` squared placeholder tokens."""
        return (sizes.image_max_side * self.merged_patch) ** 2


@dataclass(frozen=True)
class _AudioFamily:
    """An audio-language family (Qwen2-Audio, Audio Flamingo 3).

    Attributes:
        architecture: transformers model class name, written to ``config.architectures``.
        processor_class: transformers processor class name.
        added_tokens: tokenizer added tokens in id order, as (content, special).
        rope_theta: base of the language model's rotary embedding.
        audio_token: the placeholder the processor expands to one token per audio frame.
        chat_template: the Jinja chat template.
        eos_token, stop_tokens: as :class:`_Family`'s.
    """

    architecture: str
    processor_class: str
    added_tokens: tuple[tuple[str, bool], ...]
    rope_theta: float
    audio_token: str = "<|AUDIO|>"
    chat_template: str = _AUDIO_CHAT_TEMPLATE
    eos_token: str = _CHATML_EOS
    stop_tokens: tuple[str, ...] = _CHATML_STOP_TOKENS


@dataclass(frozen=True)
class _OmniFamily(_Family):
    """A Qwen Omni thinker: a Qwen-VL vision tower and a Whisper-style audio tower in front
    of one language model, stored under ``thinker.`` as in the released checkpoints.

    Attributes (besides :class:`_Family`'s):
        token_attributes: tokenizer attributes the processor reads (``image_token``,
            ``audio_bos_token``, ...) and their tokens, written as ``extra_special_tokens``.
        speaker_file: whether to write an (empty) ``spk_dict.pt``, the talker's voices, which
            transformers' top-level Qwen2.5-Omni ``from_pretrained`` insists on reading.
    """

    token_attributes: tuple[tuple[str, str], ...] = ()
    speaker_file: bool = False


@dataclass(frozen=True)
class _TiledFamily:
    """A LLaVA-style family: a vision tower run over fixed-size tiles of each image, a projector,
    and a ChatML language model.

    Attributes:
        architecture: transformers model class name, written to ``config.architectures``.
        processor_class: transformers processor class name.
        added_tokens: tokenizer added tokens in id order, as (content, special).
        chat_template: the Jinja chat template.
        rope_theta: base of the language model's rotary embedding.
        tile_px: the tower's input edge, and so a tile's (336 or 448 in the released models).
        patch_size: the tower's patch edge in pixels.
        eos_token, stop_tokens: as :class:`_Family`'s.
        bos_token: the token a template opens with (``{{ bos_token }}``), if any.
    """

    architecture: str
    processor_class: str
    added_tokens: tuple[tuple[str, bool], ...]
    chat_template: str
    rope_theta: float
    tile_px: int = 56  # 4 x 4 patches a tile
    patch_size: int = 14
    eos_token: str = _CHATML_EOS
    stop_tokens: tuple[str, ...] = _CHATML_STOP_TOKENS
    bos_token: str | None = None


@dataclass(frozen=True)
class _LlavaNextFamily(_TiledFamily):
    """LLaVA-NeXT (LLaVA 1.6): a CLIP tower run over "anyres" tiles (the image resized onto the
    best of a few tile grids and cut into tiles, plus the whole image downscaled), a two-layer
    projector, a learned embedding closing each row of tile features, and a Llama LM."""

    @property
    def grid_pinpoints(self) -> list[list[int]]:
        """The tile grids (height, width in pixels) an image may be resized onto: 1 x 2, 2 x 1 and
        2 x 2 tiles, so tall, wide and large images take different layouts."""
        tile = self.tile_px
        return [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]


@dataclass(frozen=True)
class _InternVLFamily(_TiledFamily):
    """InternVL 3 (transformers' native ``internvl``): InternViT over tiles (the image cut into up
    to ``max_tiles`` tiles by its aspect ratio, plus a thumbnail when there are several), each
    tile's patches pixel-shuffled 2 x 2 into :attr:`features_per_tile` features, an MLP projector
    and a Qwen2 LM. A video is one tile per frame.

    Attributes (besides :class:`_TiledFamily`'s):
        token_attributes: the tokenizer attributes the processor reads, as (name, token).
        max_tiles: most tiles per image (12 released).
    """

    token_attributes: tuple[tuple[str, str], ...] = ()
    max_tiles: int = 4

    @property
    def features_per_tile(self) -> int:
        return (self.tile_px // self.patch_size // 2) ** 2


@dataclass(frozen=True)
class _PixtralFamily(_TiledFamily):
    """Mistral 3 (Mistral-Small-3.1/3.2, Magistral): a Pixtral tower over the whole image at its
    own aspect ratio (resized to fit ``tile_px`` a side, rounded up to whole patches, 2-D RoPE),
    its features merged 2 x 2 by a patch merger, and a Mistral LM. One ``[IMG]`` per merged
    feature, ``[IMG_BREAK]`` closing each row, ``[IMG_END]`` the last."""

    spatial_merge: int = 2


@dataclass(frozen=True)
class _Idefics3Family(_TiledFamily):
    """Idefics3 (and SmolVLM v1, released under this architecture): a SigLIP tower over square
    tiles (the image fitted within ``max_tiles`` tiles a side and cut into them, plus the whole
    image downscaled to one tile), each tile's patches pixel-shuffled ``scale_factor`` x
    ``scale_factor`` into :attr:`features_per_tile` features, a linear connector and a Llama LM."""

    scale_factor: int = 2
    max_tiles: int = 2

    @property
    def features_per_tile(self) -> int:
        return (self.tile_px // self.patch_size // self.scale_factor) ** 2


@dataclass(frozen=True)
class _Gemma3Family(_TiledFamily):
    """Gemma 3: a SigLIP tower over the whole image resized to one tile (``tile_px`` a side; and
    over pan-and-scan crops where a request asks for them), its patches average-pooled to
    :attr:`features_per_tile` soft tokens, and a Gemma 3 LM alternating sliding-window and full attention. vLLM marks it an
    "mm prefix LM": attention is bidirectional within each image."""

    token_attributes: tuple[tuple[str, str], ...] = ()
    pooled_side: int = 2  # soft tokens a side, after pooling

    @property
    def features_per_tile(self) -> int:
        return self.pooled_side**2


_Spec = _Family | _AudioFamily | _TiledFamily
_FAMILY_SPECS: dict[str, _Spec] = {
    "qwen2_5_vl": _Family(
        architecture="Qwen2_5_VLForConditionalGeneration",
        processor_class="Qwen2_5_VLProcessor",
        video_processor_type="Qwen2VLVideoProcessor",
        added_tokens=_QWEN2_5_VL_ADDED_TOKENS,
        patch_size=14,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        rope_theta=1_000_000.0,
    ),
    "qwen3_vl": _Family(
        architecture="Qwen3VLForConditionalGeneration",
        processor_class="Qwen3VLProcessor",
        video_processor_type="Qwen3VLVideoProcessor",
        added_tokens=_QWEN3_VL_ADDED_TOKENS,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        rope_theta=5_000_000.0,
    ),
    "qwen2_audio": _AudioFamily(
        architecture="Qwen2AudioForConditionalGeneration",
        processor_class="Qwen2AudioProcessor",
        added_tokens=_QWEN2_AUDIO_ADDED_TOKENS,
        rope_theta=_AUDIO_ROPE_THETA,
    ),
    # vLLM maps both Omni architectures to its thinker-only model; the config says
    # enable_audio_output false, so transformers builds no talker either.
    "qwen2_5_omni": _OmniFamily(
        architecture="Qwen2_5OmniForConditionalGeneration",
        processor_class="Qwen2_5OmniProcessor",
        video_processor_type="Qwen2VLVideoProcessor",
        added_tokens=_QWEN2_5_OMNI_ADDED_TOKENS,
        patch_size=14,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        rope_theta=1_000_000.0,
        chat_template=_QWEN2_5_OMNI_CHAT_TEMPLATE,
        token_attributes=_QWEN2_5_OMNI_TOKEN_ATTRIBUTES,
        speaker_file=True,
    ),
    "qwen3_omni_moe": _OmniFamily(
        architecture="Qwen3OmniMoeForConditionalGeneration",
        processor_class="Qwen3OmniMoeProcessor",
        video_processor_type="Qwen2VLVideoProcessor",
        added_tokens=_QWEN3_OMNI_ADDED_TOKENS,
        patch_size=16,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        rope_theta=1_000_000.0,
        chat_template=_QWEN3_OMNI_CHAT_TEMPLATE,
        token_attributes=_QWEN3_OMNI_TOKEN_ATTRIBUTES,
    ),
    "audioflamingo3": _AudioFamily(
        architecture="AudioFlamingo3ForConditionalGeneration",
        processor_class="AudioFlamingo3Processor",
        added_tokens=_AUDIOFLAMINGO3_ADDED_TOKENS,
        rope_theta=1_000_000.0,
        audio_token="<sound>",
        chat_template=_AUDIOFLAMINGO3_CHAT_TEMPLATE,
    ),
    "llava_next": _LlavaNextFamily(
        architecture="LlavaNextForConditionalGeneration",
        processor_class="LlavaNextProcessor",
        added_tokens=_LLAVA_ADDED_TOKENS,
        chat_template=_LLAVA_CHAT_TEMPLATE,
        rope_theta=10_000.0,
    ),
    "gemma3": _Gemma3Family(
        architecture="Gemma3ForConditionalGeneration",
        processor_class="Gemma3Processor",
        added_tokens=_GEMMA3_ADDED_TOKENS,
        chat_template=_GEMMA3_CHAT_TEMPLATE,
        rope_theta=1_000_000.0,
        tile_px=64,  # 4 x 4 patches, pooled to 2 x 2 soft tokens
        patch_size=16,
        eos_token="<end_of_turn>",
        stop_tokens=("<end_of_turn>", "<eos>"),
        bos_token="<bos>",
        token_attributes=_GEMMA3_TOKEN_ATTRIBUTES,
    ),
    "mistral3": _PixtralFamily(
        architecture="Mistral3ForConditionalGeneration",
        processor_class="PixtralProcessor",
        added_tokens=_MISTRAL3_ADDED_TOKENS,
        chat_template=_MISTRAL3_CHAT_TEMPLATE,
        rope_theta=1_000_000_000.0,
        tile_px=112,  # the longest edge: 8 x 8 patches, 4 x 4 features at most
    ),
    "idefics3": _Idefics3Family(
        architecture="Idefics3ForConditionalGeneration",
        processor_class="Idefics3Processor",
        added_tokens=_IDEFICS3_ADDED_TOKENS,
        chat_template=_IDEFICS3_CHAT_TEMPLATE,
        rope_theta=500_000.0,
        tile_px=64,  # 4 x 4 patches a tile, 2 x 2 features
        patch_size=16,
        eos_token="<end_of_utterance>",
        stop_tokens=("<end_of_utterance>", "<|endoftext|>"),
    ),
    "internvl": _InternVLFamily(
        architecture="InternVLForConditionalGeneration",
        processor_class="InternVLProcessor",
        added_tokens=_INTERNVL_ADDED_TOKENS,
        chat_template=_INTERNVL_CHAT_TEMPLATE,
        rope_theta=1_000_000.0,
        token_attributes=_INTERNVL_TOKEN_ATTRIBUTES,
    ),
    "glm4v": _Family(
        architecture="Glm4vForConditionalGeneration",
        processor_class="Glm4vProcessor",
        video_processor_type="Glm4vVideoProcessor",
        added_tokens=_GLM4V_ADDED_TOKENS,
        patch_size=14,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        rope_theta=10_000.0,
        chat_template=_GLM4V_CHAT_TEMPLATE,
        image_processor_type="Glm4vImageProcessor",
        eos_token="<|endoftext|>",
        # As released: the text's end, or the model starting the next user or tool turn.
        stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
    ),
}


@dataclass(frozen=True)
class _Scale:
    """Language-model and vision-tower sizes and sharding of one checkpoint scale.

    The vision sizes apply to every vision family's tower (the Omni thinkers' included); the
    audio towers are the same at every scale.

    Attributes:
        text_hidden: hidden size; also the tower's output width.
        text_intermediate: MLP width.
        text_layers: decoder layers.
        text_heads: attention heads (head_dim = text_hidden / text_heads).
        text_kv_heads: key/value heads.
        num_shards: weight files: the tower's, then the language model's split by layer.
        vision_depth: vision blocks; the last one attends over the whole image, the others
            (Qwen2.5-VL, Qwen2.5-Omni) within windows.
        vision_hidden: vision tower width.
        vision_intermediate: vision MLP width.
        vision_heads: vision attention heads.
        image_max_side: the image processor's largest resized image, in placeholder tokens a
            side (each token covers ``2 * patch_size`` pixels a side): it caps the tokens, and so
            the tower's work, per image.
        vision_init_std: init std of the vision tower's weight matrices (see
            ``_VISION_INIT_STD``).
    """

    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    num_shards: int
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_heads: int = 2
    image_max_side: int = 8  # 8 x 8 tokens: 224 px a side at patch 14, so tests stay fast
    vision_init_std: float = _VISION_INIT_STD

    @property
    def head_dim(self) -> int:
        return self.text_hidden // self.text_heads


# About 0.7M parameters, 3 MB: what tests and the demo run on.
_TINY = _Scale(text_hidden=128, text_intermediate=256, text_layers=2, text_heads=2, text_kv_heads=1, num_shards=3)
_SCALES: dict[str, _Scale] = {
    "tiny": _TINY,
    # About 15M parameters (60 MB) per decoder layer, 15 layers: 0.9 GB in 16 shards, built in
    # seconds. Only for loading benchmarks: too slow to serve on CPU in tests.
    "bench": _Scale(text_hidden=1024, text_intermediate=4096, text_layers=15, text_heads=16, text_kv_heads=2, num_shards=16),
    # The tiny language model behind a vision tower whose work is worth saving, and images of up
    # to 32 x 32 tokens (896 px a side at patch 14, as the released Qwen2.5-VL's 1024-token
    # images). For the encoder-output reuse benchmark.
    "costly_tower": replace(
        _TINY,
        vision_depth=8,
        vision_hidden=256,
        vision_intermediate=1024,
        vision_heads=4,
        image_max_side=32,
        # Narrower than the tiny tower's 0.05: at 0.05 this wider, deeper tower's outputs are
        # about 7x a token embedding's norm (20 vs 2.8) and nearly the same for every image, so
        # greedy tokens hardly depend on the image and a token check would prove little. At 0.02
        # they are about a token embedding's norm, and six different images gave six different
        # 8-token answers.
        vision_init_std=0.02,
    ),
}
SCALES: tuple[str, ...] = tuple(_SCALES)
_TOWER_SHARD = 1
_INDEX_FILE = "model.safetensors.index.json"
# Files besides the weight shards that every complete checkpoint has; vision families also
# have a video processor config.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    _INDEX_FILE,
)
_VISION_REQUIRED_FILES = ("video_preprocessor_config.json",)
_SPEAKER_FILE = "spk_dict.pt"

# Where Qwen2-Audio's modules sit in transformers 5 (left) and in the released checkpoint,
# which vLLM reads (right). transformers 5.19's own reverse renaming doubles the inner
# "model." of the language model (``language_model.model.model.*``): its save_pretrained
# output loads back into transformers 5 but not into vLLM, so these names are written directly.
_QWEN2_AUDIO_DISK_PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
_AUDIO_TOWER_PREFIXES = ("audio_tower.", "multi_modal_projector.")
# LLaVA's and Gemma 3's towers as released: CLIP or SigLIP under ``vision_tower.vision_model.``
# (transformers 5 drops the inner ``vision_model.`` and maps it back on loading; vLLM reads only
# the released names), then the projector (and LLaVA's newline embedding) at the top level.
_LLAVA_CLIP_PREFIX, _LLAVA_CLIP_DISK_PREFIX = "vision_tower.", "vision_tower.vision_model."
# The modules of a LLaVA-style tower (LLaVA-NeXT, InternVL), wherever they sit in a name.
_VISION_TOWER_MODULES = frozenset({"vision_tower", "multi_modal_projector", "image_newline"})


def build_tiny_checkpoint(
    family: str,
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    vision_seed: int | None = None,
    scale: str = "tiny",
) -> pathlib.Path:
    """Builds (or overwrites) a tiny random-weight checkpoint in ``out_dir``.

    Args:
        family: one of :data:`ALL_FAMILIES`.
        out_dir: directory to write; created if missing, existing checkpoint files replaced.
        seed: seeds the language-model weights (and the tower weights unless
            ``vision_seed`` is given).
        vision_seed: seeds only the tower weights (the vision tower, or the audio tower and
            its projector); defaults to ``seed``. Two checkpoints with the same ``seed`` and
            different ``vision_seed`` have byte-identical tokenizer, configs and
            language-model shards.
        scale: one of :data:`SCALES`: the language model's and vision tower's sizes, the
            largest image and the shard count. ``"bench"`` keeps the tower and tokenizer but
            writes about 0.9 GB of language model; ``"costly_tower"`` keeps the language model
            and tokenizer but makes the vision tower and its images much larger.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: ``family`` is not one of :data:`ALL_FAMILIES`, or ``scale`` not one of
            :data:`SCALES`.
    """
    spec = _family_spec(family)
    sizes = _scale(scale)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(spec)
    token_ids = {content: tokenizer.token_to_id(content) for content, _ in spec.added_tokens}
    _write_tokenizer_files(out, tokenizer, spec)
    if isinstance(spec, _AudioFamily):
        config = _build_audio_config(family, spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _LlavaNextFamily):
        config = _build_llava_next_config(spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _InternVLFamily):
        config = _build_internvl_config(spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _Idefics3Family):
        config = _build_idefics3_config(spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _Gemma3Family):
        config = _build_gemma3_config(spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _PixtralFamily):
        config = _build_mistral3_config(spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    elif isinstance(spec, _OmniFamily):
        config = _build_omni_config(family, spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids, tokenizer=tokenizer)
    else:
        config = _build_config(family, spec, sizes, vocab_size=tokenizer.get_vocab_size(), token_ids=token_ids)
    config.to_json_file(out / "config.json", use_diff=True)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": [token_ids[token] for token in spec.stop_tokens],
            "pad_token_id": token_ids["<|endoftext|>"],
        },
    )
    if isinstance(spec, _AudioFamily):
        _write_audio_processor_configs(out, spec)
    elif isinstance(spec, _LlavaNextFamily):
        _write_llava_next_processor_configs(out, spec)
    elif isinstance(spec, _InternVLFamily):
        _write_internvl_processor_configs(out, spec)
    elif isinstance(spec, _PixtralFamily):
        _write_pixtral_processor_configs(out, spec)
    elif isinstance(spec, _Idefics3Family):
        _write_idefics3_processor_configs(out, spec)
    elif isinstance(spec, _Gemma3Family):
        _write_gemma3_processor_configs(out, spec)
    else:
        _write_processor_configs(out, spec, sizes)
    if isinstance(spec, _OmniFamily) and spec.speaker_file:
        _write_empty_speaker_dict(out / _SPEAKER_FILE)
    _write_sharded_weights(
        out, config, sizes.num_shards, seed=seed, vision_seed=seed if vision_seed is None else vision_seed, vision_std=sizes.vision_init_std
    )
    return out


def ensure_tiny_checkpoint(
    family: str,
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    vision_seed: int | None = None,
    scale: str = "tiny",
) -> pathlib.Path:
    """Returns a complete checkpoint under ``root``, building it first if needed.

    The directory is ``root/<family>-s<seed>`` (``root/<family>-<scale>-s<seed>`` for a scale
    other than ``"tiny"``), with ``-v<vision_seed>`` appended when ``vision_seed`` is given and
    differs from ``seed`` (otherwise the weights are the same).
    A missing or incomplete directory is rebuilt in a temporary sibling that is then renamed
    into place, so concurrent or aborted builds never expose a half-written checkpoint.

    Args:
        family: one of :data:`ALL_FAMILIES`.
        root: parent directory of the checkpoints; created if missing.
        seed: see :func:`build_tiny_checkpoint`.
        vision_seed: see :func:`build_tiny_checkpoint`.
        scale: see :func:`build_tiny_checkpoint`.

    Returns:
        The checkpoint directory.

    Raises:
        ValueError: ``family`` is not one of :data:`ALL_FAMILIES`, or ``scale`` not one of
            :data:`SCALES`.
    """
    spec = _family_spec(family)
    _scale(scale)  # fail before touching the disk
    root_path = pathlib.Path(root)
    name = f"{family}-s{seed}" if scale == "tiny" else f"{family}-{scale}-s{seed}"
    if vision_seed is not None and vision_seed != seed:
        name += f"-v{vision_seed}"
    target = root_path / name
    if _is_complete(target, spec):
        return target
    root_path.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root_path))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the checkpoint is meant to be shared
    try:
        build_tiny_checkpoint(family, staging, seed=seed, vision_seed=vision_seed, scale=scale)
        if target.exists() and not _is_complete(target, spec):
            # Left behind by an aborted non-atomic writer; move it aside so the rename below
            # can land. A concurrent builder may have moved it already, hence the suppress.
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.trash.", dir=root_path))
            with contextlib.suppress(OSError):
                target.rename(trash / name)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # A concurrent builder renamed its copy in first; both are byte-identical.
            if not _is_complete(target, spec):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _family_spec(family: str) -> _Spec:
    """The spec of ``family``; raises ValueError for an unknown one."""
    try:
        return _FAMILY_SPECS[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}") from None


def _scale(scale: str) -> _Scale:
    """The sizes of ``scale``; raises ValueError for an unknown one."""
    try:
        return _SCALES[scale]
    except KeyError:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALES}") from None


def _is_complete(path: pathlib.Path, spec: _Spec) -> bool:
    """Whether ``path`` holds every file a built checkpoint of ``spec`` has, shards included."""
    required = _REQUIRED_FILES + _VISION_REQUIRED_FILES if isinstance(spec, (_Family, _InternVLFamily)) else _REQUIRED_FILES
    if isinstance(spec, _OmniFamily) and spec.speaker_file:
        required += (_SPEAKER_FILE,)
    if not all((path / name).is_file() for name in required):
        return False
    try:
        weight_map = json.loads((path / _INDEX_FILE).read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / shard).is_file() for shard in set(weight_map.values()))


def _tokenizer_corpus() -> list[str]:
    """A made-up, fixed training corpus: chat-like English, numbers and a little code."""
    words = (
        "the a an image picture photo video frame shows describe what is in of on with and "
        "red green blue yellow black white color shape square circle line stripe left right "
        "top bottom center corner small large bright dark sky tree house car cat dog person "
        "please answer question user assistant system you are helpful model token text "
        "one two three four five many few there here this that it they we see look count"
    ).split()
    punctuation = (".", ",", "?", "!", ":", ";")
    rng = random.Random(20251130)  # fixed: the tokenizer must not depend on any seed argument
    lines = []
    for _ in range(600):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        number = rng.randint(0, 100000)
        lines.append(f"{sentence.capitalize()} {number}{rng.choice(punctuation)}")
    lines.append("def main(argv):\n    return {'key': [1, 2, 3]}  # code\n\tx = y + z\n")
    return lines


def _build_tokenizer(spec: _Spec) -> tokenizers.Tokenizer:
    """Trains a byte-level BPE with Qwen's pre-tokenizer and appends Qwen's added tokens.

    The normaliser, pre-tokenizer and decoder match what transformers' ``Qwen2Tokenizer``
    rebuilds around the vocabulary and merges when it loads ``tokenizer.json``, so the raw
    ``tokenizers`` object and the transformers tokenizer encode identically.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != _BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, expected {_BPE_VOCAB_SIZE}")
    # Added after training so that, as in Qwen, they take the ids after the BPE vocabulary.
    tokenizer.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in spec.added_tokens])
    return tokenizer


def _write_tokenizer_files(out: pathlib.Path, tokenizer: tokenizers.Tokenizer, spec: _Spec) -> None:
    """Writes tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    _write_text(out / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    config: dict[str, Any] = {
        "add_prefix_space": False,
        "bos_token": getattr(spec, "bos_token", None),
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "errors": "replace",
        "model_max_length": _MAX_POSITIONS,
        "pad_token": "<|endoftext|>",
        "processor_class": spec.processor_class,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if isinstance(spec, (_OmniFamily, _InternVLFamily, _Gemma3Family)):
        # transformers 5 sets these as tokenizer attributes (tokenizer.image_token, ...).
        config["extra_special_tokens"] = dict(spec.token_attributes)
    _write_json(out / "tokenizer_config.json", config)
    # transformers 5 reads chat_template.jinja for both the tokenizer and the processor.
    _write_text(out / "chat_template.jinja", spec.chat_template)


def _text_config(sizes: _Scale, vocab_size: int) -> dict[str, Any]:
    """What every family's tiny language model shares."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": sizes.text_hidden,
        "intermediate_size": sizes.text_intermediate,
        "num_hidden_layers": sizes.text_layers,
        "num_attention_heads": sizes.text_heads,
        "num_key_value_heads": sizes.text_kv_heads,
        "max_position_embeddings": _MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "initializer_range": _TEXT_INIT_STD,
    }


def _qwen_vision_config(spec: _Family, sizes: _Scale) -> dict[str, Any]:
    """The Qwen-VL line's vision tower (Qwen2.5-VL, Qwen3-VL and the Omni thinkers'), before each
    family's own fields."""
    return {
        "depth": sizes.vision_depth,
        "hidden_size": sizes.vision_hidden,
        "intermediate_size": sizes.vision_intermediate,
        "num_heads": sizes.vision_heads,
        "out_hidden_size": sizes.text_hidden,
        "patch_size": spec.patch_size,
        "spatial_merge_size": _SPATIAL_MERGE,
        "temporal_patch_size": _TEMPORAL_PATCH,
        "initializer_range": sizes.vision_init_std,
    }


# A narrow Whisper-style audio tower (Qwen2-Audio's and the Omni thinkers' field names).
_WHISPER_AUDIO_CONFIG: dict[str, Any] = {
    "d_model": _AUDIO_D_MODEL,
    "encoder_layers": _AUDIO_LAYERS,
    "encoder_attention_heads": _AUDIO_HEADS,
    "encoder_ffn_dim": _AUDIO_FFN,
    "num_mel_bins": _AUDIO_MEL_BINS,
    "max_source_positions": _AUDIO_MAX_SOURCE_POSITIONS,
}


def _build_config(family: str, spec: _Family, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the transformers model config (``Qwen2_5_VLConfig``, ``Qwen3VLConfig`` or
    ``Glm4vConfig``)."""
    import transformers

    if family == "glm4v":
        return _build_glm4v_config(spec, sizes, vocab_size=vocab_size, token_ids=token_ids)
    text_config: dict[str, Any] = _text_config(sizes, vocab_size) | {
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": _MROPE_SECTION},
        "pad_token_id": token_ids["<|endoftext|>"],
        "dtype": "float32",
    }
    vision_config = _qwen_vision_config(spec, sizes)
    if family == "qwen2_5_vl":
        config_class = transformers.Qwen2_5_VLConfig
        text_config |= {
            "bos_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": token_ids["<|im_end|>"],
        }
        # Windowed blocks and a last full-attention one (at depth 2 one of each), so both code
        # paths run. A window of 4 x 4 merged patches splits any image above 112 px into several
        # windows.
        vision_config |= {
            "window_size": 4 * spec.merged_patch,
            "fullatt_block_indexes": [sizes.vision_depth - 1],
            "tokens_per_second": 2,
        }
    else:
        config_class = transformers.Qwen3VLConfig
        text_config |= {"head_dim": sizes.head_dim}
        text_config["rope_parameters"] |= {"mrope_interleaved": True}
        # A 24 x 24 learned position grid (interpolated to the image); deepstack taps the
        # first block so its features differ from the final merger output.
        vision_config |= {"num_position_embeddings": 24 * 24, "deepstack_visual_indexes": [0]}
    return config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_glm4v_config(spec: _Family, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``Glm4vConfig``: the Qwen-VL line's tower sizes (GLM-4.1V's tower takes the same
    patch grids, with learned position embeddings over a 336 px grid as released), and a GLM-4 LM
    that rotates half of each head (as released), so its M-RoPE sections are halved."""
    import transformers

    text_config: dict[str, Any] = _text_config(sizes, vocab_size) | {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": 0.5,
            "mrope_section": [section // 2 for section in _MROPE_SECTION],
        },
        "pad_token_id": token_ids["<|endoftext|>"],
        "dtype": "float32",
    }
    return transformers.Glm4vConfig(
        text_config=text_config,
        vision_config=_qwen_vision_config(spec, sizes) | {"image_size": 336},
        image_token_id=token_ids["<|image|>"],
        video_token_id=token_ids["<|video|>"],
        image_start_token_id=token_ids["<|begin_of_image|>"],
        image_end_token_id=token_ids["<|end_of_image|>"],
        video_start_token_id=token_ids["<|begin_of_video|>"],
        video_end_token_id=token_ids["<|end_of_video|>"],
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _tower_sizes(sizes: _Scale) -> dict[str, Any]:
    """A tiled family's vision tower: the scale's sizes, in the names transformers' towers share."""
    return {
        "hidden_size": sizes.vision_hidden,
        "intermediate_size": sizes.vision_intermediate,
        "num_hidden_layers": sizes.vision_depth,
        "num_attention_heads": sizes.vision_heads,
        "initializer_range": sizes.vision_init_std,
    }


def _chatml_text_config(model_type: str, spec: _TiledFamily, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> dict[str, Any]:
    """A tiled family's language model: the scale's sizes as ``model_type``, ChatML's ids, untied."""
    return _text_config(sizes, vocab_size) | {
        "model_type": model_type,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _build_internvl_config(spec: _InternVLFamily, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``InternVLConfig``: the scale's tower sizes as an InternViT over the tile edge,
    the scale's LM as a Qwen2, and the released feature choices (the last tower layer, pixel
    shuffle by half)."""
    import transformers

    text_config = _chatml_text_config("qwen2", spec, sizes, vocab_size=vocab_size, token_ids=token_ids)
    vision_config = _tower_sizes(sizes) | {"image_size": [spec.tile_px, spec.tile_px], "patch_size": [spec.patch_size, spec.patch_size]}
    return transformers.InternVLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<IMG_CONTEXT>"],
        image_seq_length=spec.features_per_tile,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_llava_next_config(spec: _LlavaNextFamily, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``LlavaNextConfig``: the scale's tower sizes as a CLIP tower, the scale's LM as
    a Llama, and the released models' feature choices (the penultimate tower layer, its class
    token dropped)."""
    import transformers

    text_config = _chatml_text_config("llama", spec, sizes, vocab_size=vocab_size, token_ids=token_ids) | {"head_dim": sizes.head_dim}
    vision_config = _tower_sizes(sizes) | {
        "model_type": "clip_vision_model",
        "image_size": spec.tile_px,
        "patch_size": spec.patch_size,
        "projection_dim": sizes.vision_hidden,
        "hidden_act": "quick_gelu",
    }
    return transformers.LlavaNextConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=token_ids["<image>"],
        image_grid_pinpoints=spec.grid_pinpoints,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_gemma3_config(spec: _Gemma3Family, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``Gemma3Config``: the scale's tower sizes as a SigLIP tower over one tile, the
    scale's LM as a Gemma 3 whose two layers take its two kinds of attention (a sliding window,
    then full), and the image tokens."""
    import transformers

    text_config = _text_config(sizes, vocab_size) | {
        "model_type": "gemma3_text",
        "head_dim": sizes.head_dim,
        "query_pre_attn_scalar": sizes.head_dim,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
        },
        "bos_token_id": token_ids["<bos>"],
        "eos_token_id": token_ids["<eos>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    vision_config = _tower_sizes(sizes) | {
        "model_type": "siglip_vision_model",
        "image_size": spec.tile_px,
        "patch_size": spec.patch_size,
        "vision_use_head": False,
    }
    return transformers.Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=spec.features_per_tile,
        boi_token_index=token_ids["<start_of_image>"],
        eoi_token_index=token_ids["<end_of_image>"],
        image_token_index=token_ids["<image_soft_token>"],
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_idefics3_config(spec: _Idefics3Family, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``Idefics3Config``: the scale's tower sizes as a SigLIP tower over one tile,
    the scale's LM as a Llama ending its turns with ``<end_of_utterance>``, pixel shuffle by
    ``scale_factor``."""
    import transformers

    text_config = _text_config(sizes, vocab_size) | {
        "model_type": "llama",
        "head_dim": sizes.head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "bos_token_id": token_ids["<|begin_of_text|>"],
        "eos_token_id": token_ids["<end_of_utterance>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    vision_config = _tower_sizes(sizes) | {"image_size": spec.tile_px, "patch_size": spec.patch_size}
    return transformers.Idefics3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<image>"],
        scale_factor=spec.scale_factor,
        pad_token_id=token_ids["<|endoftext|>"],
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_mistral3_config(spec: _PixtralFamily, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the ``Mistral3Config``: the scale's tower sizes as a Pixtral tower over the longest
    edge, the scale's LM as a Mistral, and the released feature choices (the last tower layer,
    a 2 x 2 patch merger, no projector bias)."""
    import transformers

    text_config = _chatml_text_config("mistral", spec, sizes, vocab_size=vocab_size, token_ids=token_ids) | {"head_dim": sizes.head_dim}
    vision_config = _tower_sizes(sizes) | {
        "model_type": "pixtral",
        "head_dim": sizes.vision_hidden // sizes.vision_heads,
        "image_size": spec.tile_px,
        "patch_size": spec.patch_size,
    }
    return transformers.Mistral3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=token_ids["[IMG]"],
        spatial_merge_size=spec.spatial_merge,
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_audio_config(family: str, spec: _AudioFamily, sizes: _Scale, *, vocab_size: int, token_ids: Mapping[str, int]) -> PreTrainedConfig:
    """Builds the transformers ``Qwen2AudioConfig`` or ``AudioFlamingo3Config``: a narrow
    Whisper-style tower, a Qwen2 LM."""
    import transformers

    text_config: dict[str, Any] = _text_config(sizes, vocab_size) | {
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": False,
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "dtype": "float32",
    }
    audio_config: dict[str, Any] = _WHISPER_AUDIO_CONFIG | {
        "initializer_range": _AUDIO_INIT_STD,
    }
    if family == "audioflamingo3":
        # The same Whisper-style tower (AF3 pools its output 2x, like Qwen2-Audio) and a
        # two-layer GELU projector; the text config names its model type explicitly.
        text_config |= {"model_type": "qwen2"}
        audio_config = {
            "hidden_size": _AUDIO_D_MODEL,
            "num_hidden_layers": _AUDIO_LAYERS,
            "num_attention_heads": _AUDIO_HEADS,
            "intermediate_size": _AUDIO_FFN,
            "num_mel_bins": _AUDIO_MEL_BINS,
            "max_source_positions": _AUDIO_MAX_SOURCE_POSITIONS,
            "initializer_range": _AUDIO_INIT_STD,
        }
        return transformers.AudioFlamingo3Config(
            audio_config=audio_config,
            text_config=text_config,
            audio_token_id=token_ids[spec.audio_token],
            architectures=[spec.architecture],
            dtype="float32",
        )
    return transformers.Qwen2AudioConfig(
        audio_config=audio_config,
        text_config=text_config,
        audio_token_index=token_ids["<|AUDIO|>"],
        architectures=[spec.architecture],
        dtype="float32",
    )


def _build_omni_config(
    family: str,
    spec: _OmniFamily,
    sizes: _Scale,
    *,
    vocab_size: int,
    token_ids: Mapping[str, int],
    tokenizer: tokenizers.Tokenizer,
) -> PreTrainedConfig:
    """Builds the transformers ``Qwen2_5OmniConfig`` or ``Qwen3OmniMoeConfig``: a thinker
    (vision tower, audio tower, LM) and no talker (``enable_audio_output`` false)."""
    import transformers

    attributes = dict(spec.token_attributes)
    text_config: dict[str, Any] = _text_config(sizes, vocab_size) | {
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": _MROPE_SECTION},
        # Qwen2.5-Omni's text config defaults to tied embeddings; the released thinker (and
        # vLLM's loader, which would then drop lm_head) must see them untied.
        "tie_word_embeddings": False,
        "pad_token_id": token_ids["<|endoftext|>"],
        "bos_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "dtype": "float32",
    }
    vision_config = _qwen_vision_config(spec, sizes)
    audio_config: dict[str, Any] = _WHISPER_AUDIO_CONFIG | {
        "output_dim": sizes.text_hidden,
        "initializer_range": _AUDIO_INIT_STD,
    }
    thinker_config: dict[str, Any] = {
        "image_token_id": token_ids[attributes["image_token"]],
        "video_token_id": token_ids[attributes["video_token"]],
        "audio_token_id": token_ids[attributes["audio_token"]],
        "audio_start_token_id": token_ids[attributes["audio_bos_token"]],
        # Not fields of transformers' thinker configs, but read from them: vLLM wants the audio
        # end marker (audio-in-video prompts), transformers' M-RoPE the vision start marker.
        "audio_end_token_id": token_ids[attributes["audio_eos_token"]],
        "vision_start_token_id": token_ids[attributes["vision_bos_token"]],
        "vision_end_token_id": token_ids[attributes["vision_eos_token"]],
        "initializer_range": _TEXT_INIT_STD,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    # The talker is never built, but its config is written anyway; its copies of the
    # placeholder and marker ids are kept equal to the thinker's, as released.
    talker_config = {
        "vision_start_token_id": thinker_config["vision_start_token_id"],
        "audio_start_token_id": thinker_config["audio_start_token_id"],
    }
    top_level: dict[str, Any] = {}
    user_ids = tokenizer.encode("user", add_special_tokens=False).ids
    if len(user_ids) == 1:
        thinker_config["user_token_id"] = user_ids[0]  # marks user turns in the talker's input
    if family == "qwen2_5_omni":
        config_class = transformers.Qwen2_5OmniConfig
        # Windowed blocks and a last full-attention one, as for Qwen2.5-VL.
        vision_config |= {"window_size": 4 * spec.merged_patch, "fullatt_block_indexes": [sizes.vision_depth - 1]}
        # Token-id keys in the released config: ``*_index`` (transformers maps ``*_id`` onto
        # them); vLLM reads the ``*_index`` spellings.
        for key in ("image", "video", "audio"):
            thinker_config[f"{key}_token_index"] = thinker_config.pop(f"{key}_token_id")
            talker_config[f"{key}_token_index"] = thinker_config[f"{key}_token_index"]
        talker_config |= {key: thinker_config[key] for key in ("vision_end_token_id", "audio_end_token_id")}
    else:
        config_class = transformers.Qwen3OmniMoeConfig
        text_config |= {
            "head_dim": sizes.head_dim,
            "moe_intermediate_size": sizes.text_intermediate // 4,
            "num_experts": _MOE_EXPERTS,
            "num_experts_per_tok": _MOE_EXPERTS_PER_TOKEN,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        }
        text_config["rope_parameters"] |= {"mrope_interleaved": True, "interleaved": True}
        # vLLM sizes the learned position grid from image_size / patch_size and asks
        # apply_vit_abs_pos_embed; transformers' vision config has neither field (it reads
        # num_position_embeddings), so they ride along as extra keys.
        vision_config |= {
            "num_position_embeddings": _QWEN3_OMNI_POSITION_GRID**2,
            "image_size": _QWEN3_OMNI_POSITION_GRID * spec.patch_size,
            "apply_vit_abs_pos_embed": True,
            "deepstack_visual_indexes": [0],
        }
        audio_config |= {"downsample_hidden_size": _QWEN3_OMNI_AUDIO_DOWNSAMPLE}
        talker_config |= {f"{key}_token_id": thinker_config[f"{key}_token_id"] for key in ("image", "video", "audio")}
        top_level = {"im_start_token_id": token_ids["<|im_start|>"], "im_end_token_id": token_ids["<|im_end|>"]}
        if "user_token_id" in thinker_config:
            top_level["user_token_id"] = thinker_config["user_token_id"]
    thinker_config |= {"text_config": text_config, "vision_config": vision_config, "audio_config": audio_config}
    return config_class(
        thinker_config=thinker_config,
        talker_config=talker_config,
        enable_audio_output=False,
        architectures=[spec.architecture],
        dtype="float32",
        **top_level,
    )


def _write_processor_configs(out: pathlib.Path, spec: _Family, sizes: _Scale) -> None:
    """Writes the image, video and processor configs, with the scale's pixel limit (small but
    for ``costly_tower``).

    An Omni family's ``preprocessor_config.json`` also holds its Whisper feature extractor's
    settings, as in the released checkpoints: transformers reads both the image processor and
    the feature extractor from that one file, each taking its own keys.
    """
    shared = {
        "image_mean": spec.image_mean,
        "image_std": spec.image_std,
        "merge_size": _SPATIAL_MERGE,
        "patch_size": spec.patch_size,
        "processor_class": spec.processor_class,
        "temporal_patch_size": _TEMPORAL_PATCH,
    }
    max_pixels = spec.max_pixels(sizes)
    # size.shortest_edge / size.longest_edge are pixel counts (min_pixels / max_pixels).
    image: dict[str, Any] = {
        "image_processor_type": spec.image_processor_type,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": max_pixels},
    }
    if isinstance(spec, _OmniFamily):
        image |= _whisper_feature_extractor_config(spec.processor_class)
    _write_json(out / "preprocessor_config.json", shared | image)
    # cap_pixels_per_frame (an extra total-video pixel budget that transformers 5.22 turns on
    # by default) is set off explicitly: that is 5.19's behaviour, and it silences a warning.
    video: dict[str, Any] = {"video_processor_type": spec.video_processor_type, "cap_pixels_per_frame": False}
    if spec.video_processor_type == "Qwen3VLVideoProcessor":
        # Qwen3-VL's video limits count pixels over all frames; allow 8 frames at the image cap.
        video |= {
            "size": {"shortest_edge": spec.min_pixels, "longest_edge": 8 * max_pixels},
            "fps": 2,
            "min_frames": 2,
            "max_frames": 8,
        }
    else:
        # Qwen2-VL's video limits are per frame.
        video |= {"size": {"shortest_edge": spec.min_pixels, "longest_edge": max_pixels}}
    _write_json(out / "video_preprocessor_config.json", shared | video)
    _write_json(out / "processor_config.json", {"processor_class": spec.processor_class})


def _write_llava_next_processor_configs(out: pathlib.Path, spec: _LlavaNextFamily) -> None:
    """Writes the anyres image processor's config (CLIP's normalisation, the tile grids) and the
    processor's, which expands each ``<image>`` to the tile features' count."""
    image = _CLIP_IMAGE_PROCESSING | {
        "image_processor_type": "LlavaNextImageProcessor",
        "processor_class": spec.processor_class,
        "size": {"shortest_edge": spec.tile_px},
        "crop_size": {"height": spec.tile_px, "width": spec.tile_px},
        "image_grid_pinpoints": spec.grid_pinpoints,
        "do_center_crop": True,
        "do_pad": True,
    }
    _write_json(out / "preprocessor_config.json", image)
    processor = {
        "processor_class": spec.processor_class,
        "image_token": "<image>",
        "patch_size": spec.patch_size,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,  # CLIP's class token, which "default" drops
    }
    _write_json(out / "processor_config.json", processor)


def _write_internvl_processor_configs(out: pathlib.Path, spec: _InternVLFamily) -> None:
    """Writes the tiling image processor's config, the video processor's (one tile a frame) and
    the processor's (features per tile)."""
    shared = _CLIP_IMAGE_PROCESSING | {"processor_class": spec.processor_class, "size": {"height": spec.tile_px, "width": spec.tile_px}}
    tiles = {"crop_to_patches": True, "min_patches": 1, "max_patches": spec.max_tiles}
    _write_json(out / "preprocessor_config.json", shared | tiles | {"image_processor_type": "GotOcr2ImageProcessor"})
    _write_json(out / "video_preprocessor_config.json", shared | {"video_processor_type": "InternVLVideoProcessor", "initial_shift": True})
    _write_json(out / "processor_config.json", {"processor_class": spec.processor_class, "image_seq_length": spec.features_per_tile})


def _write_gemma3_processor_configs(out: pathlib.Path, spec: _Gemma3Family) -> None:
    """Writes Gemma 3's image processor config (one tile, SigLIP's normalisation; pan and scan is
    a per-call option, off unless a request's processor arguments turn it on) and the processor's
    (soft tokens per image)."""
    image = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": spec.processor_class,
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": spec.tile_px, "width": spec.tile_px},
        "resample": 2,  # bilinear
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    _write_json(out / "preprocessor_config.json", image)
    _write_json(out / "processor_config.json", {"processor_class": spec.processor_class, "image_seq_length": spec.features_per_tile})


def _write_idefics3_processor_configs(out: pathlib.Path, spec: _Idefics3Family) -> None:
    """Writes Idefics3's image processor config (split into tiles of the tower's edge, at most
    ``max_tiles`` a side, SigLIP's normalisation) and the processor's (features per tile)."""
    image = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": spec.processor_class,
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": spec.max_tiles * spec.tile_px},
        "resample": 1,  # Lanczos
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": spec.tile_px},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    _write_json(out / "preprocessor_config.json", image)
    _write_json(out / "processor_config.json", {"processor_class": spec.processor_class, "image_seq_len": spec.features_per_tile})


def _write_pixtral_processor_configs(out: pathlib.Path, spec: _PixtralFamily) -> None:
    """Writes Pixtral's image processor config (fit within the longest edge, whole patches,
    CLIP's normalisation) and the processor's (its tokens, the patch and merge sizes)."""
    image = _CLIP_IMAGE_PROCESSING | {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": spec.processor_class,
        "size": {"longest_edge": spec.tile_px},
        "patch_size": {"height": spec.patch_size, "width": spec.patch_size},
    }
    _write_json(out / "preprocessor_config.json", image)
    processor = {
        "processor_class": spec.processor_class,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge,
        "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
    }
    _write_json(out / "processor_config.json", processor)


def _write_audio_processor_configs(out: pathlib.Path, spec: _AudioFamily) -> None:
    """Writes the Whisper feature extractor config (the released Qwen2-Audio's settings) and
    the processor config."""
    _write_json(out / "preprocessor_config.json", _whisper_feature_extractor_config(spec.processor_class))
    _write_json(out / "processor_config.json", {"processor_class": spec.processor_class})


def _whisper_feature_extractor_config(processor_class: str) -> dict[str, Any]:
    """The Whisper feature extractor settings of the released Qwen2-Audio: 128 mel bins of
    10 ms frames, 30 s chunks (the Omni releases use the same, with longer chunks)."""
    return {
        "chunk_length": _AUDIO_CHUNK_SECONDS,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": _AUDIO_MEL_BINS,
        "hop_length": _AUDIO_HOP_LENGTH,
        "n_fft": _AUDIO_N_FFT,
        "n_samples": _AUDIO_CHUNK_SECONDS * _AUDIO_SAMPLING_RATE,
        "nb_max_frames": _AUDIO_CHUNK_SECONDS * _AUDIO_SAMPLING_RATE // _AUDIO_HOP_LENGTH,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": processor_class,
        "return_attention_mask": True,
        "sampling_rate": _AUDIO_SAMPLING_RATE,
    }


def _write_sharded_weights(out: pathlib.Path, config: PreTrainedConfig, num_shards: int, *, seed: int, vision_seed: int, vision_std: float) -> None:
    """Writes random float32 weights as safetensors shards plus the index.

    Tensor names and shapes come from the transformers model built on the meta device (no
    memory, no init), renamed to the on-disk names with the function ``save_pretrained``
    itself uses: Qwen2.5-VL is stored as ``visual.*`` / ``model.*``, Qwen3-VL as
    ``model.visual.*`` / ``model.language_model.*``, both with ``lm_head.*``; the Omni
    thinkers as ``thinker.visual.*`` / ``thinker.audio_tower.*`` / ``thinker.model.*`` /
    ``thinker.lm_head.*`` (Qwen3-Omni's experts one tensor per expert and projection, as
    released). Qwen2-Audio, Audio Flamingo 3 and LLaVA-NeXT get the released checkpoints' names
    instead (see :func:`_on_disk`).
    Tensors are drawn one shard at a time, so a bench-scale build holds one shard in memory.
    """
    import safetensors.torch
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    shapes, is_tower = _on_disk(config, model)
    # A projector after an audio tower is the audio tower's; after a vision tower, the vision's.
    has_audio = hasattr(config, "audio_config") or hasattr(getattr(config, "thinker_config", None), "audio_config")

    num_layers = config.get_text_config().num_hidden_layers
    names_by_shard: dict[int, list[str]] = {index: [] for index in range(1, num_shards + 1)}
    for name in sorted(shapes):
        names_by_shard[_TOWER_SHARD if is_tower(name) else _lm_shard_of(name, num_layers, num_shards)].append(name)

    weight_map: dict[str, str] = {}
    total_size = 0
    for index, names in names_by_shard.items():
        tensors = {
            name: _random_tensor(
                name,
                tuple(shapes[name].shape),
                seed=vision_seed if is_tower(name) else seed,
                std=_init_std(name, vision_std, tower=is_tower(name), audio=has_audio and _is_audio_tower_tensor(name)),
            )
            for name in names
        }
        file_name = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        # safetensors orders the header itself, so equal tensors give equal bytes. Written
        # via bytes because save_file creates the file owner-readable only.
        (out / file_name).write_bytes(safetensors.torch.save(tensors, metadata={"format": "pt"}))
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
    _write_json(out / _INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _on_disk(config: PreTrainedConfig, model: Any) -> tuple[dict[str, torch.Tensor], Callable[[str], bool]]:
    """The model's (meta) tensors under their on-disk names, and which of those names are the
    tower's."""
    from transformers.core_model_loading import revert_weight_conversion

    if config.model_type in ("qwen2_audio", "audioflamingo3"):
        return {_qwen2_audio_disk_name(name): tensor for name, tensor in model.state_dict().items()}, _is_tower_tensor
    if config.model_type == "internvl":
        # The "-hf" releases are saved by transformers itself: its in-memory names.
        return model.state_dict(), _is_vision_tower_tensor
    shapes = revert_weight_conversion(model, model.state_dict())
    if config.model_type == "mistral3":
        return shapes, _is_vision_tower_tensor
    if config.model_type == "idefics3":
        return shapes, _is_idefics3_tower_tensor
    if config.model_type in ("llava_next", "gemma3"):
        clip = _LLAVA_CLIP_PREFIX
        return {_LLAVA_CLIP_DISK_PREFIX + name.removeprefix(clip) if name.startswith(clip) else name: t for name, t in shapes.items()}, _is_vision_tower_tensor
    return shapes, _is_tower_tensor


def _qwen2_audio_disk_name(name: str) -> str:
    """The released Qwen2-Audio (and Audio Flamingo 3) checkpoint's name of a transformers 5
    parameter name."""
    for module_prefix, disk_prefix in _QWEN2_AUDIO_DISK_PREFIXES:
        if name.startswith(module_prefix):
            return disk_prefix + name[len(module_prefix) :]
    raise ValueError(f"unexpected Qwen2-Audio parameter {name!r}")


def _is_tower_tensor(name: str) -> bool:
    """Whether an on-disk tensor name belongs to the tower: a ``visual`` submodule, or an
    audio tower and the projector that maps its output to the LM width (an Omni thinker's
    audio tower ends in its own projection)."""
    return "visual" in name.split(".") or _is_audio_tower_tensor(name)


def _is_vision_tower_tensor(name: str) -> bool:
    return not _VISION_TOWER_MODULES.isdisjoint(name.split("."))


def _is_idefics3_tower_tensor(name: str) -> bool:
    return name.startswith(("model.vision_model.", "model.connector."))


def _is_audio_tower_tensor(name: str) -> bool:
    return name.startswith(_AUDIO_TOWER_PREFIXES) or "audio_tower" in name.split(".")


def _init_std(name: str, vision_std: float, *, tower: bool, audio: bool) -> float:
    """Std of the normal init of a weight matrix, by role (see ``_TEXT_INIT_STD``): the audio or
    vision tower's, else the language model's."""
    if tower:
        return _AUDIO_INIT_STD if audio else vision_std
    return _EMBED_INIT_STD if "embed_tokens" in name.split(".") else _TEXT_INIT_STD


def _lm_shard_of(name: str, num_layers: int, num_shards: int) -> int:
    """Shard number (1-based) of a language-model tensor (the tower has shard 1 alone): the
    layers spread evenly over the remaining shards, the embeddings in the first of them and the
    final norm and lm_head in the last (so ``num_shards - 1`` must not exceed ``num_layers``)."""
    lm_shards = num_shards - _TOWER_SHARD
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        return _TOWER_SHARD + 1 + layer * lm_shards // num_layers
    return _TOWER_SHARD + 1 if "embed_tokens" in parts else num_shards


def _random_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """A float32 tensor that depends only on (seed, name, shape).

    Norm scales (1-D ``weight``) start at one and biases at zero, as in a fresh model;
    everything else is normal with the given std.
    """
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.float32)
    # Seeding per tensor (not one stream for all) keeps each tensor independent of which
    # other tensors exist and of the order they are drawn in.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def _write_empty_speaker_dict(path: pathlib.Path) -> None:
    """Writes a torch-saved empty dict (no talker voices: the checkpoint has no talker).

    Saved through a buffer: saved to a path, torch names the archive inside after the file,
    so a staging copy would differ from a direct build."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save({}, buffer)
    path.write_bytes(buffer.getvalue())


def _write_json(path: pathlib.Path, data: Mapping[str, Any]) -> None:
    _write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_text(path: pathlib.Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m devkit.checkpoints --family F --out DIR [--seed N] [--vision-seed M] [--scale S]``."""
    parser = argparse.ArgumentParser(prog="python -m devkit.checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=ALL_FAMILIES)
    parser.add_argument("--out", required=True, type=pathlib.Path, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the language-model weights")
    parser.add_argument("--vision-seed", type=int, default=None, help="seed of the tower (vision or audio) weights (default: --seed)")
    parser.add_argument(
        "--scale",
        choices=SCALES,
        default="tiny",
        help="sizes: bench is a 0.9 GB language model in 16 shards, costly_tower a tiny one behind a large vision tower",
    )
    args = parser.parse_args(argv)
    path = build_tiny_checkpoint(args.family, args.out, seed=args.seed, vision_seed=args.vision_seed, scale=args.scale)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

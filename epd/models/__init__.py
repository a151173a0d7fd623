"""Model-family rules: how metadata becomes prompt placeholders, what the engines are given,
and which tower the encoder runs. One module per family; this module picks it by the
checkpoint's ``model_type``."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from epd.models.base import Encoding, ExpandedPrompt, ModelFamily

__all__ = ["Encoding", "ExpandedPrompt", "ModelFamily", "load_family", "load_processors", "load_tower"]

_VISION_LANGUAGE = ("qwen2_5_vl", "qwen3_vl")
_AUDIO_LANGUAGE = ("qwen2_audio",)


def _model_type(model_dir: str | pathlib.Path) -> tuple[str, dict[str, Any]]:
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in _VISION_LANGUAGE + _AUDIO_LANGUAGE:
        raise ValueError(f"unsupported model_type {model_type!r}: EPD knows {', '.join(_VISION_LANGUAGE + _AUDIO_LANGUAGE)}")
    return model_type, config


def load_family(model_dir: str | pathlib.Path) -> ModelFamily:
    """Reads the checkpoint's config.json and returns its family's layout rules.

    Raises:
        ValueError: the checkpoint's ``model_type`` has no family here.
    """
    model_type, config = _model_type(model_dir)
    if model_type in _AUDIO_LANGUAGE:
        from epd.models.qwen2_audio import Qwen2AudioFamily

        return Qwen2AudioFamily.from_config(config)
    from epd.models.qwen_vl import QwenVLFamily

    return QwenVLFamily.from_config(config, model_dir)


def load_tower(model_dir: str | pathlib.Path, *, dtype: str = "float32"):
    """The encoder's tower for the checkpoint (vision or audio), with only its weights read.

    It has ``family``, ``load_report`` and ``encode(modality, decoded_items) -> list[Encoding]``.
    """
    model_type, _ = _model_type(model_dir)
    if model_type in _AUDIO_LANGUAGE:
        from epd.models.qwen2_audio import AudioEncoder

        return AudioEncoder(model_dir, dtype=dtype)
    from epd.models.qwen_vl import VisionEncoder

    return VisionEncoder(model_dir, dtype=dtype)


def load_processors(model_dir: str | pathlib.Path):
    """The checkpoint's processors alone (no weights): ``layout(modality, decoded_items)``
    gives each item's layout as the processor sees it."""
    family = load_family(model_dir)
    if family.model_type in _AUDIO_LANGUAGE:
        from epd.models.qwen2_audio import AudioProcessors

        return AudioProcessors(model_dir, family)
    from epd.models.qwen_vl import VisionProcessors

    return VisionProcessors(model_dir, family)

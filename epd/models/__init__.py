"""Model-family rules: how metadata becomes prompt placeholders, what the engines are given,
and how the encoder runs the family's vision tower. One module per family."""

from __future__ import annotations

import json
import pathlib

from epd.models.qwen_vl import QwenVLFamily

ModelFamily = QwenVLFamily


def load_family(model_dir: str | pathlib.Path) -> ModelFamily:
    """Reads the checkpoint's config.json and returns its family's rules.

    Raises:
        ValueError: the checkpoint's ``model_type`` has no family here.
    """
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    return QwenVLFamily.from_config(config)

"""The Qwen-VL families (Qwen2.5-VL, Qwen3-VL): placeholder layout and vision tower.

Layout rule, shared by both: the rendered chat prompt holds one ``<|image_pad|>`` per image
(between ``<|vision_start|>`` and ``<|vision_end|>``); the processor repeats it
``t*h*w / merge²`` times, where (t, h, w) is the item's patch grid. Stages after the encoder
therefore rebuild the full layout from ``grid_thw`` alone, and vLLM does the same expansion
when it is given the grid with precomputed embeddings (or with no embeddings at all, for a
decode engine that receives the KV instead).

Qwen3-VL adds "deepstack": features from intermediate vision layers injected into early LLM
layers. vLLM takes them concatenated to the main embedding on the last dimension, so an item's
embedding width is ``out_hidden * (1 + len(deepstack_visual_indexes))``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd.domain import EngineRequest, GridThw, ItemMetadata, Modality, TokenRange
from epd.errors import FieldViolation, InvalidArgument, Unimplemented

if TYPE_CHECKING:
    import torch
    from PIL import Image

_VISION_PREFIXES = ("model.visual.", "visual.")


@dataclasses.dataclass(frozen=True)
class ExpandedPrompt:
    """A prompt with every placeholder expanded, and where each item's run sits."""

    token_ids: list[int]
    ranges: list[TokenRange]


@dataclasses.dataclass(frozen=True)
class QwenVLFamily:
    """Layout rules of one Qwen-VL checkpoint, read from its config.json."""

    model_type: str
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    embedding_width: int
    supported_modalities: frozenset[Modality] = frozenset({Modality.IMAGE})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QwenVLFamily:
        model_type = config.get("model_type")
        vision = config["vision_config"]
        if model_type == "qwen2_5_vl":
            width = vision["out_hidden_size"]
        elif model_type == "qwen3_vl":
            width = vision["out_hidden_size"] * (1 + len(vision.get("deepstack_visual_indexes", ())))
        else:
            raise ValueError(f"unsupported model_type {model_type!r}: EPD knows qwen2_5_vl and qwen3_vl")
        return cls(
            model_type=model_type,
            image_token_id=config["image_token_id"],
            video_token_id=config["video_token_id"],
            spatial_merge_size=vision["spatial_merge_size"],
            embedding_width=width,
        )

    # ---- layout -------------------------------------------------------------------------

    def placeholder_token_id(self, modality: Modality) -> int:
        if modality is Modality.IMAGE:
            return self.image_token_id
        raise Unimplemented(f"{modality.value} input is not implemented yet for {self.model_type}")

    def placeholder_count(self, grid: GridThw) -> int:
        return grid.t * grid.h * grid.w // self.spatial_merge_size**2

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> ExpandedPrompt:
        """Expands the k-th placeholder token of the prompt into item k's run.

        Raises:
            InvalidArgument: the prompt's placeholders do not match the items one to one.
        """
        self.validate_layout(token_ids, items)
        expanded: list[int] = []
        ranges: list[TokenRange] = []
        remaining = iter(items)
        placeholder_ids = {self.image_token_id, self.video_token_id}
        for token in token_ids:
            if token in placeholder_ids:
                item = next(remaining)
                ranges.append(TokenRange(offset=len(expanded), length=item.placeholder_count))
                expanded.extend([token] * item.placeholder_count)
            else:
                expanded.append(token)
        return ExpandedPrompt(expanded, ranges)

    def validate_layout(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> None:
        """Checks that prompt and metadata agree, before anything reaches an engine.

        Raises:
            InvalidArgument: naming every inconsistent field.
        """
        violations: list[FieldViolation] = []
        placeholder_ids = {self.image_token_id: Modality.IMAGE, self.video_token_id: Modality.VIDEO}
        found = [placeholder_ids[t] for t in token_ids if t in placeholder_ids]
        if len(found) != len(items):
            violations.append(
                FieldViolation(
                    "prompt.token_ids",
                    f"holds {len(found)} media placeholders but the request has {len(items)} items",
                )
            )
        for index, item in enumerate(items):
            field = f"items[{index}].metadata"
            if index < len(found) and found[index] is not item.modality:
                violations.append(
                    FieldViolation(f"{field}.modality", f"is {item.modality.value} but the prompt has a {found[index].value} placeholder there")
                )
            if item.grid_thw is None:
                violations.append(FieldViolation(f"{field}.grid_thw", "is required for images and videos"))
                continue
            expected = self.placeholder_count(item.grid_thw)
            if item.placeholder_count != expected:
                violations.append(
                    FieldViolation(f"{field}.placeholder_count", f"is {item.placeholder_count} but grid_thw implies {expected}")
                )
            if tuple(item.embedding_shape) != (expected, self.embedding_width):
                violations.append(
                    FieldViolation(
                        f"{field}.embedding_shape",
                        f"is {list(item.embedding_shape)} but this model needs [{expected}, {self.embedding_width}]",
                    )
                )
        if violations:
            raise InvalidArgument("prompt and multimodal metadata disagree", violations)

    # ---- engine inputs ------------------------------------------------------------------

    def engine_prompt(self, request: EngineRequest, embeddings: Sequence[torch.Tensor] | None) -> dict[str, Any]:
        """Builds vLLM's prompt dict from metadata, with or without embeddings.

        With embeddings (prefill, combined decode), vLLM places them at the expanded
        placeholders. Without (decode receiving KV), it only needs the grids to rebuild the same
        layout; the content hashes keep the multimodal cache keys identical across stages.
        """
        import torch

        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if not request.items:
            return prompt
        images = [item.metadata for item in request.items]
        if any(m.modality is not Modality.IMAGE for m in images):
            raise Unimplemented("only image items are implemented for the Qwen-VL families so far")
        image_data: dict[str, torch.Tensor] = {
            # vLLM wants a 2-D grid tensor even for a single image.
            "image_grid_thw": torch.tensor([m.grid_thw.as_list() for m in images], dtype=torch.int64),
        }
        if embeddings is not None:
            image_data["image_embeds"] = torch.cat(list(embeddings), dim=0)
        prompt["multi_modal_data"] = {"image": image_data}
        prompt["multi_modal_uuids"] = {"image": [m.content_hash for m in images]}
        return prompt


class VisionEncoder:
    """Runs one Qwen-VL checkpoint's image processor and vision tower, and nothing else.

    Only the vision tower's tensors are read from disk (see :mod:`epd.weights`).
    """

    def __init__(self, model_dir: str | pathlib.Path, *, dtype: str = "float32"):
        import torch
        from transformers import AutoConfig, AutoImageProcessor

        from epd.weights import load_tensors

        self.model_dir = pathlib.Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.family = QwenVLFamily.from_config(config.to_dict())
        self.dtype = getattr(torch, dtype)
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
        self.tower = _build_tower(config).to(self.dtype)
        state, self.load_report = load_tensors(self.model_dir, _VISION_PREFIXES)
        missing, unexpected = self.tower.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights do not fit the tower: missing={missing[:5]} unexpected={unexpected[:5]}")
        self.tower.eval()

    def encode_images(self, images: Sequence[Image.Image]) -> list[tuple[GridThw, torch.Tensor]]:
        """Runs the processor and the tower over a batch; returns (grid, embedding) per image."""
        import torch

        processed = self.image_processor(images=list(images), return_tensors="pt")
        grids = processed["image_grid_thw"]
        with torch.inference_mode():
            output = self.tower(processed["pixel_values"].to(self.dtype), grid_thw=grids)
            features = [output.pooler_output, *(getattr(output, "deepstack_features", None) or [])]
            merged = torch.cat(features, dim=-1)
        sizes = (grids.prod(-1) // self.family.spatial_merge_size**2).tolist()
        return [
            (GridThw(*(int(v) for v in grid.tolist())), emb.contiguous())
            for grid, emb in zip(grids, torch.split(merged, sizes), strict=True)
        ]


def _build_tower(config: Any) -> torch.nn.Module:
    """Instantiates just the vision tower class of the checkpoint's family."""
    if config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    return Tower._from_config(config.vision_config)

"""The Qwen-VL families (Qwen2.5-VL, Qwen3-VL): placeholder layout and vision tower.

Image layout, shared by both: the rendered chat prompt holds one ``<|image_pad|>`` per image
(between ``<|vision_start|>`` and ``<|vision_end|>``); the processor repeats it
``t*h*w / merge²`` times, where (t, h, w) is the item's patch grid. Stages after the encoder
therefore rebuild the full layout from ``grid_thw`` alone, and vLLM does the same expansion
when it is given the grid with precomputed embeddings (or with no embeddings at all, for a
decode engine that receives the KV instead).

Qwen3-VL video layout: the one ``<|video_pad|>`` becomes, for each temporal group j of the
grid, the text ``<{t_j:.1f} seconds>`` then ``<|vision_start|>``, ``h*w / merge²`` video pads
and ``<|vision_end|>``. So the group timestamps are part of the prompt and travel in the
metadata; the embedding rows fill only the video pads. (Qwen2.5-VL video needs
``second_per_grid_ts`` in M-RoPE instead; it is not implemented and says so.)

Qwen3-VL adds "deepstack": features from intermediate vision layers injected into early LLM
layers. vLLM takes them concatenated to the main embedding on the last dimension, so an item's
embedding width is ``out_hidden * (1 + len(deepstack_visual_indexes))``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd.domain import EngineRequest, GridThw, ItemMetadata, Modality
from epd.errors import FieldViolation, InvalidArgument, Unimplemented
from epd.models.base import Encoding, ExpandedPrompt, expand_placeholders

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from epd.media.video import DecodedVideo

_VISION_PREFIXES = ("model.visual.", "visual.")


@functools.cache
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@dataclasses.dataclass(frozen=True)
class QwenVLFamily:
    """Layout rules of one Qwen-VL checkpoint, read from its config.json."""

    model_type: str
    model_dir: str  # for the tokenizer, which Qwen3-VL's video timestamps need
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    embedding_width: int
    supported_modalities: frozenset[Modality]
    model_modalities: frozenset[Modality] = frozenset({Modality.IMAGE, Modality.VIDEO})

    @classmethod
    def from_config(cls, config: dict[str, Any], model_dir: str | pathlib.Path) -> QwenVLFamily:
        model_type = config.get("model_type")
        vision = config["vision_config"]
        if model_type == "qwen2_5_vl":
            width = vision["out_hidden_size"]
            supported = frozenset({Modality.IMAGE})
        elif model_type == "qwen3_vl":
            width = vision["out_hidden_size"] * (1 + len(vision.get("deepstack_visual_indexes", ())))
            supported = frozenset({Modality.IMAGE, Modality.VIDEO})
        else:
            raise ValueError(f"unsupported model_type {model_type!r}: EPD knows qwen2_5_vl, qwen3_vl and qwen2_audio")
        return cls(
            model_type=model_type,
            model_dir=str(model_dir),
            image_token_id=config["image_token_id"],
            video_token_id=config["video_token_id"],
            vision_start_token_id=config["vision_start_token_id"],
            vision_end_token_id=config["vision_end_token_id"],
            spatial_merge_size=vision["spatial_merge_size"],
            embedding_width=width,
            supported_modalities=supported,
        )

    # ---- layout -------------------------------------------------------------------------

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        return frozenset({self.image_token_id, self.video_token_id})

    def placeholder_token_id(self, modality: Modality) -> int:
        return self.video_token_id if modality is Modality.VIDEO else self.image_token_id

    def placeholder_count(self, grid: GridThw) -> int:
        return grid.t * grid.h * grid.w // self.spatial_merge_size**2

    def item_metadata(self, modality: Modality, content_hash: str, encoding: Encoding) -> ItemMetadata:
        return ItemMetadata(
            modality=modality,
            content_hash=content_hash,
            placeholder_token_id=self.placeholder_token_id(modality),
            placeholder_count=self.placeholder_count(encoding.grid_thw),
            embedding_shape=tuple(encoding.embedding.shape),
            embedding_dtype=str(encoding.embedding.dtype).removeprefix("torch."),
            grid_thw=encoding.grid_thw,
            video_timestamps_s=encoding.video_timestamps_s,
        )

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> ExpandedPrompt:
        """Expands the k-th placeholder token of the prompt into item k's run.

        Raises:
            InvalidArgument: the prompt's placeholders do not match the items one to one.
        """
        self.validate_layout(token_ids, items)
        return expand_placeholders(token_ids, items, self.placeholder_token_ids, self._item_run)

    def _item_run(self, item: ItemMetadata) -> list[int]:
        if item.modality is Modality.IMAGE:
            return [self.image_token_id] * item.placeholder_count
        tokens_per_group = item.grid_thw.h * item.grid_thw.w // self.spatial_merge_size**2
        tokenizer = _tokenizer(self.model_dir)
        run: list[int] = []
        for seconds in item.video_timestamps_s:
            # Each timestamp is tokenized on its own, as vLLM and the HF processor do.
            run += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            run += [self.vision_start_token_id, *[self.video_token_id] * tokens_per_group, self.vision_end_token_id]
        return run

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
            if item.modality not in self.supported_modalities:
                violations.append(FieldViolation(f"{field}.modality", f"{item.modality.value} is not supported for {self.model_type}"))
                continue
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
            if item.modality is Modality.VIDEO and len(item.video_timestamps_s) != item.grid_thw.t:
                violations.append(
                    FieldViolation(
                        f"{field}.video_timestamps_s",
                        f"holds {len(item.video_timestamps_s)} timestamps but grid_thw.t is {item.grid_thw.t} (one per temporal group)",
                    )
                )
        if violations:
            raise InvalidArgument("prompt and multimodal metadata disagree", violations)

    # ---- engine inputs ------------------------------------------------------------------

    def engine_prompt(self, request: EngineRequest, embeddings: Sequence[torch.Tensor] | None) -> dict[str, Any]:
        """Builds vLLM's prompt dict from metadata, with or without embeddings.

        With embeddings (prefill, combined decode), vLLM places them at the expanded
        placeholders. Without (decode receiving KV), it only needs the grids (and a video's
        timestamps) to rebuild the same layout; the content hashes keep the multimodal cache
        keys identical across stages.
        """
        import torch

        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if not request.items:
            return prompt
        metadata = [item.metadata for item in request.items]
        unsupported = sorted({m.modality.value for m in metadata} - {m.value for m in self.supported_modalities})
        if unsupported:
            raise Unimplemented(f"{', '.join(unsupported)} input is not implemented for {self.model_type}")
        prompt["multi_modal_data"] = {}
        prompt["multi_modal_uuids"] = {}
        for modality in (Modality.IMAGE, Modality.VIDEO):
            indices = [i for i, m in enumerate(metadata) if m.modality is modality]
            if not indices:
                continue
            key = modality.value
            # vLLM wants a 2-D grid tensor even for a single item.
            data: dict[str, Any] = {f"{key}_grid_thw": torch.tensor([metadata[i].grid_thw.as_list() for i in indices], dtype=torch.int64)}
            if modality is Modality.VIDEO:
                data["timestamps"] = [list(metadata[i].video_timestamps_s) for i in indices]
            if embeddings is not None:
                data[f"{key}_embeds"] = torch.cat([embeddings[i] for i in indices], dim=0)
            prompt["multi_modal_data"][key] = data
            prompt["multi_modal_uuids"][key] = [metadata[i].content_hash for i in indices]
        return prompt


class VisionProcessors:
    """The checkpoint's image and video processors: pixels and layout, no weights. The encoder
    runs them before its tower; the media-forwarding baseline runs them again downstream."""

    def __init__(self, model_dir: str | pathlib.Path, family: QwenVLFamily):
        from transformers import AutoImageProcessor, AutoVideoProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.video_processor = AutoVideoProcessor.from_pretrained(model_dir) if Modality.VIDEO in family.supported_modalities else None

    def preprocess(self, modality: Modality, items: Sequence[Image.Image] | Sequence[DecodedVideo]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[float, ...]]]:
        """(pixel values, grids [k, 3], per-item video timestamps (empty for images))."""
        if modality is Modality.IMAGE:
            processed = self.image_processor(images=list(items), return_tensors="pt")
            return processed["pixel_values"], processed["image_grid_thw"], [()] * len(items)
        from transformers.video_utils import VideoMetadata

        videos = list(items)
        processed = self.video_processor(
            videos=[v.frames for v in videos],
            video_metadata=[VideoMetadata(v.total_frames, fps=v.source_fps, frames_indices=list(v.frame_indices)) for v in videos],
            do_sample_frames=False,  # the decoder sampled already; see epd.media.video
            return_tensors="pt",
        )
        timestamps = [v.group_timestamps(self.video_processor.temporal_patch_size) for v in videos]
        return processed["pixel_values_videos"], processed["video_grid_thw"], timestamps

    def layout(self, modality: Modality, items: Sequence[Image.Image] | Sequence[DecodedVideo]) -> list[Encoding]:
        """What the processor says about each item's place in the prompt (no embeddings)."""
        _, grids, timestamps = self.preprocess(modality, items)
        return [Encoding(None, _grid(grid), video_timestamps_s=ts) for grid, ts in zip(grids, timestamps, strict=True)]


class VisionEncoder:
    """Runs one Qwen-VL checkpoint's processors and its vision tower, and nothing else. Only
    the vision tower's tensors are read from disk (see :mod:`epd.weights`).
    """

    def __init__(self, model_dir: str | pathlib.Path, *, dtype: str = "float32"):
        import torch
        from transformers import AutoConfig

        from epd.weights import load_tensors

        self.model_dir = pathlib.Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.family = QwenVLFamily.from_config(config.to_dict(), self.model_dir)
        self.processors = VisionProcessors(self.model_dir, self.family)
        self.dtype = getattr(torch, dtype)
        self.tower = _build_tower(config).to(self.dtype)
        state, self.load_report = load_tensors(self.model_dir, _VISION_PREFIXES)
        missing, unexpected = self.tower.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision weights do not fit the tower: missing={missing[:5]} unexpected={unexpected[:5]}")
        self.tower.eval()

    def encode(self, modality: Modality, items: Sequence[Image.Image] | Sequence[DecodedVideo]) -> list[Encoding]:
        """Runs the processor and the tower over a batch of one modality, in order."""
        pixel_values, grids, timestamps = self.processors.preprocess(modality, items)
        outputs = self._run_tower(pixel_values, grids)
        return [Encoding(embedding, grid, video_timestamps_s=ts) for (grid, embedding), ts in zip(outputs, timestamps, strict=True)]

    def encode_images(self, images: Sequence[Image.Image]) -> list[tuple[GridThw, torch.Tensor]]:
        """Runs the processor and the tower over a batch; returns (grid, embedding) per image."""
        pixel_values, grids, _ = self.processors.preprocess(Modality.IMAGE, images)
        return self._run_tower(pixel_values, grids)

    def _run_tower(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[tuple[GridThw, torch.Tensor]]:
        import torch

        with torch.inference_mode():
            output = self.tower(pixel_values.to(self.dtype), grid_thw=grids)
            features = [output.pooler_output, *(getattr(output, "deepstack_features", None) or [])]
            merged = torch.cat(features, dim=-1)
        sizes = (grids.prod(-1) // self.family.spatial_merge_size**2).tolist()
        return [(_grid(grid), emb.contiguous()) for grid, emb in zip(grids, torch.split(merged, sizes), strict=True)]


def _grid(row: torch.Tensor) -> GridThw:
    return GridThw(*(int(v) for v in row.tolist()))


def _build_tower(config: Any) -> torch.nn.Module:
    """Instantiates just the vision tower class of the checkpoint's family."""
    if config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    return Tower._from_config(config.vision_config)

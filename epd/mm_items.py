"""vLLM's per-item multimodal fields <-> :class:`~epd.domain.ItemMetadata`, in one place.

The encoder's vLLM publishes, per item, the fields its model declares as placeholder metadata
(``MultiModalDataParser.embedding_fields``: ``image_grid_thw``, ``timestamps``,
``audio_feature_lengths`` ...). A consumer's vLLM needs exactly the fields *it* declares back, as
tensors or lists, to rebuild the item's place in the prompt without the media. This module is the
only code that knows vLLM's field names, and it knows them by vLLM's naming conventions, never by
model:

- ``<modality>_grid_thw`` is the patch grid, ``timestamps`` a video's group times,
  ``second_per_grid_ts`` its seconds per temporal group, ``audio_feature_lengths`` and
  ``audio_num_tokens`` an audio clip's sizes. These become typed fields of the contract, but only
  when the typed value reproduces vLLM's exactly (dtype, shape and form); otherwise, like every
  other field, they travel verbatim in ``engine_fields``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from epd.domain import EngineField, GridThw, ItemMetadata, Modality, PublishedItem
from epd.errors import FieldViolation, InvalidArgument

_SCALAR_INT = ("int64", ())


def engine_field_from_vllm(value: Any) -> EngineField | None:
    """A vLLM per-item value as an :class:`EngineField`; None for anything else (e.g. nested)."""
    import torch

    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        values = value.flatten().tolist()
        return EngineField(dtype, tuple(value.shape), tuple(values))
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        dtype = "float64" if any(isinstance(v, float) for v in value) else "int64"
        return EngineField(dtype, (len(value),), tuple(value), is_list=True)
    return None


def engine_field_to_vllm(field: EngineField) -> Any:
    """Back to what vLLM held: a tensor of the recorded dtype and shape, or a plain list."""
    import torch

    if field.is_list:
        return list(field.values)
    return torch.tensor(field.values, dtype=getattr(torch, field.dtype)).reshape(field.shape)


def metadata_from_published(content_hash: str, item: PublishedItem) -> ItemMetadata:
    """The contract's metadata for one item the encoder's vLLM published."""
    modality = Modality(item.modality)
    typed: dict[str, Any] = {}
    extra: dict[str, EngineField] = {}
    for name, value in item.fields.items():
        known = _typed_value(modality, name, value)
        if known is None:
            extra[name] = value
        else:
            typed.update(known)
    if modality is Modality.AUDIO:
        typed.setdefault("audio_token_count", item.rows)
    return ItemMetadata(
        modality=modality,
        content_hash=content_hash,
        placeholder_token_id=item.placeholder_token_id,
        placeholder_count=item.rows,
        placeholder_length=item.placeholder_length,
        embedding_shape=(item.rows, item.width),
        embedding_dtype=item.dtype,
        engine_fields=extra,
        layout_needs_media=item.layout_needs_media,
        **typed,
    )


def vllm_fields(metadata: ItemMetadata, wanted: Iterable[str], path: str) -> dict[str, Any]:
    """The fields a consumer's vLLM declares for this item's modality, ready for vLLM.

    Raises:
        InvalidArgument: a declared field is missing from the metadata (``path`` names it).
    """
    fields: dict[str, Any] = {}
    missing: list[FieldViolation] = []
    for name in sorted(wanted):
        value = _from_typed(metadata, name)
        if value is None:
            value = metadata.engine_fields.get(name)
        if value is None:
            field = _TYPED_NAMES.get(name.removeprefix(f"{metadata.modality.value}_"), f"engine_fields[{name!r}]")
            missing.append(FieldViolation(f"{path}.{field}", f"is required: this model needs {name!r} to lay out {metadata.modality.value} items"))
        else:
            fields[name] = engine_field_to_vllm(value)
    if missing:
        raise InvalidArgument("multimodal metadata is incomplete: " + "; ".join(f"{v.field} {v.description}" for v in missing), missing)
    return fields


def batch_fields(per_item: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One modality's items as vLLM takes them: each field batched over the items, as a
    stacked tensor when every item's value has one shape, else as a list."""
    import torch

    batched: dict[str, Any] = {}
    for name in per_item[0]:
        values = [fields[name] for fields in per_item]
        if all(isinstance(v, torch.Tensor) for v in values) and len({tuple(v.shape) for v in values}) == 1:
            batched[name] = torch.stack(values)
        else:
            batched[name] = values
    return batched


# ---- well-known fields ------------------------------------------------------------------

# vLLM's field name (without a "<modality>_" prefix) -> the typed field of the contract.
_TYPED_NAMES = {
    "grid_thw": "grid_thw",
    "timestamps": "video_timestamps_s",
    "second_per_grid_ts": "second_per_grid_ts",
    "audio_feature_lengths": "audio_feature_length",
    "audio_num_tokens": "audio_token_count",
}



def _typed_value(modality: Modality, name: str, value: EngineField) -> dict[str, Any] | None:
    """The typed field(s) for a published field, if the typed form reproduces it exactly."""
    candidate: dict[str, Any] | None = None
    if name == f"{modality.value}_grid_thw" and value.shape == (3,) and value.dtype == "int64" and not value.is_list:
        candidate = {"grid_thw": GridThw(*(int(v) for v in value.values))}
    elif name == "timestamps" and value.is_list and value.dtype == "float64":
        candidate = {"video_timestamps_s": tuple(float(v) for v in value.values)}
    elif name == "second_per_grid_ts" and (value.dtype, value.shape) == ("float32", ()) and not value.is_list:
        candidate = {"second_per_grid_ts": float(value.values[0])}
    elif name == "audio_feature_lengths" and (value.dtype, value.shape) == _SCALAR_INT and not value.is_list:
        candidate = {"audio_feature_length": int(value.values[0])}
    elif name == "audio_num_tokens" and (value.dtype, value.shape) == _SCALAR_INT and not value.is_list:
        candidate = {"audio_token_count": int(value.values[0])}
    if candidate is None:
        return None
    probe = ItemMetadata(modality, "", 0, 0, 0, (), "", **candidate)
    return candidate if _from_typed(probe, name) == value else None


def _from_typed(metadata: ItemMetadata, name: str) -> EngineField | None:
    """A declared field rebuilt from the typed metadata, or None if it is not a typed one."""
    if name == f"{metadata.modality.value}_grid_thw" and metadata.grid_thw is not None:
        return EngineField("int64", (3,), tuple(metadata.grid_thw.as_list()))
    if name == "timestamps" and metadata.video_timestamps_s:
        return EngineField("float64", (len(metadata.video_timestamps_s),), metadata.video_timestamps_s, is_list=True)
    if name == "second_per_grid_ts" and metadata.second_per_grid_ts is not None:
        return EngineField("float32", (), (metadata.second_per_grid_ts,))
    if name == "audio_feature_lengths" and metadata.audio_feature_length:
        return EngineField(*_SCALAR_INT, (metadata.audio_feature_length,))
    if name == "audio_num_tokens" and metadata.audio_token_count:
        return EngineField(*_SCALAR_INT, (metadata.audio_token_count,))
    return None

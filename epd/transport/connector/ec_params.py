"""The ``ec_transfer_params`` our EC connector writes (producer) and reads (consumer).

vLLM hands these dicts between its frontend and its engine core untouched, so their content is
ours. Both keep vLLM's shape (one entry per item hash) and put our part under ``"epd"`` with a
version, so a future format can be told apart; nothing in them is pickled.

Producer output, per item hash: where the item was published and what vLLM's processor made of
it (the per-item fields vLLM declares as placeholder metadata, and the run it expanded into).
Consumer input, per item hash: where to READ from and what the rows must look like.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from epd.domain import EmbeddingLocation, EngineField, InlineEmbedding, NixlLocation, PublishedItem

KEY = "epd"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class ExpectedItem:
    """What a consumer engine is told about one item it must load."""

    rows: int
    width: int
    dtype: str
    location: EmbeddingLocation


def published_to_params(items: Mapping[str, PublishedItem]) -> dict[str, Any]:
    return {
        mm_hash: {
            KEY: {
                "version": VERSION,
                "modality": item.modality,
                "rows": item.rows,
                "width": item.width,
                "dtype": item.dtype,
                "placeholder_length": item.placeholder_length,
                "placeholder_token_id": item.placeholder_token_id,
                "fields": {name: _field_to_params(value) for name, value in item.fields.items()},
                "layout_needs_media": item.layout_needs_media,
                "location": None if item.location is None else _location_to_params(item.location),
                "error": item.error,
            }
        }
        for mm_hash, item in items.items()
    }


def published_from_params(params: Mapping[str, Any] | None) -> dict[str, PublishedItem]:
    """Raises ValueError if the producer's output is not in this format."""
    items = {}
    for mm_hash, entry in (params or {}).items():
        ours = _ours(entry, mm_hash)
        location = ours["location"]
        items[mm_hash] = PublishedItem(
            modality=str(ours["modality"]),
            rows=int(ours["rows"]),
            width=int(ours["width"]),
            dtype=str(ours["dtype"]),
            placeholder_length=int(ours["placeholder_length"]),
            placeholder_token_id=int(ours["placeholder_token_id"]),
            fields={str(name): _field_from_params(value) for name, value in ours["fields"].items()},
            layout_needs_media=bool(ours["layout_needs_media"]),
            location=None if location is None else _location_from_params(location),
            error=str(ours.get("error", "")),
        )
    return items


def expected_to_params(items: Mapping[str, ExpectedItem]) -> dict[str, Any]:
    return {
        mm_hash: {KEY: {"version": VERSION, "rows": item.rows, "width": item.width, "dtype": item.dtype, "location": _location_to_params(item.location)}}
        for mm_hash, item in items.items()
    }


def expected_from_params(params: Any) -> dict[str, ExpectedItem]:
    """Raises ValueError (with the reason) for anything but this format."""
    if not isinstance(params, Mapping):
        raise ValueError("ec_transfer_params must be a mapping of item hash to handle")
    items = {}
    for mm_hash, entry in params.items():
        ours = _ours(entry, mm_hash)
        try:
            items[str(mm_hash)] = ExpectedItem(int(ours["rows"]), int(ours["width"]), str(ours["dtype"]), _location_from_params(ours["location"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"handle of item {mm_hash} is malformed: {exc!r}") from exc
    return items


def _ours(entry: Any, mm_hash: Any) -> Mapping[str, Any]:
    ours = entry.get(KEY) if isinstance(entry, Mapping) else None
    if not isinstance(ours, Mapping) or ours.get("version") != VERSION:
        raise ValueError(f"item {mm_hash} carries no EPD v{VERSION} entry")
    return ours


def _location_to_params(location: EmbeddingLocation) -> dict[str, Any]:
    if isinstance(location, InlineEmbedding):
        return {"kind": "inline", "data": location.data}
    # Not dataclasses.asdict: it deep-copies every field, about 40 us a location here, paid by
    # the producer for every published item and by prefill and decode for every request's.
    return {
        "kind": "nixl",
        "agent_name": location.agent_name,
        "encoder_address": location.encoder_address,
        "descriptors": location.descriptors,
        "nbytes": location.nbytes,
        "lease_id": location.lease_id,
        "slot_generation": location.slot_generation,
        "expires_at_unix_ms": location.expires_at_unix_ms,
        "tag": location.tag,
    }


def _location_from_params(params: Mapping[str, Any]) -> EmbeddingLocation:
    kind = params.get("kind")
    if kind == "inline":
        return InlineEmbedding(bytes(params["data"]))
    if kind == "nixl":
        return NixlLocation(
            agent_name=str(params["agent_name"]),
            encoder_address=str(params["encoder_address"]),
            descriptors=bytes(params["descriptors"]),
            nbytes=int(params["nbytes"]),
            lease_id=str(params["lease_id"]),
            slot_generation=int(params["slot_generation"]),
            expires_at_unix_ms=int(params["expires_at_unix_ms"]),
            tag=bytes(params["tag"]),
        )
    raise ValueError(f"unknown location kind {kind!r}")


def _field_to_params(value: EngineField) -> dict[str, Any]:
    return {"dtype": value.dtype, "shape": list(value.shape), "values": list(value.values), "is_list": value.is_list}


def _field_from_params(params: Mapping[str, Any]) -> EngineField:
    return EngineField(str(params["dtype"]), tuple(int(d) for d in params["shape"]), tuple(params["values"]), bool(params["is_list"]))

"""The media-forwarding baseline, for the benchmarks' A/B (gateway ``--forward-media``).

In the seed system's baseline, prefill and decode also receive the original media and re-run
the multimodal processor to rebuild the prompt layout; the embeddings still come from the
encoder. This module is that re-run: decode each forwarded item and take its layout from the
processor instead of from the metadata. Metadata-only serving never calls into it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

from epd.domain import EngineRequest
from epd.errors import FieldViolation, InvalidArgument
from epd.media import MediaLimits
from epd.media.decode import MediaDecoder
from epd.models import ModelFamily, load_processors


class ForwardedMediaLayout:
    def __init__(self, model_dir: str | pathlib.Path, family: ModelFamily):
        self.family = family
        self.decoder = MediaDecoder.for_model(model_dir, MediaLimits())
        self.processors = load_processors(model_dir)

    async def rederive(self, request: EngineRequest) -> EngineRequest:
        """The request with each item's layout re-derived from its forwarded media; requests
        without forwarded media pass through untouched."""
        if all(item.forwarded_media is None for item in request.items):
            return request
        return await asyncio.to_thread(self._rederive, request)

    def _rederive(self, request: EngineRequest) -> EngineRequest:
        import torch

        missing = [FieldViolation(f"items[{i}].forwarded_media", "is required once any item forwards its media") for i, item in enumerate(request.items) if item.forwarded_media is None]
        if missing:
            raise InvalidArgument("forwarded media must cover every item", missing)
        media = [item.forwarded_media for item in request.items]
        decoded = self.decoder.decode_all(media, [f"items[{i}].forwarded_media" for i in range(len(media))])
        items = []
        for item, source, value in zip(request.items, media, decoded, strict=True):
            (layout,) = self.processors.layout(source.modality, [value])
            announced = item.metadata
            # The embedding is still the encoder's: keep its announced shape, without data.
            shape_only = torch.empty(announced.embedding_shape, dtype=getattr(torch, announced.embedding_dtype), device="meta")
            derived = self.family.item_metadata(source.modality, announced.content_hash, dataclasses.replace(layout, embedding=shape_only))
            items.append(dataclasses.replace(item, metadata=dataclasses.replace(derived, placeholder_range=announced.placeholder_range)))
        return dataclasses.replace(request, items=tuple(items))

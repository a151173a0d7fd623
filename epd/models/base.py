"""What every model family provides, so that stages stay family-agnostic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from epd.domain import EngineRequest, ItemMetadata, Modality, TokenRange

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class ExpandedPrompt:
    """A prompt with every placeholder expanded, and where each item's run sits."""

    token_ids: list[int]
    ranges: list[TokenRange]


def expand_placeholders(
    token_ids: Sequence[int], items: Sequence[ItemMetadata], placeholder_ids: frozenset[int], run_of: Callable[[ItemMetadata], list[int]]
) -> ExpandedPrompt:
    """Replaces the k-th placeholder token with ``run_of(items[k])``, recording each run's
    place. The family has already checked that placeholders and items match one to one."""
    expanded: list[int] = []
    ranges: list[TokenRange] = []
    remaining = iter(items)
    for token in token_ids:
        if token in placeholder_ids:
            run = run_of(next(remaining))
            ranges.append(TokenRange(offset=len(expanded), length=len(run)))
            expanded.extend(run)
        else:
            expanded.append(token)
    return ExpandedPrompt(expanded, ranges)


@dataclasses.dataclass(frozen=True)
class Encoding:
    """One media item after its tower: the embedding, and the structure the tower saw."""

    embedding: torch.Tensor | None  # [rows, width]; None where only the layout was derived
    grid_thw: Any = None  # GridThw for images and videos
    video_timestamps_s: tuple[float, ...] = ()
    audio_feature_length: int = 0
    audio_token_count: int = 0


class ModelFamily(Protocol):
    """Layout rules of one checkpoint, read from its config.json (no weights, no tokenizer
    unless a layout needs text tokens)."""

    model_type: str
    supported_modalities: frozenset[Modality]

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        """Token ids that stand for one media item each in a rendered (unexpanded) prompt."""

    def item_metadata(self, modality: Modality, content_hash: str, encoding: Encoding) -> ItemMetadata:
        """The metadata stages after the encoder need, from one tower output."""

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> ExpandedPrompt:
        """Expands the k-th placeholder of the prompt into item k's run, exactly as the engine's
        processor would; raises InvalidArgument (with field violations) when they disagree."""

    def engine_prompt(self, request: EngineRequest, embeddings: Sequence[torch.Tensor] | None) -> dict[str, Any]:
        """vLLM's prompt dict from metadata, with embeddings (prefill, combined) or without
        (decode, which receives the KV and needs only the layout)."""

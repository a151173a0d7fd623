"""Moving embeddings from encoder to prefill: NIXL one-sided READs from a leased arena."""

from epd.transport.errors import ArenaFullError, TransferError
from epd.transport.nixl import EmbeddingArena, EmbeddingFetcher, NixlRegion

__all__ = [
    "ArenaFullError",
    "EmbeddingArena",
    "EmbeddingFetcher",
    "NixlRegion",
    "TransferError",
]

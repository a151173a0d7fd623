"""The two halves of an embedding transport, as the EC connector uses them.

A :class:`Publisher` tells consumers where a producer's published slot can be had; a
:class:`Reader` brings a published item into a consumer's receive buffer. Both are driven by
polling from vLLM's scheduler loop and never block it. Implementations: NIXL one-sided READs
(:mod:`epd.transport.wire.nixl`, the default) and bytes carried in the request itself
(:mod:`epd.transport.wire.inline`, for benchmarks and hosts without NIXL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from epd.domain import EmbeddingLocation
from epd.transport.memory.arena import Lease

if TYPE_CHECKING:
    from epd.transport.wire.credentials import TransferCredentials


@dataclasses.dataclass(frozen=True)
class Read:
    """One item to bring in: from ``location`` into the reader's buffer at ``offset`` (where its
    slot header goes; the rows follow it)."""

    key: Hashable
    location: EmbeddingLocation
    offset: int


class Publisher(Protocol):
    # What consumers need to READ the producer's memory, handed out only over gRPC (NIXL:
    # epd.transport.wire.credentials.TransferCredentials); None when locations carry the bytes themselves.
    credentials: TransferCredentials | None

    def location(self, lease: Lease, expires_at_unix_s: float) -> EmbeddingLocation:
        """How a consumer reaches the slot of a lease whose item is written."""

    def ended_leases(self) -> list[str]:
        """Lease ids whose consumers are done with them, since the last call."""

    def close(self) -> None: ...


class Reader(Protocol):
    busy: bool  # whether a read or a release is still in progress

    def submit(self, reads: Sequence[Read]) -> None:
        """Starts the reads; their outcomes come from :meth:`poll`."""

    def poll(self) -> list[tuple[Hashable, str | None]]:
        """(key, error or None) for each read that ended since the last call."""

    def release(self, location: EmbeddingLocation) -> None:
        """Ends a published item's lease without reading it (its rows are here already)."""

    def close(self) -> None: ...

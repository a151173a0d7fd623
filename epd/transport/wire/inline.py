"""The inline transport: the rows travel in the request, no NIXL anywhere.

Only when explicitly configured (``--embedding-transport inline``): benchmarks, and hosts
without NIXL. Every hop then carries a copy of the embedding. The slot header stays behind:
the consumer checks the size instead, and there is no lease that could be reused under it.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import torch

from epd.domain import EmbeddingLocation, InlineEmbedding
from epd.transport.memory.arena import Lease
from epd.transport.memory.slot_header import HEADER_BYTES
from epd.transport.wire.base import Read


class InlinePublisher:
    """Copies a published slot's rows into the location itself; the lease ends right away."""

    credentials = None  # the bytes travel in the location: nothing to authorize

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._ended: list[str] = []
        self._lock = threading.Lock()  # the cache desk's thread publishes too

    def location(self, lease: Lease, expires_at_unix_s: float) -> InlineEmbedding:
        with self._lock:
            self._ended.append(lease.lease_id)  # the bytes travel in the message: nothing to wait for
        return InlineEmbedding(self._buffer[lease.offset + HEADER_BYTES : lease.offset + lease.nbytes].numpy().tobytes())

    def ended_leases(self) -> list[str]:
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def close(self) -> None:
        pass


class InlineReader:
    """Copies inline rows into the receive buffer (after the slot header's place) on submit."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._finished: list[tuple[Hashable, str | None]] = []

    def submit(self, reads: Sequence[Read]) -> None:
        for read in reads:
            data = read.location.data
            start = read.offset + HEADER_BYTES
            self._buffer[start : start + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._finished.append((read.key, None))

    @property
    def busy(self) -> bool:
        return bool(self._finished)  # finished reads wait for the next poll

    def poll(self) -> list[tuple[Hashable, str | None]]:
        finished, self._finished = self._finished, []
        return finished

    def release(self, location: EmbeddingLocation) -> None:
        pass  # an inline item holds no lease on its producer

    def close(self) -> None:
        pass

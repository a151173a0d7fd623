"""Leased slots over one buffer: where a producer keeps published encoder outputs.

The buffer is cut into fixed-size slots; an item takes a contiguous run of them, so every
published item is one contiguous range (one NIXL descriptor). A lease ties the run to one
consumer: it is *pinned* while the producer is still writing it and starts its time-to-live once
published; it ends when the consumer's READ notification arrives, when the owner releases it,
or when the TTL passes. Lease ids are 128 random bits, so a peer cannot guess another request's
lease (ending a lease needs its id). The slot header's generation is a one-way digest of the id
(:func:`generation_of`), so reading a header never reveals a lease id.

Thread-safe: the engine's scheduler reserves and publishes while a reaper thread ends leases.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import secrets
import threading
import time

import numpy as np
import torch

from epd.transport._slots import SlotAllocator
from epd.transport.location import LEASE_ID_BYTES


def generation_of(lease_id: str) -> int:
    """The slot-header generation of a lease: 64 bits of a digest of its id."""
    return int.from_bytes(hashlib.blake2b(lease_id.encode(), digest_size=8, person=b"epd-slot-gen").digest(), "little")


@dataclasses.dataclass(frozen=True)
class Lease:
    lease_id: str  # 32 hex digits
    offset: int  # of the first byte, in the arena buffer
    nbytes: int  # reserved bytes (the item's header and rows)

    @property
    def generation(self) -> int:
        return generation_of(self.lease_id)


@dataclasses.dataclass(slots=True)
class _Held:
    first_slot: int
    num_slots: int


class SharedCounters:
    """A few u64 counters at the start of a shared buffer, so another process (the gRPC
    service next to the engine) can export them as metrics without asking the engine."""

    BYTES = 4096

    def __init__(self, buffer: torch.Tensor, names: tuple[str, ...]) -> None:
        self._index = {name: i for i, name in enumerate(names)}
        self._values = buffer[: self.BYTES].numpy().view(np.uint64)

    def set(self, name: str, value: int) -> None:
        self._values[self._index[name]] = value

    def get(self, name: str) -> int:
        return int(self._values[self._index[name]])


# shards_read / shards_total: the weight shards the encoder-only engine loaded, as vLLM reported
# them (0 / 0 when it could not be observed). <modality>_width: the encoder's output width per
# row, as vLLM measured it, and element_bytes: its dtype's size (together they size an item).
# <modality>_batches / _batch_items: engine steps that encoded items of the modality, and the
# items they encoded (cumulative).
MODALITIES = ("image", "video", "audio")
ARENA_COUNTERS = (
    "leases",
    "free_slots",
    "num_slots",
    "slot_bytes",
    "shards_read",
    "shards_total",
    "element_bytes",
    *(f"{m}_width" for m in MODALITIES),
    *(f"{m}_{kind}" for m in MODALITIES for kind in ("batches", "batch_items")),
)


class EmbeddingArena:
    def __init__(self, buffer: torch.Tensor, *, slot_bytes: int, lease_ttl_s: float) -> None:
        """Args:
        buffer: the whole shared buffer; its first :attr:`SharedCounters.BYTES` hold the
            counters, the rest is cut into slots.
        slot_bytes: slot size.
        lease_ttl_s: how long a published item stays readable if nobody reads it.
        """
        data_bytes = buffer.numel() - SharedCounters.BYTES
        if slot_bytes <= 0 or data_bytes < slot_bytes or lease_ttl_s <= 0:
            raise ValueError(f"an arena of {data_bytes} bytes cannot hold {slot_bytes}-byte slots with a TTL of {lease_ttl_s} s")
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        self._ttl_s = lease_ttl_s
        self._slots = SlotAllocator(data_bytes // slot_bytes)
        self._held: dict[str, _Held] = {}
        self._deadlines: collections.OrderedDict[str, float] = collections.OrderedDict()  # one TTL: FIFO is expiry order
        self._lock = threading.Lock()
        self.counters = SharedCounters(buffer, ARENA_COUNTERS)
        self.counters.set("num_slots", self._slots.num_slots)
        self.counters.set("slot_bytes", slot_bytes)
        self._publish_counts()

    @property
    def capacity_bytes(self) -> int:
        return self._slots.num_slots * self.slot_bytes

    @property
    def leased_count(self) -> int:
        with self._lock:
            return len(self._held)

    def reserve(self, nbytes: int) -> Lease | None:
        """A pinned lease on a run of slots holding ``nbytes``, or None while none is free.

        Raises:
            ValueError: ``nbytes`` can never fit.
        """
        num_slots = -(-nbytes // self.slot_bytes)
        if not 0 < nbytes <= self.capacity_bytes:
            raise ValueError(f"{nbytes} bytes can never fit an arena of {self._slots.num_slots} x {self.slot_bytes}-byte slots")
        with self._lock:
            first = self._slots.alloc(num_slots)
            if first is None:
                return None
            lease_id = secrets.token_hex(LEASE_ID_BYTES)
            self._held[lease_id] = _Held(first, num_slots)
            self._publish_counts()
        return Lease(lease_id, SharedCounters.BYTES + first * self.slot_bytes, nbytes)

    def start_expiry(self, lease_id: str) -> float:
        """Starts a pinned lease's TTL; returns its wall-clock expiry (Unix seconds).

        The wall clock is read first, so the advertised expiry never falls after the moment
        the arena may reuse the slots.
        """
        expires_at = time.time() + self._ttl_s
        with self._lock:
            if lease_id in self._held:
                self._deadlines[lease_id] = time.monotonic() + self._ttl_s
        return expires_at

    def release(self, lease_id: str) -> bool:
        """Ends a lease now; False if it had already ended (or never existed)."""
        with self._lock:
            return self._end(lease_id)

    def expire(self) -> int:
        """Ends leases whose TTL has passed; returns how many."""
        now = time.monotonic()
        ended = 0
        with self._lock:
            while self._deadlines:
                lease_id, deadline = next(iter(self._deadlines.items()))
                if deadline > now:
                    break
                ended += self._end(lease_id)
        return ended

    def _end(self, lease_id: str) -> bool:
        held = self._held.pop(lease_id, None)
        self._deadlines.pop(lease_id, None)
        if held is None:
            return False
        self._slots.free(held.first_slot, held.num_slots)
        self._publish_counts()
        return True

    def _publish_counts(self) -> None:
        self.counters.set("leases", len(self._held))
        self.counters.set("free_slots", self._slots.free_slots)

"""Leased slots over one buffer: where a producer keeps published encoder outputs, and its
encoder-output cache.

The buffer is cut into fixed-size slots; an item takes a contiguous run of them (a *fill*), so
every published item is one contiguous range (one NIXL descriptor). A lease ties a fill to one
consumer: it is *pinned* while the producer is still writing it and starts its time-to-live once
published; it ends when the consumer's READ notification arrives, when the owner releases it,
or when the TTL passes. Lease ids are 128 random bits, so a peer cannot guess another request's
lease (ending a lease needs its id).

A published fill whose leases have all ended stays in the arena as a cache entry under its key
(the item's content hash), least recently used first out: a later request for the same item
gets a new lease on the same fill (:meth:`EmbeddingArena.share`) and the tower does not run
again. Entries are evicted when a reservation needs their room or when the idle entries hold
more than ``cache_bytes``; a fill any lease holds is never evicted, and does not count against
``cache_bytes``: it would be in the arena with the cache off too, so it must not squeeze the
cache out under load. A request that arrives while the item is still being written shares that
fill too, so concurrent misses wait for one result.

Each fill gets a random 64-bit generation, written into its slot header and carried (under the
location's tag) in every location of the fill: a reader that finds another generation after its
READ knows the slots were refilled. It reveals no lease id.

Thread-safe: the engine's scheduler reserves and publishes while a reaper thread ends leases.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
import time

import numpy as np
import torch

from epd.transport.memory.slots import SlotAllocator
from epd.transport.wire.location import LEASE_ID_BYTES


@dataclasses.dataclass(frozen=True)
class Lease:
    lease_id: str  # 32 hex digits
    offset: int  # of the first byte, in the arena buffer
    nbytes: int  # the item's header and rows
    generation: int  # the fill's stamp, in its slot header while the slots hold it


@dataclasses.dataclass(slots=True, eq=False)
class _Fill:
    key: str | None  # the cache key; None: not kept once its leases end
    first_slot: int
    num_slots: int
    nbytes: int
    generation: int
    leases: set[str]
    published: bool = False

    @property
    def kept(self) -> bool:
        """Whether it stays as a cache entry once its leases end."""
        return self.published and self.key is not None


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
# items they encoded (cumulative). cache_hits / cache_misses: items served from a fill already
# there (or being written) / that needed a new one; cache_evictions: cached fills dropped;
# cache_bytes: the arena bytes that cache entries no lease holds take;
# cache_shared_hits / cache_shared_puts: misses served from the shared tier / outputs it took.
MODALITIES = ("image", "video", "audio")
ARENA_COUNTERS = (
    "leases",
    "free_slots",
    "num_slots",
    "slot_bytes",
    "shards_read",
    "shards_total",
    "element_bytes",
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "cache_bytes",
    "cache_shared_hits",
    "cache_shared_puts",
    *(f"{m}_width" for m in MODALITIES),
    *(f"{m}_{kind}" for m in MODALITIES for kind in ("batches", "batch_items")),
)


class EmbeddingArena:
    def __init__(self, buffer: torch.Tensor, *, slot_bytes: int, lease_ttl_s: float, cache_bytes: int = 0) -> None:
        """Args:
        buffer: the whole shared buffer; its first :attr:`SharedCounters.BYTES` hold the
            counters, the rest is cut into slots.
        slot_bytes: slot size.
        lease_ttl_s: how long a published item stays leased if nobody reads it.
        cache_bytes: the most arena bytes that published fills no lease holds may keep for reuse
            (0: no cache; each fill's slots are freed as its last lease ends).
        """
        data_bytes = buffer.numel() - SharedCounters.BYTES
        if slot_bytes <= 0 or data_bytes < slot_bytes or lease_ttl_s <= 0 or cache_bytes < 0:
            raise ValueError(
                f"an arena of {data_bytes} bytes cannot hold {slot_bytes}-byte slots with a TTL of {lease_ttl_s} s and a {cache_bytes}-byte cache"
            )
        self.buffer = buffer
        self.slot_bytes = slot_bytes
        self._ttl_s = lease_ttl_s
        self._cache_bytes = cache_bytes
        self._slots = SlotAllocator(data_bytes // slot_bytes)
        self._leases: dict[str, _Fill] = {}
        self._deadlines: collections.OrderedDict[str, float] = collections.OrderedDict()  # one TTL: FIFO is expiry order
        self._by_key: dict[str, _Fill] = {}  # fills a new request may share: being written, or published
        self._idle: collections.OrderedDict[str, _Fill] = collections.OrderedDict()  # published, unleased: LRU first
        self._idle_bytes = 0
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
            return len(self._leases)

    def reserve(self, nbytes: int, key: str | None = None) -> Lease | None:
        """A pinned lease on a new fill of ``nbytes``, or None while no room can be made (cache
        entries are evicted for it, least recently used first). With ``key``, later requests
        for it share this fill (:meth:`share`) until it fails or is evicted.

        Raises:
            ValueError: ``nbytes`` can never fit.
        """
        num_slots = -(-nbytes // self.slot_bytes)
        if not 0 < nbytes <= self.capacity_bytes:
            raise ValueError(f"{nbytes} bytes can never fit an arena of {self._slots.num_slots} x {self.slot_bytes}-byte slots")
        with self._lock:
            first = self._slots.alloc(num_slots)
            # Evict only when that could make room: a fill that cannot fit even in every idle
            # slot (the rest are leased) must not empty the cache for nothing.
            if first is None and self._slots.free_slots + sum(f.num_slots for f in self._idle.values()) >= num_slots:
                while first is None and self._idle:
                    self._evict_oldest()
                    first = self._slots.alloc(num_slots)
            if first is None:
                return None
            # A key already held keeps its fill (the caller chose not to share it).
            cacheable = self._cache_bytes > 0 and key is not None and key not in self._by_key
            fill = _Fill(key if cacheable else None, first, num_slots, nbytes, secrets.randbits(64) or 1, set())
            if fill.key is not None:
                self._by_key[fill.key] = fill
            return self._lease(fill)

    def share(self, key: str) -> Lease | None:
        """A pinned lease on the fill held under ``key`` (published, or still being written),
        or None when there is none."""
        with self._lock:
            fill = self._by_key.get(key)
            if fill is None:
                return None
            if self._idle.pop(key, None) is not None:
                self._idle_bytes -= self._bytes(fill)
            return self._lease(fill)

    def is_published(self, key: str) -> bool:
        """Whether a published fill is held under ``key`` (its rows are there to copy)."""
        with self._lock:
            fill = self._by_key.get(key)
            return fill is not None and fill.published

    def is_written(self, lease_id: str) -> bool:
        """Whether the lease's own fill is published (its rows are there to copy)."""
        with self._lock:
            fill = self._leases.get(lease_id)
            return fill is not None and fill.published

    def publish(self, lease_id: str) -> float:
        """Marks a lease's fill written and starts the lease's TTL; returns its wall-clock expiry
        (Unix seconds).

        The wall clock is read first, so the advertised expiry never falls after the moment
        the arena may end the lease.
        """
        expires_at = time.time() + self._ttl_s
        with self._lock:
            fill = self._leases.get(lease_id)
            if fill is not None:
                self._deadlines[lease_id] = time.monotonic() + self._ttl_s
                fill.published = True
        return expires_at

    def mark_written(self, lease_id: str) -> None:
        """Marks a lease's fill written without starting the lease's TTL: its rows came from
        elsewhere (the shared tier) before the request holding it ran."""
        with self._lock:
            fill = self._leases.get(lease_id)
            if fill is not None:
                fill.published = True

    def discard(self, lease_id: str) -> None:
        """Ends a lease whose fill was not written: nobody shares or keeps that fill."""
        with self._lock:
            fill = self._leases.get(lease_id)
            if fill is not None and fill.key is not None and self._by_key.get(fill.key) is fill:
                del self._by_key[fill.key]
                fill.key = None
            self._end(lease_id)

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

    def _lease(self, fill: _Fill) -> Lease:
        lease_id = secrets.token_hex(LEASE_ID_BYTES)
        fill.leases.add(lease_id)
        self._leases[lease_id] = fill
        self._publish_counts()
        return Lease(lease_id, SharedCounters.BYTES + fill.first_slot * self.slot_bytes, fill.nbytes, fill.generation)

    def _end(self, lease_id: str) -> bool:
        fill = self._leases.pop(lease_id, None)
        self._deadlines.pop(lease_id, None)
        if fill is None:
            return False
        fill.leases.discard(lease_id)
        if not fill.leases:
            if fill.kept:
                self._idle[fill.key] = fill
                self._idle_bytes += self._bytes(fill)
                self._trim()
            else:
                self._free(fill)
        self._publish_counts()
        return True

    def _trim(self) -> None:
        while self._idle_bytes > self._cache_bytes and self._idle:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, fill = self._idle.popitem(last=False)
        self._idle_bytes -= self._bytes(fill)
        self._free(fill)
        self.counters.set("cache_evictions", self.counters.get("cache_evictions") + 1)

    def _free(self, fill: _Fill) -> None:
        if fill.key is not None and self._by_key.get(fill.key) is fill:
            del self._by_key[fill.key]
        self._slots.free(fill.first_slot, fill.num_slots)

    def _bytes(self, fill: _Fill) -> int:
        return fill.num_slots * self.slot_bytes

    def _publish_counts(self) -> None:
        self.counters.set("leases", len(self._leases))
        self.counters.set("free_slots", self._slots.free_slots)
        self.counters.set("cache_bytes", self._idle_bytes)

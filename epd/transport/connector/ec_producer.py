"""The producer half of the EPD EC connector, beside vLLM's scheduler (an encoder-only engine).

For every request it sees, it leases one arena fill per distinct item before the request runs:
the fill already held under the item's content hash when there is one (the encoder-output
cache, :mod:`epd.transport.memory.arena`), else new slots sized from what vLLM already knows: the
item's embedding rows (its placeholder positions), the encoder's output width (measured by vLLM
at startup) and the model's dtype. Each step's connector metadata tells the worker which slots
to fill, and which cached outputs to copy into vLLM's encoder cache instead of running the
tower; when the request finishes, the slots' headers tell whether the worker filled them, and
the request's ``ec_transfer_params`` carry each item's location plus what vLLM's processor made
of it (the per-item fields the model declares as placeholder metadata, and the run the item
expanded into).

A cached item reaches vLLM's scheduler as an external cache hit (``has_cache_item``), so its
tower does not run. Its rows are then copied from the arena into the worker's encoder cache: vLLM
records the item as cached from then on, and a later request whose fill was evicted in between
finds its output there, as it would after a tower run.

With a shared tier (:mod:`epd.transport.shared_tier`), an item the arena does not hold is looked
up there before its fill is reserved for the tower, and every output the tower writes is put
there once published: an encoder serves items that another encoder encoded.

A request waits in vLLM's queue while the arena has no room for it (backpressure, like a full
KV cache); a background thread ends leases as consumers' READ notifications arrive and as
TTLs pass. A request the encoder service gave up on (cancelled, or past its queue timeout) has
its leases ended as soon as the service says so over the engine core's desk, even when the
request finished first and its output was on the way to a caller that is gone.

With the cache on, a request whose every item is held published is served without the engine:
the encoder service asks the cache desk (:mod:`epd.transport.desk`), which leases the fills
from its own thread and answers with what vLLM published of each item when its tower ran.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from epd.mm_items import engine_field_from_vllm
from epd.transport.connector.ec_config import ConnectorConfig
from epd.transport.connector.ec_params import PublishedItem, published_to_params
from epd.transport.desk import GaveUp, LeaseHeld, is_engine_id_of, open_desk
from epd.transport.memory.arena import MODALITIES, EmbeddingArena, Lease
from epd.transport.memory.claims import ClaimLedger
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import DTYPES, SlotHeader, SlotStatus, dtype_name, item_digest, slot_bytes
from epd.transport.wire.base import Publisher

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from epd.transport.shared_tier import SharedTier


logger = logging.getLogger(__name__)

_REAP_INTERVAL_S = 0.02
# What vLLM published of this many items is kept for the cache desk. It is a function of the
# item's content and the model alone, so it may outlive the fill, and a fill encoded again
# needs no new entry; the bound only caps memory (an entry is a few hundred bytes).
_PUBLISHED_ITEMS_KEPT = 8192


@dataclasses.dataclass(frozen=True)
class Save:
    """Fill slot ``offset`` with the encoder output of ``mm_hash``."""

    request_id: str
    mm_hash: str
    offset: int
    generation: int
    rows: int
    width: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class Restore:
    """Copy a cached item's rows from slot ``offset`` into the worker's encoder cache."""

    mm_hash: str
    offset: int
    rows: int
    width: int
    dtype: str


@dataclasses.dataclass
class _Reservation:
    modality: str
    lease: Lease
    rows: int
    width: int
    cached: bool  # leased on a fill the arena already held (published, or being written), or filled from the shared tier


class ProducerScheduler:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

        self._vllm_config = vllm_config
        self._config = config
        self._dtype = dtype_name(vllm_config.model_config.dtype)
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        self._buffer = SharedBuffer.create(config.buffer_name("arena"), config.buffer_bytes)
        self._arena = EmbeddingArena(
            self._buffer.tensor, slot_bytes=config.slot_bytes, lease_ttl_s=config.lease_ttl_s, cache_bytes=config.cache_bytes
        )
        self._publisher = _publisher(config, self._buffer.tensor)
        self._shared = _shared_tier(vllm_config, config, self._buffer.tensor, self._dtype, self._arena.counters)
        # The encoder service beside this engine hands these out over gRPC (GetTransferMetadata).
        credentials = self._publisher.credentials
        self._credentials = credentials.save(config.buffer_name("transfer")) if credentials is not None else None
        self._requests: dict[str, dict[str, _Reservation]] = {}
        self._modalities: dict[str, list[str]] = {}  # request id -> modality of each item
        self._unavailable: set[str] = set()
        self._restores: list[Restore] = []  # for the worker, with the next step's metadata
        self._publish_item_sizes()
        self._counting = threading.Lock()  # the cache desk's thread counts hits too
        self._published_items: dict[str, PublishedItem] = {}  # key -> what vLLM published of it, without a location
        self._claims = ClaimLedger(matches=is_engine_id_of)  # vLLM's request ids, given up on by the service's
        self._desk = open_desk(config.buffer_name("desk"))
        self._desk.answer(GaveUp, lambda question: self._release(self._claims.give_up(question.request_id)))
        if config.cache_bytes > 0:
            self._desk.answer(LeaseHeld, lambda question: self._grant_held(question.keys))
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="epd-ec-reaper", daemon=True)
        self._reaper.start()
        logger.info(
            "EPD EC producer: %s arena of %d MiB (%d-byte slots, up to %d MiB kept as an encoder-output cache), shared buffer %s",
            config.transport,
            config.buffer_bytes >> 20,
            config.slot_bytes,
            config.cache_bytes >> 20,
            self._buffer.path,
        )

    def record_shards(self, read_of: tuple[int, int] | None) -> None:
        """Publishes how many weight shards the engine read, for the encoder service."""
        if read_of is not None:
            self._arena.counters.set("shards_read", read_of[0])
            self._arena.counters.set("shards_total", read_of[1])

    def ensure_cache_available(self, request: Request) -> bool:
        """Leases the request's fills the first time it is seen; False (wait) while full."""
        if request.request_id in self._requests:
            return True
        from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import get_encoder_output_width

        reservations: dict[str, _Reservation] = {}
        for feature in request.mm_features:
            key = feature.identifier
            if key in reservations:
                continue  # the same content twice in one prompt: one fill serves both
            rows = feature.mm_position.get_num_embeds()
            width = get_encoder_output_width(self._vllm_config, feature.modality)
            lease = self._arena.share(key)
            cached = lease is not None
            if lease is None:
                try:
                    lease = self._arena.reserve(slot_bytes(rows, width, self._dtype), key)
                except ValueError:
                    # The encoder service refuses such items before they get here; this is a guard.
                    logger.error("an item of request %s can never fit the arena (--embedding-buffer-bytes)", request.request_id)
                    self._unavailable.add(request.request_id)
                if lease is None:
                    for reservation in reservations.values():
                        self._arena.release(reservation.lease.lease_id)
                    return False
                cached = self._fill_from_shared_tier(key, lease, rows, width)
                if not cached:
                    SlotHeader(SlotStatus.PENDING, self._dtype, lease.generation, rows, width, item_digest(key)).pack_into(self._buffer.tensor, lease.offset)
            reservations[key] = _Reservation(feature.modality, lease, rows, width, cached)
        hits = sum(r.cached for r in reservations.values())
        self._count(cache_hits=hits, cache_misses=len(reservations) - hits)
        self._requests[request.request_id] = reservations
        self._modalities[request.request_id] = [f.modality for f in request.mm_features]
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the item's output is published in the arena: vLLM then skips its tower."""
        return self._arena.is_published(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """vLLM took the item as cached (:meth:`has_cache_item`): its rows go into the worker's
        encoder cache, from the request's own fill.

        That fill is the published one under the item's key, unless it was dropped unwritten
        after the request leased it and another fill of the item was published since: the
        request then moves its lease to that one, never restoring rows nobody wrote.
        """
        feature = request.mm_features[index]
        reservation = self._requests.get(request.request_id, {}).get(feature.identifier)
        if reservation is None:
            return
        if not self._arena.is_written(reservation.lease.lease_id):
            published = self._arena.share(feature.identifier)
            if published is None or not self._arena.is_written(published.lease_id):
                if published is not None:
                    self._arena.release(published.lease_id)
                return  # evicted in between: the slot stays unwritten and the item fails at publish
            self._arena.release(reservation.lease.lease_id)
            reservation.lease, reservation.cached = published, True
        self._restores.append(Restore(feature.identifier, reservation.lease.offset, reservation.rows, reservation.width, self._dtype))

    def take_unavailable_requests(self) -> set[str]:
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def saves_for(self, scheduler_output: SchedulerOutput) -> list[Save]:
        """The unwritten slots of every request scheduled in this step (the worker skips those
        it filled already)."""
        self._count_batches(scheduler_output)
        return [
            Save(request_id, mm_hash, r.lease.offset, r.lease.generation, r.rows, r.width, self._dtype)
            for request_id in scheduler_output.num_scheduled_tokens
            for mm_hash, r in self._requests.get(request_id, {}).items()
            if not self._arena.is_written(r.lease.lease_id)
        ]

    def take_restores(self) -> list[Restore]:
        restores, self._restores = self._restores, []
        return restores

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Publishes the request's items; an aborted or failed request just frees its slots."""
        from vllm.v1.request import RequestStatus

        self._modalities.pop(request.request_id, None)
        reservations = self._requests.pop(request.request_id, {})
        leases = [reservation.lease.lease_id for reservation in reservations.values()]
        if request.status != RequestStatus.FINISHED_STOPPED:
            self._release(leases)
            return None
        published = {}
        for index, feature in enumerate(request.mm_features):
            reservation = reservations.get(feature.identifier)
            if reservation is None or feature.identifier in published:
                continue
            published[feature.identifier] = self._publish(request, index, reservation)
        if not self._claims.granted(request.request_id, leases):
            self._release(leases)  # the service gave up on it; the fills stay cached under their keys
            return None
        return published_to_params(published)

    def close(self) -> None:
        self._desk.release()
        self._stop.set()
        self._reaper.join(timeout=1)
        if self._shared is not None:
            self._shared.close()
        self._publisher.close()
        if self._credentials is not None:
            self._credentials.close()
        self._buffer.close()

    # ---- internals ----------------------------------------------------------------------

    def _grant_held(self, keys: list[str]) -> dict[str, Any] | None:
        """The cache desk's answer (on its thread): a lease on the published fill of every key,
        with what vLLM published of each, as ``ec_transfer_params``; or None, leasing nothing,
        unless every key is held."""
        granted: dict[str, PublishedItem] = {}
        leases: list[str] = []
        for key in dict.fromkeys(keys):
            item = self._published_items.get(key)
            lease = self._arena.share(key) if item is not None else None
            if lease is not None:
                leases.append(lease.lease_id)
            if lease is None or not self._arena.is_written(lease.lease_id):  # absent, or still being written
                for lease_id in leases:
                    self._arena.release(lease_id)
                return None
            granted[key] = dataclasses.replace(item, location=self._publisher.location(lease, self._arena.publish(lease.lease_id)))
        self._count(cache_hits=len(granted))
        return published_to_params(granted)

    def _release(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self._arena.release(lease_id)

    def _count(self, **amounts: int) -> None:
        counters = self._arena.counters
        with self._counting:
            for name, amount in amounts.items():
                counters.set(name, counters.get(name) + amount)

    def _remember(self, key: str, item: PublishedItem) -> None:
        """Keeps what vLLM published of an item for the cache desk (its oldest entries go first)."""
        if self._config.cache_bytes <= 0:
            return
        self._published_items.pop(key, None)
        self._published_items[key] = item
        while len(self._published_items) > _PUBLISHED_ITEMS_KEPT:
            del self._published_items[next(iter(self._published_items))]

    def _publish_item_sizes(self) -> None:
        """What an item of each modality costs per row, so that the encoder service can refuse
        an item the arena can never hold before the engine sees it."""
        counters = self._arena.counters
        counters.set("element_bytes", DTYPES[self._dtype].itemsize)
        for modality, width in self._vllm_config.ec_transfer_config.mm_encoder_output_widths.items():
            if modality in MODALITIES:
                counters.set(f"{modality}_width", width)

    def _count_batches(self, scheduler_output: SchedulerOutput) -> None:
        """Items the tower encodes in this step, per modality: vLLM's batch across requests."""
        items: dict[str, int] = {}
        for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            modalities = self._modalities.get(request_id, [])
            for index in indices:
                if index < len(modalities):
                    items[modalities[index]] = items.get(modalities[index], 0) + 1
        counters = self._arena.counters
        for modality, count in items.items():
            if modality in MODALITIES:
                counters.set(f"{modality}_batches", counters.get(f"{modality}_batches") + 1)
                counters.set(f"{modality}_batch_items", counters.get(f"{modality}_batch_items") + count)

    def _publish(self, request: Request, index: int, reservation: _Reservation) -> PublishedItem:
        feature = request.mm_features[index]
        position = feature.mm_position
        first_embed = 0 if position.is_embed is None else int(position.is_embed.int().argmax())
        item = PublishedItem(
            modality=feature.modality,
            rows=reservation.rows,
            width=reservation.width,
            dtype=self._dtype,
            placeholder_length=position.length,
            placeholder_token_id=int(request.prompt_token_ids[position.offset + first_embed]),
            fields=self._declared_fields(feature),
            layout_needs_media=not self._resolver.fields_for(feature.modality),
            location=None,
        )
        lease = reservation.lease
        header = SlotHeader.unpack_from(self._buffer.tensor, lease.offset)
        if header.status is not SlotStatus.READY or header.generation != lease.generation:
            self._arena.discard(lease.lease_id)
            return dataclasses.replace(item, error=f"the encoder output of item {index} was not written ({header.status.name})")
        location = self._publisher.location(lease, self._arena.publish(lease.lease_id))
        if self._shared is not None and not reservation.cached:
            self._share(feature.identifier)
        self._remember(feature.identifier, item)
        return dataclasses.replace(item, location=location)

    def _fill_from_shared_tier(self, key: str, lease: Lease, rows: int, width: int) -> bool:
        """Whether the shared tier had the item's output: then it is in the new fill, marked
        written (vLLM takes it as cached and skips the tower), under this fill's generation."""
        if self._shared is None or not self._shared.get_into(key, lease.offset, lease.nbytes):
            return False
        try:
            header = SlotHeader.unpack_from(self._buffer.tensor, lease.offset)
        except ValueError:
            header = None
        if header is None or (header.status, header.dtype, header.rows, header.width) != (SlotStatus.READY, self._dtype, rows, width) or not header.names(key):
            logger.warning("EPD EC producer: the shared encoder cache's output for %s is not that item, or not its shape (%s); encoding it", key, header)
            return False
        dataclasses.replace(header, generation=lease.generation).pack_into(self._buffer.tensor, lease.offset)
        self._arena.mark_written(lease.lease_id)
        self._count(cache_shared_hits=1)
        return True

    def _share(self, key: str) -> None:
        """Offers a fill the tower just wrote to the shared tier, pinned by a lease of its own
        until the bytes are out (the request's lease ends as soon as its consumer reads)."""
        pin = self._arena.share(key)
        if pin is None:
            return  # not kept under its key (the local cache is off): nothing to share from
        self._shared.offer(key, pin.offset, pin.nbytes, lambda: self._arena.release(pin.lease_id))

    def _declared_fields(self, feature) -> dict:
        """The per-item fields the model declares as placeholder metadata for the modality."""
        if feature.data is None:
            return {}  # only with vLLM's processor cache on, which producers run without
        fields = {}
        for name, value in feature.data.get_data().items():
            if name in self._resolver.fields_for(feature.modality):
                converted = engine_field_from_vllm(value)
                if converted is not None:
                    fields[name] = converted
        return fields

    def _reap_loop(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL_S):
            try:
                for lease_id in self._publisher.ended_leases():
                    self._arena.release(lease_id)
                self._arena.expire()
            except Exception:
                logger.exception("EPD EC producer: reaping leases failed")


def _shared_tier(vllm_config: VllmConfig, config: ConnectorConfig, buffer, dtype: str, counters) -> SharedTier | None:
    if not config.shared_cache_master:
        return None
    if config.cache_bytes <= 0:
        raise ValueError("the shared encoder cache needs the local one: --shared-cache-master with --encoder-cache-bytes 0")
    from epd.transport.shared_tier import SharedTier, SharedTierConfig, namespace_for

    model = vllm_config.model_config
    tier = SharedTierConfig(config.shared_cache_master, config.shared_cache_metadata, config.listen_host)
    return SharedTier(
        tier,
        buffer,
        namespace_for(model.model, model.revision, dtype),
        lambda: counters.set("cache_shared_puts", counters.get("cache_shared_puts") + 1),
        max_waiting_bytes=config.cache_bytes // 4,  # pins on a quarter of the cache at most
    )


def _publisher(config: ConnectorConfig, buffer) -> Publisher:
    if config.transport == "inline":
        from epd.transport.wire.inline import InlinePublisher

        return InlinePublisher(buffer)
    if config.transport != "nixl":
        raise ValueError(f"unknown embedding transport {config.transport!r}; expected nixl or inline")
    from epd.transport.wire.nixl import NixlPublisher

    return NixlPublisher(buffer, agent_name=config.agent_name, bind_host=config.listen_host)

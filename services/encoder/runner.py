"""The encoder's domain logic: decode media, batch items of one modality across requests
through the tower (vision or audio), and publish each embedding in the NIXL arena (or inline,
when configured)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
import uuid

from epd import telemetry
from epd.domain import EncodedItem, InlineEmbedding, MediaInput, Modality
from epd.errors import FieldViolation, InvalidArgument, ResourceExhausted
from epd.media import MediaLimits
from epd.media.decode import MediaDecoder
from epd.models import Encoding, load_tower

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    model: str
    dtype: str = "float32"
    transport: str = "nixl"  # "nixl" (default) or "inline" (benchmarks, hosts without NIXL)
    arena_slot_bytes: int = 256 * 1024
    arena_slots: int = 256
    lease_ttl_s: float = 60.0
    max_batch_items: int = 16
    batch_wait_s: float = 0.005  # how long the first item of a batch waits for company
    agent_name: str = ""  # default: a unique name per process
    nixl_listen_host: str = "127.0.0.1"
    limits: MediaLimits = MediaLimits()


@dataclasses.dataclass
class _Pending:
    decoded: object
    future: asyncio.Future
    queued_at: float = dataclasses.field(default_factory=time.monotonic)


class EncoderRunner:
    """Owns the tower, the batcher and the arena."""

    def __init__(self, config: EncoderConfig):
        self.config = config
        self.tower = load_tower(config.model, dtype=config.dtype)
        self.family = self.tower.family
        self.decoder = MediaDecoder.for_model(config.model, config.limits)
        self.arena = None
        if config.transport == "nixl":
            from epd.transport.nixl import EmbeddingArena

            self.arena = EmbeddingArena(
                agent_name=config.agent_name or f"epd-encoder-{uuid.uuid4().hex[:8]}",
                slot_bytes=config.arena_slot_bytes,
                num_slots=config.arena_slots,
                lease_ttl_s=config.lease_ttl_s,
                listen_host=config.nixl_listen_host,
            )
        elif config.transport != "inline":
            raise ValueError(f"unknown embedding transport {config.transport!r}")
        # One FIFO per modality: a batch holds one modality, so one tower call serves it.
        self._queues: dict[Modality, collections.deque[_Pending]] = {m: collections.deque() for m in Modality}
        self._arrived = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def load_report(self):
        return self.tower.load_report

    def start(self) -> None:
        """Starts the batching loop and the lease reaper on the running event loop."""
        self._tasks = [asyncio.create_task(self._batch_loop(), name="encoder-batcher")]
        if self.arena is not None:
            self._tasks.append(asyncio.create_task(self._reap_loop(), name="arena-reaper"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.arena is not None:
            self.arena.close()

    async def encode(self, items: list[MediaInput]) -> list[EncodedItem]:
        """Encodes one request's items. All are validated and decoded before any reaches the
        tower, so a bad item fails only its own request, and nothing is leased for a failed
        request."""
        self._check_modalities(items)
        # Off the event loop: a video decode takes long enough to stall other calls.
        decoded = await asyncio.to_thread(self.decoder.decode_all, items, [f"items[{i}]" for i in range(len(items))])
        loop = asyncio.get_running_loop()
        pending = [_Pending(d, loop.create_future()) for d in decoded]
        for item, p in zip(items, pending, strict=True):
            self._queues[item.modality].append(p)
        self._arrived.set()
        encodings = await asyncio.gather(*(p.future for p in pending))
        return self._publish_all(items, encodings)

    def release(self, lease_ids: list[str]) -> int:
        if self.arena is None:
            return 0
        before = self.arena.leased_count
        for lease_id in lease_ids:
            self.arena.release(lease_id)
        telemetry.ARENA_LEASES.set(self.arena.leased_count)
        return before - self.arena.leased_count

    # ---- internals ----------------------------------------------------------------------

    def _check_modalities(self, items: list[MediaInput]) -> None:
        violations = [
            FieldViolation(f"items[{i}].{item.modality.value}", f"{item.modality.value} input is not supported by {self.family.model_type}")
            for i, item in enumerate(items)
            if item.modality not in self.family.supported_modalities
        ]
        if violations:
            raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in violations), violations)

    def _publish_all(self, items: list[MediaInput], encodings: list[Encoding]) -> list[EncodedItem]:
        encoded: list[EncodedItem] = []
        try:
            for item, encoding in zip(items, encodings, strict=True):
                metadata = self.family.item_metadata(item.modality, item.content_hash, encoding)
                encoded.append(EncodedItem(metadata, self._publish(encoding.embedding)))
        except BaseException:
            self.release([e.embedding.lease_id for e in encoded if not isinstance(e.embedding, InlineEmbedding)])
            raise
        telemetry.ARENA_LEASES.set(self.arena.leased_count if self.arena else 0)
        return encoded

    def _publish(self, embedding):
        if self.arena is None:
            return InlineEmbedding(embedding.numpy().tobytes())
        from epd.transport.nixl import ArenaFullError

        try:
            return self.arena.publish(embedding)
        except ArenaFullError as exc:
            raise ResourceExhausted(f"embedding arena is full: {exc}", retry_after_s=exc.retry_after_s) from exc
        except ValueError as exc:
            raise ResourceExhausted(f"embedding of {embedding.nbytes} bytes can never fit the arena: {exc}", retry_after_s=0) from exc

    def _next_batch(self) -> tuple[Modality, list[_Pending]] | None:
        """Up to ``max_batch_items`` of the modality whose oldest item has waited longest."""
        waiting = [m for m, queue in self._queues.items() if queue]
        if not waiting:
            return None
        modality = min(waiting, key=lambda m: self._queues[m][0].queued_at)
        queue = self._queues[modality]
        batch = [queue.popleft() for _ in range(min(len(queue), self.config.max_batch_items))]
        return modality, [p for p in batch if not p.future.done()]  # callers that gave up are dropped

    async def _batch_loop(self) -> None:
        while True:
            await self._arrived.wait()
            # The first item waits a moment for company from concurrent requests.
            await asyncio.sleep(self.config.batch_wait_s)
            while (next_batch := self._next_batch()) is not None:
                modality, batch = next_batch
                if batch:
                    await self._run_batch(modality, batch)
            self._arrived.clear()

    async def _run_batch(self, modality: Modality, batch: list[_Pending]) -> None:
        telemetry.ENCODER_BATCH_ITEMS.labels(modality=modality.value).observe(len(batch))
        started = time.perf_counter()
        try:
            outputs = await asyncio.to_thread(self.tower.encode, modality, [p.decoded for p in batch])
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its batch, not the loop
            logger.exception("%s tower failed on a batch of %d", modality.value, len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        telemetry.STAGE_SECONDS.labels(stage=f"encoder_forward_{modality.value}").observe(time.perf_counter() - started)
        for p, output in zip(batch, outputs, strict=True):
            if not p.future.done():
                p.future.set_result(output)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.arena.reap():
                telemetry.ARENA_LEASES.set(self.arena.leased_count)

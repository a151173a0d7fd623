"""The encoder's domain logic: decode media, batch items across requests through the vision
tower, and publish each embedding in the NIXL arena (or inline, when configured)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

from epd import telemetry
from epd.domain import EncodedItem, InlineEmbedding, ItemMetadata, MediaInput, Modality
from epd.errors import FieldViolation, InvalidArgument, ResourceExhausted, Unimplemented
from epd.media import decode_image, mime_problem
from epd.models.qwen_vl import VisionEncoder

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


@dataclasses.dataclass
class _Pending:
    image: object
    future: asyncio.Future


class EncoderRunner:
    """Owns the vision tower, the batcher and the arena."""

    def __init__(self, config: EncoderConfig):
        self.config = config
        self.vision = VisionEncoder(config.model, dtype=config.dtype)
        self.family = self.vision.family
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
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    @property
    def load_report(self):
        return self.vision.load_report

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
        """Encodes one request's items. All are validated before any reaches the tower, so a
        bad item fails only its own request, and nothing is leased for a failed request."""
        images = self._decode_all(items)
        loop = asyncio.get_running_loop()
        pending = [_Pending(image, loop.create_future()) for image in images]
        for p in pending:
            self._queue.put_nowait(p)
        results = await asyncio.gather(*(p.future for p in pending))
        return self._publish_all(items, results)

    def release(self, lease_ids: list[str]) -> int:
        if self.arena is None:
            return 0
        before = self.arena.leased_count
        for lease_id in lease_ids:
            self.arena.release(lease_id)
        telemetry.ARENA_LEASES.set(self.arena.leased_count)
        return before - self.arena.leased_count

    # ---- internals ----------------------------------------------------------------------

    def _decode_all(self, items: list[MediaInput]) -> list:
        violations = []
        images = []
        for index, item in enumerate(items):
            if item.modality is not Modality.IMAGE:
                raise Unimplemented(f"items[{index}]: {item.modality.value} encoding is not implemented yet")
            problem = mime_problem(item.modality, item.mime_type)
            if problem:
                violations.append(FieldViolation(f"items[{index}].mime_type", problem))
                continue
            try:
                images.append(decode_image(item.data))
            except ValueError as exc:
                violations.append(FieldViolation(f"items[{index}].data", str(exc)))
        if violations:
            raise InvalidArgument("undecodable media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
        return images

    def _publish_all(self, items: list[MediaInput], results) -> list[EncodedItem]:
        encoded: list[EncodedItem] = []
        try:
            for item, (grid, embedding) in zip(items, results, strict=True):
                metadata = ItemMetadata(
                    modality=item.modality,
                    content_hash=item.content_hash,
                    placeholder_token_id=self.family.placeholder_token_id(item.modality),
                    placeholder_count=self.family.placeholder_count(grid),
                    embedding_shape=tuple(embedding.shape),
                    embedding_dtype=str(embedding.dtype).removeprefix("torch."),
                    grid_thw=grid,
                )
                encoded.append(EncodedItem(metadata, self._publish(embedding)))
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

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.config.batch_wait_s
            while len(batch) < self.config.max_batch_items:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            batch = [p for p in batch if not p.future.done()]  # caller gave up meanwhile
            if not batch:
                continue
            telemetry.ENCODER_BATCH_ITEMS.observe(len(batch))
            started = time.perf_counter()
            try:
                outputs = await asyncio.to_thread(self.vision.encode_images, [p.image for p in batch])
            except Exception as exc:  # noqa: BLE001 - a failed forward fails its batch, not the loop
                logger.exception("vision tower failed on a batch of %d", len(batch))
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            telemetry.STAGE_SECONDS.labels(stage="encoder_forward").observe(time.perf_counter() - started)
            for p, output in zip(batch, outputs, strict=True):
                if not p.future.done():
                    p.future.set_result(output)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.arena.reap():
                telemetry.ARENA_LEASES.set(self.arena.leased_count)

"""The encoder's domain logic: decode a request's media within the limits, hand it to vLLM's
encoder-only engine under the items' content hashes, and turn what the engine published into
metadata and embedding locations.

vLLM owns everything model-specific here: its processor lays each item out and its tower encodes
it; its scheduler batches items across concurrent requests; the EC connector publishes each
output in the arena (``epd.transport.connector.ec_connector``). Calls that are ready while the
engine is busy share one engine request (``services.encoder.batching``). A request whose every item the arena holds
is served by the connector's cache desk instead (``epd.transport.desk``), with what vLLM
published of each item when its tower ran: no decode, no processor, no engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Sequence

from epd import telemetry
from epd.domain import EncodedItem, MediaInput, NixlLocation, PublishedItem, Sampling
from epd.engine import Engine
from epd.errors import FailedPrecondition, FieldViolation, Internal, InvalidArgument, ResourceExhausted
from epd.media import MediaLimits, check_items_per_prompt, check_modalities, source_field
from epd.media.decode import MediaDecoder, vllm_input
from epd.mm_items import metadata_from_published
from epd.prompt import PromptRenderer
from epd.transport import HEADER_BYTES, ClaimLedger, published_from_params
from services.encoder.batching import CallQueue, PendingCall

logger = logging.getLogger(__name__)

_ONE_STEP = Sampling(max_tokens=1)


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    limits: MediaLimits = MediaLimits()
    # How long one Encode may wait for the engine (a full arena or encoder queue) before it is
    # refused with RESOURCE_EXHAUSTED.
    queue_timeout_s: float = 30.0
    # The host consumers dial for this encoder's NIXL metadata (written into every location): a
    # name its TLS certificate covers, say a StatefulSet pod's DNS name. Empty: the bind host.
    advertise_host: str = ""
    # Engine requests in vLLM at once (services.encoder.batching): two keep the tower busy while
    # vLLM's single processing thread prepares the next; calls ready meanwhile join one request.
    batches_in_flight: int = 2


class EncoderRunner:
    def __init__(self, config: EncoderConfig, engine: Engine, *, address: str):
        """``address``: this service's advertised gRPC host:port, where consumers fetch the
        engine's transfer metadata (written into every NIXL location)."""
        self.config = config
        self.engine = engine
        self.address = address
        self.decoder = MediaDecoder.for_model(engine.config.model, config.limits)
        self.renderer = PromptRenderer(engine.config.model)
        self._releaser = None
        self._credentials = None  # the engine's NIXL transfer credentials, read on first use
        self._desk = engine.desk if engine.encoder_output_cache_bytes > 0 else None
        self._cleanups: set[asyncio.Task] = set()  # releases of leases whose caller is gone
        self._keys = ClaimLedger()  # callers' release keys -> the leases granted to their calls
        self._queue = CallQueue(engine.config.engine_mm_per_prompt, engine.config.max_model_len)
        self._batches: dict[asyncio.Task, list[PendingCall]] = {}  # engine requests running -> their calls

    async def encode(self, request_id: str, items: list[MediaInput], release_key: str = "") -> list[EncodedItem]:
        """Encodes one request's items, in order. All are decoded before any reaches the engine,
        so a bad item fails only its own request, and nothing is leased for a failed request.
        ``release_key``: the caller's secret that frees the leases granted here (:meth:`release`),
        even when this reply never reaches it."""
        paths = [f"items[{i}]" for i in range(len(items))]
        check_modalities(items, paths, self.engine.modalities)
        check_items_per_prompt(items, self.engine.config.mm_per_prompt)
        started = time.perf_counter()
        published = await self._held(items)
        if published is None:
            # Off the event loop: a video decode takes long enough to stall other calls.
            decode_started = time.perf_counter()
            decoded = await asyncio.to_thread(self.decoder.decode_all, items, paths)
            _observe_phase("decode", decode_started)
            published = await self._published(PendingCall(request_id, items, decoded, paths, asyncio.get_running_loop().create_future()))
        encoded = []
        for path, item in zip(paths, items, strict=True):
            entry = published.get(item.content_hash)
            if entry is None or entry.location is None:
                raise Internal(f"{path}: the encoder engine published no output for it: {entry.error if entry else 'missing'}")
            location = entry.location
            if isinstance(location, NixlLocation):
                location = dataclasses.replace(location, encoder_address=self.address)
            encoded.append(EncodedItem(metadata_from_published(item.content_hash, entry), location))
        leases = [item.embedding.lease_id for item in encoded if isinstance(item.embedding, NixlLocation)]
        if release_key and not self._keys.granted(release_key, leases):
            self._clean_up(self._end(leases))  # released by key already: the caller is gone
        elapsed = time.perf_counter() - started
        for item in items:
            telemetry.ENCODER_ITEMS.labels(modality=item.modality.value).inc()
            telemetry.ENCODER_SECONDS.labels(modality=item.modality.value).observe(elapsed)
        return encoded

    def transfer_credentials(self):
        """The engine's NIXL agent metadata and location key, for GetTransferMetadata.

        Raises:
            FailedPrecondition: this encoder publishes inline; there is nothing to READ.
        """
        if self.engine.config.embedding_transport != "nixl":
            raise FailedPrecondition("this encoder publishes embeddings inline; it has no NIXL transfer metadata")
        if self._credentials is None:
            from epd.transport import TransferCredentials

            self._credentials = TransferCredentials.load(f"{self.engine.engine_id}-transfer")
        return self._credentials

    async def release(self, lease_ids: list[str], release_keys: Sequence[str] = ()) -> int:
        """Ends leases no consumer will read, by the same NIXL notification a READ sends: by id,
        and those granted to the calls that carried ``release_keys`` (or that will be, to calls
        still running). An id or key of no lease frees nothing (ids are 128 random bits: none can
        be guessed). Returns how many lease ids it handed to the arena."""
        lease_ids = [*lease_ids, *(lease_id for key in release_keys for lease_id in self._keys.give_up(key))]
        await self._end(lease_ids)
        return len(lease_ids)

    async def _end(self, lease_ids: list[str]) -> None:
        if not lease_ids or self.engine.config.embedding_transport != "nixl":
            return  # inline leases end as soon as they are published
        if self._releaser is None:
            from epd.transport import LeaseReleaser

            self._releaser = LeaseReleaser(f"{self.engine.engine_id}-release", self.transfer_credentials(), bind_host=self.engine.config.nixl_listen_host)
        await asyncio.to_thread(self._releaser.release, lease_ids)

    def close(self) -> None:
        if self._releaser is not None:
            self._releaser.close()

    # ---- internals ----------------------------------------------------------------------

    async def _held(self, items: list[MediaInput]) -> dict[str, PublishedItem] | None:
        """The items' outputs as the cache desk leased them, when the arena holds every one;
        else None."""
        if self._desk is None:
            return None
        lookup = asyncio.ensure_future(asyncio.to_thread(self._desk.lease, [item.content_hash for item in items]))
        try:
            params = await asyncio.shield(lookup)
        except asyncio.CancelledError:
            lookup.add_done_callback(self._release_unclaimed)  # the caller is gone: nobody will read them
            raise
        return published_from_params(params) if params is not None else None

    def _release_unclaimed(self, lookup: asyncio.Future) -> None:
        if lookup.cancelled() or lookup.exception() is not None or lookup.result() is None:
            return
        leases = [item.location.lease_id for item in published_from_params(lookup.result()).values() if isinstance(item.location, NixlLocation)]
        self._clean_up(self._end(leases))

    def _clean_up(self, cleanup) -> None:
        """Runs ``cleanup`` to its end, whatever becomes of the request it cleans up after."""
        task = asyncio.get_running_loop().create_task(cleanup)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _published(self, call: PendingCall) -> dict[str, PublishedItem]:
        """What the engine published for the call's items, from the engine request it joined.

        A caller that gives up (cancelled, or the queue timeout passed) leaves its call: taken
        out if it is still waiting; else what is published for it is released when its request
        ends, and a request no waiting call is left in is aborted.
        """
        self._queue.put(call)
        self._start_batches()
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                return await asyncio.shield(call.published)
        except (asyncio.CancelledError, TimeoutError) as exc:
            self._leave(call)
            if isinstance(exc, TimeoutError):
                raise ResourceExhausted(
                    f"the encoder could not take the request within {self.config.queue_timeout_s:g} s (embedding arena or encoder queue full)",
                    retry_after_s=1.0,
                ) from exc
            raise

    def _start_batches(self) -> None:
        while self._queue and len(self._batches) < self.config.batches_in_flight:
            batch = self._queue.take_batch()
            for call in batch:
                _observe_phase("queue", call.ready_at)
            task = asyncio.get_running_loop().create_task(self._encode_batch(batch))
            self._batches[task] = batch
            task.add_done_callback(self._batch_ended)

    def _batch_ended(self, task: asyncio.Task) -> None:
        self._batches.pop(task)
        self._start_batches()

    def _leave(self, call: PendingCall) -> None:
        if self._queue.withdraw(call):
            return
        call.abandoned = True
        if call.published.done():
            self._release_abandoned(call)
            return
        for task, batch in self._batches.items():
            if call in batch and all(other.abandoned for other in batch):
                task.cancel()  # _run aborts the engine request

    def _release_abandoned(self, call: PendingCall) -> None:
        if call.published.cancelled() or call.published.exception() is not None:
            return
        locations = [entry.location for item in call.items if (entry := call.published.result().get(item.content_hash)) is not None]
        self._clean_up(self._end(sorted({location.lease_id for location in locations if isinstance(location, NixlLocation)})))

    async def _encode_batch(self, calls: list[PendingCall]) -> None:
        """One engine request for the calls; each call's future gets what was published, or the
        error that ended the request. Calls that cannot go together go alone, each with its own
        request and its own errors: their joint prompt failed in vLLM's processor, is longer than
        the engine's context, or needs more than the arena holds."""
        try:
            render_started = time.perf_counter()
            rendered = await self._render_together(calls) if len(calls) > 1 else await self._render_alone(calls[0])
            _observe_phase("render", render_started)
            if rendered is None:
                await asyncio.gather(*(self._encode_batch([call]) for call in calls))
                return
            telemetry.ENCODER_REQUEST_CALLS.observe(len(calls))
            suffix = f"+{len(calls) - 1}" if len(calls) > 1 else ""
            # Unique per request: the engine core's desk finds the request by it when its callers give up.
            engine_started = time.perf_counter()
            params = await self._run(f"{calls[0].request_id}{suffix}-encode-{secrets.token_hex(4)}", rendered)
            _observe_phase("engine", engine_started)
            published = published_from_params(params)
        except asyncio.CancelledError:  # every caller is gone
            for call in calls:
                call.published.cancel()
            raise
        except Exception as exc:
            for call in calls:
                if not call.published.done():
                    call.published.set_exception(exc)
                    call.published.exception()  # retrieved: a caller that left does not read it
            return
        for call in calls:
            call.published.set_result(published)
            if call.abandoned:
                self._release_abandoned(call)

    async def _render_together(self, calls: list[PendingCall]):
        """The calls' items as one prompt after vLLM's processor, or None when they cannot go
        together (the calls then go alone, where whatever failed here fails its own call)."""
        items = [item for call in calls for item in call.items]
        try:
            rendered = await self.engine.render(self._prompt(items, [value for call in calls for value in call.decoded]), "items")
        except Exception:
            logger.debug("%d Encode calls could not share an engine request; each goes alone", len(calls), exc_info=True)
            return None
        self._queue.learn(rendered.placeholders)
        paths = [f"items[{i}]" for i in range(len(items))]
        if len(rendered.engine_input["prompt_token_ids"]) > self.engine.config.max_model_len or self._arena_violations(rendered, paths):
            return None
        return rendered

    async def _render_alone(self, call: PendingCall):
        rendered = await self._render(call.items, call.decoded, call.paths)
        self._queue.learn(rendered.placeholders)
        violations = self._arena_violations(rendered, call.paths)
        if violations:
            raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in violations), violations)
        return rendered

    def _prompt(self, items: list[MediaInput], decoded: list) -> dict:
        data: dict[str, list] = defaultdict(list)
        uuids: dict[str, list[str]] = defaultdict(list)
        for item, value in zip(items, decoded, strict=True):
            data[item.modality.value].append(vllm_input(item.modality, value))
            uuids[item.modality.value].append(item.content_hash)
        return {"prompt_token_ids": self.renderer.render_items([i.modality for i in items]), "multi_modal_data": dict(data), "multi_modal_uuids": dict(uuids)}

    async def _render(self, items: list[MediaInput], decoded: list, paths: list[str]):
        """vLLM's processor on the request's items. When it refuses them, the item it refuses
        alone is blamed (say, an image too narrow for the patch grid); a refusal of the set only
        (more items than the model takes per prompt) blames them all."""
        try:
            return await self.engine.render(self._prompt(items, decoded), "items")
        except InvalidArgument as whole:
            for index, path in enumerate(paths):
                try:
                    await self.engine.render(self._prompt(items[index : index + 1], decoded[index : index + 1]), f"{path}.{source_field(items[index])}")
                except InvalidArgument as alone:
                    raise alone from whole
            raise

    def _arena_violations(self, rendered, paths: list[str]) -> list[FieldViolation]:
        """The items the arena can never hold (it would otherwise keep them waiting).

        Sizes come from the engine: its rows per item (the processor's layout) and its
        measured output width per modality, published by the EC connector.
        """
        counters = self.engine.connector_counters
        slot, element = counters["slot_bytes"](), counters["element_bytes"]()
        capacity = counters["num_slots"]() * slot
        needed = []
        for path, (modality, _, rows) in zip(paths, rendered.placeholders, strict=True):
            width = counters.get(f"{modality}_width", lambda: 0)()
            needed.append((path, -(-(HEADER_BYTES + rows * width * element) // slot) * slot if width else 0))
        violations = [
            FieldViolation(path, f"its embedding needs {nbytes} bytes; this encoder's arena holds {capacity} (--embedding-buffer-bytes)")
            for path, nbytes in needed
            if nbytes > capacity
        ]
        if not violations and sum(n for _, n in needed) > capacity:
            violations.append(FieldViolation("items", f"their embeddings need {sum(n for _, n in needed)} bytes together; this encoder's arena holds {capacity}"))
        return violations

    async def _run(self, request_id: str, rendered) -> dict:
        """One encoder-only engine request; its final output carries what was published.

        Cancelling it (every caller gave up) aborts it in the engine, but it may have finished
        already, or finish before the abort arrives: its output then goes nowhere, and the
        producer is told to end the leases it published.
        """
        try:
            async for step in self.engine.generate(request_id, rendered, _ONE_STEP):
                if step.finish_reason is not None:
                    return step.ec_transfer_params or {}
        except asyncio.CancelledError:
            self._give_up(request_id)
            raise
        raise Internal("the encoder engine ended the request without a final output")

    def _give_up(self, request_id: str) -> None:
        self._clean_up(asyncio.to_thread(self.engine.desk.gave_up, request_id))


def _observe_phase(phase: str, started: float) -> None:
    telemetry.ENCODER_PHASE_SECONDS.labels(phase=phase).observe(time.perf_counter() - started)

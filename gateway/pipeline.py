"""How the gateway serves one request, per deployment mode.

- ``epd``: encoder -> prefill -> decode. Prefill and decode get metadata, never media.
- ``epd-combined`` (E+PD): encoder -> a combined decode instance that reads the embeddings.
- ``monolithic``: one in-process vLLM engine gets the raw media. It is the correctness oracle
  and the benchmarks' baseline; no encoder, no NIXL.

Each pipeline turns a :class:`GenerateRequest` into a stream of :class:`Delta` events followed
by one :class:`Finished`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc

from epd import telemetry, wire
from epd.domain import EncodedItem, EngineRequest, FinishReason, GenerateRequest, TokenRange
from epd.errors import DeadlineExceeded, EpdError, FieldViolation, InvalidArgument, Unavailable, Unimplemented, from_rpc_error
from epd.media import MediaLimits, check_sizes_and_types
from epd.media.decode import MediaDecoder, vllm_input
from epd.models import ModelFamily
from epd.transport.nixl import NixlRegion
from epd.v1 import encoder_pb2
from gateway.prompt import PromptRenderer
from gateway.router import StagePool

logger = logging.getLogger(__name__)
_tracer = telemetry.tracer(__name__)


class Mode(enum.Enum):
    EPD = "epd"
    COMBINED = "epd-combined"
    MONOLITHIC = "monolithic"


@dataclasses.dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    multimodal_tokens: int


@dataclasses.dataclass
class Timings:
    """Seconds; stages that did not run stay 0."""

    encode: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    time_to_first_token: float = 0.0
    total: float = 0.0


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    timings: Timings


Event = Delta | Finished


class _Clock:
    """Request-relative times, plus TTFT/ITL/TPOT/E2EL metrics as tokens stream out."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.timings = Timings()
        self._last_token: float | None = None
        self._tokens = 0

    def token(self, count: int) -> None:
        now = time.perf_counter()
        if self._last_token is None:
            self.timings.time_to_first_token = now - self.start
            telemetry.TTFT_SECONDS.observe(self.timings.time_to_first_token)
        else:
            telemetry.ITL_SECONDS.observe(now - self._last_token)
        self._last_token = now
        self._tokens += count

    def finish(self) -> Timings:
        self.timings.total = time.perf_counter() - self.start
        telemetry.E2EL_SECONDS.observe(self.timings.total)
        if self._tokens > 1:
            telemetry.TPOT_SECONDS.observe((self.timings.total - self.timings.time_to_first_token) / (self._tokens - 1))
        for stage in ("encode", "prefill", "decode"):
            if getattr(self.timings, stage):
                telemetry.STAGE_SECONDS.labels(stage=stage).observe(getattr(self.timings, stage))
        return self.timings


def validate_media(request: GenerateRequest, family: ModelFamily, limits: MediaLimits) -> None:
    """Rejects media the model cannot take, or that breaks a size or type rule, before any
    stage does work. Modalities the model has but EPD does not serve for it are UNIMPLEMENTED."""
    violations = []
    paths = wire.media_paths(request)
    for path, item in zip(paths, request.media, strict=True):
        if item.modality in family.supported_modalities:
            continue
        if item.modality in family.model_modalities:
            raise Unimplemented(f"{path}.{item.modality.value}: {item.modality.value} input is not implemented yet for {family.model_type}")
        violations.append(FieldViolation(f"{path}.{item.modality.value}", f"{family.model_type} does not take {item.modality.value} input"))
    for index, problem in check_sizes_and_types(request.media, limits):
        violations.append(FieldViolation(f"{paths[index]}.{problem.field}" if index >= 0 else "messages", str(problem)))
    if violations:
        raise InvalidArgument("invalid media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)


def _remaining(deadline: float | None) -> float | None:
    """The time left for the next hop, so each stage's deadline is the client's."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before the next stage could start")
    return left


class DisaggregatedPipeline:
    """E/P/D and E+PD: media goes to the encoders only; later stages get metadata."""

    def __init__(
        self,
        mode: Mode,
        family: ModelFamily,
        renderer: PromptRenderer,
        limits: MediaLimits,
        encoders: StagePool,
        prefills: StagePool | None,
        decodes: StagePool,
        *,
        forward_media: bool = False,
    ):
        self.mode = mode
        # The benchmarks' baseline: later stages also get the media and re-derive the layout.
        self.forward_media = forward_media
        self.family = family
        self.renderer = renderer
        self.limits = limits
        self.encoders = encoders
        self.prefills = prefills
        self.decodes = decodes

    async def close(self) -> None:
        for pool in (self.encoders, self.prefills, self.decodes):
            if pool is not None:
                await pool.close()

    async def generate(self, request: GenerateRequest, deadline: float | None) -> AsyncIterator[Event]:
        clock = _Clock()
        validate_media(request, self.family, self.limits)
        prompt_ids = self.renderer.render(request.messages)
        leases: dict[str, list[str]] = {}
        completed = False
        try:
            items = await self._encode(request, leases, deadline)
            clock.timings.encode = time.perf_counter() - clock.start
            items = self._place(prompt_ids, items)
            if self.forward_media:
                items = [dataclasses.replace(item, forwarded_media=media) for item, media in zip(items, request.media, strict=True)]
            engine_request = EngineRequest(request.request_id, tuple(prompt_ids), tuple(items), request.sampling)
            if self.mode is Mode.EPD:
                engine_request = await self._prefill(engine_request, clock, deadline)
            async for event in self._decode(engine_request, clock, deadline):
                yield event
            completed = True
        finally:
            if not completed:
                # Leases nobody read must not wait for their TTL; freeing is idempotent.
                await asyncio.shield(self._release(leases))

    async def _encode(self, request: GenerateRequest, leases: dict[str, list[str]], deadline: float | None) -> list[EncodedItem]:
        """Spreads the items over the encoders (one call per chosen encoder), in parallel."""
        media = request.media
        if not media:
            return []
        paths = wire.media_paths(request)
        groups: dict[str, list[int]] = defaultdict(list)
        for index in range(len(media)):
            groups[self.encoders.pick()].append(index)
        results: list[EncodedItem | None] = [None] * len(media)

        async def call(address: str, indices: list[int]) -> None:
            message = encoder_pb2.EncodeRequest(request_id=request.request_id, items=[wire.media_item_to_wire(media[i]) for i in indices])
            with self.encoders.busy(address) as stub, _tracer.start_as_current_span("encode"):
                try:
                    response = await stub.Encode(message, timeout=_remaining(deadline))
                except grpc.aio.AioRpcError as exc:
                    raise _remap_item_fields(from_rpc_error(exc, peer=f"encoder {address}"), [paths[i] for i in indices]) from exc
            for i, item in zip(indices, wire.encoded_items_from_wire(response.items), strict=True):
                results[i] = item
                if isinstance(item.embedding, NixlRegion):
                    leases.setdefault(address, []).append(item.embedding.lease_id)

        # Let every call finish before raising, so that each lease granted is recorded for release.
        outcomes = await asyncio.gather(*(call(address, indices) for address, indices in groups.items()), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(results)

    def _place(self, prompt_ids: list[int], items: list[EncodedItem]) -> list[EncodedItem]:
        """Records where each item's placeholders land in the expanded prompt."""
        expanded = self.family.expand_prompt(prompt_ids, [i.metadata for i in items])
        return [
            dataclasses.replace(item, metadata=dataclasses.replace(item.metadata, placeholder_range=TokenRange(r.offset, r.length)))
            for item, r in zip(items, expanded.ranges, strict=True)
        ]

    async def _prefill(self, request: EngineRequest, clock: _Clock, deadline: float | None) -> EngineRequest:
        started = time.perf_counter()
        address = self.prefills.pick()
        with self.prefills.busy(address) as stub, _tracer.start_as_current_span("prefill"):
            try:
                response = await stub.Prefill(wire.prefill_request_to_wire(request), timeout=_remaining(deadline))
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, peer=f"prefill {address}") from exc
        clock.timings.prefill = time.perf_counter() - started
        return dataclasses.replace(request, kv_handoff=wire.kv_handoff_from_wire(response.kv_handoff))

    async def _decode(self, request: EngineRequest, clock: _Clock, deadline: float | None) -> AsyncIterator[Event]:
        started = time.perf_counter()
        address = self.decodes.pick()
        completion_tokens = 0
        with self.decodes.busy(address) as stub, _tracer.start_as_current_span("decode"):
            call = stub.Decode(wire.decode_request_to_wire(request), timeout=_remaining(deadline))
            try:
                async for response in call:
                    if response.token_ids:
                        clock.token(len(response.token_ids))
                        completion_tokens += len(response.token_ids)
                        yield Delta(list(response.token_ids), response.text)
                    if response.finish_reason:
                        clock.timings.decode = time.perf_counter() - started
                        usage = Usage(
                            prompt_tokens=response.prompt_token_count,
                            completion_tokens=completion_tokens,
                            multimodal_tokens=sum(i.metadata.placeholder_range.length for i in request.items),
                        )
                        yield Finished(wire.finish_reason_from_wire(response.finish_reason), usage, clock.finish())
                        return
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, peer=f"decode {address}") from exc
            finally:
                call.cancel()  # no-op once done; aborts the decode engine if we stop early
        raise Unavailable(f"decode {address} ended its stream without a finish reason")

    async def _release(self, leases: dict[str, list[str]]) -> None:
        for address, lease_ids in leases.items():
            try:
                await self.encoders.stub(address).ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=lease_ids), timeout=5)
            except grpc.aio.AioRpcError as exc:
                logger.warning("could not release %d leases on %s (they expire by TTL): %s", len(lease_ids), address, exc.details())


class MonolithicPipeline:
    """One in-process vLLM engine, given the raw media: the oracle and the baseline. It decodes
    with the encoder's own decoder, so both paths start from the same frames and samples."""

    def __init__(self, family: ModelFamily, renderer: PromptRenderer, limits: MediaLimits, decoder: MediaDecoder, engine):
        self.family = family
        self.renderer = renderer
        self.limits = limits
        self.decoder = decoder
        self.engine = engine

    async def close(self) -> None:
        self.engine.shutdown()

    async def generate(self, request: GenerateRequest, deadline: float | None) -> AsyncIterator[Event]:
        clock = _Clock()
        validate_media(request, self.family, self.limits)
        prompt_ids = self.renderer.render(request.messages)
        prompt: dict = {"prompt_token_ids": prompt_ids}
        media = request.media
        decoded = await asyncio.to_thread(self.decoder.decode_all, media, wire.media_paths(request))
        if media:
            prompt["multi_modal_data"] = defaultdict(list)
            for item, value in zip(media, decoded, strict=True):
                prompt["multi_modal_data"][item.modality.value].append(vllm_input(item.modality, value))
            prompt["multi_modal_data"] = dict(prompt["multi_modal_data"])
        completion_tokens = 0
        async for step in self.engine.generate(request.request_id, prompt, request.sampling):
            if step.token_ids:
                clock.token(len(step.token_ids))
                completion_tokens += len(step.token_ids)
                yield Delta(step.token_ids, step.text)
            if step.finish_reason is not None:
                multimodal = _media_token_count(self.family, step.prompt_token_count, prompt_ids)
                timings = clock.finish()
                timings.decode = timings.total
                yield Finished(step.finish_reason, Usage(step.prompt_token_count, completion_tokens, multimodal), timings)


def _media_token_count(family: ModelFamily, expanded_len: int, prompt_ids: list[int]) -> int:
    """Tokens the items occupy after expansion: what expansion added, plus the placeholders."""
    placeholders = sum(1 for t in prompt_ids if t in family.placeholder_token_ids)
    return expanded_len - len(prompt_ids) + placeholders


def _remap_item_fields(error: EpdError, paths: list[str]) -> EpdError:
    """Rewrites an encoder's ``items[i].x`` field paths into the public request's paths."""
    if not isinstance(error, InvalidArgument):
        return error
    violations = []
    for v in error.violations:
        field = v.field
        for index, path in enumerate(paths):
            prefix = f"items[{index}]"
            if field == prefix or field.startswith(prefix + "."):
                field = path + field[len(prefix) :]
                break
        violations.append(FieldViolation(field, v.description))
    message = "; ".join(f"{v.field} {v.description}" for v in violations) or error.message
    return InvalidArgument(f"invalid media: {message}", violations)

"""How the gateway serves one request, per deployment mode. Orchestration only: the stage
clients (``gateway.stages``) own the wire, the errors and the deadlines.

- ``epd``: encoder -> prefill -> decode. Prefill and decode get metadata, never media (except
  for a modality the model has no metadata-only layout for, or under ``--forward-media``).
  Under ``--local-prefill-fallback``, while no prefill instance is live, encoder -> decode as E+PD.
- ``epd-combined`` (E+PD): encoder -> a decode instance (decode or combined mode) that reads the
  embeddings and prefills itself.
- ``monolithic``: one in-process vLLM engine gets the raw media. It is the correctness oracle
  and the benchmarks' baseline; no encoder, no NIXL.

Each pipeline turns a :class:`GenerateRequest` into a stream of :class:`Delta` events followed
by one :class:`Finished`. The gateway knows no model: the engine that prefills renders the chat
with its model's template (``epd.prompt``), and vLLM's processor there expands the placeholders.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator

from epd import telemetry, wire
from epd.domain import EncodedItem, EngineRequest, FinishReason, GenerateRequest, KvHandoff
from epd.errors import Aborted, FieldViolation, InvalidArgument, Unavailable
from epd.media import MediaLimits, check_modalities, check_sizes_and_types
from epd.media.decode import MediaDecoder, vllm_input
from epd.prompt import PromptRenderer, check_chat_size
from gateway.router import RetryPolicy
from gateway.stages import DecodeClient, DecodeEnd, EncoderClient, Leases, PrefillClient, StageFailed, time_left

logger = logging.getLogger(__name__)


class Mode(enum.Enum):
    EPD = "epd"
    COMBINED = "epd-combined"
    MONOLITHIC = "monolithic"


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
class Delta:
    """Tokens generated since the last event, and their text."""

    token_ids: list[int]
    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    timings: Timings
    resumed_after: tuple[int, ...] = ()  # the reply's length at each resume on another instance


Event = Delta | Finished


class RequestClock:
    """One request's progress: its times and token counts so far, plus TTFT/ITL/TPOT/E2EL
    metrics as tokens stream out. The servicer creates it and reads it when Abort cancels the
    pipeline, so an aborted stream still reports what was done."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.timings = Timings()
        self._last_token: float | None = None
        self._decode_started: float | None = None
        self.tokens = 0  # streamed by this call
        self.continued = 0  # the reply's tokens the request came with (its continuation_token_ids)
        self.prompt_tokens = 0  # the expanded prompt, once the engine that decodes has it
        self.resumed_after: list[int] = []  # the reply's length at each resume
        self.multimodal_tokens = 0

    def decoding(self) -> None:
        self._decode_started = time.perf_counter()

    def token(self, count: int) -> None:
        now = time.perf_counter()
        if self._last_token is None:
            self.timings.time_to_first_token = now - self.start
            telemetry.TTFT_SECONDS.observe(self.timings.time_to_first_token)
        else:
            telemetry.ITL_SECONDS.observe(now - self._last_token)
        self._last_token = now
        self.tokens += count

    def finished(self, reason: FinishReason) -> Finished:
        """The request's end, its timings taken now."""
        return Finished(reason, self.usage(), self.finish(), tuple(self.resumed_after))

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.continued + self.tokens, self.multimodal_tokens)

    def snapshot(self) -> Timings:
        """The timings so far (a decode still running counts until now)."""
        now = time.perf_counter()
        timings = dataclasses.replace(self.timings, total=now - self.start)
        if self._decode_started is not None and not timings.decode:
            timings.decode = now - self._decode_started
        return timings

    def finish(self) -> Timings:
        self.timings = self.snapshot()
        telemetry.E2EL_SECONDS.observe(self.timings.total)
        telemetry.GATEWAY_OWN_SECONDS.observe(self.timings.total - self.timings.encode - self.timings.prefill - self.timings.decode)
        if self.tokens > 1:
            telemetry.TPOT_SECONDS.observe((self.timings.total - self.timings.time_to_first_token) / (self.tokens - 1))
        for stage in ("encode", "prefill", "decode"):
            if getattr(self.timings, stage):
                telemetry.STAGE_SECONDS.labels(stage=stage).observe(getattr(self.timings, stage))
        return self.timings


def check_media(request: GenerateRequest, limits: MediaLimits) -> None:
    """Rejects media that breaks a size or type rule before any stage does work."""
    paths = wire.media_paths(request)
    violations = [
        FieldViolation(f"{paths[index]}.{problem.field}" if index >= 0 else "messages", str(problem))
        for index, problem in check_sizes_and_types(request.media, limits)
    ]
    if violations:
        raise InvalidArgument("invalid media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)


class DisaggregatedPipeline:
    """E/P/D and E+PD: media goes to the encoders only; later stages get metadata."""

    def __init__(
        self,
        mode: Mode,
        limits: MediaLimits,
        encoders: EncoderClient,
        prefills: PrefillClient | None,
        decodes: DecodeClient,
        *,
        retry: RetryPolicy,
        max_prompt_bytes: int = 0,
        forward_media: bool = False,
        local_prefill_fallback: bool = False,
    ):
        self.mode = mode
        self.limits = limits
        self.encoders = encoders
        self.prefills = prefills
        self.decodes = decodes
        self.retry = retry
        self.max_prompt_bytes = max_prompt_bytes
        # The benchmarks' baseline: later stages get every item's media and lay it out from it.
        self.forward_media = forward_media
        self.local_prefill_fallback = local_prefill_fallback

    async def close(self) -> None:
        for client in (self.encoders, self.prefills, self.decodes):
            if client is not None:
                await client.pool.close()

    async def generate(self, request: GenerateRequest, deadline: float | None, clock: RequestClock | None = None) -> AsyncIterator[Event]:
        """Runs the request; when a stage fails, runs it again on other instances (see
        :class:`RetryPolicy`). Before the first token that is a retry from the encoder; after
        it, a resume: the new attempt continues the reply from the prompt plus every token
        already streamed (the encoder answers from its cache, the prefill from its prefix
        cache), so the client's stream goes on with no token repeated or missing. Aborts and
        the client's deadline end the request instead."""
        clock = clock or RequestClock()
        check_media(request, self.limits)
        check_chat_size(request.messages, self.max_prompt_bytes)
        clock.continued = len(request.continuation)
        reply = list(request.continuation)  # the reply so far, in every attempt
        avoid: set[str] = set()
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                continued = dataclasses.replace(request, continuation=tuple(reply))
                async with contextlib.aclosing(self._attempt(continued, clock, frozenset(avoid), deadline)) as events:
                    async for event in events:
                        if isinstance(event, Delta):
                            reply += event.token_ids
                        yield event
                return
            except (Unavailable, Aborted) as exc:
                # Aborted: the prefill's KV lease ran out before a decode took it (a busy host);
                # no instance is to blame, so none is avoided on the next try.
                delay = self.retry.delay(attempt)
                left = time_left(deadline)
                if attempt == self.retry.max_attempts or (left is not None and left <= delay):
                    if clock.tokens:
                        raise Unavailable(f"{exc.message} (after {clock.tokens} tokens were sent, and {attempt} attempts)") from exc
                    raise
                stage = getattr(exc, "stage", "kv_lease" if isinstance(exc, Aborted) else "routing")
                if isinstance(exc, StageFailed):
                    avoid |= exc.suspects
                if clock.tokens:
                    logger.warning("request %s: attempt %d failed after %d tokens (%s); resuming after them", request.request_id, attempt, clock.tokens, exc.message)
                    clock.resumed_after.append(len(reply))
                    telemetry.RESUMES.labels(stage=stage).inc()
                else:
                    logger.warning("request %s: attempt %d failed before its first token (%s); retrying", request.request_id, attempt, exc.message)
                    telemetry.RETRIES.labels(stage=stage).inc()
                await asyncio.sleep(delay)

    async def _attempt(self, request: GenerateRequest, clock: RequestClock, avoid: frozenset[str], deadline: float | None) -> AsyncIterator[Event]:
        leases = Leases()
        handoff: KvHandoff | None = None
        prefill_address = ""  # the instance holding the handoff's KV
        decode_answered = False
        completed = False
        try:
            items: list[EncodedItem] = []
            if request.media:
                started = time.perf_counter()
                items = await self.encoders.encode(request.request_id, request.media, wire.media_paths(request), leases, deadline, avoid)
                clock.timings.encode = time.perf_counter() - started
                clock.multimodal_tokens = sum(item.metadata.placeholder_length for item in items)
            if self.forward_media or any(item.metadata.layout_needs_media for item in items):
                # vLLM 0.32 cannot mix metadata-only and raw items in one prompt (its processor
                # then misses the metadata-only ones), so one item that needs its media sends all.
                items = [dataclasses.replace(item, forwarded_media=media) for item, media in zip(items, request.media, strict=True)]
            engine_request = EngineRequest(
                request.request_id,
                tuple(items),
                request.sampling.after(len(request.continuation)),
                chat=request.engine_chat(),
                continuation=request.continuation,
                cache_salt=request.cache_salt,
            )
            # The reply's tokens that the decode's prompt ends with.
            continued = len(request.continuation)
            if self.prefills is not None and not self._prefill_on_decode(request.request_id):
                started = time.perf_counter()
                prefilled = await self.prefills.prefill(engine_request, deadline, avoid)
                handoff, prefill_address = prefilled.kv_handoff, prefilled.address
                clock.timings.prefill = time.perf_counter() - started
                clock.prompt_tokens = prefilled.prompt_token_count - continued
                clock.token(1)
                yield Delta([prefilled.first_token_id], prefilled.first_token_text)
                if prefilled.finish_reason is not None:
                    completed = True
                    # The reply ended with its first token: no decode will read the KV.
                    await asyncio.shield(self.decodes.release_kv(request.request_id, handoff, avoid))
                    yield clock.finished(prefilled.finish_reason)
                    return
                # The decode runs the very token ids whose KV the prefill left, the reply's so far
                # after them, then goes on from the first token.
                continued += 1
                engine_request = dataclasses.replace(
                    engine_request,
                    prompt_token_ids=prefilled.prompt_token_ids,
                    chat=(),
                    continuation=(*request.continuation, prefilled.first_token_id),
                    sampling=request.sampling.after(continued),
                    kv_handoff=handoff,
                )
            clock.decoding()
            try:
                async for event in self.decodes.decode(engine_request, deadline, avoid):
                    decode_answered = True  # its engine has read the KV: vLLM frees it from here on
                    clock.prompt_tokens = event.prompt_token_count - continued
                    if isinstance(event, DecodeEnd):
                        yield clock.finished(event.reason)
                        continue
                    clock.token(len(event.token_ids))
                    yield Delta(event.token_ids, event.text)
            except StageFailed as exc:
                if prefill_address and not decode_answered:
                    # A decode that fails before answering most often could not pull the KV: the
                    # prefill holding it may be the instance that is gone, not the decode.
                    exc.suspects.add(prefill_address)
                raise
            completed = True
        finally:
            if not completed:
                # Leases nobody read must not wait for their TTL; freeing is idempotent.
                await asyncio.shield(self.encoders.release(leases))
                if handoff is not None and not decode_answered:
                    # KV no decode has read (the decode failed or the request ended first) must
                    # not wait for the prefill's lease either.
                    await asyncio.shield(self.decodes.release_kv(request.request_id, handoff, avoid))

    def _prefill_on_decode(self, request_id: str) -> bool:
        """Whether this E/P/D request goes to decode without a KV handoff, to be prefilled
        there (E+PD): only under the local-prefill fallback, while no prefill instance is live
        (a failed one is ejected at once, so the request's retry lands here)."""
        if not self.local_prefill_fallback or self.prefills.pool.available:
            return False
        logger.warning("request %s: no live prefill instance; a decode instance prefills it (--local-prefill-fallback)", request_id)
        telemetry.LOCAL_PREFILLS.inc()
        return True


class MonolithicPipeline:
    """One in-process vLLM engine, given the raw media: the oracle and the baseline. It decodes
    with the encoder's own decoder, so both paths start from the same frames and samples."""

    def __init__(self, renderer: PromptRenderer, limits: MediaLimits, decoder: MediaDecoder, engine, *, max_prompt_bytes: int = 0):
        self.renderer = renderer
        self.limits = limits
        self.max_prompt_bytes = max_prompt_bytes
        self.decoder = decoder
        self.engine = engine

    async def close(self) -> None:
        pass  # the service lifecycle stops the engine

    async def generate(self, request: GenerateRequest, deadline: float | None, clock: RequestClock | None = None) -> AsyncIterator[Event]:
        clock = clock or RequestClock()
        check_media(request, self.limits)
        check_chat_size(request.messages, self.max_prompt_bytes)
        prompt: dict = {"prompt_token_ids": await self.renderer.render_on_loop(request.messages) + list(request.continuation)}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        media = request.media
        if media:
            check_modalities(media, wire.media_paths(request), self.engine.modalities)
            decoded = await asyncio.to_thread(self.decoder.decode_all, media, wire.media_paths(request))
            data: dict[str, list] = defaultdict(list)
            uuids: dict[str, list[str]] = defaultdict(list)
            for item, value in zip(media, decoded, strict=True):
                data[item.modality.value].append(vllm_input(item.modality, value))
                uuids[item.modality.value].append(item.content_hash)
            prompt.update(multi_modal_data=dict(data), multi_modal_uuids=dict(uuids))
        rendered = await self.engine.render(prompt, "messages")
        clock.multimodal_tokens = sum(length for _, length, _ in rendered.placeholders)
        clock.decoding()  # one engine does it all: its time is the decode's
        clock.continued = len(request.continuation)
        async for step in self.engine.generate(request.request_id, rendered, request.sampling.after(clock.continued), continued=clock.continued):
            clock.prompt_tokens = step.prompt_token_count - clock.continued
            if step.token_ids:
                clock.token(len(step.token_ids))
                yield Delta(step.token_ids, step.text)
            if step.finish_reason is not None:
                yield clock.finished(step.finish_reason)

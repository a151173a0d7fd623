"""The gateway's clients of the encoder, prefill and decode stages.

Each client owns everything about talking to its stage: picking an instance, wire conversion,
the deadline passed on to the next hop, the trace span, and turning a failed call
(``AioRpcError``) into the matching domain error. The pipeline above them only orchestrates,
in domain types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import SpanKind

from epd import telemetry, wire
from epd.domain import EncodedItem, EngineRequest, FinishReason, ItemMarker, KvHandoff, MediaInput
from epd.errors import DeadlineExceeded, EpdError, FieldViolation, InvalidArgument, Unavailable, from_rpc_error
from epd.v1 import decode_pb2, encoder_pb2
from gateway.router import StagePool

logger = logging.getLogger(__name__)
_tracer = telemetry.tracer(__name__)

_RELEASE_TIMEOUT_S = 5.0
_RELEASE_ATTEMPTS = 2  # a KV release tries another decode instance once
_STATUS_AFTER_END_S = 10.0  # how long a decode call is read for its status after its last message


def time_left(deadline: float | None) -> float | None:
    """The time left for the next hop, so each stage's deadline is the client's."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before the next stage could start")
    return left


class StageFailed(Unavailable):
    """A stage instance could not serve a call (down, draining, unreachable, or a peer it
    needed was): the pipeline may retry the request on other instances before its first token."""

    def __init__(self, stage: str, address: str, message: str):
        super().__init__(message)
        self.stage = stage
        self.address = address
        self.suspects = {address}  # instances the request's next try avoids


def _stage_error(pool: StagePool, address: str, exc: grpc.aio.AioRpcError, deadline: float | None) -> EpdError:
    """The domain error for a failed call; an instance that failed it leaves the rotation."""
    error = from_rpc_error(exc, peer=f"{pool.stage} {address}", deadline=deadline)
    if not isinstance(error, Unavailable):
        return error
    pool.eject(address, exc.details() or "UNAVAILABLE")
    return StageFailed(pool.stage, address, error.message)


class Leases:
    """The release keys of a request's Encode calls, by encoder address. A key frees every lease
    its call was granted, even when the reply never arrived (a call cancelled, or past its
    deadline, as the encoder answered), which no lease id could."""

    def __init__(self) -> None:
        self.by_encoder: dict[str, list[str]] = defaultdict(list)

    def new_key(self, address: str) -> str:
        key = secrets.token_hex(16)
        self.by_encoder[address].append(key)
        return key


class EncoderClient:
    def __init__(self, pool: StagePool):
        self.pool = pool

    async def encode(
        self, request_id: str, media: list[MediaInput], paths: list[str], leases: Leases, deadline: float | None, avoid: frozenset[str] = frozenset()
    ) -> list[EncodedItem]:
        """Encodes the items over the encoder instances (one call per chosen instance, in
        parallel), in order; every call's release key is recorded in ``leases`` before it goes out.
        Each item goes to the encoder that last served it, else where its affinity key points
        (that encoder's cache may hold its output already). Instances in ``avoid`` (they failed this request before) are picked only as a
        last resort."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, item in enumerate(media):
            groups[self.pool.pick_for_key(item.affinity_key, avoid)].append(index)
        results: list[EncodedItem | None] = [None] * len(media)

        async def call(address: str, indices: list[int]) -> None:
            message = wire.encode_request_to_wire(request_id, [media[i] for i in indices], leases.new_key(address))
            with self.pool.busy(address) as stub, _tracer.start_as_current_span("encode", kind=SpanKind.CLIENT):
                try:
                    response = await stub.Encode(message, timeout=time_left(deadline), metadata=telemetry.trace_metadata())
                except grpc.aio.AioRpcError as exc:
                    raise _remap_item_fields(_stage_error(self.pool, address, exc, deadline), [paths[i] for i in indices]) from exc
            for i, item in zip(indices, wire.encoded_items_from_wire(response.items), strict=True):
                results[i] = item
                # Its arena holds the output now, and answers a repeat without its engine.
                self.pool.record_holder(media[i].affinity_key, address)

        # Let every call finish before raising, so that none is left running for a request that ended.
        outcomes = await asyncio.gather(*(call(address, indices) for address, indices in groups.items()), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(results)

    async def release(self, leases: Leases) -> None:
        """Frees leases no consumer will read, so they need not wait for their TTL."""
        for address, keys in leases.by_encoder.items():
            try:
                await self.pool.stub(address).ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(release_keys=keys), timeout=_RELEASE_TIMEOUT_S)
            except (grpc.aio.AioRpcError, EpdError) as exc:  # EpdError: the encoder has left the pool
                reason = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc.message
                logger.warning("could not release the leases of %d calls on %s (they expire by TTL): %s", len(keys), address, reason)


_TEXT_PREFIX_CHARS = 256


def prefix_affinity_key(request: EngineRequest) -> str:
    """What a prefill instance's caches could reuse for this request: the chat up to its first
    item, and that item (vLLM's prefix cache then holds the KV of both, and its encoder cache the
    item), or, with no item, the chat's first characters. The turns of one chat share it, as do
    requests with one system prompt and image; bounded load keeps a hot key from overloading one
    prefill. A salted request's KV is reusable only under its salt, which leads the key."""
    salt = f"{request.cache_salt}\x00" if request.cache_salt else ""
    prefix: list[str] = []
    for message in request.chat:
        for part in message.parts:
            if isinstance(part, ItemMarker):
                return f"{salt}{request.items[0].metadata.content_hash}:{''.join(prefix)}"
            prefix.append(f"{message.role.value}:{part.text}\x00")
    return salt + "".join(prefix)[:_TEXT_PREFIX_CHARS]


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prefill's result: the reply's first token (and the reason the reply ends there, if it
    does), the KV handoff, the prompt as the prefill rendered it (the decode must run exactly
    these token ids), and the instance that holds the KV."""

    first_token_id: int
    first_token_text: str
    finish_reason: FinishReason | None
    kv_handoff: KvHandoff
    prompt_token_ids: tuple[int, ...]
    prompt_token_count: int  # expanded
    address: str


class PrefillClient:
    def __init__(self, pool: StagePool):
        self.pool = pool

    async def prefill(self, request: EngineRequest, deadline: float | None, avoid: frozenset[str] = frozenset()) -> Prefilled:
        address = self.pool.pick_for_key(prefix_affinity_key(request), avoid)
        with self.pool.busy(address) as stub, _tracer.start_as_current_span("prefill", kind=SpanKind.CLIENT):
            try:
                response = await stub.Prefill(wire.prefill_request_to_wire(request), timeout=time_left(deadline), metadata=telemetry.trace_metadata())
            except grpc.aio.AioRpcError as exc:
                raise _engine_prompt_error(self.pool, address, request, _stage_error(self.pool, address, exc, deadline)) from exc
        return Prefilled(
            response.first_token_id,
            response.first_token_text,
            wire.finish_reason_from_wire(response.finish_reason) if response.finish_reason else None,
            wire.kv_handoff_from_wire(response.kv_handoff),
            tuple(response.prompt_token_ids),
            response.prompt_token_count,
            address,
        )


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One message of the decode stage: new tokens, and the expanded prompt's length."""

    token_ids: list[int]
    text: str
    prompt_token_count: int


@dataclasses.dataclass(frozen=True)
class DecodeEnd:
    reason: FinishReason
    prompt_token_count: int


class DecodeClient:
    def __init__(self, pool: StagePool):
        self.pool = pool

    async def decode(self, request: EngineRequest, deadline: float | None, avoid: frozenset[str] = frozenset()) -> AsyncIterator[DecodeStep | DecodeEnd]:
        """Streams the decode stage's tokens, then one :class:`DecodeEnd`; leaving early
        cancels the call, which aborts the engine request.

        After the last message the call is still read to its status rather than cancelled: a
        call cancelled there ends on the decode as CANCELLED, not as the success it was (its
        handler is cut off before it finishes, and its request count misses it). The gateway's
        client has its reply by then (``gateway.run``), so this wait is bounded but unhurried."""
        address = self.pool.pick(avoid)
        with self.pool.busy(address) as stub, _tracer.start_as_current_span("decode", kind=SpanKind.CLIENT):
            call = stub.Decode(wire.decode_request_to_wire(request), timeout=time_left(deadline), metadata=telemetry.trace_metadata())
            try:
                async for response in call:
                    if response.token_ids:
                        yield DecodeStep(list(response.token_ids), response.text, response.prompt_token_count)
                    if response.finish_reason:
                        yield DecodeEnd(wire.finish_reason_from_wire(response.finish_reason), response.prompt_token_count)
                        break
                else:
                    raise StageFailed("decode", address, f"decode {address} ended its stream without a finish reason")
            except grpc.aio.AioRpcError as exc:
                raise _engine_prompt_error(self.pool, address, request, _stage_error(self.pool, address, exc, deadline)) from exc
            except BaseException:
                call.cancel()
                raise
            await _read_to_status(call, address)

    async def release_kv(self, request_id: str, handoff: KvHandoff, avoid: frozenset[str] = frozenset()) -> None:
        """Frees a prefill's KV that no decode will read, through any live decode instance, so it
        need not wait for the prefill's KV lease. Best effort: the lease still frees it."""
        message = decode_pb2.ReleaseKvRequest(request_id=request_id, kv_handoff=wire.kv_handoff_to_wire(handoff))
        tried = set(avoid)
        for _ in range(_RELEASE_ATTEMPTS):
            try:
                address = self.pool.pick(frozenset(tried))
                await self.pool.stub(address).ReleaseKv(message, timeout=_RELEASE_TIMEOUT_S, metadata=telemetry.trace_metadata())
                return
            except EpdError as exc:  # no live decode instance
                problem = exc.message
                break
            except grpc.aio.AioRpcError as exc:
                problem = f"decode {address}: {exc.code().name} {exc.details()}"
                tried.add(address)
        logger.warning("request %s: could not release its prefill KV (the prefill's KV lease frees it): %s", request_id, problem)


async def _read_to_status(call: grpc.aio.UnaryStreamCall, address: str) -> None:
    """Waits for a decode call's status after its last message, for at most
    ``_STATUS_AFTER_END_S``. A decode sends nothing more; were it to, it is no part of the
    reply. The reply is complete and delivered, so a status that fails now fails nothing."""
    try:
        async with asyncio.timeout(_STATUS_AFTER_END_S):
            async for _ in call:
                pass
    except grpc.aio.AioRpcError as exc:
        logger.warning("decode %s: the call failed after its last message: %s %s", address, exc.code().name, exc.details())
    except TimeoutError:
        logger.warning("decode %s: no status %.0f s after the last message; the call is cancelled", address, _STATUS_AFTER_END_S)
    finally:
        call.cancel()  # a no-op once the call is done


def _remap_item_fields(error: EpdError, paths: list[str]) -> EpdError:
    """Rewrites an encoder's ``items[i].x`` field paths into the public request's paths."""
    if not isinstance(error, InvalidArgument):
        return error
    violations = []
    for v in error.violations:
        field = "messages" if v.field == "items" else v.field  # the whole item list: the chat
        for index, path in enumerate(paths):
            prefix = f"items[{index}]"
            if field == prefix or field.startswith(prefix + ".") or field.startswith(prefix + "["):
                field = path + field[len(prefix) :]
                break
        violations.append(FieldViolation(field, v.description))
    message = "; ".join(f"{v.field} {v.description}" for v in violations) or error.message
    return InvalidArgument(f"invalid media: {message}", violations)


def _engine_prompt_error(pool: StagePool, address: str, request: EngineRequest, error: EpdError) -> EpdError:
    """An engine stage's error about the prompt, for the public request: its ``prompt.chat``
    field paths become ``messages`` (the gateway sends the chat turn for turn and part for part).

    A stage from before the engines rendered chats refuses one as a prompt without token ids. That
    is no fault of the client's: the instance is ejected, and the request retried elsewhere, as
    from any instance that cannot serve it (stages must be upgraded before gateways)."""
    if not isinstance(error, InvalidArgument):
        return error
    if request.chat and [v.field for v in error.violations] == ["prompt.token_ids"]:
        pool.eject(address, "it cannot render chats (epd.v1.EnginePrompt.chat): older than this gateway")
        return StageFailed(pool.stage, address, f"{pool.stage} {address} predates chat prompts and refused one; upgrade stages before gateways")
    if not any(v.field.startswith("prompt.chat") for v in error.violations):
        return error
    violations = [FieldViolation("messages" + v.field[len("prompt.chat") :], v.description) if v.field.startswith("prompt.chat") else v for v in error.violations]
    return InvalidArgument("; ".join(f"{v.field} {v.description}" for v in violations), violations)

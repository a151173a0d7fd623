"""The vLLM engine adapter shared by the prefill, decode and monolithic roles.

One class wraps ``AsyncLLM`` so that the services speak domain types (``Sampling``,
``KvHandoff``, ``FinishReason``) and never vLLM's. Which KV-transfer role the engine has is
fixed at construction: a prefill engine is a NixlConnector producer, a decode engine a
consumer, and a combined (E+PD) or monolithic engine has no connector at all.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from epd.domain import FinishReason, KvHandoff, Sampling
from epd.errors import Unavailable

logger = logging.getLogger(__name__)


class KvRole(enum.Enum):
    NONE = "none"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a vLLM engine here. One place; the CLI fills it."""

    model: str
    kv_role: KvRole = KvRole.NONE
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_seqs: int = 16
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    max_images_per_prompt: int = 8
    max_videos_per_prompt: int = 2
    max_audios_per_prompt: int = 4
    nixl_side_channel_host: str = "127.0.0.1"
    nixl_side_channel_port: int = 0  # KV producer/consumer only; 0 means "pick a free port"
    caches: bool = True  # vLLM's prefix cache and multimodal processor cache (off: benchmarks)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class EngineStep:
    """Tokens generated since the last step, and how the request ended once it has."""

    token_ids: list[int]
    text: str
    prompt_token_count: int
    finish_reason: FinishReason | None
    kv_handoff: KvHandoff | None = None


_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "repetition": FinishReason.STOP,
}
_KV_TYPED_KEYS = (
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_num_tokens",
    "tp_size",
)
# Per-request flags that the decode side sets itself; they never travel.
_KV_ROLE_FLAGS = ("do_remote_prefill", "do_remote_decode")


class Engine:
    """An ``AsyncLLM`` behind a domain-typed interface."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._llm = None

    def start(self) -> None:
        """Loads the model (seconds to minutes). Call before serving."""
        _configure_vllm_environment(self.config)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs: dict[str, Any] = {}
        if self.config.kv_role is not KvRole.NONE:
            kwargs["kv_transfer_config"] = {
                "kv_connector": "NixlConnector",
                "kv_role": self.config.kv_role.value,
                "kv_buffer_device": "cpu",
            }
        if not self.config.caches:
            kwargs.update(enable_prefix_caching=False, mm_processor_cache_gb=0)
        args = AsyncEngineArgs(
            model=self.config.model,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            enforce_eager=True,
            seed=self.config.seed,
            limit_mm_per_prompt=self._mm_limits(),
            # Items arrive as precomputed embeddings (prefill, combined) or as grid-only
            # metadata (decode); both are "embedding" inputs to vLLM's processor.
            enable_mm_embeds=True,
            # vLLM's own Prometheus metrics (vllm:kv_cache_usage_perc, vllm:num_requests_running,
            # ...) join ours on the service's /metrics endpoint.
            disable_log_stats=False,
            **kwargs,
        )
        self._llm = AsyncLLM.from_engine_args(args)

    def _mm_limits(self) -> dict[str, int]:
        """Per-prompt item limits for every modality the model has. Modalities EPD does not
        serve for this family get 0, so vLLM neither accepts nor profiles them (an unset
        modality would default to 999 items)."""
        from epd.domain import Modality
        from epd.models import load_family

        family = load_family(self.config.model)
        per_modality = {
            Modality.IMAGE: self.config.max_images_per_prompt,
            Modality.VIDEO: self.config.max_videos_per_prompt,
            Modality.AUDIO: self.config.max_audios_per_prompt,
        }
        return {m.value: per_modality[m] if m in family.supported_modalities else 0 for m in family.model_modalities}

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def generate(
        self,
        request_id: str,
        prompt: dict[str, Any],
        sampling: Sampling,
        *,
        kv_params: dict[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[EngineStep]:
        """Streams the request's output as deltas; aborts it in the engine if the caller stops."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens = max_tokens or sampling.max_tokens
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(sampling.min_tokens, max_tokens),
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p,
            top_k=0 if sampling.top_k in (None, -1) else sampling.top_k,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_params} if kv_params else None,
        )
        finished = False
        try:
            async for output in self._llm.generate(prompt, params, request_id):
                completion = output.outputs[0]
                finished = output.finished
                reason = None
                if finished:
                    reason = _FINISH.get(str(completion.finish_reason))
                    if reason is None:
                        # vLLM's "error": a request-level engine failure such as a KV load
                        # that did not complete. Retryable, and never a silent empty reply.
                        raise Unavailable(f"engine failed request {request_id} (finish reason {completion.finish_reason!r})")
                yield EngineStep(
                    token_ids=list(completion.token_ids),
                    text=completion.text,
                    prompt_token_count=len(output.prompt_token_ids or ()),
                    finish_reason=reason,
                    kv_handoff=kv_handoff_from_engine(output.kv_transfer_params) if output.finished else None,
                )
        finally:
            if not finished:
                await self._llm.abort(request_id)


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


def _configure_vllm_environment(config: EngineConfig) -> None:
    """vLLM reads these knobs only from the environment, so set them right before it starts.

    CPU threads are left unbound: several engines share a small host in tests and demos, and
    vLLM's automatic binding would pin them all to the same cores.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if config.kv_role is not KvRole.NONE:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = config.nixl_side_channel_host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(config.nixl_side_channel_port or _free_port(config.nixl_side_channel_host))


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

"""vLLM's NixlConnector for the KV handoff, with two changes that leave its protocol alone.

- **A NIXL progress thread that sleeps when idle.** nixl's Python agent (``nixl_agent``, which
  vLLM's connector builds) hard-codes its progress thread's wakeup delay (``pthrDelay``) to 0, so
  the thread polls UCX without ever sleeping: an idle prefill or decode engine burns one full core
  (measured here: 99 % of a core each, with no request in flight). On a host that runs several
  engines, as every CPU deployment and test here does, that starves the engines that have work.
  With a delay, the thread sleeps in ``poll()`` on UCX's event descriptors, so it still wakes at
  once for a READ or a notification; the delay is only its fallback wakeup, the same one EPD's
  own embedding agents use.
- **Failures that say why.** vLLM ends a request whose KV could not be loaded with finish reason
  "error" and logs the cause. The worker's failures are also noted on the engine core's desk
  (:mod:`epd.transport.desk`, named by ``kv_connector_extra_config["epd_desk"]``), so
  the decode service's status names the cause.
- **The decode continues after the prefill's first token.** vLLM's decode loads the KV of its
  whole prompt and computes the prompt's last token again to sample the first one. Here the
  decode's prompt ends with the prefill's first token, after the KV's tokens
  (``remote_num_tokens``), so it loads only those and computes that token itself, as a
  monolithic engine's first decode step does. Every position is then computed as a monolithic
  engine computes it: the prompt in one prefill, each later token in a one-token step. vLLM's
  way rounds differently wherever a one-token step and a prefill do: in bf16 on an AMX CPU a
  reply diverged from the monolithic one at its third token.
- **A handoff that breaks a READ fails only its request.** vLLM's worker trusts the handoff it is
  given: block lists that do not fit this engine's KV layout (an empty group where the decode
  allocated blocks, fewer blocks than the prompt) raise an ``AssertionError`` or ``ValueError``
  on the engine core's step, which kills the engine and every request on it. The decode service
  refuses the shapes it can see (``epd.wire.kv_handoff_from_wire``, ``services.engine_stage``);
  whatever still raises while a request's READ is prepared fails that request alone, as a
  refused handoff (:data:`HANDOFF_REFUSED`), which the service reports as INVALID_ARGUMENT.

Engines load this module by ``kv_connector_module_path`` (:class:`epd.engine.Engine`), in the
process that creates the agent.
"""

from __future__ import annotations

from typing import Any

from nixl import _bindings as nixlb
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as VllmNixlConnector

from epd.transport.desk import HANDOFF_REFUSED, FailureLedger, open_desk
from epd.transport.wire.agent import PROGRESS_WAKEUP_US

__all__ = ["DESK_KEY", "NixlConnector"]

DESK_KEY = "epd_desk"

_agent_class = nixlb.nixlAgent


def _agent_whose_progress_thread_sleeps(name: str, config):
    if config.useProgThread and config.pthrDelay == 0:
        config.pthrDelay = PROGRESS_WAKEUP_US
    return _agent_class(name, config)


nixlb.nixlAgent = _agent_whose_progress_thread_sleeps


class NixlConnector(VllmNixlConnector):
    """vLLM's pull connector; its worker's transfer failures are noted on the engine's desk."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        desk_name = vllm_config.kv_transfer_config.get_from_extra_config(DESK_KEY, None)
        worker = self.connector_worker
        # The desk lives in the engine-core process, beside the scheduler's connectors; so does the
        # worker only when it is the engine's one worker (vLLM's in-process executor). With more,
        # their failures stay in the log: a desk per worker process would shadow the engine's.
        beside_the_scheduler = vllm_config.parallel_config.world_size == 1
        self._desk = open_desk(desk_name) if desk_name and worker is not None and beside_the_scheduler else None
        if self._desk is not None:
            # Every failure of vLLM's worker goes through this one method (it logs them).
            worker._log_failure = _noting_failures(worker, self._desk.failures)
        if worker is not None:
            worker._read_blocks_for_req = _failing_alone(worker)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        count, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        params = request.kv_transfer_params
        # (count None is vLLM's "ask again later", not a count.)
        if count and params and params.get("do_remote_prefill") and params.get("remote_num_tokens"):
            # The tokens whose KV the prefill holds, at most; after them comes its first token.
            count = max(0, min(count, params["remote_num_tokens"] - num_computed_tokens))
            load_async = load_async and count > 0
        return count, load_async

    def shutdown(self) -> None:
        super().shutdown()
        if self._desk is not None:
            self._desk.release()
            self._desk = None


def _noting_failures(worker, ledger: FailureLedger):
    log_failure = worker._log_failure

    def log_and_note(failure_type: str, req_id: str | None, msg: str = "", error: BaseException | None = None, meta: Any = None, **context) -> None:
        log_failure(failure_type, req_id, msg, error, meta, **context)
        if req_id is not None:
            # vLLM's logger finds the request's transfer the same way when it is not given.
            ledger.record(req_id, _describe(failure_type, msg, error, meta or worker._recving_metadata.get(req_id)))

    return log_and_note


def _failing_alone(worker):
    """The worker's per-request READ set-up, with an exception failing that request alone:
    reported as a failed receive (vLLM's path for a handshake that failed), not raised into the
    engine core's step."""
    read_blocks_for_req = worker._read_blocks_for_req

    def read_or_fail(req_id: str, meta) -> None:
        try:
            read_blocks_for_req(req_id, meta)
        except Exception as exc:
            worker._log_failure(failure_type="kv_handoff_refused", req_id=req_id, msg=HANDOFF_REFUSED, error=exc, meta=meta)
            if not worker._recving_transfers.get(req_id):
                worker._recving_transfers.pop(req_id, None)  # seeded for a READ that never went out
            worker._failed_recv_reqs.put(req_id)

    return read_or_fail


def _describe(failure_type: str, msg: str, error: BaseException | None, meta: Any) -> str:
    remote = getattr(meta, "remote", None)
    source = f" from the prefill engine {remote.engine_id} at {remote.host}:{remote.port}" if remote is not None else ""
    details = "; ".join(part for part in (msg, f"{type(error).__name__}: {error}" if error is not None else "") if part)
    return f"its prefilled KV could not be had{source}: {failure_type.replace('_', ' ')}" + (f" ({details})" if details else "")

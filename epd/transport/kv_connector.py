"""vLLM's NixlConnector for the KV handoff, with a NIXL progress thread that sleeps when idle.

nixl's Python agent (``nixl_agent``, which vLLM's connector builds) hard-codes its progress
thread's wakeup delay (``pthrDelay``) to 0, so the thread polls UCX without ever sleeping: an idle
prefill or decode engine burns one full core (measured here: 99 % of a core each, with no request
in flight). On a host that runs several engines, as every CPU deployment and test here does, that
starves the engines that have work. With a delay, the thread sleeps in ``poll()`` on UCX's event
descriptors, so it still wakes at once for a READ or a notification; the delay is only its
fallback wakeup, the same one EPD's own embedding agents use.

Engines load this module by ``kv_connector_module_path`` (:class:`epd.engine.Engine`), in the
process that creates the agent; the connector itself is vLLM's, unchanged.
"""

from __future__ import annotations

from nixl import _bindings as nixlb
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from epd.transport._agent import PROGRESS_WAKEUP_US

__all__ = ["NixlConnector"]

_agent_class = nixlb.nixlAgent


def _agent_whose_progress_thread_sleeps(name: str, config):
    if config.useProgThread and config.pthrDelay == 0:
        config.pthrDelay = PROGRESS_WAKEUP_US
    return _agent_class(name, config)


nixlb.nixlAgent = _agent_whose_progress_thread_sleeps

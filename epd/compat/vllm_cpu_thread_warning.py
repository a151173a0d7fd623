"""Says once, not twice a multimodal request, that vLLM's CPU worker skips ``torch.set_num_threads``.

vLLM 0.32's CPU worker replaces ``torch.set_num_threads``, process-wide, with a function that
skips the call and logs a WARNING (``vllm/v1/worker/cpu_worker.py``), and vLLM's renderer sets the
thread count around every multimodal processor call (``set_default_torch_num_threads``). With the
engine core on a thread of the service (``epd.engine_thread``) both run in one process, so every
request with media wrote two identical warnings: 1559 of an encoder's 1610 log lines in one
``bench --only encoder_throughput`` run, each a formatted write on the serving path. The skip
itself is harmless (each thread keeps the count it has). :func:`install` lets the first warning
through and drops its repeats. Remove it once vLLM warns once.
"""

from __future__ import annotations

import functools
import logging

LOGGER = "vllm.v1.worker.cpu_worker"
MESSAGE = "CPU backend doesn't allow to use `torch.set_num_threads`"


class _OnlyOnce(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(MESSAGE):
            return True
        seen, self._seen = self._seen, True
        return not seen


@functools.cache
def install() -> None:
    logging.getLogger(LOGGER).addFilter(_OnlyOnce())

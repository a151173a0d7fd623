"""vLLM's engine core on a thread of the service's own process, behind ``AsyncLLM``.

vLLM runs ``AsyncLLM``'s engine core in a process of its own, and says running it in-process under
asyncio "is not currently supported". That process costs EPD, for every role: a second import of
vLLM at start (its CPU platform forces ``spawn``; about 7 of 18 s to ready on a 2-core host), and
the serialization of every request and every step's outputs between the service and the core.
On a host where the stages share a few cores those are a large part of a request's CPU.

:class:`ThreadedEngineCore` is an engine-core client with the asyncio API ``AsyncLLM`` drives
(add, abort, outputs, utility calls), over vLLM's own ``EngineCore`` stepped by one thread here.
Everything that touches the core runs on that thread: requests and aborts reach it through a
queue, as they reach a core process through its socket, and each step's outputs come back to the
event loop through ``call_soon_threadsafe``. Torch and NIXL release the GIL while they work, so the
service's event loop runs during a step; the core's Python and the service's share one GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.engine.exceptions import EngineDeadError

logger = logging.getLogger(__name__)

_STOP = object()
# A step that ran no model while requests wait (a decode waiting for KV from a prefill, an encoder
# output being read): vLLM's core process yields the GIL this long, so transfer threads progress.
_WAITING_STEP_PAUSE_S = 0.001


@dataclasses.dataclass
class _Resources:
    """What ``AsyncLLM.errored`` reads of a client."""

    engine_dead: bool = False


class ThreadedEngineCore:
    """An engine-core client whose ``EngineCore`` runs on a thread of this process.

    Implements the part of vLLM's ``EngineCoreClient`` that ``AsyncLLM`` uses in EPD's services;
    any other call raises AttributeError rather than pretending.
    """

    def __init__(self, build_core: Callable[[Callable[[], None]], Any]):
        """``build_core(on_executor_failure)`` returns the ``EngineCore`` (it loads the model)."""
        self.resources = _Resources()
        self.engine_ranks_managed = [0]
        self._inputs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future] | object] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._core = build_core(self._executor_failed)
        self._thread = threading.Thread(target=self._run, name="vllm-engine-core", daemon=True)
        self._thread.start()

    # --- the asyncio side (the service's event loop) ------------------------------------------

    def _bind_loop(self) -> asyncio.Queue:
        if self._outputs is None:
            self._loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue()
        return self._outputs

    def _submit(self, work: Callable[[], Any]) -> asyncio.Future:
        """Runs ``work`` on the engine thread between steps; its result comes back as a future."""
        self._bind_loop()
        if self.resources.engine_dead:
            raise EngineDeadError()
        future = self._loop.create_future()
        self._inputs.put((work, future))
        return future

    async def get_output_async(self):
        outputs = await self._bind_loop().get()
        if isinstance(outputs, BaseException):
            raise outputs
        return outputs

    async def add_request_async(self, request) -> None:
        core = self._core
        await self._submit(lambda: core.add_request(*core.preprocess_add_request(request)))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._submit(lambda: self._core.abort_requests(request_ids))

    async def get_supported_tasks_async(self):
        return await self._submit(self._core.get_supported_tasks)

    async def reset_mm_cache_async(self) -> None:
        await self._submit(self._core.reset_mm_cache)

    async def reset_prefix_cache_async(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return await self._submit(lambda: self._core.reset_prefix_cache(reset_running_requests, reset_connector))

    async def reset_encoder_cache_async(self) -> None:
        await self._submit(self._core.reset_encoder_cache)

    def get_kv_event_sources(self) -> dict:
        return {}

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._inputs.put(_STOP)
            self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        try:
            while not self.resources.engine_dead:  # the executor's failure callback may end it
                if not self._take_inputs(block=not _has_work(core)):
                    return
                if not _has_work(core):
                    continue
                outputs, model_executed = core.step_fn()
                core.post_step(model_executed)
                step_outputs = outputs and outputs.get(0)
                if step_outputs is not None and (step_outputs.outputs or step_outputs.scheduler_stats):
                    self._deliver(step_outputs)
                if not model_executed and core.scheduler.has_requests():
                    time.sleep(_WAITING_STEP_PAUSE_S)
        except BaseException as exc:  # the core is dead: every stream and later call learns it
            logger.exception("vLLM's engine core failed on its thread")
            self._die(exc)
        finally:
            core.shutdown()

    def _take_inputs(self, block: bool) -> bool:
        """Applies queued requests and aborts; waits for one when the core is idle. False: stop."""
        while True:
            try:
                item = self._inputs.get(block=block)
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            work, future = item
            try:
                result = work()
            except Exception as exc:  # the caller's call failed, not the core
                self._settle(future, exc, failed=True)
            else:
                self._settle(future, result)
            block = False

    def _settle(self, future: asyncio.Future, value: Any, failed: bool = False) -> None:
        def settle() -> None:
            if not future.done():
                future.set_exception(value) if failed else future.set_result(value)

        self._loop.call_soon_threadsafe(settle)

    def _deliver(self, outputs: Any) -> None:
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)

    def _executor_failed(self) -> None:
        self._die(RuntimeError("vLLM's executor failed"))

    def _die(self, cause: BaseException) -> None:
        self.resources.engine_dead = True
        if self._loop is not None:
            dead = EngineDeadError()
            dead.__cause__ = cause
            self._deliver(dead)
            while True:  # calls queued behind the failure are answered, not left hanging
                try:
                    item = self._inputs.get_nowait()
                except queue.Empty:
                    return
                if item is not _STOP:
                    self._settle(item[1], EngineDeadError(), failed=True)


def _has_work(core) -> bool:
    """Whether the core has a step to take (vLLM's ``EngineCoreProc.has_work``, less data parallelism)."""
    return core.scheduler.has_requests() or bool(core.batch_queue)


@contextlib.contextmanager
def engine_core_on_a_thread() -> Iterator[None]:
    """While constructing an ``AsyncLLM``: its engine core on a thread here instead of a process.

    ``AsyncLLM.__init__`` builds its client with ``EngineCoreClient.make_async_mp_client`` and
    takes no client class, so that one call is redirected for the construction only.
    """
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.core import EngineCore

    def make_client(vllm_config, executor_class, log_stats: bool, **_multiprocess_only: Any) -> ThreadedEngineCore:
        return ThreadedEngineCore(lambda on_failure: EngineCore(vllm_config, executor_class, log_stats, executor_fail_callback=on_failure))

    client_class = async_llm.EngineCoreClient
    original = client_class.__dict__["make_async_mp_client"]
    client_class.make_async_mp_client = staticmethod(make_client)
    try:
        yield
    finally:
        client_class.make_async_mp_client = original

"""The thread that drives vLLM's engine core in a service's process (epd.engine_thread).

Unit tests of the driver's own logic, over a stand-in core that records what reached it: the
real core behind it is exercised by every service test, which runs engines this way.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from epd.engine_thread import ThreadedEngineCore


class _Outputs:
    def __init__(self, outputs):
        self.outputs = outputs
        self.scheduler_stats = None


class _Scheduler:
    def __init__(self, core: _RecordingCore):
        self._core = core

    def has_requests(self) -> bool:
        return bool(self._core.running)


class _RecordingCore:
    """A core that emits one output per running request per step, for ``steps`` steps each."""

    batch_queue = None

    def __init__(self, steps: int = 3, fail_on_step: int | None = None):
        self.scheduler = _Scheduler(self)
        self.steps = steps
        self.fail_on_step = fail_on_step
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.stepped = 0
        self.shut_down = threading.Event()
        self.thread_names: set[str] = set()

    def preprocess_add_request(self, request):
        if request == "malformed":
            raise ValueError("the caller's request is malformed")
        return request, 0

    def add_request(self, request, wave):
        self.thread_names.add(threading.current_thread().name)
        self.running[request] = self.steps

    def abort_requests(self, request_ids):
        self.thread_names.add(threading.current_thread().name)
        self.aborted += request_ids
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def step_fn(self):
        self.thread_names.add(threading.current_thread().name)
        self.stepped += 1
        if self.stepped == self.fail_on_step:
            raise RuntimeError("a worker assertion")
        outputs = []
        for request_id in list(self.running):
            self.running[request_id] -= 1
            outputs.append((request_id, self.running[request_id]))
            if not self.running[request_id]:
                del self.running[request_id]
        return {0: _Outputs(outputs)}, True

    def post_step(self, model_executed):
        pass

    def shutdown(self):
        self.shut_down.set()


async def _collect(client: ThreadedEngineCore, count: int) -> list:
    outputs = []
    while len(outputs) < count:
        outputs += (await asyncio.wait_for(client.get_output_async(), 10)).outputs
    return outputs


async def test_requests_are_stepped_on_the_engine_thread_and_their_outputs_come_back_in_order():
    core = _RecordingCore(steps=3)
    client = ThreadedEngineCore(lambda on_failure: core)
    try:
        await client.add_request_async("a")
        assert await _collect(client, 3) == [("a", 2), ("a", 1), ("a", 0)]
        await client.add_request_async("b")
        await client.abort_requests_async(["b"])
        assert "b" in core.aborted
        assert core.thread_names == {"vllm-engine-core"}  # never the event loop's thread
    finally:
        client.shutdown(timeout=10)
    assert core.shut_down.is_set()
    assert not client.resources.engine_dead


async def test_a_call_the_core_refuses_fails_alone():
    core = _RecordingCore(steps=1)
    client = ThreadedEngineCore(lambda on_failure: core)
    try:
        with pytest.raises(ValueError, match="malformed"):
            await client.add_request_async("malformed")
        await client.add_request_async("next")
        assert await _collect(client, 1) == [("next", 0)]
        assert not client.resources.engine_dead
    finally:
        client.shutdown(timeout=10)


async def test_a_failed_step_kills_the_core_and_every_stream_and_later_call_learns_it():
    from vllm.v1.engine.exceptions import EngineDeadError

    core = _RecordingCore(steps=5, fail_on_step=2)
    client = ThreadedEngineCore(lambda on_failure: core)
    await client.add_request_async("a")
    assert await _collect(client, 1) == [("a", 4)]
    with pytest.raises(EngineDeadError):
        await _collect(client, 1)
    assert client.resources.engine_dead  # what AsyncLLM.errored, and so Engine.alive, read
    assert core.shut_down.wait(10)
    with pytest.raises(EngineDeadError):
        await client.add_request_async("after")
    client.shutdown(timeout=10)


async def test_the_executors_failure_callback_kills_the_core():
    from vllm.v1.engine.exceptions import EngineDeadError

    callbacks = []
    core = _RecordingCore()
    client = ThreadedEngineCore(lambda on_failure: callbacks.append(on_failure) or core)
    try:
        await client.add_request_async("a")
        callbacks[0]()
        assert client.resources.engine_dead
        with pytest.raises(EngineDeadError):
            await client.add_request_async("after")
    finally:
        client.shutdown(timeout=10)

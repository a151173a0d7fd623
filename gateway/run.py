"""One request's pipeline running in its own task, read by the front that streams it back.

Both fronts (the gRPC ``Generate`` and the OpenAI-compatible HTTP one) use it. The task lets an
abort, or a client that went away, cancel the pipeline at any point while the front can still
send a last message.

Deltas the front has not yet taken are merged into one, as vLLM's ``RequestOutputCollector``
does. A client or front that reads slower than the decode produces then gets fewer, larger
messages rather than a backlog. Each relayed message costs the gateway about 0.2 ms of CPU in
grpc.aio alone (bench/gateway_overhead.py's bare relay), most of its work per request.

The front's stream ends with the ``Finished`` event, not with the pipeline: what the pipeline
still does after it (reading the decode call to its status) is no part of the reply, so the
front sends its own status at once and the pipeline winds down in the background.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from gateway.pipeline import Delta, Event, Finished


class RunCancelled(Exception):
    """The run was cancelled (an abort, or its client left) before it ended."""


_END = object()
_CANCELLED = object()

# Every run's task until it ends: the loop keeps only weak references to tasks, and a run whose
# front has gone winds down on its own.
_running: set[asyncio.Task] = set()


async def wait_for_wind_downs() -> None:
    """Waits for the runs still going, so a gateway that stops lets each read its decode call to
    its status first (each wait is bounded: ``gateway.stages._read_to_status``)."""
    if _running:
        await asyncio.wait(set(_running))


class PipelineRun:
    def __init__(self, events: AsyncIterator[Event]):
        self._pending: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._task = asyncio.create_task(self._pump(events))
        _running.add(self._task)
        self._task.add_done_callback(_running.discard)
        self._finished = False  # the Finished event was handed out

    async def next(self) -> Event | None:
        """The next event (all deltas produced since the last call, as one), None after
        ``Finished`` (or after the last event of a pipeline that ended without one).

        Raises:
            RunCancelled: if :meth:`cancel` stopped the run.
            Exception: the pipeline's own error.
        """
        if self._finished:
            return None
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        item = self._pending.popleft()
        if item is _CANCELLED:
            raise RunCancelled
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Finished):
            self._finished = True
        return None if item is _END else item

    def cancel(self) -> None:
        """Stops the pipeline; synchronous, so any way out of a front can call it. A run whose
        ``Finished`` was handed out is left to wind down instead: its reply is complete."""
        if not self._finished:
            self._task.cancel()

    async def close(self) -> None:
        """Stops the pipeline and waits until its clean-up (lease and KV release) is done; a run
        whose ``Finished`` was handed out winds down in the background instead."""
        if self._finished:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _pump(self, events: AsyncIterator[Event]) -> None:
        try:
            async for event in events:
                self._put(event)
        except asyncio.CancelledError:
            self._put(_CANCELLED)
            raise
        except Exception as exc:  # noqa: BLE001 - raised to the reader
            self._put(exc)
        else:
            self._put(_END)

    def _put(self, item: object) -> None:
        if isinstance(item, Delta) and self._pending and isinstance(self._pending[-1], Delta):
            last = self._pending[-1]
            self._pending[-1] = Delta(last.token_ids + item.token_ids, last.text + item.text)
        else:
            self._pending.append(item)
        self._ready.set()

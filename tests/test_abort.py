"""Abort ends a stream with FINISH_REASON_ABORT and frees its stages; unknown ids are NOT_FOUND."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.v1 import common_pb2, gateway_pb2
from tests.helpers import wait_for_metric


async def test_abort_ends_the_stream_and_frees_everything(family_stack):
    stub = family_stack.gateway_stub("epd")
    request = chat_request([(synthetic_image_png(128, 128, seed=44), "image/png"), "Go on."], max_tokens=2000, min_tokens=2000, request_id="to-abort")
    events = []
    async for response in stub.Generate(request, timeout=120):
        events.append(response)
        if len(events) == 3:
            await stub.Abort(gateway_pb2.AbortRequest(request_id="to-abort"), timeout=10)
    assert events[-1].HasField("finished")
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(len(e.delta.token_ids) for e in events if e.HasField("delta")) < 2000
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
    # Cancellation reached the decode stage: its stream (and engine request) ended.
    assert await wait_for_metric(family_stack.decode.metrics_port, "epd_requests_in_flight", 0.0) == 0.0


async def test_abort_of_unknown_request_is_not_found(family_stack):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await family_stack.gateway_stub("epd").Abort(gateway_pb2.AbortRequest(request_id="never-sent"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no in-flight request with id 'never-sent'"


async def test_a_request_id_already_in_flight_is_refused(family_stack):
    stub = family_stack.gateway_stub("epd")
    request = chat_request([(synthetic_image_png(96, 96, seed=46), "image/png"), "Go on."], max_tokens=2000, min_tokens=2000, request_id="twice")
    first = stub.Generate(request, timeout=120)
    assert (await first.read()).HasField("delta")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(stub, request, timeout=30)
    await stub.Abort(gateway_pb2.AbortRequest(request_id="twice"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert refused.value.details() == "request_id 'twice' is already in flight"
    while (response := await first.read()) is not grpc.aio.EOF:
        last = response
    assert last.finished.finish_reason == common_pb2.FINISH_REASON_ABORT


async def test_a_run_merges_the_deltas_its_reader_has_not_taken_and_reports_its_cancellation():
    """Pure logic of the gateway's per-request run: a reader slower than the decode gets the
    backlog as one delta, and a cancelled run says so instead of ending quietly."""
    from epd.domain import FinishReason
    from gateway.pipeline import Delta, Finished, Timings, Usage
    from gateway.run import PipelineRun, RunCancelled

    finished = Finished(FinishReason.LENGTH, Usage(3, 4, 0), Timings())

    async def burst():
        for token in range(4):
            yield Delta([token], f"t{token}")
        yield finished

    run = PipelineRun(burst())
    await asyncio.sleep(0)  # the pipeline produces everything before the reader looks
    assert await run.next() == Delta([0, 1, 2, 3], "t0t1t2t3")
    assert await run.next() == finished
    assert await run.next() is None

    started = asyncio.Event()

    async def endless():
        yield Delta([7], "x")
        started.set()
        await asyncio.Event().wait()
        yield Delta([8], "never")

    run = PipelineRun(endless())
    await started.wait()
    assert await run.next() == Delta([7], "x")
    run.cancel()
    with pytest.raises(RunCancelled):
        await run.next()
    await run.close()


async def test_a_run_ends_its_front_at_the_finished_event_and_winds_down_behind_it():
    """What a pipeline does after its Finished event (the decode call read to its status) is no
    part of the reply: the front's stream ends at once, and neither close nor cancel cuts the
    pipeline's tail short."""
    from epd.domain import FinishReason
    from gateway.pipeline import Delta, Finished, Timings, Usage
    from gateway.run import PipelineRun, wait_for_wind_downs

    finished = Finished(FinishReason.STOP, Usage(3, 1, 0), Timings())
    tail_may_end = asyncio.Event()
    tail: list[str] = []

    async def with_a_tail():
        yield Delta([5], "y")
        yield finished
        try:
            await tail_may_end.wait()
            tail.append("completed")
        except asyncio.CancelledError:
            tail.append("cancelled")
            raise

    for stop in ("close", "cancel"):
        tail.clear()
        tail_may_end.clear()
        run = PipelineRun(with_a_tail())
        assert await run.next() == Delta([5], "y")
        assert await run.next() == finished
        assert await asyncio.wait_for(run.next(), 1) is None  # not waiting for the tail
        if stop == "close":
            await asyncio.wait_for(run.close(), 1)
        else:
            run.cancel()
        await asyncio.sleep(0.05)
        assert tail == []
        tail_may_end.set()
        await asyncio.wait_for(wait_for_wind_downs(), 1)  # what a stopping gateway waits for
        assert tail == ["completed"], stop

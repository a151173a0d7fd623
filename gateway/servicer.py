"""GatewayService servicer: parse the public request, run the pipeline, stream it back."""

from __future__ import annotations

import time

from google.protobuf import duration_pb2

from epd import wire
from epd.domain import FinishReason
from epd.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable
from epd.offload import INLINE_MESSAGE_BYTES, run_sized
from epd.rpc import request_bytes, rpc_method
from epd.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.pipeline import Delta, Finished, RequestClock
from gateway.run import PipelineRun, RunCancelled


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self._in_flight: dict[str, PipelineRun] = {}

    @rpc_method("gateway")
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        """Streams the reply to a multimodal chat.

        Args:
            request: messages (text and media parts), sampling and an optional request id.
            context: the RPC context; its deadline bounds every stage, and cancelling it aborts
                every stage.

        Yields:
            Deltas, then exactly one ``finished`` message.
        """
        if self.pipeline is None:
            raise Unavailable("gateway is still starting")
        # The request's counts and times, from its arrival: the pipeline keeps them here, so an
        # aborted stream still reports them.
        clock = RequestClock()
        # Parsing hashes every media item: megabytes of work for a large request, which must not
        # stall other streams.
        generate = await run_sized(request_bytes(), INLINE_MESSAGE_BYTES, wire.generate_request_from_wire, request)
        if generate.request_id in self._in_flight:
            raise AlreadyExists(f"request_id {generate.request_id!r} is already in flight")
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        run = PipelineRun(self.pipeline.generate(generate, deadline, clock))
        self._in_flight[generate.request_id] = run
        try:
            while (event := await run.next()) is not None:
                yield _event_to_wire(event)
        except RunCancelled:  # by Abort; a dropped client is no longer reading
            yield _event_to_wire(Finished(FinishReason.ABORT, clock.usage(), clock.snapshot(), tuple(clock.resumed_after)))
        finally:
            del self._in_flight[generate.request_id]
            await run.close()

    @rpc_method("gateway")
    async def Abort(self, request: gateway_pb2.AbortRequest, context) -> gateway_pb2.AbortResponse:
        """Aborts an in-flight Generate call; its stream ends with FINISH_REASON_ABORT.

        Args:
            request: the request id to abort.
            context: the RPC context.

        Returns:
            An empty response once the abort has been issued.
        """
        if not request.request_id:
            raise InvalidArgument.for_field("request_id", "is required")
        run = self._in_flight.get(request.request_id)
        if run is None:
            raise NotFound(f"no in-flight request with id {request.request_id!r}")
        run.cancel()
        return gateway_pb2.AbortResponse()


def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(int(seconds * 1e9))
    return value


def _event_to_wire(event) -> gateway_pb2.GenerateResponse:
    if isinstance(event, Delta):
        return gateway_pb2.GenerateResponse(delta=gateway_pb2.GenerateDelta(token_ids=event.token_ids, text=event.text))
    t = event.timings
    return gateway_pb2.GenerateResponse(
        finished=gateway_pb2.GenerateFinished(
            finish_reason=wire.finish_reason_to_wire(event.reason),
            usage=gateway_pb2.Usage(
                prompt_tokens=event.usage.prompt_tokens,
                completion_tokens=event.usage.completion_tokens,
                multimodal_tokens=event.usage.multimodal_tokens,
            ),
            timings=gateway_pb2.StageTimings(
                encode=_duration(t.encode),
                prefill=_duration(t.prefill),
                decode=_duration(t.decode),
                time_to_first_token=_duration(t.time_to_first_token),
                total=_duration(t.total),
            ),
            resumed_after_tokens=event.resumed_after,
        )
    )

"""DecodeService servicer: decode from a KV handoff (metadata only), or run the whole
generation (E+PD: a request without a handoff), and stream tokens."""

from __future__ import annotations

from epd import wire
from epd.errors import Unavailable
from epd.rpc import rpc_method
from epd.v1 import decode_pb2, decode_pb2_grpc
from services.engine_stage import EngineStage


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.stage: EngineStage | None = None  # set once the engine has loaded

    @rpc_method("decode")
    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        """Streams one request's tokens.

        Args:
            request: prompt with one placeholder per item, item metadata, sampling, and either
                the KV handoff (E/P/D) or each item's embedding handle (E+PD).
            context: the RPC context; cancelling it aborts the engine request.

        Yields:
            Token deltas; the last message carries the finish reason.
        """
        if self.stage is None:
            raise Unavailable("decode engine is still loading")
        async for step in self.stage.decode(wire.decode_request_from_wire(request)):
            response = decode_pb2.DecodeResponse(token_ids=step.token_ids, text=step.text, prompt_token_count=step.prompt_token_count)
            if step.finish_reason is not None:
                response.finish_reason = wire.finish_reason_to_wire(step.finish_reason)
            yield response

    @rpc_method("decode")
    async def ReleaseKv(self, request: decode_pb2.ReleaseKvRequest, context) -> decode_pb2.ReleaseKvResponse:
        """Has the prefill that produced ``request.kv_handoff`` free its KV blocks now."""
        if self.stage is None:
            raise Unavailable("decode engine is still loading")
        await self.stage.release_kv(request.request_id or "unnamed", wire.kv_handoff_from_wire(request.kv_handoff))
        return decode_pb2.ReleaseKvResponse()

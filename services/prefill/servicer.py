"""PrefillService servicer: parse, prefill, return the first token and the KV handoff."""

from __future__ import annotations

from epd import wire
from epd.errors import Unavailable
from epd.rpc import rpc_method
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from services.engine_stage import EngineStage


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self) -> None:
        self.stage: EngineStage | None = None  # set once the engine has loaded

    @rpc_method("prefill")
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        """Prefills one request and leaves its KV for the decode engine.

        Args:
            request: prompt (a chat, or its token ids) with one placeholder per item, items with
                embedding handles, sampling.
            context: the RPC context; cancelling it aborts the engine request.

        Returns:
            The first token, the KV handoff, the prompt's token ids and timings.
        """
        if self.stage is None:
            raise Unavailable("prefill engine is still loading")
        result = await self.stage.prefill(wire.prefill_request_from_wire(request))
        response = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            first_token_text=result.first_token_text,
            kv_handoff=wire.kv_handoff_to_wire(result.kv_handoff),
            prompt_token_count=result.prompt_token_count,
            engine_s=result.engine_s,
            prompt_token_ids=result.prompt_token_ids,
        )
        if result.finish_reason is not None:
            response.finish_reason = wire.finish_reason_to_wire(result.finish_reason)
        return response

"""DecodeService servicer: decode from a KV handoff (metadata only), or run the whole
generation in combined mode (E+PD), and stream tokens."""

from __future__ import annotations

import enum

from epd import wire
from epd.embeddings import EmbeddingSource
from epd.engine import Engine, kv_params_for_decode
from epd.errors import FailedPrecondition, Unavailable
from epd.models import ModelFamily
from epd.rpc import rpc_method
from epd.v1 import decode_pb2, decode_pb2_grpc
from services.forwarded_media import ForwardedMediaLayout


class DecodeMode(enum.Enum):
    DECODE = "decode"  # E/P/D: KV arrives from a prefill engine; media only as metadata
    COMBINED = "combined"  # E+PD: reads embeddings itself and prefills too


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, mode: DecodeMode, family: ModelFamily, source: EmbeddingSource | None, forwarded: ForwardedMediaLayout) -> None:
        self.mode = mode
        self.family = family
        self.source = source
        self.forwarded = forwarded
        self.engine: Engine | None = None  # set once the model has loaded

    @rpc_method("decode")
    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        """Streams one request's tokens.

        Args:
            request: prompt with one placeholder per item, item metadata (plus embedding handles
                in combined mode), sampling, and in decode mode the KV handoff.
            context: the RPC context; cancelling it aborts the engine request.

        Yields:
            Token deltas; the last message carries the finish reason.
        """
        if self.engine is None:
            raise Unavailable("decode engine is still loading")
        engine_request = await self.forwarded.rederive(wire.decode_request_from_wire(request))
        metadata = [i.metadata for i in engine_request.items]
        fetch_s = 0.0
        if self.mode is DecodeMode.DECODE:
            if engine_request.kv_handoff is None:
                raise FailedPrecondition("this decode service runs in decode mode and needs kv_handoff (use a combined instance for E+PD)")
            self.family.validate_layout(engine_request.prompt_token_ids, metadata)
            prompt = self.family.engine_prompt(engine_request, None)
            kv_params = kv_params_for_decode(engine_request.kv_handoff)
        else:
            if engine_request.kv_handoff is not None:
                raise FailedPrecondition("this decode service runs in combined mode and cannot take a kv_handoff")
            embeddings, fetch_s = await self.source.load(engine_request.items)
            self.family.validate_layout(engine_request.prompt_token_ids, metadata)
            prompt = self.family.engine_prompt(engine_request, embeddings)
            kv_params = None
        async for step in self.engine.generate(f"{engine_request.request_id}-decode", prompt, engine_request.sampling, kv_params=kv_params):
            response = decode_pb2.DecodeResponse(token_ids=step.token_ids, text=step.text)
            if step.finish_reason is not None:
                response.finish_reason = wire.finish_reason_to_wire(step.finish_reason)
                response.prompt_token_count = step.prompt_token_count
                response.embedding_fetch_s = fetch_s
            yield response

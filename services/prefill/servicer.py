"""PrefillService servicer: parse, pull embeddings, prefill, return the KV handoff."""

from __future__ import annotations

import time

from epd import wire
from epd.embeddings import EmbeddingSource
from epd.engine import Engine, kv_params_for_prefill
from epd.errors import Unavailable
from epd.models import ModelFamily
from epd.rpc import rpc_method
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from services.forwarded_media import ForwardedMediaLayout


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, family: ModelFamily, source: EmbeddingSource, forwarded: ForwardedMediaLayout) -> None:
        self.family = family
        self.source = source
        self.forwarded = forwarded
        self.engine: Engine | None = None  # set once the model has loaded

    @rpc_method("prefill")
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        """Prefills one request and leaves its KV for the decode engine.

        Args:
            request: prompt with one placeholder per item, items with embedding handles, sampling.
            context: the RPC context; cancelling it aborts the engine request.

        Returns:
            The first token, the KV handoff and timings.
        """
        if self.engine is None:
            raise Unavailable("prefill engine is still loading")
        engine_request = await self.forwarded.rederive(wire.prefill_request_from_wire(request))
        embeddings, fetch_s = await self.source.load(engine_request.items)
        self.family.validate_layout(engine_request.prompt_token_ids, [i.metadata for i in engine_request.items])
        prompt = self.family.engine_prompt(engine_request, embeddings)
        started = time.perf_counter()
        last = None
        async for step in self.engine.generate(
            f"{engine_request.request_id}-prefill", prompt, engine_request.sampling, kv_params=kv_params_for_prefill(), max_tokens=1
        ):
            last = step
        if last is None or last.kv_handoff is None or not last.token_ids:
            raise Unavailable("prefill engine finished without a KV handoff")
        return prefill_pb2.PrefillResponse(
            first_token_id=last.token_ids[0],
            kv_handoff=wire.kv_handoff_to_wire(last.kv_handoff),
            prompt_token_count=last.prompt_token_count,
            embedding_fetch_s=fetch_s,
            engine_s=time.perf_counter() - started,
        )

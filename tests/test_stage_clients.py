"""The gateway's stage clients against a real gRPC server on loopback: how a call ends."""

from __future__ import annotations

import asyncio

import grpc

from epd.domain import EngineRequest, FinishReason, Sampling
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from gateway.router import StagePool
from gateway.stages import DecodeClient, DecodeEnd, DecodeStep


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    """Streams one token and the finish, then takes a moment to end its handler, as a decode
    that cleans up after its last message does; notes how each call ended."""

    def __init__(self) -> None:
        self.endings: list[str] = []

    async def Decode(self, request, context):
        yield decode_pb2.DecodeResponse(token_ids=[7], text="x", prompt_token_count=3)
        yield decode_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH, prompt_token_count=3)
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            self.endings.append("cancelled")
            raise
        self.endings.append("completed")


async def test_a_decode_call_is_read_to_its_status_not_cancelled_after_its_last_message():
    servicer = _Decode()
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = StagePool("decode", [f"127.0.0.1:{port}"], decode_pb2_grpc.DecodeServiceStub)
    try:
        request = EngineRequest("r1", (), Sampling(max_tokens=1), prompt_token_ids=(1, 2, 3))
        events = [event async for event in DecodeClient(pool).decode(request, deadline=None)]
        assert events == [DecodeStep([7], "x", 3), DecodeEnd(FinishReason.LENGTH, 3)]
        # The client left only once the call had ended: the handler ran to its end.
        assert servicer.endings == ["completed"]
    finally:
        await pool.close()
        await server.stop(None)

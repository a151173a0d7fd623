"""The gateway's stage clients against a real gRPC server on loopback: how a call ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.domain import ChatMessage, EngineRequest, FinishReason, Role, Sampling, TextPart
from epd.errors import EpdError, InvalidArgument
from epd.rpc import add_servicer, rpc_method
from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from gateway.router import StagePool
from gateway.stages import DecodeClient, DecodeEnd, DecodeStep, PrefillClient, StageFailed


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


class _PrefillOf(prefill_pb2_grpc.PrefillServiceServicer):
    """A prefill that refuses every call with ``error``, as the real servicer reports one."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error

    @rpc_method("prefill")
    async def Prefill(self, request, context):
        raise self.error


async def _prefill_refused_by(error: InvalidArgument) -> tuple[BaseException, StagePool]:
    server = grpc.aio.server()
    add_servicer(server, "epd.v1.PrefillService", _PrefillOf(error))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = StagePool("prefill", [f"127.0.0.1:{port}"], prefill_pb2_grpc.PrefillServiceStub)
    chat = (ChatMessage(Role.USER, (TextPart("Describe it."),)),)
    try:
        with pytest.raises(EpdError) as refused:
            await PrefillClient(pool).prefill(EngineRequest("r1", (), Sampling(max_tokens=1), chat=chat), deadline=None)
        return refused.value, pool
    finally:
        await pool.close()
        await server.stop(None)


async def test_a_prefill_that_predates_chat_prompts_is_ejected_and_the_request_retried_elsewhere():
    """A stage from before the engines rendered chats refuses a chat as a prompt without token
    ids (what it then said): not the client's fault, so not INVALID_ARGUMENT. The instance
    leaves the rotation and the pipeline may retry the request on another."""
    error, pool = await _prefill_refused_by(InvalidArgument.for_field("prompt.token_ids", "must not be empty"))
    assert isinstance(error, StageFailed) and "upgrade stages before gateways" in error.message
    assert not pool.available


async def test_a_chat_the_prefill_refuses_is_reported_on_the_public_request_s_fields():
    error, pool = await _prefill_refused_by(InvalidArgument.for_field("prompt.chat", "render to 9000 prompt tokens before any media, over the model's context of 4096"))
    assert isinstance(error, InvalidArgument) and [v.field for v in error.violations] == ["messages"]
    assert "messages render to 9000 prompt tokens" in error.message
    assert pool.available  # the client's fault, not the instance's

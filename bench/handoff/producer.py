"""The producer process: what the encoder engine's EC connector does with its arena, plus a gRPC
server for the inline baseline."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import grpc
import torch

from bench.handoff.payload import (
    _ARENA_FULL_WAIT_S,
    _DTYPE,
    _GRPC_SERVICE,
    _LEASE_TTL_S,
    _PEER_CALL_TIMEOUT_S,
    _PEER_START_TIMEOUT_S,
    _SLOT_BYTES,
    _STAMP_BYTES,
    item_shape,
    payload,
    stamp_bytes,
)
from epd.domain import NixlLocation
from epd.server import GRPC_OPTIONS
from epd.transport.memory.arena import EmbeddingArena
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import HEADER_BYTES, SlotHeader, SlotStatus, item_digest, slot_bytes
from epd.transport.wire.nixl import NixlPublisher
from epd.v1 import encoder_pb2, encoder_pb2_grpc, multimodal_pb2


class _Producer:
    """The encoder connector's publishing, without vLLM: lease, write header and rows, publish."""

    def __init__(self, arena_bytes: int) -> None:
        self.buffer = SharedBuffer.create(f"bench-handoff-arena-{os.getpid()}", arena_bytes)
        self.arena = EmbeddingArena(self.buffer.tensor, slot_bytes=_SLOT_BYTES, lease_ttl_s=_LEASE_TTL_S)
        self.publisher = NixlPublisher(self.buffer.tensor, agent_name=f"bench-handoff-producer-{os.getpid()}", bind_host="127.0.0.1")
        self.encoder_address = ""  # its gRPC server's, once it listens (as the encoder service fills it in)
        self._bases: dict[int, torch.Tensor] = {}

    def publish(self, nbytes: int, stamps: Sequence[int]) -> list[NixlLocation]:
        """One stamped copy of the size's payload per stamp, each in a lease of its own."""
        rows, width = item_shape(nbytes)
        if nbytes not in self._bases:
            self._bases[nbytes] = payload(nbytes)
        base, tensor = self._bases[nbytes], self.buffer.tensor
        locations = []
        for stamp in stamps:
            lease = self._reserve(slot_bytes(rows, width, _DTYPE))
            start = lease.offset + HEADER_BYTES
            tensor[start : start + nbytes].copy_(base)
            tensor[start : start + _STAMP_BYTES].copy_(stamp_bytes(stamp))
            # Named by its lease id, the content hash the consumer path caches it as.
            SlotHeader(SlotStatus.READY, _DTYPE, lease.generation, rows, width, item_digest(lease.lease_id)).pack_into(tensor, lease.offset)
            location = self.publisher.location(lease, self.arena.publish(lease.lease_id))
            locations.append(dataclasses.replace(location, encoder_address=self.encoder_address))
        return locations

    def leases(self) -> int:
        """Live leases after taking in the READ notifications that arrived."""
        self._reap()
        return self.arena.leased_count

    def close(self) -> None:
        self.publisher.close()
        self.buffer.close()

    def _reap(self) -> None:
        # What the producer's reaper thread does; done here, in the pipe's thread, so the
        # process sits idle (but for NIXL's progress thread) while the consumer is timed.
        for lease_id in self.publisher.ended_leases():
            self.arena.release(lease_id)
        self.arena.expire()

    def _reserve(self, nbytes: int):
        deadline = time.monotonic() + _ARENA_FULL_WAIT_S
        while True:
            self._reap()
            lease = self.arena.reserve(nbytes)
            if lease is not None:
                return lease
            if time.monotonic() > deadline:
                raise RuntimeError(f"the arena stayed full for {_ARENA_FULL_WAIT_S:g} s: READ notifications did not end the leases")
            time.sleep(0.001)


# Responses are built once per key and serialized on every call, as a real encoder would.
_RESPONSES: dict[str, encoder_pb2.EncodeResponse] = {}


async def _serve_inline(request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext) -> encoder_pb2.EncodeResponse:
    """Answers ``request_id`` = ``"{items}x{item_bytes}"`` with that many inline items."""
    key = request.request_id
    if key not in _RESPONSES:
        items, item_bytes = (int(part) for part in key.split("x"))
        inline = multimodal_pb2.InlineEmbedding(data=payload(item_bytes).numpy().tobytes())
        item = multimodal_pb2.EncodedItem(embedding=multimodal_pb2.EmbeddingHandle(inline=inline))
        _RESPONSES[key] = encoder_pb2.EncodeResponse(items=[item] * items)
    return _RESPONSES[key]


class _TransferMetadata(encoder_pb2_grpc.EncoderServiceServicer):
    """The encoder's GetTransferMetadata: consumers get the producer's NIXL metadata over gRPC."""

    def __init__(self, producer: _Producer) -> None:
        self._credentials = producer.publisher.credentials

    async def GetTransferMetadata(self, request, context):
        c = self._credentials
        return c.to_wire()


async def _peer_async(conn: Connection, arena_bytes: int) -> None:
    producer = _Producer(arena_bytes)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(_TransferMetadata(producer), server)
    handler = grpc.unary_unary_rpc_method_handler(
        _serve_inline, request_deserializer=encoder_pb2.EncodeRequest.FromString, response_serializer=encoder_pb2.EncodeResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GRPC_SERVICE, {"Fetch": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    producer.encoder_address = f"127.0.0.1:{port}"
    commands: dict[str, Callable[..., Any]] = {"publish": producer.publish, "leases": producer.leases}
    loop = asyncio.get_running_loop()
    try:
        conn.send(("ready", {"grpc_port": port, "agent_name": producer.publisher.agent_name}))
        while True:
            # Waiting on the pipe in a thread keeps this loop free to serve gRPC meanwhile.
            try:
                command, args = await loop.run_in_executor(None, conn.recv)
            except EOFError:  # the benchmark went away
                return
            if command == "close":
                return
            try:
                conn.send(("ok", commands[command](*args)))
            except Exception as exc:
                conn.send(("error", repr(exc)))
    finally:
        await server.stop(None)
        producer.close()


def _peer_main(conn: Connection, arena_bytes: int) -> None:
    asyncio.run(_peer_async(conn, arena_bytes))


class _Peer:
    """The producer process, driven over a pipe; it also serves the gRPC method."""

    def __init__(self, arena_bytes: int) -> None:
        context = multiprocessing.get_context("spawn")  # no forked NIXL, UCX or gRPC state
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_peer_main, args=(child_conn, arena_bytes), daemon=True)
        self._process.start()
        child_conn.close()
        try:
            info = self._receive(_PEER_START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise
        self.grpc_port: int = info["grpc_port"]
        self.agent_name: str = info["agent_name"]

    def publish(self, nbytes: int, stamps: Sequence[int]) -> list[NixlLocation]:
        self._conn.send(("publish", (nbytes, list(stamps))))
        locations: list[NixlLocation] = self._receive(_PEER_CALL_TIMEOUT_S, "publish")
        return locations

    def leases(self) -> int:
        self._conn.send(("leases", ()))
        count: int = self._receive(_PEER_CALL_TIMEOUT_S, "leases")
        return count

    def close(self) -> None:
        try:
            self._conn.send(("close", ()))
        except OSError:
            pass  # already gone
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _receive(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise RuntimeError(f"handoff producer process did not answer {what!r} within {timeout_s:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"handoff producer process died during {what!r} (exit code {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"handoff producer process failed {what!r}: {value}")
        return value



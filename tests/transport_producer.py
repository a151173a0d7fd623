"""The producer side of tests/test_transport.py, in a module of its own: the child process
imports only this (no vLLM), so it starts in seconds.

Like an encoder, it serves its NIXL credentials over gRPC (``EncoderService.GetTransferMetadata``)
and ends leases by ``ReleaseEmbeddings`` (through a :class:`LeaseReleaser`, as the encoder
service does), and opens no NIXL listener.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import grpc
import torch

from epd.domain import NixlLocation
from epd.transport.memory.arena import EmbeddingArena, SharedCounters
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import HEADER_BYTES, SlotHeader, SlotStatus, item_digest, slot_bytes
from epd.transport.wire.credentials import TransferCredentials
from epd.transport.wire.nixl import LeaseReleaser, NixlPublisher
from epd.v1 import encoder_pb2, encoder_pb2_grpc

ARENA_BYTES = SharedCounters.BYTES + 64 * 64 * 1024
SLOT_BYTES = 64 * 1024


def make_rows(seed: int, rows: int, width: int, dtype: str = "float32") -> torch.Tensor:
    """Deterministic contents, so both processes know what the bytes must be."""
    return torch.randn((rows, width), generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))


class _TransferMetadata(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, credentials: TransferCredentials) -> None:
        self._credentials = credentials
        self._releaser = LeaseReleaser(f"{credentials.agent_name}-release", credentials, bind_host="127.0.0.1")

    def GetTransferMetadata(self, request, context):
        c = self._credentials
        return c.to_wire()

    def ReleaseEmbeddings(self, request, context):
        self._releaser.release(list(request.lease_ids))
        return encoder_pb2.ReleaseEmbeddingsResponse()


class _Producer:
    def __init__(self, agent_name: str, ttl_s: float, grpc_port: int) -> None:
        self.buffer = SharedBuffer.create(f"test-producer-{uuid.uuid4().hex[:8]}", ARENA_BYTES)
        self.arena = EmbeddingArena(self.buffer.tensor, slot_bytes=SLOT_BYTES, lease_ttl_s=ttl_s)
        self.publisher = NixlPublisher(self.buffer.tensor, agent_name=agent_name, bind_host="127.0.0.1")
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(_TransferMetadata(self.publisher.credentials), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(f'127.0.0.1:{grpc_port}')}"
        self.server.start()

    def publish(self, seed: int, rows: int, width: int, dtype: str, key: str = "") -> NixlLocation:
        """Publishes rows of ``seed`` as the item called ``key`` (its content hash; default
        ``item-<seed>``), as the encoder's EC producer would."""
        lease = self.arena.reserve(slot_bytes(rows, width, dtype))
        data = make_rows(seed, rows, width, dtype).reshape(-1).view(torch.uint8)
        self.buffer.tensor[lease.offset + HEADER_BYTES : lease.offset + HEADER_BYTES + data.numel()].copy_(data)
        SlotHeader(SlotStatus.READY, dtype, lease.generation, rows, width, item_digest(key or f"item-{seed}")).pack_into(self.buffer.tensor, lease.offset)
        # What the encoder service does to every location before handing it out.
        return dataclasses.replace(self.publisher.location(lease, self.arena.publish(lease.lease_id)), encoder_address=self.address)

    def reap_until_idle(self, timeout_s: float = 5.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for lease_id in self.publisher.ended_leases():
                self.arena.release(lease_id)
            self.arena.expire()
            if self.arena.leased_count == 0:
                break
            time.sleep(0.005)
        return self.arena.leased_count

    def overwrite(self, location: NixlLocation, seed: int, rows: int, width: int, dtype: str, key: str = "") -> NixlLocation:
        """Ends a lease and publishes another item, which reuses the same first slot."""
        self.arena.release(location.lease_id)
        return self.publish(seed, rows, width, dtype, key)


_COMMANDS: dict[str, Callable[..., Any]] = {
    "publish": _Producer.publish,
    "reap_until_idle": _Producer.reap_until_idle,
    "overwrite": _Producer.overwrite,
    "leases": lambda producer: producer.arena.leased_count,
    # What the encoder service reads from shared memory beside its engine.
    "credentials": lambda producer: producer.publisher.credentials,
}


def producer_main(conn: Connection, agent_name: str, ttl_s: float, grpc_port: int = 0) -> None:
    producer = _Producer(agent_name, ttl_s, grpc_port)
    conn.send(producer.address)
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:  # the test process went away
                return
            if command == "close":
                return
            try:
                conn.send(("ok", _COMMANDS[command](producer, *args)))
            except Exception as exc:
                conn.send(("error", repr(exc)))
    finally:
        producer.server.stop(0)
        producer.publisher.close()
        producer.buffer.close()



"""Handoff through the connector, encoder arena to consumer encoder cache, against inline gRPC and
an in-process copy.

A producer process does what the encoder engine's EC connector does (:mod:`epd.transport.connector.ec_producer`
and its worker side): it leases arena slots (:class:`~epd.transport.memory.arena.EmbeddingArena` over a
``/dev/shm`` :class:`~epd.transport.memory.shared_buffer.SharedBuffer` registered with NIXL once), writes
each item's 64-byte :class:`~epd.transport.memory.slot_header.SlotHeader` and rows, starts the lease's TTL
and publishes its location (:class:`~epd.transport.wire.nixl.NixlPublisher`); consumers' READ
notifications end the leases. This process is the consumer. Per payload size, each method is
timed per item, from the consumer's first call until the rows are usable as a tensor:

- ``ec_consumer``: the real consumer path, :class:`~epd.transport.connector.ec_consumer.ConsumerScheduler`
  driven as vLLM's scheduler drives it (``ensure_cache_available`` until the item is here: handle
  parsing, receive-buffer pages, one batched READ per producer through
  :class:`~epd.transport.wire.nixl.NixlReader`, header check), then ``update_state_after_alloc`` and
  ``build_installs``, then the view of the shared receive buffer the worker hands vLLM's encoder
  cache (no copy).
- ``nixl_reader``: :class:`~epd.transport.wire.nixl.NixlReader` alone (submit, poll until done, header
  check, view): the transport without the scheduler's bookkeeping.
- ``raw_read``: one NIXL READ of the same bytes through the agent wrapper
  (:class:`~epd.transport.wire.agent.NixlAgent` ``post_read``, ``state`` until DONE, ``release``),
  with the same lease notification: the floor for any NIXL path, so ``ec_consumer - raw_read`` is
  our path's fixed per-fetch cost.
- ``grpc_inline``: the same rows inline in an ``EncodeResponse`` (``InlineEmbedding`` items) from a
  ``grpc.aio`` server in the producer process, with the project's message limits, then what the
  consumer does with inline rows (:class:`~epd.transport.wire.inline.InlineReader`: ``bytearray`` of
  the field, copied into the receive buffer) and the view.
- ``memcpy``: ``Tensor.copy_`` of the same size within this process, the ceiling for any handoff
  (source and target stay in this core's caches up to a few MiB).
- ``memcpy_fresh``: the same copy from a different region each time, cycling through a buffer at
  least as large as the producer's arena: an in-process copy of bytes this core did not just touch.

This process runs torch with one thread, as a vLLM engine core serves on a small CPU host. The
goals (see DESIGN.md): ``ec_consumer`` at least half memcpy's throughput at every size from 1 MiB,
and at least 10 times faster than inline gRPC at 1 MiB; ``ec_consumer - raw_read`` should stay
near a raw READ's own cost.

The batched part compares many small items in one transfer (one request whose items all come
from one producer: one READ; one message) against one transfer per item, back to back.

Every NIXL fetch is checked: the header must show the promised lease generation and shape, and
the rows must equal what the producer wrote (each publish is stamped with a unique counter, so a
stale or reused slot is caught). gRPC and memcpy results are checked once per size. A mismatch
raises :class:`HandoffMismatchError`.

Run ``python -m bench.handoff [--quick] [--iterations N] [--results-dir DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import math
import multiprocessing
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
import torch

from bench.common import RESULTS_DIR, command_line, plot_lines, progress, summarize, write_result
from bench.formatting import KIB, MIB, fmt, machine, size
from devkit.vllm_requests import Feature, Position, Request, SchedulerOutput
from epd.domain import NixlLocation
from epd.server import CLIENT_OPTIONS, GRPC_OPTIONS, MAX_MESSAGE_BYTES
from epd.transport.connector.ec_config import ConnectorConfig
from epd.transport.connector.ec_consumer import PAGE_BYTES, ConsumerScheduler
from epd.transport.connector.ec_params import ExpectedItem, expected_to_params
from epd.transport.memory.arena import EmbeddingArena, SharedCounters
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import HEADER_BYTES, SlotHeader, SlotStatus, slot_bytes
from epd.transport.wire.agent import NixlAgent
from epd.transport.wire.base import Read
from epd.transport.wire.location import decode_descriptors
from epd.transport.wire.nixl import NixlPublisher, NixlReader
from epd.v1 import encoder_pb2, encoder_pb2_grpc, multimodal_pb2

FULL_SIZES = [KIB * 4**i for i in range(9)]  # 1 KiB, 4 KiB, ... 64 MiB
QUICK_SIZES = [KIB, 64 * KIB, MIB]
BATCHES = [(64, 16 * KIB), (256, 4 * KIB)]  # (items, bytes per item)
FULL_ITERATIONS = 200
QUICK_ITERATIONS = 20
# Large sizes take fewer samples: at most this many bytes per (method, size), but never fewer
# than MIN_ITERATIONS samples (or --iterations, if that is lower).
BYTES_PER_MEASUREMENT = 2 * 1024 * MIB
MIN_ITERATIONS = 20
REFERENCE_BYTES = MIB  # where the gRPC ratio is taken; the memcpy ratio at every size from here up
METHODS = ("ec_consumer", "nixl_reader", "raw_read", "grpc_inline", "memcpy", "memcpy_fresh")
NIXL_METHODS = ("ec_consumer", "nixl_reader", "raw_read")
BATCHED_METHODS = ("ec_consumer", "raw_read", "grpc_inline")
# What the project needs of its path (see DESIGN.md, performance facts).
GOAL_MEMCPY_FRACTION = 0.5  # ec_consumer throughput over memcpy's, at every size >= 1 MiB
GOAL_GRPC_SPEEDUP = 10.0  # ec_consumer over inline gRPC at 1 MiB

_DTYPE = "float32"
_ROW_FLOATS = 1024  # rows of 4 KiB, like a 1024-wide fp32 encoder output
_SLOT_BYTES = ConnectorConfig.slot_bytes  # the production default
# Published items wait at most one chunk of fetches; this is far longer, so none expires.
_LEASE_TTL_S = 300.0
_PEER_START_TIMEOUT_S = 120.0  # spawn + importing torch and NIXL on a loaded 2-core machine
_PEER_CALL_TIMEOUT_S = 60.0
_ARENA_FULL_WAIT_S = 10.0  # how long a publish waits for READ notifications to end leases
_FETCH_TIMEOUT_S = 30.0
_STAMP_BYTES = 8
_FRESH_RING_BYTES = 64 * MIB
# The consumer side runs in a vLLM engine core, which serves with one torch thread on a small CPU
# host; a parallel copy on a busy host also waits for its slowest thread (milliseconds).
_TORCH_THREADS = 1
# The benchmark's own gRPC method; messages are the project's (epd.v1), so the payload is
# framed exactly like an encoder's inline response.
_GRPC_SERVICE = "epd.bench.v1.HandoffBench"
_GRPC_METHOD = f"/{_GRPC_SERVICE}/Fetch"


class HandoffMismatchError(AssertionError):
    """Bytes arrived different from what was sent: the benchmark's numbers would be meaningless."""


def payload(nbytes: int) -> torch.Tensor:
    """Deterministic random bytes for a size; both processes derive the same ones from ``nbytes``,
    so the consumer can check what arrived without a reference copy travelling alongside."""
    return torch.frombuffer(bytearray(np.random.default_rng(nbytes).bytes(nbytes)), dtype=torch.uint8)


def stamp_bytes(stamp: int) -> torch.Tensor:
    """The first bytes of a stamped publish: unique per publish, so stale slots are detected."""
    return torch.frombuffer(bytearray(stamp.to_bytes(_STAMP_BYTES, "little")), dtype=torch.uint8)


def check_bytes(method: str, received: torch.Tensor, base: torch.Tensor, stamp: int | None = None) -> None:
    """Raises :class:`HandoffMismatchError` unless ``received`` equals ``base`` (its first bytes
    replaced by ``stamp``, if given)."""
    head = stamp_bytes(stamp) if stamp is not None else base[:_STAMP_BYTES]
    if (
        received.dtype != torch.uint8
        or received.numel() != base.numel()
        or not torch.equal(received[:_STAMP_BYTES], head)
        or not torch.equal(received[_STAMP_BYTES:], base[_STAMP_BYTES:])
    ):
        raise HandoffMismatchError(
            f"{method}: a {base.numel()}-byte payload arrived as {received.numel()} bytes that differ from what was sent"
            + (f" (publish stamp {stamp})" if stamp is not None else "")
        )


def item_shape(nbytes: int) -> tuple[int, int]:
    """(rows, width) of a float32 item of ``nbytes``: 4 KiB rows, or one row for smaller items."""
    width = min(_ROW_FLOATS, nbytes // 4)
    rows, rest = divmod(nbytes, 4 * width)
    if rest or not rows:
        raise ValueError(f"{nbytes} bytes is not a whole number of float32 rows")
    return rows, width


def _paged(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def _request_key(items: int, item_bytes: int) -> str:
    return f"{items}x{item_bytes}"


# --- The producer process: the encoder connector's arena, and a gRPC server --------------------


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
            SlotHeader(SlotStatus.READY, _DTYPE, lease.generation, rows, width).pack_into(tensor, lease.offset)
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


# --- The consumer: the fields of vLLM's objects that ConsumerScheduler reads ---------------------


def _elapsed_us(started_ns: int) -> float:
    return (time.perf_counter_ns() - started_ns) / 1000


def _rows_view(buffer: torch.Tensor, offset: int, rows: int, width: int) -> torch.Tensor:
    return buffer[offset : offset + rows * width * 4].view(torch.float32).view(rows, width)


# A fetch: locations and the item size in; microseconds and one float32 view per item out.
Fetch = Callable[[Sequence[NixlLocation], int], tuple[float, list[torch.Tensor]]]


class _Consumers:
    """The three NIXL consumers, each with its own agent and registered buffer."""

    def __init__(self, peer: _Peer, receive_bytes: int) -> None:
        pid = os.getpid()
        self.peer = peer
        self._cleanup = contextlib.ExitStack()
        self.config = ConnectorConfig(engine_id=f"bench-handoff-{pid}", buffer_bytes=SharedCounters.BYTES + receive_bytes, read_timeout_s=_FETCH_TIMEOUT_S)
        self.consumer = ConsumerScheduler(self.config)
        self._cleanup.callback(self.consumer.close)
        # The worker side's mapping of the receive buffer, where vLLM's encoder cache gets views.
        self.receive = SharedBuffer.attach(self.config.buffer_name("receive")).tensor
        reader_buffer = SharedBuffer.create(f"bench-handoff-reader-{pid}", receive_bytes)
        self._cleanup.callback(reader_buffer.close)
        self.reader_buffer = reader_buffer.tensor
        self.reader = NixlReader(self.reader_buffer, agent_name=f"bench-handoff-reader-{pid}", timeout_s=_FETCH_TIMEOUT_S)
        self._cleanup.callback(self.reader.close)
        raw_buffer = SharedBuffer.create(f"bench-handoff-raw-{pid}", receive_bytes)
        self._cleanup.callback(raw_buffer.close)
        self.raw_buffer = raw_buffer.tensor
        self.raw_agent = NixlAgent(f"bench-handoff-raw-{pid}", bind_host="127.0.0.1", progress_thread=False)
        registration = self.raw_agent.register(self.raw_buffer)
        self._cleanup.callback(self.raw_agent.deregister, registration)
        self._requests: Iterator[int] = itertools.count()
        self._pending_release: tuple[Request, list[str]] | None = None
        self.fetch: dict[str, Fetch] = {"ec_consumer": self.ec_consumer, "nixl_reader": self.nixl_reader, "raw_read": self.raw_read}

    def close(self) -> None:
        self._cleanup.close()

    def connect_raw(self) -> float:
        """Fetches the producer's agent metadata over gRPC (as consumers do) and loads it into the
        raw agent; returns the milliseconds taken."""
        started = time.perf_counter_ns()
        with grpc.insecure_channel(f"127.0.0.1:{self.peer.grpc_port}", options=CLIENT_OPTIONS) as channel:
            response = encoder_pb2_grpc.EncoderServiceStub(channel).GetTransferMetadata(encoder_pb2.GetTransferMetadataRequest(), timeout=_FETCH_TIMEOUT_S)
        self.raw_agent.load_peer(response.agent_metadata)
        return _elapsed_us(started) / 1000

    def ec_consumer(self, locations: Sequence[NixlLocation], nbytes: int) -> tuple[float, list[torch.Tensor]]:
        """One request carrying every location, as vLLM's scheduler presents it."""
        rows, width = item_shape(nbytes)
        hashes = [location.lease_id for location in locations]  # unique per publish
        params = expected_to_params({h: ExpectedItem(rows, width, _DTYPE, location) for h, location in zip(hashes, locations, strict=True)})
        request = Request(f"bench-{next(self._requests)}", [Feature(h, Position(rows)) for h in hashes], params)
        consumer = self.consumer
        started = time.perf_counter_ns()
        deadline = time.monotonic() + _FETCH_TIMEOUT_S
        while not consumer.ensure_cache_available(request, 0):  # a new request: nothing computed yet
            if consumer.take_unavailable_requests() or time.monotonic() > deadline:
                raise HandoffMismatchError(f"ec_consumer: request {request.request_id} could not load its items (the consumer logged why)")
        for index in range(len(hashes)):
            consumer.update_state_after_alloc(request, index)
        installs = consumer.build_installs(SchedulerOutput())
        views = [_rows_view(self.receive, install.offset, install.rows, install.width) for install in installs]
        elapsed = _elapsed_us(started)
        if [install.mm_hash for install in installs] != hashes:
            raise HandoffMismatchError(f"ec_consumer: installs {[i.mm_hash for i in installs]} for items {hashes}")
        # Checked by the caller before the next fetch; the pages come back one step late, as in vLLM.
        self._pending_release = (request, hashes)
        return elapsed, views

    def release_ec_consumer(self) -> None:
        """The request finishes and vLLM's encoder cache drops its items: pages free again."""
        assert self._pending_release is not None
        request, hashes = self._pending_release
        self._pending_release = None
        self.consumer.request_finished(request)
        self.consumer.build_installs(SchedulerOutput(hashes))
        self.consumer.build_installs(SchedulerOutput())

    def nixl_reader(self, locations: Sequence[NixlLocation], nbytes: int) -> tuple[float, list[torch.Tensor]]:
        rows, width = item_shape(nbytes)
        stride = _paged(HEADER_BYTES + nbytes, PAGE_BYTES)
        offsets = [index * stride for index in range(len(locations))]
        started = time.perf_counter_ns()
        self.reader.submit([Read(index, location, offset) for index, (location, offset) in enumerate(zip(locations, offsets, strict=True))])
        pending = set(range(len(locations)))
        deadline = time.monotonic() + _FETCH_TIMEOUT_S
        while pending:
            for key, error in self.reader.poll():
                if error is not None:
                    raise HandoffMismatchError(f"nixl_reader: {error}")
                pending.discard(key)
            if time.monotonic() > deadline:
                raise HandoffMismatchError(f"nixl_reader: {len(pending)} reads did not end within {_FETCH_TIMEOUT_S:g} s")
        views = []
        for location, offset in zip(locations, offsets, strict=True):
            header = SlotHeader.unpack_from(self.reader_buffer, offset)
            if (header.status, header.generation, header.rows, header.width, header.dtype) != (SlotStatus.READY, location.slot_generation, rows, width, _DTYPE):
                raise HandoffMismatchError(f"nixl_reader: the slot of lease {location.lease_id} holds {header}")
            views.append(_rows_view(self.reader_buffer, offset + HEADER_BYTES, rows, width))
        return _elapsed_us(started), views

    def raw_read(self, locations: Sequence[NixlLocation], nbytes: int) -> tuple[float, list[torch.Tensor]]:
        """One READ of every location's header and rows, with the notification that ends the leases."""
        rows, width = item_shape(nbytes)
        stride = _paged(HEADER_BYTES + nbytes, PAGE_BYTES)
        base = self.raw_buffer.data_ptr()
        remote = [row for location in locations for row in decode_descriptors(location.descriptors)]
        local = [(base + index * stride, location.nbytes, 0) for index, location in enumerate(locations)]
        notification = ",".join(location.lease_id for location in locations).encode()
        agent = self.raw_agent
        started = time.perf_counter_ns()
        handle = agent.post_read(self.peer.agent_name, local, remote, notification)
        while (state := agent.state(handle)) == "PROC":
            pass
        agent.release(handle)
        elapsed = _elapsed_us(started)
        if state != "DONE":
            raise HandoffMismatchError(f"raw_read: the READ ended in state {state}")
        return elapsed, [_rows_view(self.raw_buffer, index * stride + HEADER_BYTES, rows, width) for index in range(len(locations))]


class _Bench:
    """The consumer side of one run: consumers, gRPC channel, peer and the stamps handed out."""

    def __init__(self, peer: _Peer, consumers: _Consumers, channel: grpc.aio.Channel, arena_slots: int, inline_bytes: int) -> None:
        self.peer = peer
        self.consumers = consumers
        self.arena_slots = arena_slots
        self.call = channel.unary_unary(
            _GRPC_METHOD, request_serializer=encoder_pb2.EncodeRequest.SerializeToString, response_deserializer=encoder_pb2.EncodeResponse.FromString
        )
        # Where inline rows are copied, as InlineReader copies them into the receive buffer.
        self.inline_target = torch.zeros(inline_bytes, dtype=torch.uint8)
        # memcpy_fresh's sources: as large as the producer's arena, and beyond this core's caches.
        self.ring = torch.ones(max(arena_slots * _SLOT_BYTES, _FRESH_RING_BYTES), dtype=torch.uint8)
        self.ring[:: 4 * KIB] = torch.arange(self.ring.numel() // (4 * KIB), dtype=torch.uint8)
        self._ring_cursor: Iterator[int] = itertools.count()
        self._stamps: Iterator[int] = itertools.count(1)
        self._bases: dict[int, torch.Tensor] = {}
        self.verified: dict[str, set[int]] = {method: set() for method in METHODS}

    def base(self, nbytes: int) -> torch.Tensor:
        if nbytes not in self._bases:
            self._bases[nbytes] = payload(nbytes)
        return self._bases[nbytes]

    def stamps(self, count: int) -> list[int]:
        return list(itertools.islice(self._stamps, count))

    def chunk_size(self, nbytes: int) -> int:
        """How many items of this size to publish before fetching them: at most half the arena,
        so a chunk always fits next to the previous one's leases that are still ending."""
        return max(1, self.arena_slots // 2 // -(-(HEADER_BYTES + nbytes) // _SLOT_BYTES))

    def nixl_fetch(self, method: str, locations: Sequence[NixlLocation], nbytes: int, stamps: Sequence[int]) -> float:
        """One timed fetch; every item is checked before its memory can be reused."""
        elapsed, views = self.consumers.fetch[method](locations, nbytes)
        base = self.base(nbytes)
        for view, stamp in zip(views, stamps, strict=True):
            check_bytes(method, view.reshape(-1).view(torch.uint8), base, stamp)
        if method == "ec_consumer":
            self.consumers.release_ec_consumer()
        self.verified[method].add(nbytes)
        return elapsed

    def nixl_single(self, method: str, nbytes: int, count: int) -> list[float]:
        """``count`` fetches of one item each.

        Publishing happens untimed and in chunks, so the producer process sits idle (rather than
        waking on the pipe) while fetches are timed: on two cores it would compete with them.
        """
        samples: list[float] = []
        while len(samples) < count:
            stamps = self.stamps(min(self.chunk_size(nbytes), count - len(samples)))
            locations = self.peer.publish(nbytes, stamps)
            for location, stamp in zip(locations, stamps, strict=True):
                samples.append(self.nixl_fetch(method, [location], nbytes, [stamp]))
        return samples

    def nixl_batched(self, method: str, items: int, item_bytes: int, count: int, *, one_transfer: bool) -> list[float]:
        samples = []
        for _ in range(count):
            stamps = self.stamps(items)
            locations = self.peer.publish(item_bytes, stamps)
            if one_transfer:
                samples.append(self.nixl_fetch(method, locations, item_bytes, stamps))
            else:
                samples.append(sum(self.nixl_fetch(method, [loc], item_bytes, [stamp]) for loc, stamp in zip(locations, stamps, strict=True)))
        return samples

    async def grpc_once(self, items: int, item_bytes: int) -> tuple[float, list[torch.Tensor]]:
        rows, width = item_shape(item_bytes)
        stride = _paged(item_bytes, PAGE_BYTES)
        started = time.perf_counter_ns()
        response = await self.call(encoder_pb2.EncodeRequest(request_id=_request_key(items, item_bytes)))
        views = []
        for index, item in enumerate(response.items):
            # What InlineReader does with an inline item in the consumer, then the view.
            data = item.embedding.inline.data
            offset = index * stride
            self.inline_target[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            views.append(_rows_view(self.inline_target, offset, rows, width))
        return _elapsed_us(started), views

    async def grpc(self, items: int, item_bytes: int, count: int, *, calls: int = 1) -> list[float]:
        """``count`` samples of ``calls`` sequential calls, each returning ``items`` items."""
        samples = []
        for _ in range(count):
            total, views = 0.0, []
            for _ in range(calls):
                elapsed, views = await self.grpc_once(items, item_bytes)
                total += elapsed
            samples.append(total)
            if len(views) != items:
                raise HandoffMismatchError(f"grpc_inline: expected {items} items, got {len(views)}")
        for view in views:
            check_bytes("grpc_inline", view.reshape(-1).view(torch.uint8), self.base(item_bytes))
        self.verified["grpc_inline"].add(item_bytes)
        return samples

    def memcpy(self, nbytes: int, count: int, *, fresh: bool = False) -> list[float]:
        """``count`` copies into one reused target, from the same source (``memcpy``: the bytes
        sit in this core's caches) or each from the next region of a ring at least as large as the
        producer's arena (``memcpy_fresh``: like an arena slot that another core wrote)."""
        method = "memcpy_fresh" if fresh else "memcpy"
        target = torch.zeros(nbytes, dtype=torch.uint8)  # touched, like the receive buffer's reused pages
        regions = self.ring.numel() // nbytes
        samples = []
        for _ in range(count):
            if fresh:
                start = next(self._ring_cursor) % regions * nbytes
                source = self.ring[start : start + nbytes]
            else:
                source = self.base(nbytes)
            started = time.perf_counter_ns()
            target.copy_(source)
            view = target.view(torch.float32)
            samples.append(_elapsed_us(started))
        if not torch.equal(view.view(torch.uint8), source):
            raise HandoffMismatchError(f"{method}: the copy of {nbytes} bytes differs from its source")
        self.verified[method].add(nbytes)
        return samples


def _result(method: str, nbytes: int, samples: Sequence[float]) -> dict[str, Any]:
    latency = summarize(samples)
    return {"method": method, "bytes": nbytes, "latency_us": latency, "gb_per_s": nbytes / latency["median"] / 1e3}


def _batched(method: str, items: int, item_bytes: int, one: Sequence[float], per_item: Sequence[float]) -> dict[str, Any]:
    one_summary, per_item_summary = summarize(one), summarize(per_item)
    return {
        "method": method,
        "items": items,
        "item_bytes": item_bytes,
        "one_transfer_us": one_summary,
        "per_item_transfers_us": per_item_summary,
        "speedup": per_item_summary["median"] / one_summary["median"],
    }


def iterations_for(nbytes: int, iterations: int) -> int:
    """Samples for one (method, size): fewer for large sizes (see BYTES_PER_MEASUREMENT)."""
    return min(iterations, max(MIN_ITERATIONS, BYTES_PER_MEASUREMENT // nbytes))


def _buffer_sizes(sizes: Sequence[int]) -> tuple[int, int]:
    """(arena slots, receive buffer bytes) for the largest single item and the largest batch."""
    item_slots = max(-(-(HEADER_BYTES + n) // _SLOT_BYTES) for n in sizes)
    batch_slots = max(items * -(-(HEADER_BYTES + n) // _SLOT_BYTES) for items, n in BATCHES)
    receive = max(
        max(_paged(HEADER_BYTES + n, PAGE_BYTES) for n in sizes),
        max(items * _paged(HEADER_BYTES + n, PAGE_BYTES) for items, n in BATCHES),
    )
    return 2 * max(item_slots, batch_slots), receive + PAGE_BYTES


async def _measure(sizes: Sequence[int], iterations: int, batch_iterations: int) -> dict[str, Any]:
    arena_slots, receive_bytes = _buffer_sizes(sizes)
    arena_bytes = SharedCounters.BYTES + arena_slots * _SLOT_BYTES
    with contextlib.ExitStack() as cleanup:
        peer = _Peer(arena_bytes)
        cleanup.callback(peer.close)
        consumers = _Consumers(peer, receive_bytes)
        cleanup.callback(consumers.close)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{peer.grpc_port}", options=CLIENT_OPTIONS) as channel:
            bench = _Bench(peer, consumers, channel, arena_slots, receive_bytes)
            measured = await _measure_all(bench, sizes, iterations, batch_iterations)
        measured["leases_left"] = _leases_left(peer)
    return {**measured, "arena_bytes": arena_bytes, "receive_buffer_bytes": receive_bytes}


def _leases_left(peer: _Peer) -> int:
    """Leases still live once the last READ notifications are in (must be 0)."""
    deadline = time.monotonic() + 5
    while (left := peer.leases()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


async def _measure_all(bench: _Bench, sizes: Sequence[int], iterations: int, batch_iterations: int) -> dict[str, Any]:
    # First contact: metadata over gRPC (GetTransferMetadata) and the UCX connection; gRPC connects.
    first: dict[str, float] = {}
    for method in ("ec_consumer", "nixl_reader"):
        first[method] = bench.nixl_single(method, KIB, 1)[0] / 1000
    connect_ms = bench.consumers.connect_raw()
    first["raw_read"] = connect_ms + bench.nixl_single("raw_read", KIB, 1)[0] / 1000
    first["grpc_inline"] = (await bench.grpc_once(1, KIB))[0] / 1000
    progress("handoff: first contact " + ", ".join(f"{m} {ms:.1f} ms" for m, ms in first.items()))

    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    # Methods alternate per size, so slow drift in background load hits all of them alike.
    for nbytes in sizes:
        count = iterations_for(nbytes, iterations)
        warmup = max(2, count // 10)
        for method in NIXL_METHODS:
            bench.nixl_single(method, nbytes, warmup)
            results.append(_result(method, nbytes, bench.nixl_single(method, nbytes, count)))
        try:
            await bench.grpc(1, nbytes, warmup)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            # The payload plus its protobuf framing exceeds the project's message limit.
            skipped.append({"method": "grpc_inline", "bytes": nbytes, "reason": f"{error.code().name}: {error.details()}"})
        else:
            results.append(_result("grpc_inline", nbytes, await bench.grpc(1, nbytes, count)))
        for fresh in (False, True):
            bench.memcpy(nbytes, warmup, fresh=fresh)
            results.append(_result("memcpy_fresh" if fresh else "memcpy", nbytes, bench.memcpy(nbytes, count, fresh=fresh)))
        line = ", ".join(f"{r['method']} {r['latency_us']['median']:.1f}" for r in results if r["bytes"] == nbytes)
        progress(f"handoff: {nbytes} B, median µs: {line}")

    batched = []
    for items, item_bytes in BATCHES:
        for method in BATCHED_METHODS:
            if method == "grpc_inline":
                # Warm-up; the first call for a key also has the server build that response.
                await bench.grpc(items, item_bytes, 1)
                await bench.grpc(1, item_bytes, 1)
                one = await bench.grpc(items, item_bytes, batch_iterations)
                per_item = await bench.grpc(1, item_bytes, batch_iterations, calls=items)
            else:
                bench.nixl_batched(method, items, item_bytes, 1, one_transfer=True)
                bench.nixl_batched(method, items, item_bytes, 1, one_transfer=False)
                one = bench.nixl_batched(method, items, item_bytes, batch_iterations, one_transfer=True)
                per_item = bench.nixl_batched(method, items, item_bytes, batch_iterations, one_transfer=False)
            batched.append(_batched(method, items, item_bytes, one, per_item))
        line = ", ".join(f"{b['method']} x{b['speedup']:.1f}" for b in batched[-len(BATCHED_METHODS) :])
        progress(f"handoff: {items} x {item_bytes} B, one transfer vs one per item: {line}")
    return {
        "results": results,
        "batched": batched,
        "first_contact_ms": first,
        "skipped": skipped,
        "verified": {method: sorted(verified) for method, verified in bench.verified.items()},
    }


def _median_at(results: Sequence[dict[str, Any]], method: str, nbytes: int) -> float:
    for result in results:
        if result["method"] == method and result["bytes"] == nbytes:
            return float(result["latency_us"]["median"])
    return math.nan


def analyze(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Throughput ratios, the goals they are held to, and our path's fixed cost over a raw READ."""
    sizes = sorted({r["bytes"] for r in results})
    large = [n for n in sizes if n >= REFERENCE_BYTES]
    over_memcpy = {str(n): _median_at(results, "memcpy", n) / _median_at(results, "ec_consumer", n) for n in large}
    raw_over_memcpy = {str(n): _median_at(results, "memcpy", n) / _median_at(results, "raw_read", n) for n in large}
    over_fresh = {str(n): _median_at(results, "memcpy_fresh", n) / _median_at(results, "ec_consumer", n) for n in large}
    over_grpc = _median_at(results, "grpc_inline", REFERENCE_BYTES) / _median_at(results, "ec_consumer", REFERENCE_BYTES)
    worst = min(over_memcpy.values(), default=math.nan)
    overhead = {
        str(n): {
            "ec_consumer_minus_raw_read_us": _median_at(results, "ec_consumer", n) - _median_at(results, "raw_read", n),
            "nixl_reader_minus_raw_read_us": _median_at(results, "nixl_reader", n) - _median_at(results, "raw_read", n),
        }
        for n in sizes
    }
    return {
        "ratios": {
            "ec_consumer_over_memcpy": over_memcpy,
            "raw_read_over_memcpy": raw_over_memcpy,
            "ec_consumer_over_memcpy_fresh": over_fresh,
            "ec_consumer_over_grpc_inline_at_1MiB": over_grpc,
        },
        "goals": [
            {
                "goal": f"ec_consumer throughput >= {GOAL_MEMCPY_FRACTION:g}x memcpy's at every size >= 1 MiB (worst size)",
                "value": worst,
                "target": GOAL_MEMCPY_FRACTION,
                "met": bool(worst >= GOAL_MEMCPY_FRACTION),
            },
            {
                "goal": f"ec_consumer >= {GOAL_GRPC_SPEEDUP:g}x faster than inline gRPC at 1 MiB",
                "value": over_grpc,
                "target": GOAL_GRPC_SPEEDUP,
                "met": bool(over_grpc >= GOAL_GRPC_SPEEDUP),
            },
        ],
        "fixed_cost_us": overhead,
    }


def _size_label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _plot(results: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
    series = {}
    for method in METHODS:
        points = sorted((r["bytes"], r["latency_us"]["median"]) for r in results if r["method"] == method)
        series[method] = ([x for x, _ in points], [y for _, y in points])
    sizes = sorted({r["bytes"] for r in results})
    return plot_lines(
        path,
        series,
        title="Embedding handoff: median latency, first call to rows usable as a tensor",
        xlabel="payload",
        ylabel="median latency (µs)",
        xticks={size: _size_label(size) for size in sizes},
    )


def run(
    *, quick: bool = False, iterations: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str | None = None
) -> pathlib.Path:
    """Runs the handoff benchmark and writes ``handoff.json`` (and ``handoff.png``).

    Args:
        quick: Only 1 KiB, 64 KiB and 1 MiB, with few iterations (seconds).
        iterations: Timed samples per (method, size), fewer for sizes above
            ``BYTES_PER_MEASUREMENT / iterations``; batched cases take a fifth of that.
        results_dir: Where the files go.
        command: The command line recorded in the result; defaults to this process's.

    Returns:
        The path of the JSON result.

    Raises:
        HandoffMismatchError: If any method delivered bytes other than those sent.
        ValueError: If ``iterations`` is not positive.
    """
    sizes = QUICK_SIZES if quick else FULL_SIZES
    iterations = iterations if iterations is not None else QUICK_ITERATIONS if quick else FULL_ITERATIONS
    if iterations <= 0:
        raise ValueError(f"iterations must be positive, got {iterations}")
    batch_iterations = max(3, iterations // 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS)
    try:
        # A private loop, never installed as the thread's current loop, so callers' loops are untouched.
        with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
            measured = runner.run(_measure(sizes, iterations, batch_iterations))
    finally:
        torch.set_num_threads(threads)
    results = measured["results"]
    analysis = analyze(results)
    for goal in analysis["goals"]:
        progress(f"handoff: {goal['goal']}: {goal['value']:.3g} ({'met' if goal['met'] else 'NOT met'})")
    payload_doc = {
        "experiment": "handoff",
        "config": {
            "quick": quick,
            "sizes": sizes,
            "iterations": {str(n): iterations_for(n, iterations) for n in sizes},
            "batches": [{"items": items, "item_bytes": item_bytes} for items, item_bytes in BATCHES],
            "batched_iterations": batch_iterations,
            "dtype": _DTYPE,
            "arena_slot_bytes": _SLOT_BYTES,
            "arena_bytes": measured["arena_bytes"],
            "receive_buffer_bytes": measured["receive_buffer_bytes"],
            "slot_header_bytes": HEADER_BYTES,
            "grpc_max_message_bytes": MAX_MESSAGE_BYTES,
            "ucx_tls": os.environ.get("UCX_TLS", "UCX default"),
            "torch_threads": _TORCH_THREADS,
            "timing": "consumer wall clock per item, from its first call until the rows are usable as a float32 tensor "
            "(NIXL methods: a view of the registered receive buffer, no copy; gRPC: the message field copied into a buffer, "
            "as InlineReader does). NIXL READs move the 64-byte slot header with the rows.",
            "ratio_definition": "throughput ratio = other method's median latency / ec_consumer's (above 1: ec_consumer faster); "
            "fixed cost = median latency minus raw_read's at the same size",
            "skipped": measured["skipped"],
            "verified": measured["verified"],
            "leases_left": measured["leases_left"],
        },
        "results": results,
        "batched": measured["batched"],
        "first_contact_ms": measured["first_contact_ms"],
        **analysis,
    }
    path = write_result("handoff", payload_doc, command=command or command_line(), results_dir=results_dir)
    _plot(results, results_dir / "handoff.png")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.handoff", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 KiB, 64 KiB and 1 MiB only, few iterations")
    parser.add_argument("--iterations", type=int, default=None, help="timed samples per method and size")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(shlex.quote(a) for a in [pathlib.Path(sys.executable).name, "-m", "bench.handoff", *argv])
    print(run(quick=args.quick, iterations=args.iterations, results_dir=args.results_dir, command=command))


if __name__ == "__main__":
    main()


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    cfg = doc["config"]
    lines = [
        "## Embedding handoff: encoder arena to consumer encoder cache",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Per item, from the consumer's first call until the rows are usable as a tensor ({cfg['dtype']} rows; NIXL READs also move the "
        f"{cfg['slot_header_bytes']}-byte slot header). ec_consumer: ConsumerScheduler as vLLM's scheduler drives it; nixl_reader: NixlReader alone; "
        "raw_read: one NIXL READ through the agent; grpc_inline: the rows inline in an EncodeResponse, copied into a buffer; "
        "memcpy: an in-process copy (memcpy_fresh: from a different region each time). UCX: " + f"{cfg['ucx_tls']}; torch threads {cfg['torch_threads']}.",
        "",
        "| method | size | median µs | p99 µs | GB/s | samples |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        lines.append(f"| {r['method']} | {size(r['bytes'])} | {fmt(r['latency_us']['median'], 1)} | {fmt(r['latency_us']['p99'], 1)} | {fmt(r['gb_per_s'], 3)} | {r['latency_us']['count']} |")
    lines += ["", "Goals:", ""]
    lines += [f"- {g['goal']}: ×{fmt(g['value'], 3)} ({'met' if g['met'] else 'NOT met'})" for g in doc["goals"]]
    lines += ["", "Throughput ratios and fixed cost:", ""]
    ratios = doc["ratios"]
    for key, label in (
        ("ec_consumer_over_memcpy", "ec_consumer throughput over memcpy's"),
        ("ec_consumer_over_memcpy_fresh", "ec_consumer over memcpy_fresh"),
        ("raw_read_over_memcpy", "raw_read over memcpy (what NIXL itself reaches)"),
    ):
        lines.append(f"- {label}: " + ", ".join(f"{size(int(n))} ×{fmt(v, 3)}" for n, v in ratios[key].items()))
    lines.append(
        "- Fixed cost over a raw READ (median µs, ec_consumer / nixl_reader): "
        + ", ".join(f"{size(int(n))} {fmt(c['ec_consumer_minus_raw_read_us'], 1)} / {fmt(c['nixl_reader_minus_raw_read_us'], 1)}" for n, c in doc["fixed_cost_us"].items())
    )
    lines += ["", "| batched | items x size | one transfer median µs | one per item median µs | speedup |", "| --- | --- | --- | --- | --- |"]
    for b in doc["batched"]:
        lines.append(
            f"| {b['method']} | {b['items']} x {size(b['item_bytes'])} | {fmt(b['one_transfer_us']['median'], 1)} | {fmt(b['per_item_transfers_us']['median'], 1)} | ×{fmt(b['speedup'])} |"
        )
    first = ", ".join(f"{k} {fmt(v, 1)} ms" for k, v in doc["first_contact_ms"].items())
    skipped = "".join(f" Not measured: {s['method']} at {size(s['bytes'])} ({s['reason']})." for s in cfg.get("skipped", []))
    return [*lines, "", f"First contact (excluded above): {first}. Leases left at the end: {cfg['leases_left']}.{skipped}", ""]

"""This process's consumer paths: the EC consumer as vLLM's scheduler drives it, the NIXL reader
alone, and a raw NIXL READ."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import torch

from bench.handoff.payload import _DTYPE, _FETCH_TIMEOUT_S, HandoffMismatchError, _paged, item_shape
from bench.handoff.producer import _Peer
from devkit.vllm_requests import Feature, Position, Request, SchedulerOutput
from epd.domain import NixlLocation
from epd.server import CLIENT_OPTIONS
from epd.transport.connector.ec_config import ConnectorConfig
from epd.transport.connector.ec_consumer import PAGE_BYTES, ConsumerScheduler
from epd.transport.connector.ec_params import ExpectedItem, expected_to_params
from epd.transport.memory.arena import SharedCounters
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import HEADER_BYTES, SlotHeader, SlotStatus
from epd.transport.wire.agent import NixlAgent
from epd.transport.wire.base import Read
from epd.transport.wire.location import decode_descriptors
from epd.transport.wire.nixl import NixlReader
from epd.v1 import encoder_pb2, encoder_pb2_grpc


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
        if state != "DONE":
            raise HandoffMismatchError(f"raw_read: the READ ended in state {state}")
        # Timed up to the same point as the other methods: the rows usable as tensors.
        views = [_rows_view(self.raw_buffer, index * stride + HEADER_BYTES, rows, width) for index in range(len(locations))]
        return _elapsed_us(started), views



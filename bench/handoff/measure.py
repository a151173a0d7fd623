"""Timing each method at each size, and in batches."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import torch

from bench.common import progress, summarize
from bench.formatting import KIB
from bench.handoff.consumers import _Consumers, _elapsed_us, _rows_view
from bench.handoff.payload import (
    _FRESH_RING_BYTES,
    _GRPC_METHOD,
    _SLOT_BYTES,
    BATCHED_METHODS,
    BATCHES,
    BYTES_PER_MEASUREMENT,
    METHODS,
    MIN_ITERATIONS,
    NIXL_METHODS,
    HandoffMismatchError,
    _paged,
    _request_key,
    check_bytes,
    item_shape,
    payload,
)
from bench.handoff.producer import _Peer
from epd.domain import NixlLocation
from epd.server import CLIENT_OPTIONS
from epd.transport.connector.ec_consumer import PAGE_BYTES
from epd.transport.memory.arena import SharedCounters
from epd.transport.memory.slot_header import HEADER_BYTES
from epd.v1 import encoder_pb2


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



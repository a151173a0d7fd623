"""Embedding handoff microbenchmark: how fast an embedding's bytes get from producer to consumer.

Three ways, each timed from the consumer's request until the bytes sit in a torch tensor there:

- ``nixl_read``: the project's transport. A peer process publishes the payload into its
  :class:`~epd.transport.EmbeddingArena`; this process READs it with an
  :class:`~epd.transport.EmbeddingFetcher` (one-sided READ, notification frees the lease).
- ``grpc_inline``: the same bytes inside a protobuf message from a gRPC server in the peer
  process, with the project's message size limits (``epd.server``), the encoder's response type
  (``EncodeResponse`` with ``InlineEmbedding`` handles) and the conversion prefill does
  (``torch.frombuffer(bytearray(data))``).
- ``memcpy``: ``Tensor.copy_`` of the same size within one process, the ceiling for any handoff.

The batched part compares one transfer carrying many small items (one READ for all regions of a
producer; one message with all items) against one transfer per item, sequentially.

Every NIXL fetch is compared byte for byte with what the peer published (each publish is stamped
with a unique counter, so a read of a stale or reused slot is caught too); gRPC and memcpy results
are compared once per size. A mismatch raises :class:`HandoffMismatchError`.

Run ``python -m bench.handoff [--quick] [--iterations N] [--results-dir DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import multiprocessing
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
import torch

from bench.common import RESULTS_DIR, command_line, plot_lines, progress, summarize, write_result
from epd.server import CLIENT_OPTIONS, GRPC_OPTIONS, MAX_MESSAGE_BYTES
from epd.transport import ArenaFullError, EmbeddingArena, EmbeddingFetcher, NixlRegion
from epd.v1 import encoder_pb2, multimodal_pb2

KIB = 1024
MIB = 1024 * KIB
FULL_SIZES = [KIB * 4**i for i in range(9)]  # 1 KiB, 4 KiB, ... 64 MiB
QUICK_SIZES = [KIB, 64 * KIB, MIB]
BATCHES = [(64, 16 * KIB), (256, 4 * KIB)]  # (items, bytes per item)
FULL_ITERATIONS = 200
QUICK_ITERATIONS = 20
REFERENCE_BYTES = MIB  # where the headline ratios are taken
METHODS = ("nixl_read", "grpc_inline", "memcpy")

# Small slots so that 4 KiB items do not each hold a large slot; a large item takes a run of them.
_SLOT_BYTES = 4 * KIB
# Published regions wait at most one chunk of fetches; this is far longer, so none expires.
_LEASE_TTL_S = 300.0
_PEER_START_TIMEOUT_S = 120.0  # spawn + importing torch and NIXL on a loaded 2-core machine
_PEER_CALL_TIMEOUT_S = 60.0
_ARENA_FULL_WAIT_S = 10.0  # how long a publish waits for notifications of finished READs
_STAMP_BYTES = 8
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


def _request_key(items: int, item_bytes: int) -> str:
    return f"{items}x{item_bytes}"


# --- The peer process: NIXL arena (producer) and gRPC server --------------------------------


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


def _publish(arena: EmbeddingArena, bases: dict[int, torch.Tensor], nbytes: int, stamps: Sequence[int]) -> list[NixlRegion]:
    """Publishes one stamped copy of the size's payload per stamp."""
    if nbytes not in bases:
        bases[nbytes] = payload(nbytes)
    base = bases[nbytes]
    regions = []
    for stamp in stamps:
        base[:_STAMP_BYTES] = stamp_bytes(stamp)
        deadline = time.monotonic() + _ARENA_FULL_WAIT_S
        while True:
            try:
                regions.append(arena.publish(base))
                break
            except ArenaFullError:
                # The consumer's last READs are done, but their notifications may still be in flight.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)
    return regions


async def _peer_async(conn: Connection, arena_bytes: int) -> None:
    arena = EmbeddingArena(
        agent_name=f"bench-handoff-producer-{os.getpid()}",
        slot_bytes=_SLOT_BYTES,
        num_slots=arena_bytes // _SLOT_BYTES,
        lease_ttl_s=_LEASE_TTL_S,
    )
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                _GRPC_SERVICE,
                {
                    "Fetch": grpc.unary_unary_rpc_method_handler(
                        _serve_inline,
                        request_deserializer=encoder_pb2.EncodeRequest.FromString,
                        response_serializer=encoder_pb2.EncodeResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    bases: dict[int, torch.Tensor] = {}
    loop = asyncio.get_running_loop()
    try:
        conn.send(("ready", port))
        while True:
            # Waiting on the pipe in a thread keeps this loop free to serve gRPC meanwhile.
            try:
                command, args = await loop.run_in_executor(None, conn.recv)
            except EOFError:  # the benchmark went away
                return
            if command == "close":
                return
            try:
                conn.send(("ok", _publish(arena, bases, *args)))
            except Exception as exc:
                conn.send(("error", repr(exc)))
    finally:
        await server.stop(None)
        arena.close()


def _peer_main(conn: Connection, arena_bytes: int) -> None:
    asyncio.run(_peer_async(conn, arena_bytes))


class _Peer:
    """The producer process, driven over a pipe; also serves the gRPC method."""

    def __init__(self, arena_bytes: int) -> None:
        context = multiprocessing.get_context("spawn")  # no forked NIXL, UCX or gRPC state
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_peer_main, args=(child_conn, arena_bytes), daemon=True)
        self._process.start()
        child_conn.close()
        try:
            self.grpc_port: int = self._receive(_PEER_START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    def publish(self, nbytes: int, stamps: Sequence[int]) -> list[NixlRegion]:
        self._conn.send(("publish", (nbytes, list(stamps))))
        regions: list[NixlRegion] = self._receive(_PEER_CALL_TIMEOUT_S, "publish")
        return regions

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
            raise RuntimeError(f"handoff peer process did not answer {what!r} within {timeout_s:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"handoff peer process died during {what!r} (exit code {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"handoff peer process failed {what!r}: {value}")
        return value


# --- The consumer: measurements ---------------------------------------------------------------


def _elapsed_us(started_ns: int) -> float:
    return (time.perf_counter_ns() - started_ns) / 1000


class _Bench:
    """The consumer side of one run: fetcher, gRPC channel, peer and the stamps handed out."""

    def __init__(self, peer: _Peer, fetcher: EmbeddingFetcher, channel: grpc.aio.Channel, arena_bytes: int) -> None:
        self.peer = peer
        self.fetcher = fetcher
        self.arena_bytes = arena_bytes
        self.call = channel.unary_unary(
            _GRPC_METHOD,
            request_serializer=encoder_pb2.EncodeRequest.SerializeToString,
            response_deserializer=encoder_pb2.EncodeResponse.FromString,
        )
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
        """How many regions of this size to publish before fetching them.

        At most half the arena: the previous chunk's leases end only when the producer reaps
        their notifications, which it does once a publish finds no room, so a new chunk may be
        laid out around them. With half the arena it always fits once they are freed; a chunk
        filling the whole arena can end up fragmented and wait for leases of its own.
        """
        return max(1, self.arena_bytes // 2 // (-(-nbytes // _SLOT_BYTES) * _SLOT_BYTES))

    def check_nixl(self, fetched: Sequence[torch.Tensor], nbytes: int, stamps: Sequence[int]) -> None:
        for data, stamp in zip(fetched, stamps, strict=True):
            check_bytes("nixl_read", data, self.base(nbytes), stamp)
        self.verified["nixl_read"].add(nbytes)

    async def nixl_single(self, nbytes: int, count: int) -> list[float]:
        """``count`` fetches of one region each.

        Publishing happens untimed and in chunks, so the producer process sits idle (rather than
        waking on the pipe) while fetches are timed: on two cores it would compete with them.
        """
        samples: list[float] = []
        while len(samples) < count:
            stamps = self.stamps(min(self.chunk_size(nbytes), count - len(samples)))
            regions = self.peer.publish(nbytes, stamps)
            for region, stamp in zip(regions, stamps, strict=True):
                started = time.perf_counter_ns()
                fetched = await self.fetcher.fetch([region])
                samples.append(_elapsed_us(started))
                self.check_nixl(fetched, nbytes, [stamp])
        return samples

    async def nixl_batched(self, items: int, item_bytes: int, count: int, *, one_transfer: bool) -> list[float]:
        samples = []
        for _ in range(count):
            stamps = self.stamps(items)
            regions = self.peer.publish(item_bytes, stamps)
            started = time.perf_counter_ns()
            if one_transfer:
                fetched = await self.fetcher.fetch(regions)
            else:
                fetched = [(await self.fetcher.fetch([region]))[0] for region in regions]
            samples.append(_elapsed_us(started))
            self.check_nixl(fetched, item_bytes, stamps)
        return samples

    async def grpc_once(self, items: int, item_bytes: int) -> list[torch.Tensor]:
        response = await self.call(encoder_pb2.EncodeRequest(request_id=_request_key(items, item_bytes)))
        # What prefill does with an inline embedding (epd.embeddings): one writable copy.
        return [torch.frombuffer(bytearray(item.embedding.inline.data), dtype=torch.uint8) for item in response.items]

    async def grpc(self, items: int, item_bytes: int, count: int, *, calls: int = 1) -> list[float]:
        """``count`` samples of ``calls`` sequential calls, each returning ``items`` items."""
        samples = []
        received: list[torch.Tensor] = []
        for _ in range(count):
            started = time.perf_counter_ns()
            received = [tensor for _ in range(calls) for tensor in await self.grpc_once(items, item_bytes)]
            samples.append(_elapsed_us(started))
        if count:
            if len(received) != items * calls:
                raise HandoffMismatchError(f"grpc_inline: expected {items * calls} items, got {len(received)}")
            for tensor in received:
                check_bytes("grpc_inline", tensor, self.base(item_bytes))
            self.verified["grpc_inline"].add(item_bytes)
        return samples

    def memcpy(self, nbytes: int, count: int) -> list[float]:
        source = self.base(nbytes)
        target = torch.empty_like(source)
        samples = []
        for _ in range(count):
            started = time.perf_counter_ns()
            target.copy_(source)
            samples.append(_elapsed_us(started))
        if count:
            check_bytes("memcpy", target, source)
            self.verified["memcpy"].add(nbytes)
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


async def _measure(sizes: Sequence[int], iterations: int, warmup: int, batch_iterations: int) -> dict[str, Any]:
    largest = max([*sizes, *(items * item_bytes for items, item_bytes in BATCHES)])
    # Twice the largest payload (see _Bench.chunk_size).
    arena_bytes = 2 * (-(-largest // _SLOT_BYTES) * _SLOT_BYTES)
    with contextlib.ExitStack() as cleanup:
        peer = _Peer(arena_bytes)
        cleanup.callback(peer.close)
        fetcher = EmbeddingFetcher(agent_name=f"bench-handoff-consumer-{os.getpid()}", buffer_bytes=largest)
        cleanup.callback(fetcher.close)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{peer.grpc_port}", options=CLIENT_OPTIONS) as channel:
            measured = await _measure_all(_Bench(peer, fetcher, channel, arena_bytes), sizes, iterations, warmup, batch_iterations)
    return {**measured, "arena_bytes": arena_bytes, "fetch_buffer_bytes": largest}


async def _measure_all(bench: _Bench, sizes: Sequence[int], iterations: int, warmup: int, batch_iterations: int) -> dict[str, Any]:
    # First contact: NIXL fetches the producer's metadata and connects; gRPC connects (HTTP/2).
    (first_nixl_us,) = await bench.nixl_single(KIB, 1)
    first_nixl_ms = first_nixl_us / 1000
    started = time.perf_counter_ns()
    await bench.grpc_once(1, KIB)
    first_grpc_ms = _elapsed_us(started) / 1000
    progress(f"handoff: first contact NIXL {first_nixl_ms:.1f} ms, gRPC {first_grpc_ms:.1f} ms")

    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    # Methods alternate per size, so slow drift in background load hits all of them alike.
    for nbytes in sizes:
        await bench.nixl_single(nbytes, warmup)
        results.append(_result("nixl_read", nbytes, await bench.nixl_single(nbytes, iterations)))
        try:
            await bench.grpc(1, nbytes, warmup)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            # The payload plus its protobuf framing exceeds the project's message limit.
            skipped.append({"method": "grpc_inline", "bytes": nbytes, "reason": f"{error.code().name}: {error.details()}"})
        else:
            results.append(_result("grpc_inline", nbytes, await bench.grpc(1, nbytes, iterations)))
        bench.memcpy(nbytes, warmup)
        results.append(_result("memcpy", nbytes, bench.memcpy(nbytes, iterations)))
        line = ", ".join(f"{r['method']} {r['latency_us']['median']:.1f} µs" for r in results if r["bytes"] == nbytes)
        progress(f"handoff: {nbytes} B: {line}")

    batched = []
    for items, item_bytes in BATCHES:
        await bench.nixl_batched(items, item_bytes, 1, one_transfer=True)
        await bench.nixl_batched(items, item_bytes, 1, one_transfer=False)
        one = await bench.nixl_batched(items, item_bytes, batch_iterations, one_transfer=True)
        per_item = await bench.nixl_batched(items, item_bytes, batch_iterations, one_transfer=False)
        batched.append(_batched("nixl_read", items, item_bytes, one, per_item))
        # Warm-up; the first call for a key also has the server build that response.
        await bench.grpc(items, item_bytes, 1)
        await bench.grpc(1, item_bytes, 1)
        one = await bench.grpc(items, item_bytes, batch_iterations)
        per_item = await bench.grpc(1, item_bytes, batch_iterations, calls=items)
        batched.append(_batched("grpc_inline", items, item_bytes, one, per_item))
        line = ", ".join(f"{b['method']} x{b['speedup']:.1f}" for b in batched[-2:])
        progress(f"handoff: {items} x {item_bytes} B, one transfer vs one per item: {line}")
    return {
        "results": results,
        "batched": batched,
        "first_contact_ms": {"nixl_read": first_nixl_ms, "grpc_inline": first_grpc_ms},
        "skipped": skipped,
        "verified": {method: sorted(verified) for method, verified in bench.verified.items()},
    }


def _median_at(results: Sequence[dict[str, Any]], method: str, nbytes: int) -> float:
    for result in results:
        if result["method"] == method and result["bytes"] == nbytes:
            return float(result["latency_us"]["median"])
    return math.nan


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
        title="Embedding handoff: median latency, request to bytes in a tensor",
        xlabel="payload",
        ylabel="median latency (µs)",
        xticks={size: _size_label(size) for size in sizes},
    )


def run(
    *, quick: bool = False, iterations: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str | None = None
) -> pathlib.Path:
    """Runs the handoff benchmark and writes ``handoff.json`` (and ``handoff.png``).

    Args:
        quick: Only 1 KiB, 64 KiB and 1 MiB, with few iterations (a few seconds).
        iterations: Timed samples per (method, size); batched cases take a fifth of that.
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
    warmup = max(2, iterations // 10)
    batch_iterations = max(3, iterations // 5)
    # A private loop, never installed as the thread's current loop, so callers' loops are untouched.
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        measured = runner.run(_measure(sizes, iterations, warmup, batch_iterations))
    results = measured["results"]
    payload_doc = {
        "experiment": "handoff",
        "config": {
            "quick": quick,
            "sizes": sizes,
            "iterations": iterations,
            "warmup_iterations": warmup,
            "batches": [{"items": items, "item_bytes": item_bytes} for items, item_bytes in BATCHES],
            "batched_iterations": batch_iterations,
            "arena_slot_bytes": _SLOT_BYTES,
            "arena_bytes": measured["arena_bytes"],
            "fetch_buffer_bytes": measured["fetch_buffer_bytes"],
            "grpc_max_message_bytes": MAX_MESSAGE_BYTES,
            "ucx_tls": os.environ.get("UCX_TLS", "UCX default"),
            "torch_threads": torch.get_num_threads(),
            "timing": "consumer wall clock from request to bytes in a torch tensor, one copy included "
            "(NIXL: the fetcher's clone out of its receive buffer; gRPC: bytearray of the message field)",
            "ratio_definition": "other method's median latency / nixl_read's median latency at 1 MiB "
            "(NIXL's throughput relative to it; above 1: NIXL faster)",
            "skipped": measured["skipped"],
            "verified": measured["verified"],
        },
        "results": results,
        "batched": measured["batched"],
        "first_contact_ms": measured["first_contact_ms"],
        "ratios": {
            "nixl_vs_grpc_at_1MiB": _median_at(results, "grpc_inline", REFERENCE_BYTES) / _median_at(results, "nixl_read", REFERENCE_BYTES),
            "nixl_vs_memcpy_at_1MiB": _median_at(results, "memcpy", REFERENCE_BYTES) / _median_at(results, "nixl_read", REFERENCE_BYTES),
        },
    }
    path = write_result("handoff", payload_doc, command=command or command_line(), results_dir=results_dir)
    _plot(results, results_dir / "handoff.png")
    progress(f"handoff: wrote {path}")
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

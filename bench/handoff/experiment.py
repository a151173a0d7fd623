"""The experiment: run it, analyze its samples, plot and report them."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import pathlib
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import torch

from bench.common import RESULTS_DIR, command_line, plot_lines, progress, write_result
from bench.formatting import KIB, MIB, fmt, machine, size
from bench.handoff.measure import _measure, iterations_for
from bench.handoff.payload import (
    _DTYPE,
    _SLOT_BYTES,
    _TORCH_THREADS,
    BATCHES,
    FULL_ITERATIONS,
    FULL_SIZES,
    GOAL_FIXED_COST_US,
    GOAL_GRPC_SPEEDUP,
    GOAL_MEMCPY_FRACTION,
    GOAL_RAW_READ_FRACTION,
    METHODS,
    QUICK_ITERATIONS,
    QUICK_SIZES,
    REFERENCE_BYTES,
    SMALL_BYTES,
)
from epd.server import MAX_MESSAGE_BYTES
from epd.transport.memory.slot_header import HEADER_BYTES


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
    over_raw = {str(n): _median_at(results, "raw_read", n) / _median_at(results, "ec_consumer", n) for n in large}
    over_grpc = _median_at(results, "grpc_inline", REFERENCE_BYTES) / _median_at(results, "ec_consumer", REFERENCE_BYTES)
    worst = min(over_memcpy.values(), default=math.nan)
    worst_over_raw = min(over_raw.values(), default=math.nan)
    overhead = {
        str(n): {
            "ec_consumer_minus_raw_read_us": _median_at(results, "ec_consumer", n) - _median_at(results, "raw_read", n),
            "nixl_reader_minus_raw_read_us": _median_at(results, "nixl_reader", n) - _median_at(results, "raw_read", n),
        }
        for n in sizes
    }
    worst_fixed = max((c["ec_consumer_minus_raw_read_us"] for n, c in overhead.items() if int(n) <= SMALL_BYTES), default=math.nan)
    return {
        "ratios": {
            "ec_consumer_over_memcpy": over_memcpy,
            "raw_read_over_memcpy": raw_over_memcpy,
            "ec_consumer_over_memcpy_fresh": over_fresh,
            "ec_consumer_over_raw_read": over_raw,
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
            {
                "goal": f"ec_consumer throughput >= {GOAL_RAW_READ_FRACTION:g}x a raw READ's at every size >= 1 MiB (worst size)",
                "value": worst_over_raw,
                "target": GOAL_RAW_READ_FRACTION,
                "met": bool(worst_over_raw >= GOAL_RAW_READ_FRACTION),
            },
            {
                "goal": f"ec_consumer's fixed cost over a raw READ <= {GOAL_FIXED_COST_US:g} µs at every size <= {_size_label(SMALL_BYTES)} (worst size, µs)",
                "value": worst_fixed,
                "target": GOAL_FIXED_COST_US,
                "met": bool(worst_fixed <= GOAL_FIXED_COST_US),
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
    lines += [f"- {g['goal']}: {'' if g['goal'].endswith('µs)') else '×'}{fmt(g['value'], 3)} ({'met' if g['met'] else 'NOT met'})" for g in doc["goals"]]
    lines += ["", "Throughput ratios and fixed cost:", ""]
    ratios = doc["ratios"]
    for key, label in (
        ("ec_consumer_over_memcpy", "ec_consumer throughput over memcpy's"),
        ("ec_consumer_over_memcpy_fresh", "ec_consumer over memcpy_fresh"),
        ("raw_read_over_memcpy", "raw_read over memcpy (what NIXL itself reaches)"),
        ("ec_consumer_over_raw_read", "ec_consumer throughput over raw_read's (what EPD adds to NIXL)"),
    ):
        lines.append(f"- {label}: " + ", ".join(f"{size(int(n))} ×{fmt(v, 3)}" for n, v in ratios[key].items()))
    lines.append(
        "- Fixed cost over a raw READ (median µs, ec_consumer / nixl_reader): "
        + ", ".join(f"{size(int(n))} {fmt(c['ec_consumer_minus_raw_read_us'], 1)} / {fmt(c['nixl_reader_minus_raw_read_us'], 1)}" for n, c in doc["fixed_cost_us"].items())
    )
    lines.append(
        "- Reading these: at the small sizes a raw READ's own median moves between about 10 and 30 µs from run to run. Its "
        "notification wakes the producer's NIXL progress thread, a system call in the reader's post, whenever that thread "
        "has gone back to sleep, which it does when READs come further apart (as between an engine's steps); the paths "
        "with more work per READ pay it nearly always. The rest of the fixed cost is the consumer's Python per READ."
    )
    lines += ["", "| batched | items x size | one transfer median µs | one per item median µs | speedup |", "| --- | --- | --- | --- | --- |"]
    for b in doc["batched"]:
        lines.append(
            f"| {b['method']} | {b['items']} x {size(b['item_bytes'])} | {fmt(b['one_transfer_us']['median'], 1)} | {fmt(b['per_item_transfers_us']['median'], 1)} | ×{fmt(b['speedup'])} |"
        )
    first = ", ".join(f"{k} {fmt(v, 1)} ms" for k, v in doc["first_contact_ms"].items())
    skipped = "".join(f" Not measured: {s['method']} at {size(s['bytes'])} ({s['reason']})." for s in cfg.get("skipped", []))
    return [*lines, "", f"First contact (excluded above): {first}. Leases left at the end: {cfg['leases_left']}.{skipped}", ""]

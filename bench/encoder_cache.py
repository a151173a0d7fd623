"""Encoder-output reuse: a workload where about half the items repeat, as in multi-turn chats.

Every unique image is asked about twice, by two requests with different questions; the repeat
comes a few requests later, as the next turn of a chat would. One E/P/D deployment of the tiny
Qwen2.5-VL: a pair of encoders with the encoder-output cache off, a pair with it on, one prefill
and one decode (both with ``--no-caches``, so that vLLM's prefix cache does not answer for the
encoder), and three gateways, one per arm:

- ``cache off``: the cache-off encoders, affinity routing;
- ``local cache, least in-flight``: the cache-on encoders, ``--no-affinity-routing``;
- ``local cache, affinity``: the cache-on encoders, items routed by content hash.

Each arm sends its own salted copy of the workload (same pixels, new bytes: no arm's cache can
serve another's) at most ``CONCURRENCY`` in flight. Reported per arm: TTFT and E2EL
(mean/median/p99), tower runs (``epd_encoder_batch_items`` over both encoders: the items vLLM
scheduled for the tower), cache hits, and whether every request's tokens equal the monolithic
run's. A shared tier across encoders is not implemented, so it has no arm.

With the cache off, vLLM's own encoder cache in the encoder engine still answers a repeat that
comes while the output is resident (it frees entries lazily): the tower-run count shows how
often. What the arena cache adds is reuse that outlives that window and survives vLLM's eviction.
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc

from bench.common import RESULTS_DIR, progress, write_result
from bench.workload import WorkloadSpec, build_requests, run_load, salted
from epd.client import generate
from epd.launcher import ServiceProcess, Stack, gateway_args, start_monolithic
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2, gateway_pb2_grpc

NAME = "encoder_cache"
FAMILY = "qwen2_5_vl"
CONCURRENCY = 4
UNIQUE_ITEMS = 24
QUICK_UNIQUE_ITEMS = 4
REPEAT_AFTER = 3  # a repeat follows its first use this many requests later
ARMS = {"cache off": ("off", True), "local cache, least in-flight": ("on", False), "local cache, affinity": ("on", True)}


def build_workload(unique: int) -> list[gateway_pb2.GenerateRequest]:
    """``2 * unique`` one-image requests; each image twice, its second use ``REPEAT_AFTER``
    requests after its first."""
    firsts = build_requests(WorkloadSpec(num_requests=unique, items_per_request=(1, 1), image_edge_px=(448, 896), max_tokens=8, seed=11))
    order: list[gateway_pb2.GenerateRequest] = []
    pending: list[tuple[int, gateway_pb2.GenerateRequest]] = []
    for index, first in enumerate(firsts):
        order.append(first)
        again = gateway_pb2.GenerateRequest()
        again.CopyFrom(first)
        again.request_id = f"{first.request_id}-again"
        again.messages[0].parts[-1].text = f"Turn two of request {index}: and what colours does it have?"
        pending.append((index + REPEAT_AFTER, again))
        while pending and pending[0][0] <= index:
            order.append(pending.pop(0)[1])
    order += [request for _, request in pending]
    return order


def _tower_runs(encoders: list[ServiceProcess]) -> tuple[float, float]:
    """Items scheduled for the tower and cache hits, summed over the encoders."""
    samples = [scrape(e.metrics_port) for e in encoders]
    return sum(s.get("epd_encoder_batch_items{modality=image}", 0.0) for s in samples), sum(s.get("epd_encoder_cache_hits_total", 0.0) for s in samples)


def _start(stack: Stack, model: str) -> tuple[dict[str, list[ServiceProcess]], dict[str, ServiceProcess]]:
    observability = ["--metrics-port", "0"]
    encoders = {
        cache: [stack.start(f"encoder-cache-{cache}-{i}", ["encoder", "--model", model, *observability, *([] if cache == "on" else ["--encoder-cache-bytes", "0"])]) for i in range(2)]
        for cache in ("off", "on")
    }
    prefill = stack.start("prefill", ["prefill", "--model", model, "--no-caches", *observability])
    decode = stack.start("decode", ["decode", "--model", model, "--mode", "decode", "--no-caches", *observability])
    monolithic = start_monolithic(stack, model, extra=["--no-caches", *observability])
    stack.wait_ready([*encoders["off"], *encoders["on"], prefill, decode], timeout=900)
    gateways = {}
    for arm, (cache, affinity) in ARMS.items():
        extra = [*observability, *([] if affinity else ["--no-affinity-routing"])]
        args = gateway_args(model, "epd", encoders=[e.address for e in encoders[cache]], prefills=[prefill.address], decodes=[decode.address], extra=extra)
        gateways[arm] = stack.start(f"gateway-{cache}-{'affinity' if affinity else 'least'}", args)
    gateways["monolithic"] = monolithic
    stack.wait_ready(list(gateways.values()), timeout=600)
    return encoders, gateways


def run(*, quick: bool = False, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from epd.checkpoints import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    workload = build_workload(QUICK_UNIQUE_ITEMS if quick else UNIQUE_ITEMS)

    async def experiment() -> list[dict[str, Any]]:
        stack = Stack()
        try:
            encoders, gateways = await asyncio.to_thread(_start, stack, model)
            async with grpc.aio.insecure_channel(gateways["monolithic"].address, options=CLIENT_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                oracle = [(await generate(stub, r, timeout=300)).token_ids for r in workload]
            # Every arm's engines warmed up alike (the first arm would otherwise pay for all),
            # on bytes no measured pass sends.
            for arm in ARMS:
                await run_load(gateways[arm].address, salted(workload[:CONCURRENCY], f"warm-{arm}"), float("inf"), seed=0, max_concurrency=CONCURRENCY)
            results = []
            for index, (arm, (cache, _)) in enumerate(ARMS.items()):
                requests = salted(workload, f"arm-{index}")
                before = _tower_runs(encoders[cache])
                load = await run_load(gateways[arm].address, requests, float("inf"), seed=index, max_concurrency=CONCURRENCY)
                after = _tower_runs(encoders[cache])
                same = [list(record) == expected for record, expected in zip(load.pop("outputs"), oracle, strict=True)]
                results.append(
                    {
                        "arm": arm,
                        "requests": len(requests),
                        "unique_items": len(requests) // 2,
                        "failed": load["failed"],
                        "errors": load["errors"],
                        "tower_runs": after[0] - before[0],
                        "cache_hits": after[1] - before[1],
                        "tokens_equal_monolithic": sum(same),
                        "ttft_ms": load["ttft_ms"],
                        "e2el_ms": load["e2el_ms"],
                    }
                )
                progress(f"{NAME}: {arm}: TTFT p50 {load['ttft_ms']['median']:.0f} ms, {results[-1]['tower_runs']:.0f} tower runs for {len(requests) // 2} images")
            return results
        finally:
            await asyncio.to_thread(stack.stop)

    results = asyncio.run(experiment())
    return write_result(NAME, {"model": model, "concurrency": CONCURRENCY, "repeat_after": REPEAT_AFTER, "warmed_up": True, "results": results}, command=command, results_dir=results_dir)

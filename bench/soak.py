"""Soak: many requests at steady concurrency through one E/P/D deployment; nothing may be lost
and nothing may grow.

The tiny Qwen2.5-VL on loopback (one encoder, prefill and decode behind a gateway), a closed loop
of ``concurrency`` clients sending one-image requests (16 output tokens, a rotating set of
images) until ``requests`` have been sent. Reported:

- lost requests (any error) and their codes; E2EL and TTFT p50/p99;
- RSS of each service's process tree (vLLM's engine core included) every ``sample_every``
  requests, and its growth per request after the first sample (warm-up): flat means no leak;
- arena leases, consumer receive-buffer items and KV cache usage once the load has drained
  (all must be back to 0).
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable
from typing import Any

import grpc
import psutil

from bench.common import RESULTS_DIR, progress, service_processes, summarize, write_result
from bench.formatting import fmt, machine
from bench.workload import Sent, closed_loop
from cli.launcher import ServiceProcess, Stack, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2_grpc

NAME = "soak"
FAMILY = "qwen2_5_vl"
REQUESTS, QUICK_REQUESTS = 1000, 64
CONCURRENCY = 16
SAMPLE_EVERY, QUICK_SAMPLE_EVERY = 250, 16
OUTPUT_TOKENS = 16
_DRAIN_S = 30.0
_END_STATE = {"encoder": "epd_arena_leases", "prefill": "vllm:kv_cache_usage_perc", "decode": "vllm:kv_cache_usage_perc"}


def tree_memory_mib(service: ServiceProcess) -> tuple[float, float]:
    """(RSS, private) of a service and its engine processes. Private is RSS less shared pages:
    the arena and receive buffers are shared memory, touched page by page until each has been
    used whole, so their growth is bounded by their size and shows in RSS only."""
    rss = private = 0
    for _, process in service_processes(service):
        try:
            memory = process.memory_info()
        except psutil.NoSuchProcess:
            continue
        rss += memory.rss
        private += memory.rss - memory.shared
    return rss / 2**20, private / 2**20


async def drained(read: Callable[[], dict[str, float]], timeout_s: float) -> dict[str, float]:
    """``read()`` once every value it returns is 0 (leases and KV are freed by asynchronous
    notifications), or as it stands after ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    state = read()
    while any(v != 0 for v in state.values()) and time.perf_counter() < deadline:
        await asyncio.sleep(0.5)
        state = read()
    return state


def _end_state(services: dict[str, ServiceProcess]) -> dict[str, float]:
    state = {f"{name} {metric}": scrape(services[name].metrics_port).get(metric, float("nan")) for name, metric in _END_STATE.items()}
    state["prefill epd_receive_buffer_items"] = scrape(services["prefill"].metrics_port).get("epd_receive_buffer_items", float("nan"))
    return state


def run(*, quick: bool = False, num_requests: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from devkit.checkpoints import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    total = num_requests or (QUICK_REQUESTS if quick else REQUESTS)
    sample_every = QUICK_SAMPLE_EVERY if quick else SAMPLE_EVERY
    requests = [
        chat_request([(synthetic_image_png(96 + 8 * i, 96 + 8 * (i % 3), seed=1200 + i), "image/png"), f"Describe image {i}."], max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS)
        for i in range(16)
    ]

    async def experiment() -> dict[str, Any]:
        stack = Stack()
        try:
            observability = ["--model", model, "--metrics-port", "0"]
            services = {
                "encoder": stack.start("encoder", ["encoder", *observability]),
                "prefill": stack.start("prefill", ["prefill", *observability]),
                "decode": stack.start("decode", ["decode", "--mode", "decode", *observability]),
            }
            await asyncio.to_thread(stack.wait_ready, list(services.values()), 900)
            args = gateway_args(model, "epd", encoders=[services["encoder"].address], prefills=[services["prefill"].address], decodes=[services["decode"].address])
            services["gateway"] = stack.start("gateway", [*args, "--metrics-port", "0"])
            await asyncio.to_thread(stack.wait_ready, [services["gateway"]], 300)
            rss: list[dict[str, Any]] = [{"requests": 0, **{name: tree_memory_mib(s)[0] for name, s in services.items()}}]
            log: list[Sent] = []
            started = time.perf_counter()

            async def sample() -> None:
                while len(rss) <= total // sample_every:
                    if len(log) >= len(rss) * sample_every:
                        rss.append({"requests": len(log), **{name: tree_memory_mib(s)[0] for name, s in services.items()}})
                        progress(f"{NAME}: {len(log)} requests, {sum(not s.record.ok for s in log)} lost, RSS MiB " + ", ".join(f"{k} {v:.0f}" for k, v in rss[-1].items() if k != "requests"))
                    await asyncio.sleep(0.2)

            async with grpc.aio.insecure_channel(services["gateway"].address, options=CLIENT_OPTIONS) as channel:
                sampler = asyncio.create_task(sample())
                await closed_loop(gateway_pb2_grpc.GatewayServiceStub(channel), requests, CONCURRENCY, log, total=total)
                await asyncio.wait_for(sampler, 30)
            duration = time.perf_counter() - started
            state = await drained(lambda: _end_state(services), _DRAIN_S)
            return {"duration_s": duration, "log": log, "rss": rss, "end_state": state}
        finally:
            await asyncio.to_thread(stack.stop)

    outcome = asyncio.run(experiment())
    log, rss = outcome["log"], outcome["rss"]
    ok = [s.record for s in log if s.record.ok]
    services = [k for k in rss[0] if k != "requests"]
    warm, last = rss[1] if len(rss) > 2 else rss[0], rss[-1]
    growth = {name: (last[name] - warm[name]) / max(1, last["requests"] - warm["requests"]) for name in services}
    payload = {
        "model": model,
        "requests": len(log),
        "concurrency": CONCURRENCY,
        "output_tokens": OUTPUT_TOKENS,
        "duration_s": outcome["duration_s"],
        "lost": len(log) - len(ok),
        "errors": sorted({s.record.error for s in log if not s.record.ok})[:10],
        "e2el_ms": summarize([r.e2el_s * 1e3 for r in ok]),
        "ttft_ms": summarize([r.ttft_s * 1e3 for r in ok]),
        "rss_mib": rss,
        "rss_growth_mib_per_request_after_warmup": growth,
        "end_state": outcome["end_state"],
    }
    progress(f"{NAME}: {payload['lost']} of {len(log)} lost; growth MiB/request " + ", ".join(f"{k} {v:.3f}" for k, v in growth.items()))
    return write_result(NAME, payload, command=command, results_dir=results_dir)


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    services = [k for k in doc["rss_mib"][0] if k != "requests"]
    lines = [
        "## Soak: requests at steady concurrency, nothing lost, nothing growing",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"{doc['requests']} one-image E/P/D requests ({doc['output_tokens']} output tokens) through the gateway "
        f"at concurrency {doc['concurrency']} in {doc['duration_s']:.0f} s. "
        f"Lost: {doc['lost']}{' (' + ', '.join(doc['errors']) + ')' if doc['errors'] else ''}. "
        f"E2EL p50 {fmt(doc['e2el_ms']['median'], 0)} ms, p99 {fmt(doc['e2el_ms']['p99'], 0)} ms; TTFT p50 {fmt(doc['ttft_ms']['median'], 0)} ms, p99 {fmt(doc['ttft_ms']['p99'], 0)} ms.",
        "",
        "RSS of each service's process tree (MiB), by requests completed:",
        "",
        "| requests | " + " | ".join(services) + " |",
        "| --- | " + " | ".join("---" for _ in services) + " |",
    ]
    for sample in doc["rss_mib"]:
        lines.append(f"| {sample['requests']} | " + " | ".join(f"{sample[s]:.0f}" for s in services) + " |")
    growth = ", ".join(f"{k} {v * 1024:.1f} KiB" for k, v in doc["rss_growth_mib_per_request_after_warmup"].items())
    end = ", ".join(f"{k} {v:g}" for k, v in doc["end_state"].items())
    return [*lines, "", f"Growth per request after the first sample: {growth}. After the load drained: {end}.", ""]

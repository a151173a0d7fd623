"""Chaos: random SIGKILLs of every stage under steady load; no request may fail, and every
greedy reply must equal its oracle.

One E/P/D deployment of the tiny Qwen2.5-VL with two encoders, two prefills and two decodes
behind one gateway (``bench.faults.start_two_of_each``), and a monolithic gateway as the oracle,
all on loopback. A closed loop of ``concurrency`` clients sends one-image greedy requests
(``OUTPUT_TOKENS`` each, long enough that decodes die mid-stream) for ``DURATION_S``. Meanwhile,
every ``PAUSE_S`` (20-40 s, drawn at random) the busiest instance of a random stage (every stage
once in each round of three) is SIGKILLed, service and engine core, and restarted at its address
as soon as its port has closed. Only a stage whose other instance is up is chosen, so the
deployment always has a live instance of each stage, as with one failure domain down at a
time; restarts overlap. The short form (``--quick``, CI) kills one instance of each stage, 8-12 s
apart.

Checked and reported:

- failed requests (goal 0) and their errors;
- every reply against its oracle: one the gateway did not resume equals the monolithic run of the
  same request; a resumed one equals it up to the resume, and after it what monolithic generates
  given the prompt and the tokens before (``continuation_token_ids``); how many resumed replies
  also equal the uninterrupted run;
- kills and restarts, resumes and retries (the gateway's counters), time to eject (the kill until
  the gateway's ``epd_stage_instance_up`` reads 0) and to rejoin (the restarted process's
  readiness until it reads 1);
- arena leases and KV cache usage of every instance once the load has
  drained (goal 0), and each instance's RSS over its life after a warm-up (goal: flat).
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
from typing import Any

import grpc

from bench.common import RESULTS_DIR, progress, summarize, write_result
from bench.faults import start_two_of_each, wait_gauge, wait_port_closed
from bench.formatting import fmt, machine
from bench.soak import drained, tree_memory_mib
from bench.workload import Sent, closed_loop
from cli.launcher import ServiceProcess, Stack, start_monolithic
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2_grpc

NAME = "chaos"
FAMILY = "qwen2_5_vl"
STAGES = ("encoder", "prefill", "decode")
CONCURRENCY = 8
OUTPUT_TOKENS = 192
DURATION_S = 300.0
QUICK_KILLS = len(STAGES)  # the short form (CI): one instance of each stage, in random order
PAUSE_S, QUICK_PAUSE_S = (20.0, 40.0), (8.0, 12.0)
WARM_UP_S = 20.0  # an instance's RSS counts from this long after it is ready
_RSS_EVERY_S = 5.0
_DRAIN_S = 30.0
# What a drained deployment holds for nobody: every one must be 0. (A consumer's receive buffer
# keeps the items it read as vLLM's encoder cache, by design: not counted.)
_END_STATE = {"encoder": ("epd_arena_leases",), "prefill": ("vllm:kv_cache_usage_perc",), "decode": ("vllm:kv_cache_usage_perc",)}


def _requests(count: int = 8) -> list:
    return [
        chat_request([(synthetic_image_png(96 + 16 * i, 112, seed=3100 + i), "image/png"), f"Tell a story about picture {i}."], max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS)
        for i in range(count)
    ]


class _Lives:
    """Each instance's lives (a restart begins a new one): when it became ready, and its RSS and
    private memory."""

    def __init__(self) -> None:
        self.lives: list[dict[str, Any]] = []
        self._current: dict[str, dict[str, Any]] = {}

    def begin(self, name: str, service: ServiceProcess) -> None:
        self._current[name] = life = {"instance": name, "ready_at": time.perf_counter(), "service": service, "rss_mib": []}
        self.lives.append(life)

    def end(self, name: str) -> None:
        """The instance is about to be killed: no more samples of it (a dying process tree's RSS
        falls, which would read as the life's end)."""
        del self._current[name]

    def sample(self) -> None:
        now = time.perf_counter()
        for life in self._current.values():
            if life["service"].process.poll() is None and now - life["ready_at"] >= WARM_UP_S:
                life["rss_mib"].append((round(now - life["ready_at"], 1), *(round(m, 1) for m in tree_memory_mib(life["service"]))))

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for life in self.lives:
            samples = life["rss_mib"]
            if len(samples) >= 2:
                (t0, first, first_private), (t1, last, last_private) = samples[0], samples[-1]
                minutes = max(t1 - t0, 1e-9) / 60
                rows.append(
                    {
                        "instance": life["instance"],
                        "lived_s": t1,
                        "first_mib": first,
                        "last_mib": last,
                        "max_mib": max(m for _, m, _ in samples),
                        "growth_mib_per_min": (last - first) / minutes,
                        "private_growth_mib_per_min": (last_private - first_private) / minutes,
                    }
                )
        return rows


def _end_state(services: dict[str, ServiceProcess]) -> dict[str, float]:
    return {
        f"{name} {metric}": scrape(service.metrics_port).get(metric, float("nan"))
        for name, service in services.items()
        for stage, metrics in _END_STATE.items()
        if name.startswith(stage)
        for metric in metrics
    }


# How long a kill waits for its stage to have a call in flight.
_BUSY_WAIT_S = 10.0


class _Victims:
    """Random stages, every stage once in each round of three (so that a short run hits each),
    and only a stage whose other instance is up: one instance of each stage is always live, as
    with one failure domain down at a time. Of the stage, the instance serving the most calls
    (ties at random): a kill that finds no request in flight tests nothing."""

    def __init__(self, rng: random.Random, services: dict[str, ServiceProcess]) -> None:
        self._rng = rng
        self._services = services
        self._round: list[str] = []
        self.down: set[str] = set()  # stages with an instance killed and not yet back

    async def next(self) -> str:
        while True:
            if not self._round:
                self._round = self._rng.sample(STAGES, len(STAGES))
            stage = next((s for s in self._round if s not in self.down), None)
            if stage is not None:
                self._round.remove(stage)
                busy = await self._busy(stage)
                return max(self._rng.sample(sorted(busy), 2), key=busy.get)
            await asyncio.sleep(0.5)

    async def _busy(self, stage: str) -> dict[str, float]:
        """Calls in flight on each instance of the stage, once one has any (or after
        :data:`_BUSY_WAIT_S`): under a closed loop every request passes each stage, but at a
        given moment all of them may be at the others."""
        deadline = time.perf_counter() + _BUSY_WAIT_S
        while True:
            busy = {f"{stage}{i}": scrape(self._services[f"{stage}{i}"].metrics_port).get(f"epd_requests_in_flight{{service={stage}}}", 0.0) for i in range(2)}
            if max(busy.values()) > 0 or time.perf_counter() >= deadline:
                return busy
            await asyncio.sleep(0.05)


async def _kill_and_restart(stack: Stack, services: dict[str, ServiceProcess], lives: _Lives, name: str) -> dict[str, Any]:
    stage, gateway = name[:-1], services["gateway"]
    victim = services[name]
    started = time.perf_counter()
    lives.end(name)
    victim.kill()
    eject_s, _ = await asyncio.gather(wait_gauge(gateway, stage, victim.address, 0.0, 30), wait_port_closed(victim.address, 30))
    await asyncio.to_thread(victim.process.wait, 30)
    restarted = stack.restart(victim)
    await asyncio.to_thread(stack.wait_ready, [restarted], 900)
    services[name] = restarted
    lives.begin(name, restarted)
    rejoin_s = await wait_gauge(gateway, stage, restarted.address, 1.0, 60)
    event = {"instance": name, "eject_s": eject_s, "restart_s": time.perf_counter() - started, "rejoin_s": rejoin_s}
    progress(f"{NAME}: killed {name}; ejected in {fmt(eject_s, 2)} s, back in {event['restart_s']:.0f} s, rejoined {fmt(rejoin_s, 2)} s after ready")
    return event


def _counters(gateway: ServiceProcess, prefix: str) -> dict[str, float]:
    return {key[len(prefix) :].strip("{}"): value for key, value in scrape(gateway.metrics_port).items() if key.startswith(prefix + "{")}


async def _judge(monolithic_stub, requests: list, log: list[Sent], uninterrupted: dict[int, list[int]]) -> dict[str, Any]:
    """Each reply against its oracle (see the module's docstring)."""
    wrong, resumed, resumed_identical = [], 0, 0
    continued_oracles: dict[tuple[int, int], list[int]] = {}
    for sent in log:
        record = sent.record
        if not record.ok:
            continue
        tokens, expected = list(record.token_ids), uninterrupted[sent.index]
        if not record.resumed_after:
            if tokens != expected:
                wrong.append({"request": sent.index, "resumed_after": []})
            continue
        resumed += 1
        resumed_identical += tokens == expected
        cuts = [*record.resumed_after, len(tokens)]
        if tokens[: cuts[0]] != expected[: cuts[0]]:
            wrong.append({"request": sent.index, "resumed_after": list(record.resumed_after), "before_the_resume": True})
            continue
        for start, end in zip(cuts, cuts[1:], strict=False):
            key = (sent.index, start)
            if key not in continued_oracles:
                continued = type(requests[sent.index])()
                continued.CopyFrom(requests[sent.index])
                continued.continuation_token_ids.extend(tokens[:start])
                continued_oracles[key] = (await generate(monolithic_stub, continued, timeout=300)).token_ids
            if tokens[start:end] != continued_oracles[key][: end - start]:
                wrong.append({"request": sent.index, "resumed_after": list(record.resumed_after), "after": start})
                break
    return {"wrong_tokens": len(wrong), "wrong_examples": wrong[:8], "resumed_replies": resumed, "resumed_identical_to_uninterrupted": resumed_identical}


def run(*, quick: bool = False, duration_s: float | None = None, seed: int = 0, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from devkit.checkpoints import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    duration_s = duration_s or DURATION_S
    most_kills = QUICK_KILLS if quick else None
    pause_s = QUICK_PAUSE_S if quick else PAUSE_S
    requests = _requests()
    rng = random.Random(seed)

    async def experiment() -> dict[str, Any]:
        stack = Stack()
        try:
            services = await asyncio.to_thread(start_two_of_each, stack, model)
            monolithic = await asyncio.to_thread(start_monolithic, stack, model)
            lives = _Lives()
            for name, service in services.items():
                lives.begin(name, service)
            async with (
                grpc.aio.insecure_channel(services["gateway"].address, options=CLIENT_OPTIONS) as channel,
                grpc.aio.insecure_channel(monolithic.address, options=CLIENT_OPTIONS) as oracle_channel,
            ):
                stub, oracle_stub = gateway_pb2_grpc.GatewayServiceStub(channel), gateway_pb2_grpc.GatewayServiceStub(oracle_channel)
                uninterrupted = {i: (await generate(oracle_stub, r, timeout=300)).token_ids for i, r in enumerate(requests)}
                log: list[Sent] = []
                stop = asyncio.Event()
                load = asyncio.create_task(closed_loop(stub, requests, CONCURRENCY, log, until=stop.is_set))
                started = time.perf_counter()
                events: list[dict[str, Any]] = []

                async def chaos() -> None:
                    victims, restarts = _Victims(rng, services), []

                    async def kill(name: str) -> None:
                        victims.down.add(name[:-1])
                        try:
                            events.append(await _kill_and_restart(stack, services, lives, name))
                        finally:
                            victims.down.discard(name[:-1])

                    while most_kills is None or len(restarts) < most_kills:
                        await asyncio.sleep(rng.uniform(*pause_s))
                        if most_kills is None and time.perf_counter() - started >= duration_s:
                            break
                        restarts.append(asyncio.create_task(kill(await victims.next())))
                    await asyncio.gather(*restarts)
                    await asyncio.sleep(rng.uniform(*pause_s))  # load on the last restarted instances too

                async def sample_rss() -> None:
                    while not stop.is_set():
                        lives.sample()
                        await asyncio.sleep(_RSS_EVERY_S)

                sampler = asyncio.create_task(sample_rss())
                await chaos()
                stop.set()
                await load
                await sampler
                load_s = time.perf_counter() - started
                state = await drained(lambda: _end_state(services), _DRAIN_S)
                judged = await _judge(oracle_stub, requests, log, uninterrupted)
            gateway = services["gateway"]
            return {
                "load_s": load_s,
                "log": log,
                "events": events,
                "judged": judged,
                "end_state": state,
                "rss": lives.summary(),
                "resumes": _counters(gateway, "epd_gateway_resumes_total"),
                "retries": _counters(gateway, "epd_gateway_retries_total"),
            }
        finally:
            await asyncio.to_thread(stack.stop)

    outcome = asyncio.run(experiment())
    log, events = outcome["log"], outcome["events"]
    ok = [s.record for s in log if s.record.ok]
    payload = {
        "model": model,
        "concurrency": CONCURRENCY,
        "output_tokens": OUTPUT_TOKENS,
        "pause_s": list(pause_s),
        "seed": seed,
        "load_s": outcome["load_s"],
        "requests": len(log),
        "failed": len(log) - len(ok),
        "errors": sorted({s.record.error for s in log if not s.record.ok})[:10],
        "e2el_ms": summarize([r.e2el_s * 1e3 for r in ok]),
        "kills": events,
        "resumes": outcome["resumes"],
        "retries": outcome["retries"],
        **outcome["judged"],
        "end_state": outcome["end_state"],
        "rss": outcome["rss"],
    }
    progress(f"{NAME}: {payload['failed']} of {len(log)} failed, {payload['wrong_tokens']} wrong, {len(events)} kills, resumes {outcome['resumes']}")
    return write_result(NAME, payload, command=command, results_dir=results_dir)


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    kills = doc["kills"]
    by_stage = {stage: [k for k in kills if k["instance"].startswith(stage)] for stage in STAGES}
    lines = [
        "## Chaos: random SIGKILLs of every stage under load",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Two encoders, prefills and decodes behind one gateway; {doc['concurrency']} clients sending one-image greedy requests "
        f"({doc['output_tokens']} tokens) for {doc['load_s']:.0f} s; every {doc['pause_s'][0]:g}-{doc['pause_s'][1]:g} s, "
        "the busiest instance of a random stage whose other instance was up SIGKILLed and restarted at its address.",
        "",
        f"**{doc['failed']} of {doc['requests']} requests failed**{' (' + '; '.join(doc['errors']) + ')' if doc['errors'] else ''}; "
        f"{doc['wrong_tokens']} replies differed from their oracle. {doc['resumed_replies']} replies were resumed mid-stream, "
        f"{doc['resumed_identical_to_uninterrupted']} of them identical to the uninterrupted run. "
        f"E2EL p50 {fmt(doc['e2el_ms']['median'], 0)} ms, p99 {fmt(doc['e2el_ms']['p99'], 0)} ms.",
        "",
        "| stage | kills | time to eject p50 / max (s) | kill to ready again p50 (s) | time to rejoin after ready p50 / max (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage, stage_kills in by_stage.items():
        eject = [k["eject_s"] for k in stage_kills if k["eject_s"] is not None]
        rejoin = [k["rejoin_s"] for k in stage_kills if k["rejoin_s"] is not None]
        restart = [k["restart_s"] for k in stage_kills]
        lines.append(
            f"| {stage} | {len(stage_kills)} | {fmt(summarize(eject)['median'], 2)} / {fmt(max(eject, default=float('nan')), 2)} | "
            f"{fmt(summarize(restart)['median'], 0)} | {fmt(summarize(rejoin)['median'], 2)} / {fmt(max(rejoin, default=float('nan')), 2)} |"
        )
    counters = ", ".join(f"{k} {v:g}" for k, v in doc["resumes"].items()) or "none"
    retries = ", ".join(f"{k} {v:g}" for k, v in doc["retries"].items()) or "none"
    end = ", ".join(f"{k} {v:g}" for k, v in doc["end_state"].items())
    lines += ["", f"Resumes: {counters}. Retries before the first token: {retries}. After the load drained: {end}.", ""]
    lines += [
        "RSS of each instance's process tree over its life, from 20 s after it was ready (MiB; private: RSS less shared pages, "
        "which leaves out the arena and receive buffers, shared memory touched page by page until used whole):",
        "",
        "| instance | lived (s) | first | last | max | growth (MiB/min) | private growth (MiB/min) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["rss"]:
        lines.append(
            f"| {row['instance']} | {row['lived_s']:.0f} | {row['first_mib']:.0f} | {row['last_mib']:.0f} | {row['max_mib']:.0f} | "
            f"{row['growth_mib_per_min']:+.1f} | {row['private_growth_mib_per_min']:+.1f} |"
        )
    return [*lines, ""]

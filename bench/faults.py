"""Fault experiments: SIGKILL one instance of a stage under steady load, then restart it.

One E/P/D deployment of the tiny Qwen2.5-VL with two encoders, two prefills and two decodes
behind one gateway, all on loopback. A closed loop of ``concurrency`` clients keeps sending
one-image requests (16 output tokens) through the gateway. Per scenario:

- ``encoder`` / ``prefill``: SIGKILL the second instance mid-load; keep the load on; restart it at
  the same address; keep the load on until it has served again. Goal: 0 failed requests.
  Reported: time to eject (the kill until the gateway's ``epd_stage_instance_up`` for it reads 0),
  time to rejoin (the restarted process's readiness until that gauge reads 1), failures.
- ``decode``: SIGKILL the second decode mid-load. Reported: streams in flight on it that ended
  (with UNAVAILABLE saying how many tokens were sent: those cannot be retried), the time from
  the kill to the next successful request, and failures among requests started after the kill
  (goal 0).

Every successful request's tokens are checked against the first answer to the same request.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from typing import Any

import grpc

from bench.common import RESULTS_DIR, progress, summarize, write_result
from bench.formatting import fmt, machine, seconds
from bench.workload import Sent, closed_loop
from cli.launcher import ServiceProcess, Stack, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2_grpc

NAME = "faults"
FAMILY = "qwen2_5_vl"
SCENARIOS = ("encoder", "prefill", "decode")
CONCURRENCY = 8
OUTPUT_TOKENS = 16
LOAD_S = 8.0  # before the kill, and again after the restart
QUICK_LOAD_S = 3.0
_POLL_S = 0.05


def _requests(count: int = 8) -> list:
    return [
        chat_request([(synthetic_image_png(112 + 16 * i, 112, seed=900 + i), "image/png"), f"What is in picture {i}?"], max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS)
        for i in range(count)
    ]


def _instance_up(gateway: ServiceProcess, stage: str, address: str) -> float | None:
    return scrape(gateway.metrics_port).get(f"epd_stage_instance_up{{address={address},stage={stage}}}")


async def wait_gauge(gateway: ServiceProcess, stage: str, address: str, wanted: float, timeout: float) -> float | None:
    """Seconds until the gateway's view of the instance reads ``wanted`` (None: never)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if _instance_up(gateway, stage, address) == wanted:
            return time.perf_counter() - started
        await asyncio.sleep(_POLL_S)
    return None


async def wait_port_closed(address: str, timeout: float) -> float | None:
    """Seconds until the address refuses connections: the killed process has exited (its sockets
    close last, after its memory is torn down), so the gateway could have seen it go."""
    host, port = address.rsplit(":", 1)
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), _POLL_S)
            writer.close()
        except ConnectionRefusedError:
            return time.perf_counter() - started
        except OSError:  # a timeout, on a saturated host: ask again
            pass
        await asyncio.sleep(_POLL_S)
    return None


def start_two_of_each(stack: Stack, model: str) -> dict[str, ServiceProcess]:
    """Two encoders, prefills and decodes (``encoder0`` ... ``decode1``) and an E/P/D
    ``gateway`` over them, every one exporting metrics."""
    services = {}
    for stage, args in (("encoder", ["encoder"]), ("prefill", ["prefill"]), ("decode", ["decode", "--mode", "decode"])):
        for index in range(2):
            services[f"{stage}{index}"] = stack.start(f"{stage}{index}", [*args, "--model", model, "--metrics-port", "0"])
    stack.wait_ready(list(services.values()), timeout=900)
    addresses = {stage: [services[f"{stage}{i}"].address for i in range(2)] for stage in ("encoder", "prefill", "decode")}
    args = gateway_args(model, "epd", encoders=addresses["encoder"], prefills=addresses["prefill"], decodes=addresses["decode"], extra=["--metrics-port", "0"])
    services["gateway"] = stack.start("gateway", args)
    stack.wait_ready([services["gateway"]], timeout=300)
    return services


_LATE_KV_NOTIFICATIONS = "vllm:nixl_num_notifications_after_expiry_total"
_KV_RELEASES = "epd_requests_total{code=OK,method=ReleaseKv,service=decode}"
_KV_LEASE_RETRIES = "epd_gateway_retries_total{stage=kv_lease}"


def _counts(services: dict[str, ServiceProcess], stage: str, metric: str) -> dict[str, tuple[ServiceProcess, float]]:
    """Per live instance of ``stage``, the samples of ``metric`` summed over their labels."""
    return {
        name: (service, sum(v for k, v in scrape(service.metrics_port).items() if k.startswith(metric)))
        for name, service in services.items()
        if name.startswith(stage) and service.process.poll() is None
    }


def _growth(before: dict[str, tuple[ServiceProcess, float]], after: dict[str, tuple[ServiceProcess, float]]) -> float:
    """How much a count grew over the instances alive at the end: a restarted one counts from 0,
    and a killed one's count is lost with it."""
    return sum(n - (before[name][1] if before[name][0] is service else 0.0) for name, (service, n) in after.items())


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def _scenario(stack: Stack, services: dict[str, ServiceProcess], stage: str, stub, requests, expected: dict, load_s: float) -> dict[str, Any]:
    gateway, victim = services["gateway"], services[f"{stage}1"]
    late_before = _counts(services, "prefill", _LATE_KV_NOTIFICATIONS)
    releases_before = _counts(services, "decode", _KV_RELEASES)
    retries_before = scrape(gateway.metrics_port).get(_KV_LEASE_RETRIES, 0.0)
    log: list[Sent] = []
    stop = asyncio.Event()
    load = asyncio.create_task(closed_loop(stub, requests, CONCURRENCY, log, until=stop.is_set))
    await asyncio.sleep(load_s)
    killed_at = time.perf_counter()
    victim.kill()
    gone_s, eject_s = await asyncio.gather(wait_port_closed(victim.address, 30), wait_gauge(gateway, stage, victim.address, 0.0, 30))
    victim.process.wait(30)
    stack.services.remove(victim)
    result: dict[str, Any] = {"stage": stage, "gone_s": gone_s, "eject_s": eject_s}
    if stage == "decode":
        await asyncio.sleep(load_s)
    else:
        reborn = stack.restart(victim)
        await asyncio.to_thread(stack.wait_ready, [reborn], 900)
        result["rejoin_s"] = await wait_gauge(gateway, stage, reborn.address, 1.0, 60)
        services[f"{stage}1"] = reborn
        await asyncio.sleep(load_s)
    stop.set()
    await load
    failed = [s for s in log if not s.record.ok]
    wrong = [s for s in log if s.record.ok and list(s.record.token_ids) != expected[s.index]]
    after_kill = [s for s in log if s.started > killed_at]
    first_success = min((s.ended for s in after_kill if s.record.ok), default=None)
    result.update(
        requests=len(log),
        failed=len(failed),
        errors=sorted({s.record.error for s in failed})[:5],
        failed_started_after_kill=sum(1 for s in after_kill if not s.record.ok),
        ended_in_flight=sum(1 for s in failed if s.started <= killed_at),
        first_success_after_kill_s=None if first_success is None else first_success - killed_at,
        e2el_ms=summarize([s.record.e2el_s * 1e3 for s in log if s.record.ok]),
        wrong_tokens=len(wrong),
        # A decode's notices for KV its prefill no longer held, such as a READ that ended after
        # the lease ran out (the blocks may hold another request's KV by then).
        late_kv_notifications=_growth(late_before, _counts(services, "prefill", _LATE_KV_NOTIFICATIONS)),
        kv_releases=_growth(releases_before, _counts(services, "decode", _KV_RELEASES)),
        kv_lease_retries=scrape(gateway.metrics_port).get(_KV_LEASE_RETRIES, 0.0) - retries_before,
        # Where they differ (to tell a fault's effect from batch-dependent rounding): the
        # request, when it started relative to the kill, and the first differing position.
        wrong_examples=[
            {"request": s.index, "started_after_kill_s": round(s.started - killed_at, 3), "first_difference": _first_difference(expected[s.index], list(s.record.token_ids))}
            for s in wrong[:8]
        ],
    )
    progress(f"{NAME}: {stage}: {result['failed']} of {result['requests']} failed, eject {eject_s}, rejoin {result.get('rejoin_s')}")
    return result


def run(*, quick: bool = False, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from devkit.checkpoints import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    load_s = QUICK_LOAD_S if quick else LOAD_S
    requests = _requests()

    async def experiment() -> list[dict[str, Any]]:
        stack = Stack()
        try:
            services = await asyncio.to_thread(start_two_of_each, stack, model)
            async with grpc.aio.insecure_channel(services["gateway"].address, options=CLIENT_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                expected = {i: (await generate(stub, r, timeout=120)).token_ids for i, r in enumerate(requests)}
                return [await _scenario(stack, services, stage, stub, requests, expected, load_s) for stage in SCENARIOS]
        finally:
            await asyncio.to_thread(stack.stop)

    results = asyncio.run(experiment())
    return write_result(NAME, {"model": model, "concurrency": CONCURRENCY, "output_tokens": OUTPUT_TOKENS, "load_s": load_s, "results": results}, command=command, results_dir=results_dir)


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    lines = [
        "## Faults: SIGKILL of one of two instances of a stage under steady load",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Two encoders, two prefills and two decodes behind one E/P/D gateway; {doc['concurrency']} clients in a closed loop of one-image requests "
        f"({doc['output_tokens']} output tokens), {doc['load_s']:.0f} s of load before the kill and again after the restart. "
        "Gone: the kill until the instance's port refuses connections (its processes have exited, sockets last); eject: the kill until the gateway's "
        "`epd_stage_instance_up` for the instance reads 0 (both polled every 50 ms); rejoin: the restarted process ready until it reads 1.",
        "",
        "| killed | requests | failed | in flight on it, ended | failed, started after the kill | first success after the kill s | gone s | eject s | rejoin s | tokens differing | late KV notifications | KV releases | KV-lease retries | E2EL p50 / p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['stage']} | {r['requests']} | {r['failed']} | {r['ended_in_flight']} | {r['failed_started_after_kill']} | {seconds(r['first_success_after_kill_s'])} "
            f"| {seconds(r.get('gone_s'))} | {seconds(r['eject_s'])} | {seconds(r.get('rejoin_s')) if 'rejoin_s' in r else 'n/a (not restarted)'} | {r['wrong_tokens']} "
            f"| {fmt(r.get('late_kv_notifications'), 0)} | {fmt(r.get('kv_releases'), 0)} | {fmt(r.get('kv_lease_retries'), 0)} | {fmt(r['e2el_ms']['median'], 0)} / {fmt(r['e2el_ms']['p99'], 0)} |"
        )
    errors = "; ".join(f"{r['stage']}: {', '.join(r['errors'])}" for r in doc["results"] if r["errors"])
    goals = (
        "Goals: 0 failed for encoder and prefill; for decode, only streams in flight on it end (after their first token, so not retried) and 0 failures for requests started after the kill; "
        "0 tokens differing (successful requests whose greedy tokens differ from the same request's answer on the idle deployment before the load; "
        "`wrong_examples` in the result file says when each started and where it first differs); 0 late KV notifications "
        "(`vllm:nixl_num_notifications_after_expiry_total`, over the prefills alive at the end: a decode's notice for KV its prefill no longer held, "
        "such as a READ that ended after the lease had run out, when the blocks may hold another request's KV; in the decode run it can also be "
        "harmless: the gateway's release of KV that the killed decode had read just before it died, before its first token). KV releases: the gateway's "
        "`ReleaseKv` calls, over the decodes alive at the end, for requests that failed between prefill and a decode's answer. KV-lease retries: "
        "requests run again because a decode refused a handoff whose lease was about to run out (`epd_gateway_retries_total{stage=kv_lease}`)."
    )
    return [*lines, "", goals + (f" Errors seen: {errors}." if errors else ""), ""]

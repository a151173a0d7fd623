"""Serving experiments on one stack, side by side in one run:

- **A/B (the seed system's):** E/P/D metadata-only vs E/P/D media-forwarding (the gateway also
  sends the original media to prefill and decode, which decode it and re-run the processor for
  the layout; embeddings still come over NIXL). Same services, same requests, same arrivals.
- **Topologies:** monolithic vs E+PD vs E/P/D at the same offered load.
- **A compiled data path:** ``epd-go-relay`` runs the same E/P/D requests through the same
  stages by way of ``bench/go_stages/relay.go`` (EPD's data path alone in grpc-go: no routing,
  retries, validation, spans or metrics) instead of the gateway: what the hops cost a compiled
  runtime, beside what they cost the gateway. It is a measuring instrument, not a gateway.
- **The client** is compiled too (``bench/go_stages -role load``), so that its own cost is small
  and the same for every arm.
- **Gateway overhead:** client-observed E2EL minus the gateway's timed stage calls; and of it,
  what the gateway counts inside itself (its Finished timings: total minus the stage calls), the
  rest being the client's hop to it (sending it the media) and the client's own reading.
- **Resources:** peak RSS per service (process tree), and where each request's CPU goes: user +
  system CPU of every process an arm's requests run through (its gateway, each service, each
  engine core), per request of its saturation runs (:func:`bench.common.cpu_seconds`; NIXL's and UCX's
  progress threads are unnamed, so they count in the process that runs them).
- **End state:** what must be back to zero once the load is gone: the encoder's arena leases
  (``epd_arena_leases``), every engine's KV cache usage and requests, and the embedding loads that
  failed during the run (``epd_embedding_load_failures``); alongside, during the run, the
  embedding bytes each consumer loaded per transport (``epd_embedding_bytes_loaded``) and how many
  items the encoder's engine encoded per step (``epd_encoder_batch_items`` / ``epd_encoder_batches``),
  and at the end the items each receive buffer still holds for vLLM's encoder cache
  (``epd_receive_buffer_items``; not a leak: they go when the encoder cache evicts them).

Experiments (one stack each): ``serving`` (images, Qwen2.5-VL), ``serving_video`` (video,
Qwen3-VL), ``serving_audio`` (audio, Qwen2-Audio) and ``serving_omni`` (audio clips into a
Qwen2.5-Omni thinker), all on the project's tiny checkpoints unless ``--model`` says otherwise.

Engines run with prefix caching and the multimodal processor cache off, and every pass sends the
media under new bytes (same pixels and samples, new content hashes), so no arm profits from
another's warm cache (vLLM's encoder cache, keyed by content hash, outlives requests); arms
alternate order across repeats so drift hits all of them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import pathlib
import statistics
import time
from collections.abc import Sequence

from bench.common import RESULTS_DIR, command_line, cpu_seconds, progress, write_result
from bench.compiled import GoRelay, go_relay
from bench.formatting import MIB, fmt, machine
from bench.workload import STAGES, WorkloadSpec, build_requests, run_load, salted
from cli.launcher import ServiceProcess, Stack, gateway_args, start_monolithic
from epd.telemetry import scrape

ARMS = ("monolithic", "epd-combined", "epd", "epd-forward-media", "epd-go-relay")
LOADS = ("poisson", "saturation")
# The services each arm's requests run through, whose CPU its requests cost.
ARM_SERVICES = {
    "monolithic": ("gateway-monolithic",),
    "epd-combined": ("gateway-epd-combined", "encoder", "combined"),
    "epd": ("gateway-epd", "encoder", "prefill", "decode"),
    "epd-forward-media": ("gateway-epd-forward-media", "encoder", "prefill", "decode"),
    "epd-go-relay": ("gateway-epd-go-relay", "encoder", "prefill", "decode"),
}
# Issue 32's goal: all of E/P/D's processes together spend at most this much CPU per request
# over the monolithic engine's.
CPU_GOAL_OVER_MONOLITHIC = 1.4
# And its saturation throughput at least this fraction of monolithic's, on this host.
THROUGHPUT_GOAL_OVER_MONOLITHIC = 0.7


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    model: str
    rate: float  # requests per second, Poisson
    repeats: int
    workload: WorkloadSpec
    caches: str  # "off" (engines started with --no-caches) or "on"
    max_concurrency: int | None = None
    family: str | None = None  # the tiny checkpoint's family, when the model is one


def start_stack(stack: Stack, model: str, engine_flags: Sequence[str] = ()) -> dict[str, ServiceProcess]:
    """Every arm's services on ``model``, engine caches off; ``engine_flags`` go to every engine
    (``--dtype bfloat16``, say). By the names :data:`ARM_SERVICES` uses."""
    observability = ["--metrics-port", "0"]
    engine = ["--model", model, "--no-caches", *engine_flags, *observability]
    encoder = stack.start("encoder", ["encoder", "--model", model, *engine_flags, *observability])
    prefill = stack.start("prefill", ["prefill", *engine])
    decode = stack.start("decode", ["decode", *engine, "--mode", "decode"])
    combined = stack.start("combined", ["decode", *engine, "--mode", "combined"])
    stack.wait_ready([encoder, prefill, decode, combined], timeout=900)
    services = {"encoder": encoder, "prefill": prefill, "decode": decode, "combined": combined}
    services["gateway-monolithic"] = start_monolithic(stack, model, extra=["--no-caches", *engine_flags, *observability])
    epd = dict(encoders=[encoder.address], prefills=[prefill.address], decodes=[decode.address])
    services["gateway-epd"] = stack.start("gateway-epd", gateway_args(model, "epd", **epd, extra=observability))
    services["gateway-epd-forward-media"] = stack.start("gateway-epd-forward-media", gateway_args(model, "epd", **epd, extra=["--forward-media", *observability]))
    services["gateway-epd-combined"] = stack.start(
        "gateway-epd-combined", gateway_args(model, "epd-combined", encoders=[encoder.address], decodes=[combined.address], extra=observability)
    )
    stack.wait_ready(list(services.values()), timeout=900)
    return services


def peak_rss_mib(service: ServiceProcess | GoRelay) -> float:
    """VmHWM of the service and its children (vLLM's engine core is a child process)."""
    import psutil

    total = 0
    for process in [psutil.Process(service.process.pid), *psutil.Process(service.process.pid).children(recursive=True)]:
        try:
            for line in pathlib.Path(f"/proc/{process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _cpu_ms_per_request(services: dict, before: dict[str, dict[str, float]], requests: int) -> dict[str, float]:
    """CPU milliseconds per request since ``before`` (:func:`bench.common.cpu_seconds` per service), by
    ``"<service> <role>"``."""
    spent = {}
    for name, service in services.items():
        for role, seconds in cpu_seconds(service).items():
            spent[f"{name} {role}"] = (seconds - before[name].get(role, 0.0)) * 1000 / requests
    return spent


def _median_of(runs: list[dict], *path: str) -> float:
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def measure(
    gateways: dict[str, str], requests: list, *, rate: float, repeats: int, max_concurrency: int | None = None, services: dict | None = None
) -> dict[str, dict[str, list[dict]]]:
    """Runs the request set through every arm's gateway: a Poisson run and a saturation run per
    repeat, arms in rotating order. ``gateways`` maps each of :data:`ARMS` to an address. Every
    pass sends its own :func:`~bench.workload.salted` copy (same media, new content hashes), so
    no engine's encoder cache serves one pass from another's items. With ``services`` (by name,
    as :data:`ARM_SERVICES` names them), each saturation run also records the CPU its requests
    cost each process (``cpu_ms_per_request``)."""
    for arm in ARMS:  # warm-up: first contact, lazy imports, NIXL metadata exchange
        asyncio.run(run_load(gateways[arm], salted(requests[:1], f"warm-up {arm}"), float("inf"), seed=0))
    runs: dict[str, dict[str, list[dict]]] = {arm: {"poisson": [], "saturation": []} for arm in ARMS}
    for repeat in range(repeats):
        order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
        for load, load_rate in (("poisson", rate), ("saturation", float("inf"))):
            for arm in order:
                progress(f"serving: repeat {repeat + 1}/{repeats} {load} {arm}")
                batch = salted(requests, f"{repeat} {load} {arm}")
                used = {name: services[name] for name in ARM_SERVICES[arm]} if services and load == "saturation" else {}
                cpu_before = {name: cpu_seconds(service) for name, service in used.items()}
                result = asyncio.run(run_load(gateways[arm], batch, load_rate, seed=repeat, max_concurrency=max_concurrency))
                if used:
                    result["cpu_ms_per_request"] = _cpu_ms_per_request(used, cpu_before, len(batch))
                if result["failed"]:
                    raise RuntimeError(f"{arm} {load}: {result['failed']} requests failed: {result['errors']}")
                runs[arm][load].append(result)
    return runs


CONSUMERS = ("prefill", "combined")  # the engines that load embeddings (EC consumers)
ENGINES = ("prefill", "decode", "combined", "gateway-monolithic")
_DRAIN_S = 10.0  # leases end by asynchronous notifications; give them this long


def _scrape(services: dict[str, ServiceProcess]) -> dict[str, dict[str, float]]:
    return {name: scrape(services[name].metrics_port) for name in dict.fromkeys(("encoder", *CONSUMERS, *ENGINES))}


def counters(services: dict[str, ServiceProcess], modality: str = "image", metrics: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """The cumulative counters ``end_state`` reports as differences: take them before a run."""
    metrics = metrics or _scrape(services)
    encoder = metrics["encoder"]
    values = {
        "encoder.items": encoder.get(f"epd_encoder_items_total{{modality={modality}}}", 0.0),
        "encoder.steps": encoder.get(f"epd_encoder_batches{{modality={modality}}}", 0.0),
        "encoder.batch_items": encoder.get(f"epd_encoder_batch_items{{modality={modality}}}", 0.0),
    }
    for name in CONSUMERS:
        values[f"{name}.failures"] = metrics[name].get("epd_embedding_load_failures", float("nan"))
        values[f"{name}.nixl"] = metrics[name].get("epd_embedding_bytes_loaded{transport=nixl}", 0.0)
        values[f"{name}.inline"] = metrics[name].get("epd_embedding_bytes_loaded{transport=inline}", 0.0)
    return values


def end_state(services: dict[str, ServiceProcess], modality: str = "image", since: dict[str, float] | None = None) -> dict:
    """What must be back to zero after a run (arena leases, KV and requests per engine, and no
    embedding load failed), plus what the encoder and the consumers did since ``since`` (a
    :func:`counters` snapshot; since the services started if None). Leases end and KV is freed
    by asynchronous notifications, so this waits up to ``_DRAIN_S`` for everything to drain."""
    deadline = time.monotonic() + _DRAIN_S
    while not (state := _state(_scrape(services), modality, since))["drained"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return state


def _state(metrics: dict[str, dict[str, float]], modality: str, since: dict[str, float] | None) -> dict:
    now = counters({}, modality, metrics)
    delta = {key: value - (since or {}).get(key, 0.0) for key, value in now.items()}
    state: dict = {
        "arena_leases": metrics["encoder"].get("epd_arena_leases", float("nan")),
        "encoder": {
            "items_encoded": delta["encoder.items"],
            "engine_steps": delta["encoder.steps"],
            "mean_items_per_step": delta["encoder.batch_items"] / delta["encoder.steps"] if delta["encoder.steps"] else float("nan"),
        },
        "consumers": {
            name: {
                "embedding_load_failures": delta[f"{name}.failures"],
                "nixl_bytes_loaded": delta[f"{name}.nixl"],
                "inline_bytes_loaded": delta[f"{name}.inline"],
                "receive_buffer_items": metrics[name].get("epd_receive_buffer_items", float("nan")),
            }
            for name in CONSUMERS
        },
        "engines": {
            name: {
                "kv_cache_usage": metrics[name].get("vllm:kv_cache_usage_perc", float("nan")),
                "requests_running": metrics[name].get("vllm:num_requests_running", float("nan")),
                "requests_waiting": metrics[name].get("vllm:num_requests_waiting", float("nan")),
            }
            for name in ENGINES
        },
    }
    state["drained"] = drained(state)
    return state


def drained(state: dict) -> bool:
    """Whether everything that must be back to zero is (receive buffers need not be: their items
    stay as long as vLLM's encoder cache keeps them)."""
    return (
        state["arena_leases"] == 0
        and all(c["embedding_load_failures"] == 0 for c in state["consumers"].values())
        and all(e["kv_cache_usage"] == 0 and e["requests_running"] == 0 and e["requests_waiting"] == 0 for e in state["engines"].values())
    )


def build_payload(runs: dict[str, dict[str, list[dict]]], config: ServingConfig, state: dict, resources: dict) -> dict:
    """Medians over repeats, the ratios, and whether every arm's tokens equal monolithic's."""
    reference = runs["monolithic"]["poisson"][0]["outputs"]
    identical = {arm: all(r["outputs"] == reference for load in runs[arm].values() for r in load) for arm in ARMS}
    runs = {arm: {load: [{k: v for k, v in r.items() if k != "outputs"} for r in results] for load, results in loads.items()} for arm, loads in runs.items()}
    summary = {
        arm: {
            load: {
                "request_throughput": _median_of(runs[arm][load], "request_throughput"),
                "output_throughput": _median_of(runs[arm][load], "output_throughput"),
                "ttft_ms_median": _median_of(runs[arm][load], "ttft_ms", "median"),
                "tpot_ms_median": _median_of(runs[arm][load], "tpot_ms", "median"),
                "e2el_ms_mean": _median_of(runs[arm][load], "e2el_ms", "mean"),
                "e2el_ms_median": _median_of(runs[arm][load], "e2el_ms", "median"),
                "e2el_ms_p99": _median_of(runs[arm][load], "e2el_ms", "p99"),
                "gateway_overhead_ms_median": _median_of(runs[arm][load], "gateway_overhead_ms", "median"),
                "gateway_overhead_ms_p99": _median_of(runs[arm][load], "gateway_overhead_ms", "p99"),
                "gateway_own_ms_median": _median_of(runs[arm][load], "gateway_own_ms", "median"),
                "stage_ms_median": {stage: _median_of(runs[arm][load], "stage_ms", stage, "median") for stage in STAGES},
            }
            for load in LOADS
        }
        for arm in ARMS
    }
    for arm in ARMS:
        measured = [r["cpu_ms_per_request"] for r in runs[arm]["saturation"] if "cpu_ms_per_request" in r]
        if measured:
            summary[arm]["saturation"]["cpu_ms_per_request"] = {process: statistics.median(m[process] for m in measured) for process in measured[0]}

    def ratio(a: str, b: str, load: str, key: str) -> float:
        return summary[a][load][key] / summary[b][load][key]

    ratios = {
        "metadata_only_over_media_forwarding": {
            load: {
                "request_throughput": ratio("epd", "epd-forward-media", load, "request_throughput"),
                "e2el_mean": ratio("epd", "epd-forward-media", load, "e2el_ms_mean"),
                "ttft_median": ratio("epd", "epd-forward-media", load, "ttft_ms_median"),
            }
            for load in LOADS
        },
        "topologies_over_monolithic": {
            arm: {load: {"request_throughput": ratio(arm, "monolithic", load, "request_throughput"), "e2el_mean": ratio(arm, "monolithic", load, "e2el_ms_mean")} for load in LOADS}
            for arm in ("epd-combined", "epd")
        },
    }
    if "cpu_ms_per_request" in summary["monolithic"]["saturation"]:
        monolithic_cpu = sum(summary["monolithic"]["saturation"]["cpu_ms_per_request"].values())
        ratios["cpu_per_request_over_monolithic"] = {arm: sum(summary[arm]["saturation"]["cpu_ms_per_request"].values()) / monolithic_cpu for arm in ARMS}
    return {
        "experiment": "serving",
        "config": {
            "model": config.model,
            "family": config.family,
            "rate": config.rate,
            "repeats": config.repeats,
            "workload": dataclasses.asdict(config.workload),
            "arms": list(ARMS),
            "caches": config.caches,
            "max_concurrency": config.max_concurrency,
        },
        "summary": summary,
        "ratios": ratios,
        "outputs_identical_to_monolithic": identical,
        "end_state": state,
        "resources": resources,
        "runs": runs,
    }


@dataclasses.dataclass(frozen=True)
class Experiment:
    family: str  # the tiny checkpoint that serves it by default
    workload: WorkloadSpec  # a full run's request set


EXPERIMENTS = {  # bench.common.SERVING_EXPERIMENTS
    "serving": Experiment("qwen2_5_vl", WorkloadSpec("image", num_requests=16, items_per_request=(2, 4))),
    "serving_video": Experiment("qwen3_vl", WorkloadSpec("video", num_requests=8, items_per_request=(1, 2))),
    "serving_audio": Experiment("qwen2_audio", WorkloadSpec("audio", num_requests=8, items_per_request=(1, 3))),
    # The Omni thinker gets the audio workload's clips (its EC path is declared for audio).
    "serving_omni": Experiment("qwen2_5_omni", WorkloadSpec("audio", num_requests=8, items_per_request=(1, 3))),
}


def run(
    *,
    experiment: str = "serving",
    quick: bool = False,
    model: str | None = None,
    rate: float | None = None,
    num_requests: int | None = None,
    repeats: int | None = None,
    max_concurrency: int | None = None,
    duration_s: float | None = None,
    results_dir: pathlib.Path = RESULTS_DIR,
    command: str | None = None,
) -> pathlib.Path:
    """Runs one of :data:`EXPERIMENTS`; writes ``<experiment>.json``.

    ``duration_s`` (if given) sizes the request set to that many seconds of arrivals; ``model``
    replaces the experiment's tiny checkpoint.
    """
    from devkit.checkpoints import ensure_tiny_checkpoint

    spec = EXPERIMENTS[experiment]
    family = None if model else spec.family
    model = model or str(ensure_tiny_checkpoint(spec.family, pathlib.Path("checkpoints")))
    rate = rate or (4.0 if quick else 2.0)
    if duration_s:
        num_requests = max(1, math.ceil(rate * duration_s))
    workload = spec.workload
    if quick:
        workload = dataclasses.replace(workload, num_requests=3, items_per_request=(1, 2))
    workload = dataclasses.replace(workload, num_requests=num_requests or workload.num_requests)
    config = ServingConfig(
        model=model, rate=rate, repeats=repeats or (1 if quick else 3), workload=workload, caches="off", max_concurrency=max_concurrency, family=family
    )
    progress(f"{experiment}: building {workload.num_requests} {workload.modality} requests (seed {workload.seed})")
    requests = build_requests(workload)
    # Every arm's engine runs on this host at once, monolithic included: one share for all.
    stack = Stack(engines=len(("encoder", *ENGINES)))
    progress(f"{experiment}: starting the stack for {model} (logs in {stack.log_dir})")
    with contextlib.ExitStack() as running:
        running.callback(stack.stop)
        services: dict = start_stack(stack, model)
        stages = (services[name].address for name in ("encoder", "prefill", "decode"))
        services["gateway-epd-go-relay"] = running.enter_context(go_relay(*stages))
        gateways = {arm: services[f"gateway-{arm}"].address for arm in ARMS}
        before = counters(services, workload.modality)
        runs = measure(gateways, requests, rate=config.rate, repeats=config.repeats, max_concurrency=config.max_concurrency, services=services)
        state = end_state(services, workload.modality, since=before)
        resources = {name: {"peak_rss_mib": round(peak_rss_mib(service), 1)} for name, service in services.items()}
    if not state["drained"]:
        progress(f"{experiment}: NOT back to zero at the end: {state}")
    return write_result(experiment, build_payload(runs, config, state, resources), command=command or command_line(), results_dir=results_dir)


# ---- the report section ---------------------------------------------------------------------


_MEDIA = {
    "image": lambda w: f"JPEG images ({w['image_edge_px'][0]}-{w['image_edge_px'][1]} px)",
    "video": lambda w: f"MP4 clips at 10 fps ({w['clip_seconds'][0]:g}-{w['clip_seconds'][1]:g} s, {w['video_edge_px'][0]}-{w['video_edge_px'][1]} px)",
    "audio": lambda w: f"16 kHz WAV clips ({w['clip_seconds'][0]:g}-{w['clip_seconds'][1]:g} s)",
}


# Issue 9's goal for the gateway's own overhead in the serving benchmark.
GATEWAY_SHARE_GOAL_PERCENT = 3


def report(doc: dict) -> list[str]:
    cfg, summary, ratios = doc["config"], doc["summary"], doc["ratios"]
    w = cfg["workload"]
    family = f", {cfg['family']}" if cfg.get("family") else ""
    lines = [
        f"## Serving ({w['modality']}{family}): metadata-only vs media forwarding, and topologies",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Model: `{cfg['model']}`; {w['num_requests']} requests of {w['items_per_request'][0]}-{w['items_per_request'][1]} "
        f"{_MEDIA[w['modality']](w)} and {w['max_tokens']} output tokens each, "
        f"seed {cfg['workload']['seed']}; Poisson at {cfg['rate']} req/s and a saturation run (all at once); medians over {cfg['repeats']} repeats; "
        f"engine prefix and multimodal caches {cfg['caches']}; the five engines (encoder, prefill, decode, combined, monolithic) run side by side, "
        "each with its share of the cores as OpenMP threads (`cli.launcher.cpu_share_env`).",
        "",
        "| arm | load | req/s | output tok/s | TTFT median ms | TPOT median ms | E2EL mean ms | E2EL p99 ms | encode / prefill / decode median ms | gateway overhead p50 / p99 ms | tokens = monolithic |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, loads in summary.items():
        for load, s in loads.items():
            stages = " / ".join(fmt(s["stage_ms_median"][k], 1) for k in ("encode", "prefill", "decode"))
            lines.append(
                f"| {arm} | {load} | {fmt(s['request_throughput'])} | {fmt(s['output_throughput'], 1)} | {fmt(s['ttft_ms_median'], 1)} | {fmt(s['tpot_ms_median'], 1)} "
                f"| {fmt(s['e2el_ms_mean'], 1)} | {fmt(s['e2el_ms_p99'], 1)} | {stages} | {fmt(s['gateway_overhead_ms_median'], 1)} / {fmt(s['gateway_overhead_ms_p99'], 1)} "
                f"| {'yes' if doc['outputs_identical_to_monolithic'][arm] else 'NO'} |"
            )
    ab = ratios["metadata_only_over_media_forwarding"]
    lines += ["", "Ratios (metadata-only / media forwarding; throughput > 1 and latency < 1 favour metadata-only):", ""]
    for load, r in ab.items():
        lines.append(f"- {load}: request throughput ×{fmt(r['request_throughput'], 3)}, mean E2EL ×{fmt(r['e2el_mean'], 3)}, median TTFT ×{fmt(r['ttft_median'], 3)}")
    lines += ["", _ab_analysis(summary, ab), ""]
    shares = [
        f"{arm} {load} {s['gateway_overhead_ms_median'] / s['e2el_ms_median'] * 100:.1f} %"
        for arm, loads in summary.items()
        if arm != "monolithic"
        for load, s in loads.items()
    ]
    lines += [f"Gateway overhead over E2EL (medians; goal ≤ {GATEWAY_SHARE_GOAL_PERCENT:g} %): " + ", ".join(shares) + ".", ""]
    if "epd-go-relay" in summary:
        relay = summary["epd-go-relay"]
        gateways = [arm for arm in ("epd",) if arm in summary]
        lines += [
            "epd-go-relay sends the epd arm's requests through the same stages by way of EPD's data path alone, compiled "
            "(`bench/go_stages/relay.go`: no routing, retries, validation, spans or metrics; a measuring instrument, not a gateway). "
            "The relay's overhead is what remains with a compiled data path: the client sending the media and reading the stream, "
            "and the hops. The gateway's overhead over it, medians: "
            + "; ".join(
                f"{arm} " + ", ".join(f"{load} {fmt(summary[arm][load]['gateway_overhead_ms_median'] - relay[load]['gateway_overhead_ms_median'], 1)} ms" for load in ("poisson", "saturation"))
                for arm in gateways
            )
            + "; saturation throughput over the relay's: "
            + ", ".join(f"{arm} ×{fmt(summary[arm]['saturation']['request_throughput'] / relay['saturation']['request_throughput'], 3)}" for arm in gateways)
            + ".",
            "",
        ]
    inside = [
        f"{arm} {load} {fmt(s['gateway_own_ms_median'], 2)} ms"
        for arm, loads in summary.items()
        if arm != "monolithic"
        for load, s in loads.items()
        if "gateway_own_ms_median" in s  # runs recorded before it was
    ]
    if inside:
        lines += [
            "Of that overhead, the gateway's own time (parsing and hashing, routing: its Finished timings' total minus the stage "
            "calls; the rest is the client's hop to it, which carries the media, and the client's reading), medians: " + ", ".join(inside) + ".",
            "",
        ]
    if "cpu_per_request_over_monolithic" in ratios:
        lines += [
            "Where each request's CPU goes at saturation (ms of user + system CPU per request, medians over repeats; every process the arm's "
            "requests run through, idle time included; NIXL and UCX progress threads count in their process):",
            "",
            "| arm | all processes | over monolithic | by process |",
            "| --- | --- | --- | --- |",
        ]
        for arm, loads in summary.items():
            cpu = loads["saturation"]["cpu_ms_per_request"]
            by_process = ", ".join(f"{process} {fmt(ms, 1)}" for process, ms in sorted(cpu.items(), key=lambda item: -item[1]) if ms >= 0.05)
            lines.append(f"| {arm} | {fmt(sum(cpu.values()), 1)} | ×{fmt(ratios['cpu_per_request_over_monolithic'][arm], 2)} | {by_process} |")
        epd_cpu = ratios["cpu_per_request_over_monolithic"]["epd"]
        lines += ["", f"Goal: E/P/D's CPU per request ≤ ×{CPU_GOAL_OVER_MONOLITHIC:g} of monolithic's: ×{fmt(epd_cpu, 2)}, {'met' if epd_cpu <= CPU_GOAL_OVER_MONOLITHIC else 'NOT met'}.", ""]
    lines += ["Topologies over monolithic:", ""]
    for arm, loads in ratios["topologies_over_monolithic"].items():
        parts = ", ".join(f"{load}: throughput ×{fmt(r['request_throughput'], 3)}, mean E2EL ×{fmt(r['e2el_mean'], 3)}" for load, r in loads.items())
        lines.append(f"- {arm}: {parts}")
    saturation = ratios["topologies_over_monolithic"]["epd"]["saturation"]["request_throughput"]
    lines.append(
        f"- Goal: E/P/D's saturation throughput ≥ ×{THROUGHPUT_GOAL_OVER_MONOLITHIC:g} of monolithic's: ×{fmt(saturation, 3)}, "
        f"{'met' if saturation >= THROUGHPUT_GOAL_OVER_MONOLITHIC else 'NOT met'}."
    )
    end = doc["end_state"]
    encoder = end["encoder"]
    lines += [
        "",
        f"End state ({'all back to zero' if end['drained'] else 'NOT back to zero'}): {end['arena_leases']:g} arena leases; "
        "failed embedding loads: " + ", ".join(f"{name} {c['embedding_load_failures']:g}" for name, c in end["consumers"].items()) + "; "
        "engines (KV cache usage, requests running, waiting): "
        + ", ".join(f"{name} {e['kv_cache_usage']:g}/{e['requests_running']:g}/{e['requests_waiting']:g}" for name, e in end["engines"].items())
        + ".  ",
        "Embeddings loaded (MiB over NIXL / inline; items still held for vLLM's encoder cache): "
        + ", ".join(
            f"{name} {c['nixl_bytes_loaded'] / MIB:.1f} / {c['inline_bytes_loaded'] / MIB:.1f}; {c['receive_buffer_items']:g}" for name, c in end["consumers"].items()
        )
        + f".  \nEncoder: {encoder['items_encoded']:g} items in {encoder['engine_steps']:g} engine steps ({fmt(encoder['mean_items_per_step'], 2)} items per step).  ",
        "Peak RSS (MiB, process tree): " + ", ".join(f"{name} {r['peak_rss_mib']:g}" for name, r in doc["resources"].items()) + ".",
        "",
    ]
    return lines


def _ab_analysis(summary: dict, ab: dict) -> str:
    """Says plainly whether metadata-only won here, and which stage decides it."""
    r = ab["saturation"]["request_throughput"]
    forward, meta = summary["epd-forward-media"]["saturation"], summary["epd"]["saturation"]
    stages_f, stages_m = forward["stage_ms_median"], meta["stage_ms_median"]
    dominant = max(stages_m, key=lambda stage: stages_m[stage])
    text = (
        f"{'Metadata-only is faster here' if r > 1 else 'Metadata-only is NOT faster here'} (saturation throughput ×{fmt(r, 3)}). "
        f"Media forwarding re-decodes and re-processes every item in prefill and decode: at saturation their medians are "
        f"{fmt(stages_f['prefill'], 1)} vs {fmt(stages_m['prefill'], 1)} ms (prefill) and {fmt(stages_f['decode'], 1)} vs {fmt(stages_m['decode'], 1)} ms "
        f"(decode), forwarding vs metadata-only. The {dominant} stage dominates metadata-only E/P/D "
        f"({fmt(stages_m[dominant], 1)} of {fmt(meta['e2el_ms_median'], 1)} ms median E2EL)."
    )
    if r <= 1:
        text += f" So on this machine the processor re-run is small next to {dominant}, and the difference is within the noise."
    return text


def plot(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(doc["summary"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("request_throughput", "e2el_ms_mean", "ttft_ms_median"), ("requests/s", "mean E2EL (ms)", "median TTFT (ms)"), strict=True):
        for offset, load in ((-0.2, "poisson"), (0.2, "saturation")):
            ax.bar([i + offset for i in range(len(arms))], [doc["summary"][a][load][key] for a in arms], width=0.4, label=load)
        ax.set_xticks(range(len(arms)), arms, rotation=20)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"Serving ({doc['config']['workload']['modality']}): medians over repeats")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

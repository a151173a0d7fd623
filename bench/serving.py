"""Serving experiments on one stack, side by side in one run:

- **A/B (the seed system's):** E/P/D metadata-only vs E/P/D media-forwarding (the gateway also
  sends the original media to prefill and decode, which decode it and re-run the processor for
  the layout; embeddings still come over NIXL). Same services, same requests, same arrivals.
- **Topologies:** monolithic vs E+PD vs E/P/D at the same offered load.
- **Gateway overhead:** client-observed E2EL minus the gateway's timed stage calls.
- **Resources:** peak RSS per service (process tree), and arena leases and engine requests left
  in flight at the end (both must be zero).

Engines run with prefix caching and the multimodal processor cache off, so no arm profits from
another's warm cache; arms alternate order across repeats so drift hits all of them alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
import statistics

from bench.common import RESULTS_DIR, command_line, progress, write_result
from bench.workload import STAGES, WorkloadSpec, build_requests, run_load
from epd.launcher import ServiceProcess, Stack, gateway_args, start_monolithic
from epd.telemetry import scrape

ARMS = ("monolithic", "epd-combined", "epd", "epd-forward-media")
LOADS = ("poisson", "saturation")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    model: str
    rate: float  # requests per second, Poisson
    repeats: int
    workload: WorkloadSpec
    caches: str  # "off" (engines started with --no-caches) or "on"
    max_concurrency: int | None = None


def _start(stack: Stack, model: str) -> dict[str, ServiceProcess]:
    observability = ["--metrics-port", "0"]
    engine = ["--model", model, "--no-caches", *observability]
    encoder = stack.start("encoder", ["encoder", "--model", model, *observability])
    prefill = stack.start("prefill", ["prefill", *engine])
    decode = stack.start("decode", ["decode", *engine, "--mode", "decode"])
    combined = stack.start("combined", ["decode", *engine, "--mode", "combined"])
    stack.wait_ready([encoder, prefill, decode, combined], timeout=900)
    services = {"encoder": encoder, "prefill": prefill, "decode": decode, "combined": combined}
    services["gateway-monolithic"] = start_monolithic(stack, model, extra=["--no-caches", *observability])
    epd = dict(encoders=[encoder.address], prefills=[prefill.address], decodes=[decode.address])
    services["gateway-epd"] = stack.start("gateway-epd", gateway_args(model, "epd", **epd, extra=observability))
    services["gateway-epd-forward-media"] = stack.start("gateway-epd-forward-media", gateway_args(model, "epd", **epd, extra=["--forward-media", *observability]))
    services["gateway-epd-combined"] = stack.start(
        "gateway-epd-combined", gateway_args(model, "epd-combined", encoders=[encoder.address], decodes=[combined.address], extra=observability)
    )
    stack.wait_ready(list(services.values()), timeout=900)
    return services


def peak_rss_mib(service: ServiceProcess) -> float:
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


def _median_of(runs: list[dict], *path: str) -> float:
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def measure(gateways: dict[str, str], requests: list, *, rate: float, repeats: int, max_concurrency: int | None = None) -> dict[str, dict[str, list[dict]]]:
    """Runs the request set through every arm's gateway: a Poisson run and a saturation run per
    repeat, arms in rotating order. ``gateways`` maps each of :data:`ARMS` to an address."""
    for arm in ARMS:  # warm-up: first contact, lazy imports, NIXL metadata exchange
        asyncio.run(run_load(gateways[arm], requests[:1], float("inf"), seed=0))
    runs: dict[str, dict[str, list[dict]]] = {arm: {"poisson": [], "saturation": []} for arm in ARMS}
    for repeat in range(repeats):
        order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
        for load, load_rate in (("poisson", rate), ("saturation", float("inf"))):
            for arm in order:
                progress(f"serving: repeat {repeat + 1}/{repeats} {load} {arm}")
                result = asyncio.run(run_load(gateways[arm], requests, load_rate, seed=repeat, max_concurrency=max_concurrency))
                if result["failed"]:
                    raise RuntimeError(f"{arm} {load}: {result['failed']} requests failed: {result['errors']}")
                runs[arm][load].append(result)
    return runs


def end_state(services: dict[str, ServiceProcess]) -> dict:
    """What must be back to zero after a run: arena leases, and KV and requests per engine."""
    state = {"arena_leases": scrape(services["encoder"].metrics_port).get("epd_arena_leases", 0.0), "engines": {}}
    for name in ("prefill", "decode", "combined", "gateway-monolithic"):
        metrics = scrape(services[name].metrics_port)
        state["engines"][name] = {
            "kv_cache_usage": metrics.get("vllm:kv_cache_usage_perc", float("nan")),
            "requests_running": metrics.get("vllm:num_requests_running", float("nan")),
            "requests_waiting": metrics.get("vllm:num_requests_waiting", float("nan")),
        }
    return state


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
                "stage_ms_median": {stage: _median_of(runs[arm][load], "stage_ms", stage, "median") for stage in STAGES},
            }
            for load in LOADS
        }
        for arm in ARMS
    }

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
    return {
        "experiment": "serving",
        "config": {"model": config.model, "rate": config.rate, "repeats": config.repeats, "workload": dataclasses.asdict(config.workload), "arms": list(ARMS), "caches": config.caches, "max_concurrency": config.max_concurrency},
        "summary": summary,
        "ratios": ratios,
        "outputs_identical_to_monolithic": identical,
        "end_state": state,
        "resources": resources,
        "runs": runs,
    }


# Per modality: the tiny checkpoint that serves it, and a full run's request set.
DEFAULT_FAMILY = {"image": "qwen2_5_vl", "video": "qwen3_vl", "audio": "qwen2_audio"}
DEFAULT_WORKLOAD = {
    "image": WorkloadSpec("image", num_requests=16, items_per_request=(2, 4)),
    "video": WorkloadSpec("video", num_requests=8, items_per_request=(1, 2)),
    "audio": WorkloadSpec("audio", num_requests=8, items_per_request=(1, 3)),
}


def result_name(modality: str) -> str:
    return "serving" if modality == "image" else f"serving_{modality}"


def run(
    *,
    modality: str = "image",
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
    """``duration_s`` (if given) sizes the request set to that many seconds of arrivals."""
    from epd.checkpoints import ensure_tiny_checkpoint

    model = model or str(ensure_tiny_checkpoint(DEFAULT_FAMILY[modality], pathlib.Path("checkpoints")))
    rate = rate or (4.0 if quick else 2.0)
    if duration_s:
        num_requests = max(1, math.ceil(rate * duration_s))
    workload = DEFAULT_WORKLOAD[modality]
    if quick:
        workload = dataclasses.replace(workload, num_requests=3, items_per_request=(1, 2))
    workload = dataclasses.replace(workload, num_requests=num_requests or workload.num_requests)
    config = ServingConfig(model=model, rate=rate, repeats=repeats or (1 if quick else 3), workload=workload, caches="off", max_concurrency=max_concurrency)
    name = result_name(modality)
    progress(f"{name}: building {workload.num_requests} {modality} requests (seed {workload.seed})")
    requests = build_requests(workload)
    stack = Stack()
    progress(f"{name}: starting the stack (logs in {stack.log_dir})")
    try:
        services = _start(stack, model)
        gateways = {arm: services[f"gateway-{arm}"].address for arm in ARMS}
        runs = measure(gateways, requests, rate=config.rate, repeats=config.repeats, max_concurrency=config.max_concurrency)
        state = end_state(services)
        resources = {name: {"peak_rss_mib": round(peak_rss_mib(service), 1)} for name, service in services.items()}
    finally:
        stack.stop()
    return write_result(name, build_payload(runs, config, state, resources), command=command or command_line(), results_dir=results_dir)


if __name__ == "__main__":
    import sys

    from bench.__main__ import main

    raise SystemExit(main(["--only", "serving", *sys.argv[1:]]))

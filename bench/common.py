"""What every experiment shares: statistics in ``vllm bench serve`` vocabulary, the machine's
description, and the result file format."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment of the suite: its module (``bench.<module>``) has ``run(*, quick,
    results_dir, command, **options)``, which writes ``<name>.json``, and ``report(doc)``, its
    section of BENCHMARKS.md (and ``plot(doc, path)`` where it draws one). ``options`` names the
    command-line options its run takes; ``fixed`` what it is always given. ``gpu_note``: what a
    GPU host changes in its figures and what to measure there; ``bench/gpu_check.sh`` runs the
    experiments that have one, and the report lists the notes."""

    name: str
    module_name: str
    options: tuple[str, ...] = ()
    fixed: tuple[tuple[str, Any], ...] = ()
    gpu_note: str = ""

    def module(self):
        return importlib.import_module(self.module_name)


_SERVING_OPTIONS = ("model", "rate", "num_requests", "repeats", "max_concurrency", "duration_s")
_GPU_HANDOFF = (
    "EPD's buffers are host memory on GPU hosts too (a consumer copies each item to its device once), so a READ between two "
    "processes of one host stays UCX's CMA copy; what changes is the host (memory bandwidth, more cores). Measure: ec_consumer "
    "at >= x0.85 of raw_read from 1 MiB up and <= 25 us over it up to 64 KiB (the consumer's own cost, which any host shows), "
    "and the memcpy and inline-gRPC goals, which only a host with a DMA path (xpmem/knem, or NIXL on device memory, not "
    "built) could meet."
)
_GPU_COLD_START = (
    "A full GPU engine also profiles device memory, allocates its KV cache and captures CUDA graphs; the encoder-only engine "
    "(eager, no KV cache) does none of that, so its lead should grow. Measure ready_full_over_encoder warm and cold: the goal "
    "is x1.67 or more (encoder <= x0.6 of a full engine). The quick form starts the tiny checkpoint once; `python -m bench "
    "--only cold_start` starts the 16-shard bench checkpoint three times."
)
_GPU_ENCODER_THROUGHPUT = (
    "On a GPU the tower takes well under a millisecond an item, so the service's own per-item work (media decode, "
    "processor, the hop to the engine core, the arena write, gRPC) is all that separates it from the in-process pipeline. "
    "Measure the service's items/s over the pipeline's on the same GPU: the goal is x0.9; its phases and cores busy "
    "(\"Where a pass's time goes\") say which of that work is left."
)
_GPU_SERVING = (
    "On CPU every stage shares two cores, so disaggregation's processes and hops cost throughput directly (goal: E/P/D >= "
    "x0.7 of monolithic's saturation). With stages on GPUs of their own the hops overlap with device work: measure E/P/D "
    "and E+PD saturation throughput over monolithic, and the gateway's share of E2EL, on one GPU shared by all stages "
    "(the quick form) and, given more GPUs, one per stage."
)
SERVING_EXPERIMENTS = ("serving", "serving_video", "serving_audio", "serving_omni")
# The registry, in the order the suite runs the experiments and the report shows them
# (bench.__main__ runs them, bench.report renders them; both read them here, never each other).
EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment("handoff", "bench.handoff", ("iterations",), gpu_note=_GPU_HANDOFF),
        Experiment("cold_start", "bench.cold_start", ("repeats",), gpu_note=_GPU_COLD_START),
        Experiment("encoder_throughput", "bench.encoder_throughput", ("repeats", "num_items"), gpu_note=_GPU_ENCODER_THROUGHPUT),
        Experiment("gateway_overhead", "bench.gateway_overhead", ("num_requests",)),
        Experiment("h2_abuse", "bench.h2_abuse"),
        *(
            Experiment(name, "bench.serving", _SERVING_OPTIONS, (("experiment", name),), gpu_note=_GPU_SERVING if name == "serving" else "")
            for name in SERVING_EXPERIMENTS
        ),
        Experiment("encoder_cache", "bench.encoder_cache"),
        Experiment("faults", "bench.faults"),
        Experiment("soak", "bench.soak", ("num_requests",)),
        Experiment("encoder_memory", "bench.encoder_memory"),
        Experiment("chaos", "bench.chaos", ("duration_s",)),
        Experiment("bf16_load", "bench.bf16_load", ("repeats",)),
    )
}
SCHEMA_VERSION = 2  # 2: the vLLM encoder and EC connector (handoff, cold_start and serving changed)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def service_processes(service) -> Iterator[tuple[str, Any]]:
    """A service's process and every process under it, each as (role, ``psutil.Process``): the
    ``service``'s own, vLLM's ``engine core``, or a ``helper`` (multiprocessing's). Processes that
    end meanwhile are skipped; reading one may still raise ``psutil.NoSuchProcess``."""
    import psutil

    root = psutil.Process(service.process.pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
        except psutil.NoSuchProcess:
            continue
        yield ("service" if process.pid == root.pid else "engine core" if name.startswith("VLLM") else "helper"), process


def cpu_seconds(service) -> dict[str, float]:
    """User + system CPU seconds each process of a service has spent so far: ``service`` (its
    own process), ``engine core`` (vLLM's) and ``helper`` (:func:`service_processes`)."""
    import psutil

    spent: dict[str, float] = {}
    for role, process in service_processes(service):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        spent[role] = spent.get(role, 0.0) + times.user + times.system
    return spent


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, median and p99 (and the count), as vLLM's benchmarks report them."""
    values = list(values)
    if not values:
        return {"count": 0, "mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"count": len(values), "mean": statistics.fmean(values), "median": statistics.median(values), "p99": percentile(values, 99)}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def command_line(only: str | None = None) -> str:
    """The command that reproduces this run; with ``only``, just that experiment of it."""
    args = sys.argv[1:]
    if only is not None:
        kept: list[str] = []
        skip = False
        for arg in args:
            if skip:
                skip = False
            elif arg == "--only":
                skip = True
            elif not arg.startswith("--only="):
                kept.append(arg)
        args = ["--only", only, *kept]
    return " ".join(shlex.quote(a) for a in [pathlib.Path(sys.executable).name, "-m", "bench", *args])


def write_result(name: str, payload: dict[str, Any], *, command: str, results_dir: pathlib.Path = RESULTS_DIR) -> pathlib.Path:
    """Writes ``<results_dir>/<name>.json`` with the common envelope around ``payload``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    document = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "command": command,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        **payload,
    }
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    return path


def progress(message: str) -> None:
    """One line of progress on stderr (the suite runs for minutes)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plot_lines(
    path: pathlib.Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    log: bool = True,
    xticks: dict[float, str] | None = None,
) -> pathlib.Path | None:
    """Writes a line plot (one line per ``series`` entry: label -> (xs, ys)) to ``path``.

    ``xticks`` maps x positions to labels, e.g. byte counts to "1 KiB".

    Plots are a convenience next to the JSON, so matplotlib is optional (``pip install -e
    '.[bench]'``): without it this prints a notice and returns None instead of failing the run.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed; not plotting {path.name} (pip install -e '.[bench]')", file=sys.stderr)
        return None
    # A bare Figure needs no pyplot, so no GUI backend and no global figure state.
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    axes = figure.subplots()
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o", label=label)
    if log:
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
    if xticks:
        axes.set_xticks(list(xticks), list(xticks.values()))
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path

"""Encoder cold start: the vLLM encoder-only service against a full engine, to ready.

The encoder service (``epd encoder``) runs vLLM's encoder-only engine (an EC producer), which
reads only the safetensors shards that hold the tower and says how many it read on its
``EPD_ENCODER_LOAD`` line; a full engine (here ``epd decode --mode combined``, the E+PD consumer)
must read every shard. Both are started as the services they are, on a "bench" checkpoint built
by the project (``devkit.checkpoints``, ``scale="bench"``): the tiny tower in one shard and a 0.9 GB
language model in 15 more, so the encoder reads 1 of 16 shards, as on real checkpoints (vLLM
read 2 of Qwen2.5-VL-72B's 96).

Per start, from the service's own output (stdout lines are timestamped as they arrive):

- ``seconds_to_ready``: from spawning the process to its ``EPD_READY`` line (what an orchestrator
  waits for), and ``seconds_to_listening`` (the gRPC port is up; the engine starts after it);
- ``weights_seconds``: vLLM's own "Loading weights took" figure (two decimals), and
  ``load_model_seconds``: from vLLM's "Starting to load model" line to that one (building the
  model and reading its weights, timed here to the millisecond);
- ``shards_read``: the encoder's ``EPD_ENCODER_LOAD`` line ("read k of n safetensors shards"),
  and for the full engine vLLM's "Loading safetensors checkpoint shards" count;
- after a cold start, the checkpoint pages the start brought into the page cache
  (``mincore(2)``): which shards and how many bytes were actually read from disk;
- ``phases``: where the time to ready goes, from the first line each phase ends with
  (``PHASES``): the service's imports and gRPC port, vLLM's import and config in the service,
  the engine core's start (with ``--engine-core process`` a spawned process, which imports vLLM
  again; on a thread, the default, a fraction of a second), the engine core's set-up until it
  loads the model, the model load, vLLM's profiling, KV cache and warm-up, and the service's work
  after the engine (arena counters, health flip to SERVING).

The page cache is set before every start: warm (every checkpoint file fully resident) and cold
(every file written back and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no
root); only the checkpoint is evicted, not Python or vLLM. Both states are checked with
``mincore(2)``; if the files cannot be evicted (another process holding them mapped, a file
system that ignores the advice), the cold starts are left out and the result says
``page_cache: "warm"``. One service runs at a time.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import RESULTS_DIR, command_line, progress, summarize, write_result
from bench.formatting import MIB, fmt, machine

NAME = "cold_start"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT_ROOT = REPO_ROOT / "checkpoints"  # where tests and `epd up` build theirs too
FAMILY = "qwen2_5_vl"
# What each mode starts: `epd <args> --model DIR --port 0`.
MODES: dict[str, list[str]] = {"encoder_only": ["encoder"], "full_engine": ["decode", "--mode", "combined"]}
PAGE_CACHES = ("warm", "cold")
DEFAULT_REPEATS = 3
QUICK_REPEATS = 1
START_TIMEOUT_S = 600.0
# The states a run may start from: cold allows a few pages that eviction cannot drop (for
# example ones another process has mapped at that moment), warm allows none missing.
COLD_MAX_RESIDENT = 0.01
WARM_MIN_RESIDENT = 1.0
_READ_CHUNK = 8 * 2**20
_ENCODER_LOAD = re.compile(r"^EPD_ENCODER_LOAD read (\d+) of (\d+) safetensors shards")
_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) seconds")
_LOAD_STARTS = "Starting to load model"
_SHARD_PROGRESS = re.compile(r"Loading safetensors checkpoint shards:.*?\|\s*(\d+)/(\d+)")
# Each phase of a start and the stdout line that ends it (the first that contains the text), in
# order; a phase whose line a start lacks is merged into the next.
PHASES: tuple[tuple[str, str], ...] = (
    ("imports and gRPC port", "EPD_LISTENING "),
    ("vLLM import and config", "Resolved architecture"),
    ("engine core start", "Initializing a V1 LLM engine"),
    ("engine core set-up", _LOAD_STARTS),
    ("model load", "Loading weights took"),
    ("profiling, KV cache, warm-up", "init engine (profile, create kv cache, warmup model) took"),
    ("service after the engine", "EPD_READY "),
)
# Issue 32's goal: the encoder-only service ready in at most this fraction of a full engine's time.
READY_GOAL = 0.6
# What every service does before its engine starts, encoder-only or full: no engine setting removes it.
BEFORE_THE_ENGINE = ("imports and gRPC port", "vLLM import and config")


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    results_dir: pathlib.Path = RESULTS_DIR,
    command: str | None = None,
    checkpoint_root: pathlib.Path | None = None,
    page_caches: Sequence[str] = PAGE_CACHES,
    family: str = FAMILY,
) -> pathlib.Path:
    """Starts each service with each page-cache state, ``repeats`` times; writes the result.

    Args:
        quick: use the tiny checkpoint (3 shards, 3 MB) and 1 repeat: a smoke run.
        repeats: starts per mode and page-cache state (default 3, quick 1).
        results_dir: where ``cold_start.json`` is written.
        command: the command line recorded in the result (default: this process's).
        checkpoint_root: parent directory of the checkpoint, built there if missing (about 0.9 GB
            and a minute for bench). Default: ``<repo>/checkpoints`` for the bench checkpoint,
            which nothing else reads; a private temporary copy for quick runs, since tests read
            the shared tiny checkpoint concurrently and would fill the page cache under us.
        page_caches: which of ``warm`` and ``cold`` to measure.
        family: the tiny checkpoint family (default Qwen2.5-VL).

    Returns:
        The path of the result file.
    """
    unknown = set(page_caches) - set(PAGE_CACHES)
    if unknown or not page_caches:
        raise ValueError(f"page_caches must be a non-empty subset of {PAGE_CACHES}, got {list(page_caches)}")
    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    scale = "tiny" if quick else "bench"
    private_root = None
    if checkpoint_root is None and quick:
        private_root = checkpoint_root = pathlib.Path(tempfile.mkdtemp(prefix="epd-bench-cold-start-checkpoint-"))
    try:
        from devkit.checkpoints import ensure_tiny_checkpoint

        started = time.perf_counter()
        model_dir = ensure_tiny_checkpoint(family, checkpoint_root or DEFAULT_CHECKPOINT_ROOT, scale=scale)
        progress(f"{NAME}: {model_dir} ready after {time.perf_counter() - started:.1f}s")
        return _measure(model_dir, repeats=repeats, page_caches=page_caches, results_dir=results_dir, command=command)
    finally:
        if private_root is not None:
            shutil.rmtree(private_root, ignore_errors=True)


def _measure(model_dir: pathlib.Path, *, repeats: int, page_caches: Sequence[str], results_dir: pathlib.Path, command: str | None) -> pathlib.Path:
    checkpoint = describe_checkpoint(model_dir)
    progress(f"{NAME}: {checkpoint['shards']} shards, {checkpoint['bytes'] / 2**20:.1f} MiB of tensors")
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    shards = [model_dir / shard for shard in checkpoint["shard_files"]]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="epd-bench-cold-start-"))
    progress(f"{NAME}: service logs in {log_dir}")

    samples: dict[tuple[str, str], list[dict[str, Any]]] = {(cache, mode): [] for cache in page_caches for mode in MODES}
    cold_left_out = False
    for repeat in range(repeats):
        for cache in page_caches:
            for mode in MODES:
                if cache == "cold":
                    resident = _evict(files)
                    if resident > COLD_MAX_RESIDENT:
                        progress(f"{NAME}: cold page cache not achieved ({resident:.1%} of the checkpoint still resident after eviction); cold starts left out")
                        cold_left_out = True
                        continue
                else:
                    _make_warm(files)
                start = start_service(mode, model_dir, log_dir / f"{mode}-{cache}-{repeat}.log")
                if cache == "cold":
                    start |= _read_from_disk(shards)
                samples[cache, mode].append(start)
                progress(
                    f"{NAME}: {mode:<12} {cache}: ready in {start['seconds_to_ready']:.1f}s (listening {start['seconds_to_listening']:.1f}s), "
                    f"model load {start['load_model_seconds']}s (vLLM: weights {start['weights_seconds']}s), read {start['shards_read']}/{start['shards_total']} shards"
                )
    results = [_summarize(cache, mode, runs) for (cache, mode), runs in samples.items() if runs]
    measured_caches = sorted({r["page_cache"] for r in results}, key=PAGE_CACHES.index)
    payload = {
        "experiment": NAME,
        "config": {
            "checkpoint": model_dir.name,
            "repeats": repeats,
            "page_cache": "both" if measured_caches == list(PAGE_CACHES) else measured_caches[0],
            "cold_left_out": cold_left_out,
            "commands": {mode: shlex.join(["epd", *args, "--model", model_dir.name, "--port", "0"]) for mode, args in MODES.items()},
        },
        "checkpoint": {k: v for k, v in checkpoint.items() if k != "shard_files"},
        "results": results,
        "ratios": _ratios(results),
    }
    return write_result(NAME, payload, command=command or command_line(), results_dir=results_dir)


def _summarize(cache: str, mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    def numbers(key: str) -> list[float]:
        return [r[key] for r in runs if r.get(key) is not None]

    result = {
        "mode": mode,
        "page_cache": cache,
        "shards_read": runs[0]["shards_read"],
        "shards_total": runs[0]["shards_total"],
        "seconds_to_ready": summarize(numbers("seconds_to_ready")),
        "seconds_to_listening": summarize(numbers("seconds_to_listening")),
        "weights_seconds": summarize(numbers("weights_seconds")),
        "load_model_seconds": summarize(numbers("load_model_seconds")),
        "phases_seconds": {name: summarize(seconds)["median"] for name, _ in PHASES if (seconds := [r["phases"][name] for r in runs if name in r["phases"]])},
    }
    if cache == "cold":
        result["shards_read_from_disk"] = runs[0]["shards_read_from_disk"]
        result["bytes_read_from_disk"] = runs[0]["bytes_read_from_disk"]
    return result


def _ratios(results: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    by_key = {(r["page_cache"], r["mode"]): r for r in results}

    def ratio(cache: str, key: str) -> float | None:
        full, encoder = by_key.get((cache, "full_engine")), by_key.get((cache, "encoder_only"))
        if full is None or encoder is None or not encoder[key]["median"]:
            return None
        return full[key]["median"] / encoder[key]["median"]

    any_cache = next(iter(by_key))[0]
    full, encoder = by_key[any_cache, "full_engine"], by_key[any_cache, "encoder_only"]
    return {
        "ready_full_over_encoder_warm": ratio("warm", "seconds_to_ready"),
        "ready_full_over_encoder_cold": ratio("cold", "seconds_to_ready"),
        "load_model_full_over_encoder_warm": ratio("warm", "load_model_seconds"),
        "load_model_full_over_encoder_cold": ratio("cold", "load_model_seconds"),
        "shards_full_over_encoder": full["shards_read"] / encoder["shards_read"] if encoder["shards_read"] else None,
    }


def describe_checkpoint(model_dir: pathlib.Path) -> dict[str, Any]:
    """Shard files, their count and tensor bytes (in all, and in the largest and smallest shard).

    Only the safetensors headers are read (an 8-byte little-endian length, then JSON with each
    tensor's byte range), so the tensor data's page-cache state is left alone.
    """
    weight_map: dict[str, str] = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard_files = sorted(set(weight_map.values()))
    sizes = []
    for shard in shard_files:
        with open(model_dir / shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        sizes.append(sum(e["data_offsets"][1] - e["data_offsets"][0] for name, e in header.items() if name != "__metadata__"))
    return {"shards": len(shard_files), "bytes": sum(sizes), "smallest_shard_bytes": min(sizes), "largest_shard_bytes": max(sizes), "shard_files": shard_files}


def _read_from_disk(shards: Sequence[pathlib.Path]) -> dict[str, int]:
    """After a cold start: the shards with pages in the page cache now, and those pages' bytes."""
    touched = nbytes = 0
    for shard in shards:
        fraction = resident_fraction([shard])
        touched += fraction > 0
        nbytes += round(fraction * shard.stat().st_size)
    return {"shards_read_from_disk": touched, "bytes_read_from_disk": nbytes}


# --- one service start ------------------------------------------------------------------------


def start_service(mode: str, model_dir: pathlib.Path, log_path: pathlib.Path, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
    """Starts ``epd <mode's args>`` on ``model_dir``, waits for it to be ready, stops it.

    Returns:
        seconds_to_listening, seconds_to_ready, weights_seconds and load_model_seconds (None
        where vLLM did not say), shards_read and shards_total.

    Raises:
        RuntimeError: the service exited or was not ready within ``timeout_s``.
    """
    args = [*MODES[mode], "--model", str(model_dir), "--port", "0"]
    lines: list[tuple[float, str]] = []
    ready = threading.Event()
    with open(log_path, "w") as log:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append((time.perf_counter() - started, line.rstrip("\n")))
                if line.startswith("EPD_READY "):
                    ready.set()
            ready.set()  # the process ended

        reader = threading.Thread(target=read, name=f"{mode}-stdout", daemon=True)
        reader.start()
        try:
            if not ready.wait(timeout_s) or process.poll() is not None:
                raise RuntimeError(f"{mode} was not ready within {timeout_s:g} s (exit code {process.poll()}); log {log_path}")
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            reader.join(10)
    return parse_start(lines, log_path.read_text(errors="replace"))


def parse_start(lines: Sequence[tuple[float, str]], stderr: str) -> dict[str, Any]:
    """What one start's output says: (seconds since spawn, stdout line) pairs, and its stderr."""

    def first(prefix: str) -> float:
        for at, line in lines:
            if line.startswith(prefix):
                return at
        raise RuntimeError(f"the service never printed {prefix!r}")

    weights = next(((at, float(m.group(1))) for at, line in lines if (m := _WEIGHTS.search(line))), None)
    load_started = next((at for at, line in lines if _LOAD_STARTS in line), None)
    loaded = _SHARD_PROGRESS.findall(stderr)
    shards_read, shards_total = (int(loaded[-1][0]), int(loaded[-1][1])) if loaded else (None, None)
    encoder_load = next((m for _, line in lines if (m := _ENCODER_LOAD.match(line))), None)
    if encoder_load is not None:
        shards_read, shards_total = int(encoder_load.group(1)), int(encoder_load.group(2))
    return {
        "seconds_to_listening": first("EPD_LISTENING "),
        "seconds_to_ready": first("EPD_READY "),
        "phases": _phases(lines),
        "weights_seconds": weights[1] if weights else None,
        "load_model_seconds": weights[0] - load_started if weights and load_started is not None else None,
        "shards_read": shards_read,
        "shards_total": shards_total,
    }


def _phases(lines: Sequence[tuple[float, str]]) -> dict[str, float]:
    """Seconds per phase of ``PHASES``: from the previous phase's end line to its own."""
    phases: dict[str, float] = {}
    previous = 0.0
    for name, marker in PHASES:
        at = next((at for at, line in lines if marker in line), None)
        if at is not None:
            phases[name] = at - previous
            previous = at
    return phases


# --- page cache ---------------------------------------------------------------------------


def resident_fraction(paths: Iterable[pathlib.Path]) -> float:
    """Fraction of the files' pages that are in the page cache, by ``mincore(2)``.

    The files are mapped without being touched (no page faults), so asking does not change
    the answer.
    """
    libc = _libc()
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += sum(byte & 1 for byte in vector)
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 1.0


def _evict(paths: Iterable[pathlib.Path]) -> float:
    """Drops the files from the page cache; returns the fraction still resident afterwards."""
    paths = list(paths)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            # DONTNEED skips dirty pages, and a checkpoint built moments ago may not have
            # been written back yet.
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def _make_warm(paths: Iterable[pathlib.Path]) -> None:
    """Reads every file that is not fully resident; raises if that does not make it so."""
    buffer = bytearray(_READ_CHUNK)
    for path in paths:
        if resident_fraction([path]) >= WARM_MIN_RESIDENT:
            continue
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        if resident_fraction([path]) < WARM_MIN_RESIDENT:
            raise RuntimeError(f"{path} does not stay in the page cache (memory pressure?); warm runs would not be warm")


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny 3-shard checkpoint and 1 repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help=f"starts per mode and page-cache state (default {DEFAULT_REPEATS})")
    parser.add_argument("--page-cache", choices=[*PAGE_CACHES, "both"], default="both")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [pathlib.Path(sys.executable).name, "-m", "bench.cold_start", *sys.argv[1:]])
    caches = PAGE_CACHES if args.page_cache == "both" else (args.page_cache,)
    print(run(quick=args.quick, repeats=args.repeats, results_dir=args.results_dir, command=command, page_caches=caches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    c, cfg = doc["checkpoint"], doc["config"]
    commands = "; ".join(f"{mode}: `{command}`" for mode, command in cfg["commands"].items())
    lines = [
        "## Encoder cold start: vLLM encoder-only service vs a full engine, to ready",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Checkpoint: `{cfg['checkpoint']}`, {c['shards']} shards, {c['bytes'] / MIB:.1f} MiB of tensors. Services: {commands}. "
        f"Medians over {cfg['repeats']} starts; seconds from spawning the process.",
        "",
        "| mode | page cache | shards read (its log) | read from disk (shards, MiB) | to ready s median | p99 | to listening s | model load s | vLLM weights s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        disk = f"{r['shards_read_from_disk']}, {r['bytes_read_from_disk'] / MIB:.1f}" if "shards_read_from_disk" in r else "n/a (warm)"
        lines.append(
            f"| {r['mode']} | {r['page_cache']} | {r['shards_read']} of {r['shards_total']} | {disk} | {fmt(r['seconds_to_ready']['median'], 2)} "
            f"| {fmt(r['seconds_to_ready']['p99'], 2)} | {fmt(r['seconds_to_listening']['median'], 2)} | {fmt(r['load_model_seconds']['median'], 3)} "
            f"| {fmt(r['weights_seconds']['median'], 2)} |"
        )
    lines += [
        "",
        "Where the time to ready goes (median seconds per phase, each ending at the first stdout line that marks it; `bench.cold_start.PHASES`):",
        "",
        "| mode | page cache | " + " | ".join(name for name, _ in PHASES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in PHASES) + " |",
    ]
    for r in doc["results"]:
        lines.append(f"| {r['mode']} | {r['page_cache']} | " + " | ".join(fmt(r["phases_seconds"].get(name), 2) for name, _ in PHASES) + " |")
    ratios = ", ".join(f"{k} ×{fmt(v, 2)}" for k, v in doc["ratios"].items() if v is not None)
    left_out = " Cold starts were left out: the checkpoint could not be evicted from the page cache." if cfg["cold_left_out"] else ""
    return [*lines, "", f"Ratios (full engine over encoder-only): {ratios}.{left_out}", "", *goal_lines(doc["results"])]


def goal_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """The goal, judged per page-cache state, and what of the encoder's start no engine setting
    can remove (its imports before the engine), against the same full engine."""
    by_key = {(r["page_cache"], r["mode"]): r for r in results}
    judged, floors = [], []
    for cache in PAGE_CACHES:
        full, encoder = by_key.get((cache, "full_engine")), by_key.get((cache, "encoder_only"))
        if full is None or encoder is None:
            continue
        full_ready = full["seconds_to_ready"]["median"]
        judged.append((cache, encoder["seconds_to_ready"]["median"] / full_ready))
        floors.append((cache, sum(encoder["phases_seconds"].get(name, 0.0) for name in BEFORE_THE_ENGINE) / full_ready))
    if not judged:
        return []
    met = all(ratio <= READY_GOAL for _, ratio in judged)
    lines = [
        f"Goal: the encoder-only service ready in ≤ ×{READY_GOAL} of a full engine's time, page cache warm and cold: "
        + ", ".join(f"{cache} ×{ratio:.2f}" for cache, ratio in judged)
        + (": met." if met else ": NOT met.")
    ]
    if not met:
        phases = " and ".join(f'"{name}"' for name in BEFORE_THE_ENGINE)
        spent = " and ".join(f"×{floor:.2f} ({cache})" for cache, floor in floors)
        verdict = (
            "removing engine work cannot meet the goal on this host"
            if any(floor > READY_GOAL for _, floor in floors)
            else "what is left to cut is in the engine's own start"
        )
        lines.append(f"Before its engine starts (the phases {phases}, which a full engine goes through alike), the encoder-only service has already spent {spent} of a full engine's time to ready: {verdict}.")
    return [*lines, ""]


def plot(doc: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([f"{r['mode']}\n{r['page_cache']}" for r in rows], [r["seconds_to_ready"]["median"] for r in rows])
    ax.set_ylabel("seconds to ready (median)")
    ax.set_title("Cold start: vLLM encoder-only service vs full engine")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

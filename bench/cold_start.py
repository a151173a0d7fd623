"""Encoder cold start: loading only the vision tower versus reading the whole checkpoint.

The encoder service reads only the shards that hold the vision tower (``epd.weights``); a
prefill or monolithic engine must read every tensor of every shard. This experiment measures
both on a "bench" checkpoint built by the project (``epd.checkpoints``, ``scale="bench"``):
the tiny vision tower in one shard and a 0.9 GB language model in 15 more, so that the
encoder reads about 1 of 16 shards, as on real checkpoints.

- ``encoder_only``: constructing ``epd.models.qwen_vl.VisionEncoder`` (config, processors,
  tower, vision tensors), the encoder service's whole start-up after its imports.
- ``full_checkpoint``: ``epd.weights.load_tensors`` with an empty prefix, i.e. the same reader
  fetching every tensor, each then copied into process memory as an engine copies weights into
  its parameters: what a prefill engine must read before it can serve. (safetensors returns
  tensors over a memory map, so without the copy little would be read at all.)

Each measurement runs in a fresh process, forked from a "zygote" interpreter that has imported
what both loads need (torch, safetensors, transformers and the model's modules) and nothing
else, so the load seconds exclude import time: on this kind of machine the imports take
seconds, longer than the tiny tower's load, and would otherwise drown what is measured. The
zygote's import seconds are reported on their own (progress lines). Forking also keeps a
quick run of eight loads within seconds.

The page cache is set before every run: warm (every checkpoint file fully resident) and cold
(every file written back and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs
no root). Both states are checked with ``mincore(2)``; if the files cannot be evicted (another
process holding them mapped, a file system that ignores the advice), the cold runs are left out
and the result says ``page_cache: "warm"``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
import pathlib
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import RESULTS_DIR, command_line, progress, summarize, write_result

NAME = "cold_start"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT_ROOT = REPO_ROOT / "checkpoints"  # where tests and `epd up` build theirs too
FAMILY = "qwen2_5_vl"
MODES = ("encoder_only", "full_checkpoint")
DEFAULT_REPEATS = 5
QUICK_REPEATS = 2
# The states a run may start from: cold allows a few pages that eviction cannot drop (for
# example ones another process has mapped at that moment), warm allows none missing.
COLD_MAX_RESIDENT = 0.01
WARM_MIN_RESIDENT = 1.0
_READ_CHUNK = 8 * 2**20


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    results_dir: pathlib.Path = RESULTS_DIR,
    command: str | None = None,
    checkpoint_root: pathlib.Path | None = None,
) -> pathlib.Path:
    """Measures both loads with a warm and, where possible, a cold page cache; writes the result.

    Args:
        quick: use the default tiny checkpoint (3 shards, 3 MB) and 2 repeats: a smoke test.
        repeats: runs per mode and page-cache state (default 5, quick 2).
        results_dir: where ``cold_start.json`` is written.
        command: the command line recorded in the result (default: this process's).
        checkpoint_root: parent directory of the checkpoints (default ``<repo>/checkpoints``);
            the checkpoint is built there if missing (about 0.9 GB and half a minute for bench).

    Returns:
        The path of the result file.
    """
    from epd.checkpoints import ensure_tiny_checkpoint
    from epd.models.qwen_vl import _VISION_PREFIXES  # exactly what VisionEncoder reads

    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    scale = "tiny" if quick else "bench"
    root = checkpoint_root or DEFAULT_CHECKPOINT_ROOT
    started = time.perf_counter()
    model_dir = ensure_tiny_checkpoint(FAMILY, root, scale=scale)
    checkpoint = describe_checkpoint(model_dir, _VISION_PREFIXES)
    progress(
        f"{NAME}: {model_dir} ready after {time.perf_counter() - started:.1f}s: {checkpoint['shards']} shards, "
        f"{checkpoint['bytes'] / 2**20:.1f} MiB of tensors, {checkpoint['vision_bytes'] / 2**20:.2f} MiB vision"
    )
    files = sorted(p for p in model_dir.iterdir() if p.is_file())

    with _Zygote(model_dir) as zygote:
        progress(f"{NAME}: imports, excluded from the load seconds: " + ", ".join(f"{m} {s:.2f}s" for m, s in zygote.import_seconds.items()))
        samples = {("warm", mode): [] for mode in MODES}
        for _ in range(repeats):
            for mode in MODES:
                _make_warm(files)
                samples["warm", mode].append(zygote.load(mode))
        cold = _cold_samples(zygote, files, repeats)
    samples |= cold

    results = []
    for (cache, mode), runs in samples.items():
        seconds = [r["seconds"] for r in runs]
        lazy = max(r["modules_imported"] for r in runs)
        results.append(
            {
                "mode": mode,
                "page_cache": cache,
                "shards_read": runs[0]["shards_read"],
                "bytes_read": runs[0]["bytes_read"],
                "seconds": summarize(seconds),
            }
        )
        progress(
            f"{NAME}: {mode:<15} {cache}: median {results[-1]['seconds']['median'] * 1e3:.1f} ms, "
            f"read {runs[0]['shards_read']}/{checkpoint['shards']} shards, {runs[0]['bytes_read'] / 2**20:.2f} MiB"
            + (f" ({lazy} modules imported inside the timed load)" if lazy else "")
        )
    payload = {
        "experiment": NAME,
        "config": {"checkpoint": model_dir.name, "repeats": repeats, "page_cache": "both" if cold else "warm"},
        "checkpoint": checkpoint,
        "results": results,
        "ratios": _ratios(results),
    }
    path = write_result(NAME, payload, command=command or command_line(), results_dir=results_dir)
    progress(f"{NAME}: wrote {path}")
    return path


def _cold_samples(zygote: _Zygote, files: Sequence[pathlib.Path], repeats: int) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Cold-cache runs, or nothing if the files cannot be evicted here (checked before each run)."""
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {("cold", mode): [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            resident = _evict(files)
            if resident > COLD_MAX_RESIDENT:
                progress(f"{NAME}: cold page cache not achieved ({resident:.1%} of the checkpoint still resident after eviction); cold runs left out")
                return {}
            samples["cold", mode].append(zygote.load(mode))
    return samples


def _ratios(results: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    by_key = {(r["page_cache"], r["mode"]): r for r in results}

    def seconds_ratio(cache: str) -> float | None:
        if (cache, "full_checkpoint") not in by_key:
            return None
        return by_key[cache, "full_checkpoint"]["seconds"]["median"] / by_key[cache, "encoder_only"]["seconds"]["median"]

    return {
        "seconds_full_over_encoder_warm": seconds_ratio("warm"),
        "bytes_full_over_encoder": by_key["warm", "full_checkpoint"]["bytes_read"] / by_key["warm", "encoder_only"]["bytes_read"],
        "seconds_full_over_encoder_cold": seconds_ratio("cold"),
    }


def describe_checkpoint(model_dir: pathlib.Path, vision_prefixes: Sequence[str]) -> dict[str, int]:
    """Shard count and tensor bytes (total, vision tower, language model) from the shard headers.

    Only the safetensors headers are read (an 8-byte little-endian length, then JSON with each
    tensor's byte range), so the tensor data's page-cache state is left alone.
    """
    weight_map: dict[str, str] = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    vision = language = 0
    for shard in shards:
        with open(model_dir / shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if name.startswith(tuple(vision_prefixes)):
                vision += end - begin
            else:
                language += end - begin
    return {"shards": len(shards), "bytes": vision + language, "vision_bytes": vision, "language_bytes": language}


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


# --- the measuring processes ----------------------------------------------------------------


class _Zygote:
    """The parent's handle on the zygote: one JSON line per load in, one JSON reply out."""

    def __init__(self, model_dir: pathlib.Path):
        # -m with the repository as working directory, so `bench` imports whoever runs this.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.cold_start", "--zygote", str(model_dir)],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.import_seconds: dict[str, float] = self._receive()

    def load(self, mode: str) -> dict[str, Any]:
        """Runs one load in a freshly forked process: seconds, shards_read, bytes_read, modules_imported."""
        assert self._process.stdin is not None
        self._process.stdin.write(mode + "\n")
        self._process.stdin.flush()
        return self._receive()

    def _receive(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{NAME} zygote exited with status {self._process.wait()} (its stderr is above)")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{NAME} load failed:\n{reply['error']}")
        return reply

    def __enter__(self) -> _Zygote:
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()  # end of input: the zygote exits
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _zygote_main(model_dir: pathlib.Path) -> None:
    """Imports, reports the import seconds, then forks one child per requested load."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the replies
    _send(protocol, _import_load_paths(model_dir))
    for line in sys.stdin:
        sys.stdout.flush()
        sys.stderr.flush()  # or the child would print the zygote's buffered output again
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            status = 0
            try:
                reply = _measure(line.strip(), model_dir)
            except BaseException:
                reply, status = {"error": traceback.format_exc()}, 1
            with os.fdopen(write_end, "w") as out:
                json.dump(reply, out)
            os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end) as inp:
            data = inp.read()
        _, wait_status = os.waitpid(pid, 0)
        _send(protocol, json.loads(data) if data else {"error": f"load process died (wait status {wait_status})"})


def _import_load_paths(model_dir: pathlib.Path) -> dict[str, float]:
    """Imports what both loads need; returns each mode's import seconds (cumulative: the
    encoder needs everything the full read does, plus transformers and the model's modules).

    Besides plain imports, transformers resolves the config and processor classes by name on
    first use, importing further modules (for Qwen3-VL's video processor, dozens); building
    the config and processors once here does that resolution. The tower and the weights are
    left to the measured process, and so are torch operations: forking after torch has started
    its OpenMP threads is not safe.
    """
    import importlib

    started = time.perf_counter()
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import epd.weights  # noqa: F401

    full = time.perf_counter() - started
    from transformers import AutoConfig, AutoImageProcessor, AutoVideoProcessor

    import epd.models.qwen_vl  # noqa: F401

    config = AutoConfig.from_pretrained(model_dir)
    importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    AutoImageProcessor.from_pretrained(model_dir)
    if (model_dir / "video_preprocessor_config.json").exists():
        AutoVideoProcessor.from_pretrained(model_dir)
    return {"full_checkpoint": full, "encoder_only": time.perf_counter() - started}


def _measure(mode: str, model_dir: pathlib.Path) -> dict[str, Any]:
    """One timed load; ``modules_imported`` counts imports inside the timer (should be 0)."""
    import torch

    from epd.models.qwen_vl import VisionEncoder
    from epd.weights import load_tensors

    modules_before = len(sys.modules)
    started = time.perf_counter()
    if mode == "encoder_only":
        encoder = VisionEncoder(model_dir)
        report = encoder.load_report
    elif mode == "full_checkpoint":
        state, report = load_tensors(model_dir, ("",))  # every name starts with ""
        # safetensors hands out tensors over its memory map, so nothing need be read until
        # the bytes are touched. An engine copies every weight into its own parameters, as
        # VisionEncoder's load_state_dict does with the tower's: the same copy is made here.
        for name, tensor in state.items():
            state[name] = torch.empty_like(tensor).copy_(tensor)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "shards_read": report.shards_read,
        "bytes_read": report.bytes_read,
        "modules_imported": len(sys.modules) - modules_before,
    }


def _send(stream: Any, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny 3-shard checkpoint and 2 repeats: a smoke test in seconds")
    parser.add_argument("--repeats", type=int, default=None, help=f"runs per mode and page-cache state (default {DEFAULT_REPEATS})")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    parser.add_argument("--zygote", type=pathlib.Path, help=argparse.SUPPRESS)  # internal: the measuring process
    args = parser.parse_args(argv)
    if args.zygote is not None:
        _zygote_main(args.zygote)
        return 0
    command = " ".join(shlex.quote(a) for a in [pathlib.Path(sys.executable).name, "-m", "bench.cold_start", *sys.argv[1:]])
    print(run(quick=args.quick, repeats=args.repeats, results_dir=args.results_dir, command=command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

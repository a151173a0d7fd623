"""The benchmarks' compiled parts (``bench/go_stages``, grpc-go on the generated Go SDK): built
here, started as their own processes, each printing the port it listens on.

- ``-role stages``: stand-in encoder, prefill and decode that answer at once (gateway_overhead);
- ``-role relay``: EPD's E/P/D data path alone, compiled (``relay.go``): against the stand-ins in
  gateway_overhead, and against real stages as the serving experiments' ``epd-go-relay`` arm;
- ``-role client``: the timing client of gateway_overhead;
- ``-role load``: the serving experiments' client (``bench.workload.run_load``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence

from bench.common import progress

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_go_stages(out_dir: pathlib.Path) -> pathlib.Path:
    """Builds ``bench/go_stages`` into ``out_dir`` as ``scripts/gen_sdks.sh --check`` builds the
    Go client (module mode, offline: :mod:`devkit.go_build`), generating the SDK first if it is
    missing."""
    from devkit.go_build import build

    if not (_ROOT / "sdk" / "go" / "epd" / "v1").is_dir():
        progress("bench/go_stages: no generated Go SDK; running scripts/gen_sdks.sh")
        subprocess.run([str(_ROOT / "scripts" / "gen_sdks.sh")], check=True, timeout=900)
    binary = out_dir / "go_stages"
    build(_ROOT / "bench" / "go_stages", binary)
    return binary


@functools.cache
def go_stages() -> pathlib.Path:
    """``go_stages``, built once per process into a folder removed at exit."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="epd-go-stages-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return build_go_stages(scratch)


def run_load(address: str, requests: Sequence[bytes], offsets: Sequence[float] | None, max_concurrency: int | None) -> list[dict]:
    """Sends serialized GenerateRequests to ``address`` with the compiled client (``-role load``):
    request i at ``offsets[i]`` seconds from the start (None: all at once, in order), at most
    ``max_concurrency`` in flight. Returns one record per request, in order (the fields of
    ``bench.workload.RequestRecord``)."""
    with tempfile.NamedTemporaryFile(prefix="epd-requests-", suffix=".bin") as file:
        for request in requests:
            file.write(len(request).to_bytes(4, "big") + request)
        file.flush()
        command = [str(go_stages()), "-role", "load", "-target", address, "-request-file", file.name, "-max-concurrency", str(max_concurrency or 0)]
        if offsets is not None:
            command += ["-offsets", ",".join(repr(offset) for offset in offsets)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the compiled load client failed (exit code {done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def start_go(binary: pathlib.Path, *args: str) -> tuple[subprocess.Popen, str]:
    """Starts ``go_stages`` and waits for the port it prints; (process, its address)."""
    process = subprocess.Popen([str(binary), *args], stdout=subprocess.PIPE, text=True)
    port = process.stdout.readline().strip()
    if not port.isdigit():
        process.kill()
        raise RuntimeError(f"go_stages {' '.join(args)} printed {port!r} instead of its port (exit code {process.wait(10)})")
    return process, f"127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(10)


@dataclasses.dataclass(frozen=True)
class GoRelay:
    """A running compiled relay: where it serves GatewayService, and its process."""

    address: str
    process: subprocess.Popen


@contextlib.contextmanager
def go_relay(encoder: str, prefill: str, decode: str) -> Iterator[GoRelay]:
    """The compiled E/P/D relay in front of the given stage instances, built for the occasion."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="epd-go-stages-") as scratch:
        process, address = start_go(build_go_stages(pathlib.Path(scratch)), "-role", "relay", "-encoder", encoder, "-prefill", prefill, "-decode", decode)
        try:
            yield GoRelay(address, process)
        finally:
            stop(process)

"""``epd shared-cache``: the shared tier of the encoder-output cache, a Mooncake Store node.

It runs Mooncake's master (object placement, plus the HTTP metadata server its transfer engines
meet through) and one holder, a Mooncake client that contributes the memory every object lives
in. Encoders join as clients that contribute none (:mod:`epd.transport.shared_tier`), so an
object outlives the encoder that put it. The master evicts the oldest objects when the holder's
segment fills.

Like the EPD services it prints ``EPD_LISTENING`` (``port``: the master's RPC port,
``metadata_port``, ``metrics_port``: the master's Prometheus endpoint) and then ``EPD_READY``,
once a probe object went in and came back out. It exits when either Mooncake process does.

Mooncake's binaries take fixed ports and do not report what they bound, so free ports are picked
here when a flag is 0 (a port could be taken between the pick and the bind: then the start fails
and says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class SharedCacheConfig:
    host: str = "127.0.0.1"
    port: int = 0  # the master's RPC port (what encoders' --shared-cache-master names); 0 picks one
    metadata_port: int = 0  # the master's HTTP metadata server; 0 picks one
    metrics_port: int = 0  # the master's Prometheus endpoint; 0 picks one
    segment_bytes: int = 256 * 1024 * 1024  # the memory the holder contributes: all the tier holds


def serve(config: SharedCacheConfig) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through the finally below: no orphaned Mooncake process
    binaries = pathlib.Path(sys.executable).parent
    if not (binaries / "mooncake_master").exists():
        raise SystemExit("epd shared-cache needs Mooncake Store: pip install 'epd[shared-cache]' (and libibverbs1)")
    port, metadata_port, metrics_port, holder_port = (
        p or _free_port(config.host) for p in (config.port, config.metadata_port, config.metrics_port, 0)
    )
    metadata = f"http://{config.host}:{metadata_port}/metadata"
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": config.host}
    master = subprocess.Popen(
        [
            str(binaries / "mooncake_master"),
            f"--rpc_address={config.host}",
            f"--rpc_port={port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={config.host}",
            f"--http_metadata_server_port={metadata_port}",
            f"--metrics_host={config.host}",
            f"--metrics_port={metrics_port}",
        ],
        env=env,
    )
    processes = [master]
    try:
        _wait_for_port(config.host, port, master)
        holder = subprocess.Popen(
            [
                str(binaries / "mooncake_client"),
                f"--host={config.host}",
                f"--port={holder_port}",
                f"--global_segment_size={config.segment_bytes}",
                f"--master_server_address={config.host}:{port}",
                f"--metadata_server={metadata}",
                "--protocol=tcp",
            ],
            env=env,
        )
        processes.append(holder)
        print(
            "EPD_LISTENING " + json.dumps({"service": "shared-cache", "port": port, "metadata_port": metadata_port, "metrics_port": metrics_port}),
            flush=True,
        )
        _probe(config.host, f"{config.host}:{port}", metadata, processes)
        print("EPD_READY " + json.dumps({"service": "shared-cache"}), flush=True)
        logger.info("shared encoder cache: master %s:%d, metadata %s, %d MiB", config.host, port, metadata, config.segment_bytes >> 20)
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        gone = next(p for p in processes if p.poll() is not None)
        logger.error("shared encoder cache: %s exited with %s", pathlib.Path(gone.args[0]).name, gone.returncode)
        return 1
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in reversed(processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_port(host: str, port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"mooncake_master exited with {process.returncode} (port {port} taken?)")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    raise SystemExit(f"mooncake_master did not listen on {host}:{port} within {_READY_TIMEOUT_S:.0f} s")


def _probe(host: str, master: str, metadata: str, processes: list[subprocess.Popen]) -> None:
    """Ready once an object can go in and come back out: the holder has mounted its segment."""
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    store = MooncakeDistributedStore()
    if store.setup(host, metadata, 0, 1 << 20, "tcp", "", master) != 0:
        raise SystemExit(f"could not join the Mooncake master at {master}")
    payload = os.urandom(4096)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    try:
        while store.put("epd/probe", payload) != 0 or store.get("epd/probe") != payload:
            if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                raise SystemExit("the Mooncake holder did not take a probe object (see its log above)")
            time.sleep(0.2)
        store.remove("epd/probe")
    finally:
        store.close()

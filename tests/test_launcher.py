"""No orphans: every process a launcher starts (services, and vLLM engine-core processes where they run apart) ends
when the launcher stops, fails or dies. Real services, loading real engines; each test kills
only processes it started, by PID."""

from __future__ import annotations

import contextlib
import mimetypes
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from cli.launcher import DEMO_MAX_TOKENS, DEMO_PROMPT, Stack, cpu_share_env, demo_media, gateway_args
from epd.client import chat_request, generate
from tests.conftest import checkpoint

_STARTUP_S = 300
_GONE_S = 60


def _maps_vllm_ops(process: psutil.Process) -> bool:
    """Whether ``process`` has vLLM's native ops mapped: it is loading or running an engine."""
    with contextlib.suppress(psutil.Error, OSError):
        return "/vllm/_C" in pathlib.Path(f"/proc/{process.pid}/maps").read_text()
    return False


def _loads_an_engine(process: psutil.Process, *, in_child: bool = False) -> bool:
    """Whether ``process``'s engine is loading: in the process itself (the engine core on a
    thread), or with ``in_child`` in vLLM's engine-core process under it (the service maps vLLM's
    ops before it spawns that process)."""
    with contextlib.suppress(psutil.Error):
        return any(map(_maps_vllm_ops, process.children(recursive=True) if in_child else [process]))
    return False


def _wait_for_engine_loading(service_pid: int, log: pathlib.Path, *, in_child: bool) -> None:
    """Until the service is loading its vLLM engine (the moment a launcher's death once left engine
    processes behind)."""
    deadline = time.monotonic() + _STARTUP_S
    service = psutil.Process(service_pid)
    while not _loads_an_engine(service, in_child=in_child):
        assert service.status() != psutil.STATUS_ZOMBIE, f"the service exited before it loaded its engine; its log:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the service loaded no engine"
        time.sleep(0.5)


def _processes_in_groups(groups: set[int]) -> list[psutil.Process]:
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in groups and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive


def _assert_groups_end(groups: set[int]) -> None:
    deadline = time.monotonic() + _GONE_S
    while (left := _processes_in_groups(groups)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for process in left:  # ours: started in these groups by this test's launcher
        process.kill()
    assert not left, [p.cmdline()[:4] for p in left]


@contextlib.contextmanager
def _killable_launcher(tmp_path: pathlib.Path, name: str, args: list[str], *, wait_ready: bool = False) -> Iterator[tuple[subprocess.Popen, int]]:
    """A Python process that starts one service with epd's launcher and sleeps, for the test to
    SIGKILL; yields it and the service's PID (its own process group)."""
    script = (
        "import time\n"
        "from cli.launcher import Stack\n"
        f"service = Stack({str(tmp_path)!r}).start({name!r}, {args!r})\n"
        + ("service.wait_ready(60)\n" if wait_ready else "")
        + "print(service.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        service_pid = int(launcher.stdout.readline())
        assert os.getpgid(service_pid) == service_pid  # its own process group
        yield launcher, service_pid
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_services_stop_when_their_launcher_is_killed(tmp_path, engine_core):
    """SIGKILL gives the launcher no chance to clean up: the service notices it was orphaned,
    stops itself and takes its engine with it (vLLM's engine-core process too, in that placement)."""
    args = ["prefill", "--model", str(checkpoint("qwen2_5_vl")), "--engine-core", engine_core]
    with _killable_launcher(tmp_path, "prefill", args) as (launcher, service_pid):
        _wait_for_engine_loading(service_pid, tmp_path / "prefill.log", in_child=engine_core == "process")
        launcher.kill()
        launcher.wait()
        _assert_groups_end({service_pid})


def test_epd_up_stops_every_process_on_sigterm(tmp_path):
    """SIGTERM while the stack is still coming up (the moment ``epd up`` used to leave vLLM
    engine processes behind): every service group ends, and ``epd up`` exits."""
    model = checkpoint("qwen2_5_vl")
    up = subprocess.Popen([sys.executable, "-m", "cli", "up", "--model", str(model), "--mode", "epd-combined"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + _STARTUP_S
        while not any(_loads_an_engine(child) for child in psutil.Process(up.pid).children()):
            assert up.poll() is None and time.monotonic() < deadline, "epd up's services loaded no engine"
            time.sleep(0.5)
        groups = {child.pid for child in psutil.Process(up.pid).children()}
        up.send_signal(signal.SIGTERM)
        assert up.wait(_GONE_S) == 0
        _assert_groups_end(groups)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_the_gateway_stops_when_its_launcher_is_killed(tmp_path):
    """A gateway (no engine of its own) watches its launcher too: SIGKILL the launcher and it
    drains and exits. Nothing listens at its stage addresses; it needs none to start."""
    stage = "127.0.0.1:9"
    args = gateway_args("m", "epd", encoders=[stage], prefills=[stage], decodes=[stage])
    with _killable_launcher(tmp_path, "gateway", args, wait_ready=True) as (launcher, gateway_pid):
        launcher.kill()
        launcher.wait()
        _assert_groups_end({gateway_pid})
        assert "the launcher (pid" in (tmp_path / "gateway.log").read_text()


async def test_the_readme_demo_streams_what_monolithic_vllm_generates(family_stack, tmp_path):
    """`epd up --demo` (what scripts/demo.sh runs) starts E/P/D and streams the demo request; its text and token count are those of the monolithic
    vLLM run of the same request."""
    command = [sys.executable, "-m", "cli", "up", "--model", family_stack.model, "--demo"]
    demo = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=2 * _STARTUP_S)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "mode=epd;" in demo.stdout
    streamed, finish = demo.stdout.split("streamed through ", 1)[1].split(":\n", 1)[1].rsplit("\n[finish=", 1)
    parts = [(data, mimetypes.guess_type(name)[0]) for name, data in demo_media(family_stack.model).items()]
    assert [mime.split("/")[0] for _, mime in parts] == ["image", "video"]  # Qwen2.5-VL: no audio tower
    oracle = await generate(family_stack.gateway_stub("monolithic"), chat_request([*parts, DEMO_PROMPT], max_tokens=DEMO_MAX_TOKENS), timeout=300)
    assert streamed == oracle.text
    assert f"completion_tokens={len(oracle.token_ids)} " in finish


@pytest.mark.parametrize(("preset", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_services_start_with_openmp_threads_that_sleep_when_idle(preset, expected):
    """cli sets OMP_WAIT_POLICY before anything imports torch (libgomp reads it when it loads),
    and leaves an operator's setting alone."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": preset} if preset else {})
    probe = "import sys, os, cli; print('torch' in sys.modules, os.environ['OMP_WAIT_POLICY'])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert result.stdout.split() == ["False", expected], result.stderr


@pytest.mark.parametrize(("cores", "engines", "expected"), [(8, 3, "2"), (2, 3, "1"), (2, 1, "2"), (16, 4, "4")])
def test_co_located_engines_share_the_cores(monkeypatch, cores, engines, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert cpu_share_env(engines) == {"OMP_NUM_THREADS": expected}


def test_an_operators_openmp_thread_count_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_share_env(4) == {}


def test_a_stack_gives_each_service_its_share(tmp_path, monkeypatch):
    """The share reaches the service's environment (libgomp reads it when torch loads); a
    service's own env still wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    stack = Stack(tmp_path, engines=3)
    try:
        # Gateways load no model: they listen at once, and a stage-less one still starts.
        shared = stack.start("gateway-a", gateway_args("unused", "epd", encoders=["127.0.0.1:1"], prefills=["127.0.0.1:1"], decodes=["127.0.0.1:1"]))
        own = stack.start("gateway-b", gateway_args("unused", "epd", encoders=["127.0.0.1:1"], prefills=["127.0.0.1:1"], decodes=["127.0.0.1:1"]), env={"OMP_NUM_THREADS": "5"})
        stack.wait_listening([shared, own], timeout=120)
        assert _environ(shared.process.pid)["OMP_NUM_THREADS"] == "2"
        assert _environ(own.process.pid)["OMP_NUM_THREADS"] == "5"
    finally:
        stack.stop()


def _environ(pid: int) -> dict[str, str]:
    entries = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)

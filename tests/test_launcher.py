"""No orphans: every process a launcher starts (services and their vLLM engine processes) ends
when the launcher stops, fails or dies. Real services, loading real engines; each test kills
only processes it started, by PID."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil

from tests.conftest import checkpoint

_STARTUP_S = 300
_GONE_S = 60


def _wait_for_engine_process(service_pid: int, log: pathlib.Path) -> None:
    """Until the service has spawned its vLLM engine process (so there is a grandchild to orphan)."""
    deadline = time.monotonic() + _STARTUP_S
    service = psutil.Process(service_pid)
    while not service.children(recursive=True):
        assert service.status() != psutil.STATUS_ZOMBIE, f"the service exited before it spawned its engine; its log:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the service spawned no engine process"
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


def test_services_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: the service notices it was orphaned,
    stops itself and takes its engine process with it."""
    model = checkpoint("qwen2_5_vl")
    script = (
        "import sys, time\n"
        "from epd.launcher import Stack\n"
        f"service = Stack({str(tmp_path)!r}).start('prefill', ['prefill', '--model', {str(model)!r}])\n"
        "print(service.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        service_pid = int(launcher.stdout.readline())
        assert os.getpgid(service_pid) == service_pid  # its own process group
        _wait_for_engine_process(service_pid, tmp_path / "prefill.log")
        launcher.kill()
        launcher.wait()
        _assert_groups_end({service_pid})
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_epd_up_stops_every_process_on_sigterm(tmp_path):
    """SIGTERM while the stack is still coming up (the moment ``epd up`` used to leave vLLM
    engine processes behind): every service group ends, and ``epd up`` exits."""
    model = checkpoint("qwen2_5_vl")
    up = subprocess.Popen([sys.executable, "-m", "epd.cli", "up", "--model", str(model), "--mode", "epd-combined"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + _STARTUP_S
        while not any(child.children() for child in psutil.Process(up.pid).children()):
            assert up.poll() is None and time.monotonic() < deadline, "epd up started no engine process"
            time.sleep(0.5)
        groups = {child.pid for child in psutil.Process(up.pid).children()}
        up.send_signal(signal.SIGTERM)
        assert up.wait(_GONE_S) == 0
        _assert_groups_end(groups)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_the_compiled_gateway_stops_when_its_launcher_is_killed(tmp_path):
    """`epd gateway --impl go` replaces the Python process with the compiled gateway (same PID,
    same process group), which watches its launcher itself: SIGKILL the launcher and it drains
    and exits. Nothing listens at its stage addresses; it needs none to start."""
    script = (
        "import time\n"
        "from epd.launcher import Stack, gateway_args\n"
        "stage = '127.0.0.1:9'\n"
        f"gateway = Stack({str(tmp_path)!r}).start('gateway', gateway_args('m', 'epd', encoders=[stage], prefills=[stage], decodes=[stage], extra=['--impl', 'go']))\n"
        "gateway.wait_ready(60)\n"
        "print(gateway.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        gateway_pid = int(launcher.stdout.readline())
        assert os.getpgid(gateway_pid) == gateway_pid  # its own process group
        assert psutil.Process(gateway_pid).exe().endswith("epd-gateway")  # exec'd: the compiled binary
        launcher.kill()
        launcher.wait()
        _assert_groups_end({gateway_pid})
        assert "the launcher (pid" in (tmp_path / "gateway.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

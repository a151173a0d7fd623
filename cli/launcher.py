"""Starts EPD services as subprocesses on loopback with ephemeral ports (``epd up``, tests).

Each service binds port 0 and prints ``EPD_LISTENING {...}`` then ``EPD_READY {...}`` on
stdout; the launcher reads those lines, so no port is guessed and none can collide.

No process outlives the launcher. Each service runs in its own process group, which its vLLM
engine processes inherit, so stopping a service ends the whole group; and a service whose
launcher dies (even by SIGKILL) notices it is orphaned and stops itself
(:func:`exit_with_launcher`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)


class ServiceProcess:
    """One service subprocess and what it has announced."""

    def __init__(
        self,
        name: str,
        args: list[str],
        *,
        log_dir: pathlib.Path,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        wrapper: list[str] | None = None,
    ):
        """``host``: where peers reach it (its ``--host``); ``wrapper``: a command that runs it,
        say ``ip netns exec NAME`` (it must exec the service, so the PID stays the service's)."""
        self.name = name
        self.args = args
        self.host = host
        self._placement = {"env": env, "host": host, "wrapper": wrapper}
        self.log_path = log_dir / f"{name}.log"
        # O_APPEND: the service writes its stderr here itself, and _read_stdout adds its other
        # stdout lines (vLLM logs to stdout, its engine core included); whole writes interleave.
        self._log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644), "w")
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # a gateway's OpenAI-compatible front, when it has one
        self.announced: dict = {}  # the whole EPD_LISTENING line (the shared cache's metadata_port)
        self.listening = threading.Event()  # its ports are known (it binds them before loading)
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            [*(wrapper or []), sys.executable, "-m", "cli", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, **(env or {}), _LAUNCHER_PID: str(os.getpid())},
            start_new_session=True,  # its own process group: one killpg reaches its engine processes too
        )
        self._reader = threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not announced its port yet (wait_listening)")
        return f"{self.host}:{self.port}"

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            if line.startswith("EPD_LISTENING "):
                info = json.loads(line.split(" ", 1)[1])
                self.port, self.metrics_port, self.http_port = info["port"], info["metrics_port"], info.get("http_port")
                self.announced = info
                self.listening.set()
            elif line.startswith("EPD_READY "):
                self.ready.set()
            else:
                self._log.write(line)
                self._log.flush()

    def wait_listening(self, timeout: float) -> None:
        self._wait(self.listening, "listening", timeout)

    def wait_ready(self, timeout: float) -> None:
        self._wait(self.ready, "ready", timeout)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Waits for a ready gateway's readiness to be SERVING: it follows its stages, which its
        health watch sees serve moments after they do, and a first request must not race that."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from epd.v1 import gateway_pb2

        deadline = time.monotonic() + timeout
        request = health_pb2.HealthCheckRequest(service=gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name)
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while (status := stub.Check(request, timeout=5).status) != health_pb2.HealthCheckResponse.SERVING:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not serving after {timeout:.0f} s ({health_pb2.HealthCheckResponse.ServingStatus.Name(status)})")
                time.sleep(0.1)

    def _wait(self, event: threading.Event, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not event.wait(0.2):
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not {what} after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        """Asks the service to drain and exit (SIGTERM); see :meth:`stop`."""
        if self.process.poll() is None:
            self.process.terminate()

    def kill(self) -> None:
        """SIGKILLs the whole instance, the service and its engine processes, as a host or
        container failure would (the fault tests' kill). SIGKILL of the service alone would leave
        its engine process running, orphaned, still holding CPU and memory."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def stop(self, timeout: float = 20) -> None:
        """Drains the service (SIGTERM), then kills what is left of its process group: the
        service if it did not exit in ``timeout`` s, and any engine process it left behind."""
        self.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=5)  # the group is gone, so its stdout is at EOF
        self._log.close()


_LAUNCHER_PID = "EPD_LAUNCHER_PID"
_ORPHAN_POLL_S = 0.5


def exit_with_launcher() -> None:
    """In a service the launcher started: SIGTERM ourselves (a normal drain and shutdown) once
    the launcher is gone, for whatever reason it went. A no-op for a service started otherwise
    (by Kubernetes, systemd or a shell)."""
    launcher = os.environ.pop(_LAUNCHER_PID, None)  # popped: engine processes need no watch
    if launcher is None:
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(_ORPHAN_POLL_S)
        logger.warning("the launcher (pid %s) is gone: stopping", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


class Stack:
    """A set of services started together and stopped in reverse order."""

    def __init__(self, log_dir: str | pathlib.Path | None = None, *, engines: int | None = None):
        """``engines``: how many vLLM engines this stack runs on this host; each service then
        gets its share of the host's cores as OpenMP threads (:func:`cpu_share_env`)."""
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="epd-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: list[ServiceProcess] = []
        self._env = cpu_share_env(engines) if engines else {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None, **placement) -> ServiceProcess:
        """Starts a service; ``placement``: :class:`ServiceProcess`'s ``host`` and ``wrapper``."""
        service = ServiceProcess(name, args, log_dir=self.log_dir, env={**self._env, **(env or {})}, **placement)
        self.services.append(service)
        return service

    def restart(self, service: ServiceProcess) -> ServiceProcess:
        """Starts ``service`` again at its address, as a supervisor restarts a process that died
        (its log continues under a new name); the new process takes its place in the stack."""
        again = ServiceProcess(f"{service.name}-restarted", [*service.args, "--port", str(service.port)], log_dir=self.log_dir, **service._placement)
        if service in self.services:
            self.services[self.services.index(service)] = again
        else:
            self.services.append(again)
        return again

    def supervise(self, stop: threading.Event | None = None) -> None:
        """Until a service exits for good (or ``stop`` is set): starts again every service whose
        engine core died (it exits with ``EXIT_ENGINE_DIED``); any other exit ends it, returning."""
        from epd.server import EXIT_ENGINE_DIED

        stop = stop or threading.Event()
        while not stop.wait(1):
            for service in list(self.services):
                status = service.process.poll()
                if status is None:
                    continue
                if status != EXIT_ENGINE_DIED:
                    logger.error("%s exited with status %s; stopping the stack", service.name, status)
                    return
                logger.warning("%s: its vLLM engine core died; starting it again at %s", service.name, service.address)
                self.restart(service)

    @contextlib.contextmanager
    def temporary(self, name: str, args: list[str], timeout: float = 300):
        """A service that lives for one ``with`` block, ready on entry, gone on exit."""
        service = self.start(name, args)
        try:
            self.wait_ready([service], timeout)
            yield service
        finally:
            service.stop()
            if service in self.services:  # not when the whole stack was stopped inside the block
                self.services.remove(service)

    def wait_listening(self, services: list[ServiceProcess], timeout: float = 120) -> None:
        for service in services:
            service.wait_listening(timeout)

    def wait_ready(self, services: list[ServiceProcess], timeout: float = 300) -> None:
        for service in services:
            service.wait_ready(timeout)

    def stop(self) -> None:
        """Drains every service at once (gateways first in signal order), then reaps them."""
        for service in reversed(self.services):
            service.terminate()
        for service in reversed(self.services):
            service.stop()
        self.services.clear()


def cpu_share_env(engines: int) -> dict[str, str]:
    """The environment that gives each of ``engines`` vLLM engines on this host its share of the
    cores as OpenMP threads (at least one); nothing where the operator set ``OMP_NUM_THREADS``.

    Torch sizes each process's OpenMP pool to every core it may run on, so co-located engines
    oversubscribe the host. With the pool's threads asleep between regions (``OMP_WAIT_POLICY``,
    ``cli/__init__.py``), each parallel region then pays a wake-up per thread: a decode step of the
    tiny Qwen2.5-VL took 3.4 ms of wall time and 3.1 ms of CPU with 2 threads against 1.75 and 1.8
    with one (batch 1). Serving images on a 2-core host (A/B, 6 rotating repeats): E/P/D with one
    thread per engine 15.4 req/s at 103 ms of CPU per request, with two 13.3 at 117; monolithic
    22.5 and 21.8 either way.

    The thread count is part of what a bf16 engine computes: on an AMX host the Qwen2.5-Omni
    thinker's greedy bf16 tokens with one thread differ from vLLM's with two (fp32 ones do not).
    So a monolithic reference for such a stack must run with the same count, as the serving
    benchmark's does (all its engines share one stack); the test stacks keep torch's default,
    the count of their in-process ``LLM.chat`` oracle.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // engines))}


def gateway_args(model: str, mode: str, *, encoders=(), prefills=(), decodes=(), extra=()) -> list[str]:
    """``epd gateway`` arguments for the given stage addresses."""
    args = ["gateway", "--model", model, "--mode", mode]
    for flag, addresses in (("--encoder", encoders), ("--prefill", prefills), ("--decode", decodes)):
        args += [arg for address in addresses for arg in (flag, address)]
    return [*args, *extra]


def start_shared_cache(stack: Stack, host: str = "127.0.0.1") -> list[str]:
    """Starts the encoder-output cache's shared tier; returns the encoder flags that join it."""
    tier = stack.start("shared-cache", ["shared-cache", "--host", host], host=host)
    stack.wait_ready([tier])
    return shared_cache_flags(tier)


def shared_cache_flags(tier: ServiceProcess) -> list[str]:
    """``epd encoder`` flags for the shared tier ``tier`` runs."""
    return ["--shared-cache-master", tier.address, "--shared-cache-metadata", f"http://{tier.host}:{tier.announced['metadata_port']}/metadata"]


def handoff_key_flags(folder: pathlib.Path) -> list[str]:
    """Prefill and decode flags that seal KV handoffs with a random key written under ``folder``
    (readable by this user only): every prefill and decode of one deployment gets the same."""
    path = folder / "handoff.key"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return ["--handoff-key-file", str(path)]


def start_disaggregated(
    stack: Stack, model: str, mode: str, *, encoders: int = 1, prefills: int = 1, decodes: int = 1, gateway_extra=(), encoder_extra=()
) -> ServiceProcess:
    """Starts encoders (with ``encoder_extra`` arguments), prefills (E/P/D only), decodes and a
    gateway (with ``gateway_extra``); returns the gateway."""
    model_flag = ["--model", model]
    sealed = handoff_key_flags(stack.log_dir)
    stage = [stack.start(f"encoder{i}", ["encoder", *model_flag, *encoder_extra]) for i in range(encoders)]
    pre = [stack.start(f"prefill{i}", ["prefill", *model_flag, *sealed]) for i in range(prefills if mode == "epd" else 0)]
    dec_mode = "decode" if mode == "epd" else "combined"
    dec = [stack.start(f"decode{i}", ["decode", *model_flag, "--mode", dec_mode, *(sealed if mode == "epd" else ())]) for i in range(decodes)]
    # The gateway starts beside the engines, once they have bound their ports (it serves when
    # the stages it watches do).
    stack.wait_listening(stage + pre + dec)
    args = gateway_args(
        model, mode, encoders=[s.address for s in stage], prefills=[s.address for s in pre], decodes=[s.address for s in dec], extra=gateway_extra
    )
    gateway = stack.start(f"gateway-{mode}", args)
    stack.wait_ready([*stage, *pre, *dec, gateway])
    gateway.wait_serving()
    return gateway


def start_monolithic(stack: Stack, model: str, *, extra=()) -> ServiceProcess:
    gateway = stack.start("gateway-monolithic", ["gateway", "--model", model, "--mode", "monolithic", *extra])
    stack.wait_ready([gateway])
    return gateway


def up_cli(args) -> int:
    """``epd up``: the whole stack on loopback; with --demo, one streamed multimodal request."""
    import asyncio

    from devkit.checkpoints import ensure_tiny_checkpoint

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or str(ensure_tiny_checkpoint(args.family, pathlib.Path("checkpoints")))
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack as Ctrl-C does
    stack = Stack(engines=_engines(args))
    print(f"[epd up] model={model} mode={args.mode}; logs in {stack.log_dir}", flush=True)
    http = ["--http-port", str(args.http_port)] if args.http_port >= 0 else []
    try:
        if args.mode == "monolithic":
            gateway = start_monolithic(stack, model, extra=http)
        else:
            shared = start_shared_cache(stack) if args.shared_cache else []
            gateway = start_disaggregated(
                stack,
                model,
                args.mode,
                encoders=args.encoders,
                prefills=args.prefills,
                decodes=args.decodes,
                gateway_extra=http,
                encoder_extra=shared,
            )
        for service in stack.services:
            print(f"[epd up] {service.name:<20} {service.address}", flush=True)
        if gateway.http_port is not None:
            print(f"[epd up] OpenAI-compatible API: http://127.0.0.1:{gateway.http_port}/v1 (model {pathlib.Path(model).name})", flush=True)
        if args.demo:
            return asyncio.run(_demo(gateway.address, model))
        print(f"[epd up] ready: epd generate --gateway {gateway.address} --media cat.png 'Describe this'  (Ctrl-C stops)", flush=True)
        stack.supervise()
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _engines(args) -> int:
    """How many vLLM engines ``epd up`` starts on this host."""
    if args.mode == "monolithic":
        return 1
    return args.encoders + (args.prefills if args.mode == "epd" else 0) + args.decodes


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


DEMO_PROMPT = "Describe what you see and hear."
DEMO_MAX_TOKENS = 24


def demo_media(model: str) -> dict[str, bytes]:
    """The demo's media, by file name: an image, a clip and a tone, as the model's processor has
    an image processor, a video processor and an audio feature extractor."""
    from transformers import AutoProcessor

    from devkit.media import sine_wav, synthetic_image_png, synthetic_video

    processor = AutoProcessor.from_pretrained(model)
    media = {}
    if getattr(processor, "image_processor", None) is not None:
        media["demo.png"] = synthetic_image_png(160, 120, seed=1)
    if getattr(processor, "video_processor", None) is not None:
        media["demo.mp4"] = synthetic_video(96, 64, 24, fps=8.0, seed=2)
    if getattr(processor, "feature_extractor", None) is not None:
        media["demo.wav"] = sine_wav(1.5, seed=3)
    return media


async def _demo(address: str, model: str) -> int:
    """One streamed request with every kind of media the model takes."""
    from epd.client import generate_cli

    folder = pathlib.Path(tempfile.mkdtemp())
    media = demo_media(model)
    for name, data in media.items():
        (folder / name).write_bytes(data)
    files = [folder / name for name in media]
    print(f"[epd up] demo: Generate with {', '.join(map(str, files))} streamed through {address}:", flush=True)
    return await generate_cli(address, DEMO_PROMPT, files, max_tokens=DEMO_MAX_TOKENS, temperature=0.0)

"""The gRPC host every service runs in: one place for server options, health, reflection,
tracing, metrics, readiness and ordered shutdown.

Lifecycle: listen first with the service NOT_SERVING (liveness "" is SERVING), load the model,
then flip to SERVING. On SIGTERM/SIGINT: NOT_SERVING first (so load balancers and mesh
sidecars stop routing here), then stop accepting with a grace period so in-flight streams can
finish, then release the engine. Kubernetes probes use the standard grpc.health.v1 service:
``""`` for liveness, the full service name for readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import inspect
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from epd import telemetry
from epd.rpc import add_servicer
from epd.security import TlsConfig, server_credentials

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Channel/server options shared by servers and clients. Symmetric, explicit limits (never -1):
# inline embeddings and media must fit, and a peer cannot make us buffer more than this.
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept client keepalive pings as often as every 10 s, even between calls, so idle
    # connections through meshes and NATs stay open without the server sending GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# Client side: ping every 30 s (well above the servers' 10 s floor) to detect dead peers.
CLIENT_OPTIONS: list[tuple[str, int]] = GRPC_OPTIONS + [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 binds an ephemeral port, reported on stdout
    metrics_port: int | None = None
    otlp_endpoint: str | None = None
    grace_s: float = 5.0
    tls: TlsConfig = TlsConfig()  # plaintext unless a certificate is given
    # Streams one connection may hold open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS;
    # grpcio's default is unlimited). It is what bounds a rapid-reset flood (HEADERS then
    # RST_STREAM, stream after stream): gRPC's core refuses and tarpits streams past it while
    # the handlers of reset calls still queue for the event loop, so the loop never holds more
    # than this many dead calls per connection. Unbounded, one client on loopback left 11 of 56
    # legitimate calls served and the gateway 170 MiB larger; at 100 or 256, 56 of 56 and 20-40
    # MiB (bench h2_abuse). The gateway's public port takes 100 (clients multiplex little); a
    # stage's callers are gateways that multiplex every request they route on one channel.
    max_concurrent_streams: int = 1024
    # How long a connection may take to finish its handshake (TLS, HTTP/2 preface) before it is
    # closed: gRPC's default of 120 s lets slow connections hold sockets for two minutes.
    handshake_timeout_s: float = 20.0


class GrpcHost:
    """An aio server with health, reflection and tracing, for one EPD service.

    ``interceptors`` run before every handler (the gateway's token check: a refused call does no work).
    """

    def __init__(self, config: ServerConfig, *, service_name: str, full_service_name: str, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        telemetry.configure_tracing(service_name, config.otlp_endpoint)
        self.config = config
        self.service_name = service_name
        self.full_service_name = full_service_name
        options = [
            *GRPC_OPTIONS,
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000)),
        ]
        self.server = grpc.aio.server(interceptors=list(interceptors), options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        _enable_reflection(self.server, (full_service_name, health.SERVICE_NAME))
        self.port = 0
        self.announce: dict[str, int] = {}  # more ports for the EPD_LISTENING line (the gateway's http_port)
        self._stop = asyncio.Event()

    def add_servicer(self, servicer) -> None:
        """Serves the host's service with ``servicer`` (:func:`epd.rpc.add_servicer`)."""
        add_servicer(self.server, self.full_service_name, servicer, allowed_peers=frozenset(self.config.tls.allowed_peers))

    async def start(self) -> None:
        """Listens; liveness SERVING, readiness NOT_SERVING until :meth:`set_ready`."""
        address = f"{self.config.host}:{self.config.port}"
        tls = self.config.tls
        self.port = self.server.add_secure_port(address, server_credentials(tls)) if tls.serves_tls else self.server.add_insecure_port(address)
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING, liveness=True)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        metrics_port = telemetry.start_metrics_server(self.config.metrics_port, self.config.host)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        # Launchers (epd up, tests) read this line to learn the ephemeral ports.
        print(
            "EPD_LISTENING " + json.dumps({"service": self.service_name, "port": self.port, "metrics_port": metrics_port, **self.announce}),
            flush=True,
        )
        transport = ("mTLS" if tls.require_client_cert else "TLS") if tls.serves_tls else "plaintext"
        logger.info("%s listening on %s:%d, %s (loading)", self.service_name, self.config.host, self.port, transport)

    async def set_ready(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        print("EPD_READY " + json.dumps({"service": self.service_name}), flush=True)
        logger.info("%s ready", self.service_name)

    async def set_serving(self, serving: bool) -> None:
        """Readiness that follows something else (the gateway: its stages), until draining."""
        if not self._stop.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def wait_for_termination(self) -> None:
        await self._stop.wait()

    async def set_dead(self) -> None:
        """Readiness and liveness NOT_SERVING: the process can no longer serve and should be
        restarted (a Kubernetes liveness probe does that)."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, liveness=True)

    async def stop(self) -> None:
        """Drains: readiness off first, then stop accepting and let streams finish."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, liveness=True)
        await self.server.stop(self.config.grace_s)
        logger.info("%s stopped", self.service_name)

    async def _set_health(self, status, *, liveness: bool = False) -> None:
        await self.health.set("" if liveness else self.full_service_name, status)


REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serves server reflection as both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

    grpcurl, Postman and current grpc libraries ask v1 first; older clients ask only v1alpha.
    grpcio-reflection (1.85) implements only v1alpha, but v1 is the same protocol promoted:
    the same messages with the same field numbers under another package. So v1 is served by
    grpcio-reflection's own servicer (same lookups, same answers), reading v1 bytes as v1alpha
    messages, and its descriptor is registered so that v1 reflects on itself too.
    """
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
    _register_reflection_v1_file()
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1_SERVICE, {"ServerReflectionInfo": handler}),))


def _register_reflection_v1_file() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default pool, derived from v1alpha's."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return  # registered already (an earlier server in this process, or a real v1 module)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _REFLECTION_V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")  # v1alpha's java/go package options name v1alpha
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # only message fields: setting one marks it present
                field.type_name = field.type_name.replace(old, new, 1)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new, 1)
        method.output_type = method.output_type.replace(old, new, 1)
    pool.AddSerializedFile(proto.SerializeToString())


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Caps glibc's malloc arenas for this process (as ``MALLOC_ARENA_MAX`` would at exec).

    glibc gives threads that contend for malloc arenas of their own, up to eight per core, and
    rarely gives their memory back: after HTTP/2 floods made gRPC's threads allocate, the gateway
    stayed 55 MiB larger for good; with two arenas it came back to within 5-20 MiB, most times
    (bench h2_abuse; :func:`release_freed_heap_periodically` returns the rest).
    Call it before the process starts its threads. A no-op where the C library has no mallopt.
    """
    m_arena_max = -8  # glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(m_arena_max, arenas)


# How often a process that floods may bloat gives its C heap's free pages back (see
# release_freed_heap_periodically).
HEAP_RELEASE_PERIOD_S = 1.0


def release_freed_heap() -> bool:
    """Gives the pages the C heap holds free back to the OS (glibc's ``malloc_trim``).

    Returns whether any went back; False also where the C library has no ``malloc_trim``.
    """
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


async def release_freed_heap_periodically(period_s: float = HEAP_RELEASE_PERIOD_S) -> None:
    """Every ``period_s``, :func:`release_freed_heap`, off the event loop, until cancelled.

    Two arenas (:func:`limit_malloc_arenas`) were not enough: after about one HTTP/2 flood in
    ten, the gateway kept 80 MiB more than before it, which glibc held free between live blocks
    and returns only when asked (bench h2_abuse, 6 s of rapid reset; ``gc.collect`` freed
    nothing, ``malloc_trim`` all but 3-7 MiB). Released each second, 14 such floods left 6-20
    MiB (what a flood holds while it lasts is live, and varies: peaks of 10-80 MiB with or
    without releases). A release takes about a millisecond, 30 ms on a fragmented gigabyte, in a
    worker thread; an allocation waits for it only on the arena it is trimming.
    """
    while True:
        await asyncio.sleep(period_s)
        await asyncio.to_thread(release_freed_heap)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


_ENGINE_WATCH_S = 1.0
# A service whose vLLM engine core died exits with this status, so that its supervisor (Kubernetes,
# ``epd up``) starts it again: vLLM cannot restart an engine core in place. EX_TEMPFAIL.
EXIT_ENGINE_DIED = 75
# How long a service whose engine died still answers NOT_SERVING before it exits: the gateways'
# health watches see it leave (and stop routing to it) rather than a refused connection.
_DEAD_ENGINE_GRACE_S = 5.0


async def run_service(host: GrpcHost, engine=None, *, on_ready=None, on_stop=None) -> None:
    """The lifecycle every EPD service shares, in one place.

    Listen first (liveness SERVING, readiness NOT_SERVING), start the engine off the event loop,
    call ``on_ready(engine)`` (the servicer takes its runner), then report SERVING until SIGTERM.
    Readiness follows the engine: if its core dies, the service reports NOT_SERVING (liveness
    too) instead of failing every request while looking healthy, and exits with
    :data:`EXIT_ENGINE_DIED` for its supervisor to start it again. Shutdown drains the server,
    then calls ``on_stop()``, then stops the engine.
    """
    await host.start()
    started = engine is None
    died = False
    try:
        if engine is not None:
            started = await _start_engine(host, engine)
            if not started:
                return
            _bind_engine_gauges(engine)
        if on_ready is not None:
            on_ready(engine)
        await host.set_ready()
        died = await _serve_until_stopped(host, engine)
    finally:
        await host.stop()
        if on_stop is not None and inspect.isawaitable(stopped := on_stop()):
            await stopped
        if started and engine is not None:
            engine.shutdown()
        elif not started:
            _kill_children()
    if died:
        raise SystemExit(EXIT_ENGINE_DIED)


async def _start_engine(host: GrpcHost, engine) -> bool:
    """Loads the engine in a daemon thread; False if SIGTERM came first.

    A stop request must work while an engine loads (or hangs loading): the service then exits
    without waiting for the load, and takes the engine's half-started processes with it.
    """
    loop = asyncio.get_running_loop()
    loaded: asyncio.Future = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not loaded.done():
            loaded.set_exception(error) if error is not None else loaded.set_result(None)

    def load() -> None:
        try:
            engine.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=load, name="engine-load", daemon=True).start()
    stop = asyncio.create_task(host.wait_for_termination())
    await asyncio.wait([loaded, stop], return_when=asyncio.FIRST_COMPLETED)
    if loaded.done():
        stop.cancel()
        loaded.result()  # re-raises a failed load
        return True
    logger.warning("%s: stopping while the engine is still loading", host.service_name)
    return False


def _kill_children() -> None:
    """Kills this process's children: the processes of an engine that never finished loading."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


async def _serve_until_stopped(host: GrpcHost, engine) -> bool:
    """Serves until SIGTERM, or until the engine core dies (True)."""
    stopped = asyncio.create_task(host.wait_for_termination())
    while engine is not None and not stopped.done():
        await asyncio.wait([stopped], timeout=_ENGINE_WATCH_S)
        if not engine.alive:
            logger.error("%s: the vLLM engine core died; NOT_SERVING, exiting with status %d to be started again", host.service_name, EXIT_ENGINE_DIED)
            await host.set_dead()
            await asyncio.wait([stopped], timeout=_DEAD_ENGINE_GRACE_S)
            stopped.cancel()
            return True
    await stopped
    return False


def _bind_engine_gauges(engine) -> None:
    counters = engine.connector_counters
    bindings = {
        "leases": telemetry.ARENA_LEASES,
        "free_slots": telemetry.ARENA_FREE_SLOTS,
        "items": telemetry.RECEIVE_ITEMS,
        "free_pages": telemetry.RECEIVE_FREE_PAGES,
        "failed_loads": telemetry.EMBEDDING_LOAD_FAILURES,
        "cache_bytes": telemetry.ENCODER_CACHE_BYTES,
    }
    if "cache_hits" in counters:
        telemetry.EncoderCacheCollector.register(counters)
    for name, read in counters.items():
        modality, _, kind = name.partition("_")
        if name in bindings:
            bindings[name].set_function(read)
        elif kind == "batches":
            telemetry.ENCODER_BATCHES.labels(modality=modality).set_function(read)
        elif kind == "batch_items":
            telemetry.ENCODER_BATCH_ITEMS.labels(modality=modality).set_function(read)
        elif kind == "bytes" and modality in ("nixl", "inline"):  # not the arena's slot_bytes / element_bytes sizes
            telemetry.EMBEDDING_BYTES_LOADED.labels(transport=modality).set_function(read)

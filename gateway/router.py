"""Spreads calls over the instances of one stage, and keeps dead instances out of the rotation.

Picking: least in-flight first, round-robin on ties, instances known to serve before ones not
yet heard from. Work that a cache on the instance can reuse (an item's encoder output, a
prompt prefix's KV) is picked by key instead (:meth:`StagePool.pick_for_key`): consistent
hashing with bounded load, so a key keeps going to the same instance, a hot key spills to the
next instance on the ring rather than to a random one, and an instance that joins or leaves
moves only its own share of the keys. Where a repeat costs its holder next to nothing (an
encoder answers an item its arena holds from the cache desk, without its engine), the caller
records who served a key (:meth:`StagePool.record_holder`) and the key goes back there past
the load bound: another instance would run the tower again.

Health: every instance's standard health service is watched (``Watch`` on the stage's
readiness name), so an instance that drains, loses its engine or dies leaves the rotation at
once, and one that comes back (restarted at the same address) rejoins by itself. A call that
fails with UNAVAILABLE ejects its instance until a fresh health check says it serves: a kill -9
is seen on the first failed call, not after a probe period.

Membership: instances are listed, or found behind DNS names (:class:`StagePool`). Channels are
created once per instance and reused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import enum
import hashlib
import itertools
import logging
import math
import random
import secrets
import socket
from collections import OrderedDict
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd import telemetry
from epd.errors import Unavailable
from epd.security import read_secret
from epd.server import CLIENT_OPTIONS

logger = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to 120 s: a restarted instance would stay unreachable
# for minutes. Instances come back in seconds, so retry connecting often. The minimum stays at
# gRPC's default: it is also each connection attempt's timeout, and at 100 ms a loaded host's
# first connection timed out, which failed the health watch and marked a live instance down
# (the soak lost 25 requests that way in its first second).
_CHANNEL_OPTIONS = CLIENT_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_WATCH_RETRY_MIN_S = 0.1
_WATCH_RETRY_MAX_S = 1.0
_CHECK_TIMEOUT_S = 2.0
# Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2016): an instance
# takes a key only while its in-flight calls are under this factor times the mean (after the
# call), so no instance gets more than ~25% above its share however hot a key is.
_LOAD_BOUND = 1.25
_POINTS_PER_INSTANCE = 64  # virtual nodes: keys spread evenly even over two or three instances
_HOLDERS_KEPT = 65536  # keys whose last server a pool remembers (a few MB)


def read_routing_secret(path: str = "") -> bytes:
    """The secret that places keys and instances on every ring: the SHA-256 of the file's text
    (surrounding whitespace ignored), or 32 random bytes of this process's own for ``""``.

    Gateway replicas send an item to the same encoder only when they share it. It is secret so
    that a client cannot tell where an item will land, and so cannot craft distinct items that
    pile onto one instance (bounded load limits the damage, the secret removes the aim).

    Raises:
        ValueError: the file cannot be read or holds only whitespace.
    """
    if not path:
        return secrets.token_bytes(32)
    return read_secret(path, "affinity key file")


def _ring_hash(text: str, secret: bytes) -> int:
    """A point on the ring: a keyed BLAKE2b (a MAC) of the text."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, key=secret).digest(), "big")


class HashRing:
    """Where each key lands among a set of instances; instances come and go without moving
    other instances' keys. ``secret`` (:func:`read_routing_secret`) keys every point."""

    def __init__(self, addresses: list[str], secret: bytes) -> None:
        self._secret = secret
        points = sorted((_ring_hash(f"{address}#{i}", secret), address) for address in addresses for i in range(_POINTS_PER_INSTANCE))
        self._hashes = [h for h, _ in points]
        self._owners = [a for _, a in points]

    def walk(self, key: str) -> list[str]:
        """Every instance once, in ring order from the key's point."""
        start = bisect.bisect(self._hashes, _ring_hash(key, self._secret))
        seen: dict[str, None] = {}
        for index in range(len(self._owners)):
            seen.setdefault(self._owners[(start + index) % len(self._owners)])
        return list(seen)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How the gateway retries a request whose stage call failed before the first token."""

    max_attempts: int = 3  # per request, the first try included
    retry_backoff_s: float = 0.05  # doubles per attempt, with full jitter; the deadline caps it

    def delay(self, attempt: int) -> float:
        return random.uniform(0, self.retry_backoff_s * 2 ** (attempt - 1))


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not heard from yet: usable, after instances known to serve
    SERVING = "serving"
    DOWN = "down"  # NOT_SERVING, unreachable, or its last call failed: never picked


DNS_PREFIX = "dns:///"


def _dns_target(target: str) -> tuple[str, int]:
    """``dns:///host:port`` as (host, port); raises ValueError for anything else."""
    host, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r} is not dns:///host:port")
    return host, int(port)


def _instances(infos, port: int) -> list[str]:
    """getaddrinfo results as instance addresses, one per distinct IP."""
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


class StagePool:
    """The instances of one stage (encoder, prefill or decode).

    Targets are instance addresses (``host:port``) or DNS names that stand for a set of instances
    (``dns:///name:port``, say a Kubernetes headless Service: one instance per address the name
    resolves to). Names are resolved again every ``resolve_interval_s`` and at once after a call
    fails, so instances join and leave without a restart: a new one is watched and taken into
    the ring; one the name no longer lists takes no new work and goes once its calls end.
    """

    def __init__(
        self,
        stage: str,
        targets: list[str],
        stub_class,
        *,
        health_service: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        on_availability_change: Callable[[], None] | None = None,
        affinity: bool = True,
        routing_secret: bytes | None = None,
        resolve_interval_s: float = 5.0,
    ):
        """``affinity``: False makes :meth:`pick_for_key` ignore the key (least in-flight);
        ``routing_secret``: keys the ring (:func:`read_routing_secret`; default: a random one)."""
        if not targets:
            raise ValueError(f"no addresses for the {stage} stage")
        self.stage = stage
        self._stub_class = stub_class
        self._credentials = credentials
        self._health_service = health_service
        self._on_availability_change: Callable[[], None] | None = None  # set once the first members are in
        self._affinity = affinity
        self._routing_secret = routing_secret or read_routing_secret()
        self._resolve_interval_s = resolve_interval_s
        self._static = [t for t in targets if not t.startswith(DNS_PREFIX)]
        self._names = [_dns_target(t) for t in targets if t.startswith(DNS_PREFIX)]
        self._resolved: dict[tuple[str, int], list[str]] = {}  # the last answer for each name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, object] = {}
        self._in_flight: dict[str, int] = {}
        self._health: dict[str, Health] = {}
        self._leaving: set[str] = set()  # no longer listed: no new work, dropped when idle
        self._watchers: dict[str, asyncio.Task] = {}
        self._watching = False
        self._resolve_now: asyncio.Event | None = None
        self._turn = itertools.count()
        self._ring: HashRing | None = None
        # key -> (the instance that last served it, the key's ring owner then)
        self._holders: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        for host, port in self._names:
            try:
                self._resolved[(host, port)] = _instances(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), port)
            except OSError as exc:
                logger.warning("%s: cannot resolve %s yet: %s", stage, host, exc)
        self._set_members(self._wanted())
        self._on_availability_change = on_availability_change

    @property
    def addresses(self) -> list[str]:
        return [a for a in self._stubs if a not in self._leaving]

    @property
    def available(self) -> bool:
        """Whether any instance may be picked (the gateway's readiness needs one per stage)."""
        return any(self._health[a] is not Health.DOWN for a in self.addresses)

    def health(self, address: str) -> Health:
        return self._health[address]

    def watch_health(self) -> None:
        """Starts watching every instance's health, and re-resolving the names; runs until
        :meth:`close`."""
        self._watching = True
        for address in self.addresses:
            self._watchers[address] = self._spawn(self._watch(address))
        if self._names:
            self._resolve_now = asyncio.Event()
            self._spawn(self._resolve_loop())

    def pick(self, avoid: frozenset[str] = frozenset()) -> str:
        """The least-loaded live instance, preferring ones not in ``avoid`` (those that already
        failed this request) and ones known to serve; ties rotate so idle instances share work."""
        live = [a for a in self.addresses if self._health[a] is not Health.DOWN]
        if not live:
            raise Unavailable(f"no live {self.stage} instance (all {len(self.addresses)} are down or unreachable)")
        candidates = [a for a in live if a not in avoid] or live
        start = next(self._turn) % len(candidates)
        ordered = candidates[start:] + candidates[:start]
        return min(ordered, key=lambda a: (self._health[a] is not Health.SERVING, self._in_flight[a]))

    def pick_for_key(self, key: str, avoid: frozenset[str] = frozenset()) -> str:
        """The live instance recorded as the key's holder, whatever its load, while the key's
        ring owner is the one it had then; else the first live instance from the key's point on
        the ring whose load is within the bound; ones known to serve before ones not yet heard
        from, and instances in ``avoid`` only when no other is live.

        The owner check is what lets a joining instance take its share of keys: a key whose point
        on the ring it now owns leaves its old holder (one tower run on the newcomer), while a key
        that spilled past a busy owner stays with the instance whose cache holds it.
        """
        if self._ring is None:
            return self.pick(avoid)
        walk = self._ring.walk(key)
        holder, owner = self._holders.get(key, (None, None))
        usable = holder is not None and holder not in avoid and self._health.get(holder, Health.DOWN) is not Health.DOWN and holder not in self._leaving
        if usable and owner == walk[0]:
            return holder
        live = [a for a in walk if self._health[a] is not Health.DOWN]
        if not live:
            raise Unavailable(f"no live {self.stage} instance (all {len(self.addresses)} are down or unreachable)")
        candidates = [a for a in live if a not in avoid] or live
        candidates = [a for a in candidates if self._health[a] is Health.SERVING] or candidates
        bound = math.ceil(_LOAD_BOUND * (sum(self._in_flight[a] for a in candidates) + 1) / len(candidates))
        return next(a for a in candidates if self._in_flight[a] < bound)

    def record_holder(self, key: str, address: str) -> None:
        """Records that ``address`` served ``key``, so that :meth:`pick_for_key` sends the key
        back there: only for work a holder repeats at next to no cost."""
        if self._ring is None:
            return  # no affinity: keys are not routed
        self._holders[key] = (address, self._ring.walk(key)[0])
        self._holders.move_to_end(key)
        if len(self._holders) > _HOLDERS_KEPT:
            self._holders.popitem(last=False)

    def stub(self, address: str):
        """The stub of an instance still in the pool.

        Raises:
            Unavailable: the instance has left it.
        """
        if address not in self._stubs:
            raise Unavailable(f"{self.stage} {address} is no longer an instance")
        return self._stubs[address]

    @contextlib.contextmanager
    def busy(self, address: str):
        """Counts a call against an instance while it runs.

        Raises:
            Unavailable: the instance has left the pool since it was picked.
        """
        stub = self.stub(address)
        self._in_flight[address] += 1
        try:
            yield stub
        finally:
            self._in_flight[address] -= 1
            if address in self._leaving and not self._in_flight[address]:
                self._drop(address)

    def eject(self, address: str, reason: str) -> None:
        """Takes an instance whose call failed out of the rotation until a health check passes.

        The check runs at once: an instance that is fine (the failure was a peer's, say the
        encoder that prefill read from) is back within a round trip; a dead one stays out until
        its health watch reconnects to a restarted process. Names are resolved again too.
        """
        if address not in self._health:
            return
        if self._health[address] is not Health.DOWN:
            logger.warning("%s %s ejected: %s", self.stage, address, reason)
            telemetry.STAGE_EJECTIONS.labels(stage=self.stage).inc()
        self._set_health(address, Health.DOWN)
        self._spawn(self._check(address))
        if self._resolve_now is not None:
            self._resolve_now.set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- membership -------------------------------------------------------------------------

    def _wanted(self) -> list[str]:
        return list(dict.fromkeys([*self._static, *(a for addresses in self._resolved.values() for a in addresses)]))

    def _set_members(self, wanted: list[str]) -> None:
        was_available = self.available
        for address in wanted:
            if address in self._leaving:
                self._rejoin(address)
            elif address not in self._stubs:
                self._add(address)
        for address in [a for a in self.addresses if a not in wanted]:
            self._retire(address)
        self._ring = HashRing(self.addresses, self._routing_secret) if self._affinity and self.addresses else None
        if self.available != was_available and self._on_availability_change is not None:
            self._on_availability_change()

    def _add(self, address: str) -> None:
        options = list(_CHANNEL_OPTIONS)
        name = next((host for (host, port), listed in self._resolved.items() if address in listed), None)
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if name is not None:  # dialled by IP: verify the certificate against the name
                options.append(("grpc.ssl_target_name_override", name))
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        self._channels[address] = channel
        self._stubs[address] = self._stub_class(channel)
        self._in_flight[address] = 0
        self._admit(address)

    def _rejoin(self, address: str) -> None:
        """Listed again before it was dropped (a call to it still ran): leaving had stopped its
        health watch, so it is admitted afresh."""
        self._leaving.discard(address)
        self._admit(address)

    def _admit(self, address: str) -> None:
        self._health[address] = Health.UNKNOWN
        telemetry.STAGE_INSTANCE_UP.labels(stage=self.stage, address=address).set(1)
        if self._watching:
            logger.info("%s %s joined", self.stage, address)
            self._watchers[address] = self._spawn(self._watch(address))

    def _retire(self, address: str) -> None:
        logger.info("%s %s left (no longer listed)", self.stage, address)
        self._leaving.add(address)
        watcher = self._watchers.pop(address, None)
        if watcher is not None:
            watcher.cancel()
        with contextlib.suppress(KeyError):
            telemetry.STAGE_INSTANCE_UP.remove(self.stage, address)
        if not self._in_flight[address]:
            self._drop(address)

    def _drop(self, address: str) -> None:
        self._leaving.discard(address)
        for table in (self._stubs, self._in_flight, self._health):
            table.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._spawn(channel.close())

    async def _resolve_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resolve_now.wait(), self._resolve_interval_s)
            self._resolve_now.clear()
            for host, port in self._names:
                try:
                    self._resolved[(host, port)] = _instances(await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), port)
                except (OSError, UnicodeError) as exc:  # keep the last answer: a DNS hiccup must not empty the pool
                    logger.warning("%s: cannot resolve %s: %s", self.stage, host, exc)
            try:
                self._set_members(self._wanted())
            except Exception:  # a bug here must not end re-resolution for the gateway's lifetime
                logger.exception("%s: could not apply the resolved members", self.stage)

    # ---- health -----------------------------------------------------------------------------

    async def _watch(self, address: str) -> None:
        stub = health_pb2_grpc.HealthStub(self._channels[address])
        retry_s = _WATCH_RETRY_MIN_S
        while True:
            try:
                async for response in stub.Watch(health_pb2.HealthCheckRequest(service=self._health_service)):
                    retry_s = _WATCH_RETRY_MIN_S
                    self._set_health(address, _health_of(response))
            except grpc.aio.AioRpcError as exc:
                logger.debug("%s %s health watch ended: %s", self.stage, address, exc.code())
            # The stream ended: the instance stopped or became unreachable.
            self._set_health(address, Health.DOWN)
            await asyncio.sleep(retry_s * random.uniform(0.5, 1.0))
            retry_s = min(retry_s * 2, _WATCH_RETRY_MAX_S)

    async def _check(self, address: str) -> None:
        channel = self._channels.get(address)
        if channel is None:
            return
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=self._health_service), timeout=_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return  # still down; the watch brings it back when it returns
        self._set_health(address, _health_of(response))

    def _set_health(self, address: str, state: Health) -> None:
        if address not in self._health or address in self._leaving:
            return  # it left the pool meanwhile
        was_available = self.available
        if self._health[address] is not state and state is Health.SERVING and self._health[address] is Health.DOWN:
            logger.info("%s %s is serving again", self.stage, address)
        self._health[address] = state
        telemetry.STAGE_INSTANCE_UP.labels(stage=self.stage, address=address).set(state is not Health.DOWN)
        if self.available != was_available and self._on_availability_change is not None:
            self._on_availability_change()


def _health_of(response: health_pb2.HealthCheckResponse) -> Health:
    return Health.SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else Health.DOWN

"""Spreads calls over the instances of one stage, and keeps dead instances out of the rotation.

Picking: least in-flight first, round-robin on ties, instances known to serve before ones not
yet heard from. Work that a cache on the instance can reuse (an item's encoder output, a
prompt prefix's KV) is picked by key instead (:meth:`StagePool.pick_for_key`): consistent
hashing with bounded load, so a key keeps going to the same instance, a hot key spills to the
next instance on the ring rather than to a random one, and an instance that joins or leaves
moves only its own share of the keys. Health: every instance's standard health service is watched (``Watch`` on the
stage's readiness name), so an instance that drains, loses its engine or dies leaves the
rotation at once, and one that comes back (restarted at the same address) rejoins by itself.
A call that fails with UNAVAILABLE ejects its instance until a fresh health check says it
serves: a kill -9 is seen on the first failed call, not after a probe period.

Channels are created once per address and reused.
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
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd import telemetry
from epd.errors import Unavailable
from epd.server import CLIENT_OPTIONS

logger = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to 120 s: a restarted instance would stay unreachable
# for minutes. Instances come back in seconds, so retry connecting often.
_CHANNEL_OPTIONS = CLIENT_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
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


def _ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Where each key lands among a set of instances; instances come and go without moving
    other instances' keys."""

    def __init__(self, addresses: list[str]) -> None:
        points = sorted((_ring_hash(f"{address}#{i}"), address) for address in addresses for i in range(_POINTS_PER_INSTANCE))
        self._hashes = [h for h, _ in points]
        self._owners = [a for _, a in points]

    def walk(self, key: str) -> list[str]:
        """Every instance once, in ring order from the key's point."""
        start = bisect.bisect(self._hashes, _ring_hash(key))
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


class StagePool:
    """The instances of one stage (encoder, prefill or decode)."""

    def __init__(
        self,
        stage: str,
        addresses: list[str],
        stub_class,
        *,
        health_service: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        on_availability_change: Callable[[], None] | None = None,
        affinity: bool = True,
    ):
        """``affinity``: False makes :meth:`pick_for_key` ignore the key (least in-flight)."""
        if not addresses:
            raise ValueError(f"no addresses for the {stage} stage")
        self.stage = stage
        self._health_service = health_service
        self._on_availability_change = on_availability_change

        def channel(address: str) -> grpc.aio.Channel:
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            return grpc.aio.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)

        self._channels = {a: channel(a) for a in addresses}
        self._stubs = {a: stub_class(c) for a, c in self._channels.items()}
        self._in_flight = dict.fromkeys(addresses, 0)
        self._health = dict.fromkeys(addresses, Health.UNKNOWN)
        self._turn = itertools.count()
        self._ring = HashRing(addresses) if affinity else None
        self._tasks: set[asyncio.Task] = set()
        for address in addresses:
            telemetry.STAGE_INSTANCE_UP.labels(stage=stage, address=address).set(1)

    @property
    def addresses(self) -> list[str]:
        return list(self._stubs)

    @property
    def available(self) -> bool:
        """Whether any instance may be picked (the gateway's readiness needs one per stage)."""
        return any(state is not Health.DOWN for state in self._health.values())

    def health(self, address: str) -> Health:
        return self._health[address]

    def watch_health(self) -> None:
        """Starts watching every instance's health; runs until :meth:`close`."""
        for address in self.addresses:
            self._spawn(self._watch(address))

    def pick(self, avoid: frozenset[str] = frozenset()) -> str:
        """The least-loaded live instance, preferring ones not in ``avoid`` (those that already
        failed this request) and ones known to serve; ties rotate so idle instances share work."""
        live = [a for a in self.addresses if self._health[a] is not Health.DOWN]
        if not live:
            raise Unavailable(f"no live {self.stage} instance (all {len(self._stubs)} are down or unreachable)")
        candidates = [a for a in live if a not in avoid] or live
        start = next(self._turn) % len(candidates)
        ordered = candidates[start:] + candidates[:start]
        return min(ordered, key=lambda a: (self._health[a] is not Health.SERVING, self._in_flight[a]))

    def pick_for_key(self, key: str, avoid: frozenset[str] = frozenset()) -> str:
        """The first live instance from the key's point on the ring whose load is within the
        bound; ones known to serve before ones not yet heard from, and instances in ``avoid``
        only when no other is live."""
        if self._ring is None:
            return self.pick(avoid)
        live = [a for a in self._ring.walk(key) if self._health[a] is not Health.DOWN]
        if not live:
            raise Unavailable(f"no live {self.stage} instance (all {len(self._stubs)} are down or unreachable)")
        candidates = [a for a in live if a not in avoid] or live
        candidates = [a for a in candidates if self._health[a] is Health.SERVING] or candidates
        bound = math.ceil(_LOAD_BOUND * (sum(self._in_flight[a] for a in candidates) + 1) / len(candidates))
        return next(a for a in candidates if self._in_flight[a] < bound)

    def stub(self, address: str):
        return self._stubs[address]

    @contextlib.contextmanager
    def busy(self, address: str):
        """Counts a call against an instance while it runs."""
        self._in_flight[address] += 1
        try:
            yield self._stubs[address]
        finally:
            self._in_flight[address] -= 1

    def eject(self, address: str, reason: str) -> None:
        """Takes an instance whose call failed out of the rotation until a health check passes.

        The check runs at once: an instance that is fine (the failure was a peer's, say the
        encoder that prefill read from) is back within a round trip; a dead one stays out until
        its health watch reconnects to a restarted process.
        """
        if self._health[address] is not Health.DOWN:
            logger.warning("%s %s ejected: %s", self.stage, address, reason)
            telemetry.STAGE_EJECTIONS.labels(stage=self.stage).inc()
        self._set_health(address, Health.DOWN)
        self._spawn(self._check(address))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        stub = health_pb2_grpc.HealthStub(self._channels[address])
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=self._health_service), timeout=_CHECK_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return  # still down; the watch brings it back when it returns
        self._set_health(address, _health_of(response))

    def _set_health(self, address: str, state: Health) -> None:
        was_available = self.available
        if self._health[address] is not state and state is Health.SERVING and self._health[address] is Health.DOWN:
            logger.info("%s %s is serving again", self.stage, address)
        self._health[address] = state
        telemetry.STAGE_INSTANCE_UP.labels(stage=self.stage, address=address).set(state is not Health.DOWN)
        if self.available != was_available and self._on_availability_change is not None:
            self._on_availability_change()


def _health_of(response: health_pb2.HealthCheckResponse) -> Health:
    return Health.SERVING if response.status == health_pb2.HealthCheckResponse.SERVING else Health.DOWN

"""Tests for epd.transport over real NIXL: a producer arena in a child process, a fetcher here."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import socket
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from epd.transport import (
    ArenaFullError,
    EmbeddingArena,
    EmbeddingFetcher,
    NixlRegion,
    TransferError,
)

pytestmark = pytest.mark.timeout(60)

SLOT_BYTES = 64 * 1024
NUM_SLOTS = 64
FETCH_BUFFER_BYTES = 2 * 1024 * 1024


def make_tensor(seed: int, shape: tuple[int, ...], dtype: str = "float32") -> torch.Tensor:
    """Deterministic contents, so both processes know what the bytes must be."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(getattr(torch, dtype))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def reap_until_idle(arena: EmbeddingArena, timeout_s: float = 5.0) -> int:
    """Reaps until no lease is live (or the timeout passes); returns how many were freed."""
    freed = 0
    deadline = time.monotonic() + timeout_s
    while True:
        freed += arena.reap()
        if arena.leased_count == 0 or time.monotonic() > deadline:
            return freed
        time.sleep(0.005)


# --- The producer process ------------------------------------------------------------------

_COMMANDS: dict[str, Callable[..., Any]] = {
    "publish": lambda arena, seed, shape, dtype: arena.publish(make_tensor(seed, shape, dtype)),
    "reap_until_idle": lambda arena: (reap_until_idle(arena), arena.leased_count, arena.free_slots),
    "release": lambda arena, lease_id: arena.release(lease_id),
}


def _producer_main(conn: Connection) -> None:
    arena = EmbeddingArena(
        agent_name="test-producer", slot_bytes=SLOT_BYTES, num_slots=NUM_SLOTS, lease_ttl_s=30.0
    )
    conn.send(arena.agent_address)
    try:
        while True:
            try:
                command, args = conn.recv()
            except EOFError:  # the test process went away
                return
            if command == "close":
                return
            try:
                conn.send(("ok", _COMMANDS[command](arena, *args)))
            except Exception as exc:
                conn.send(("error", repr(exc)))
    finally:
        arena.close()


class Producer:
    """Drives the arena in the child process."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def _call(self, command: str, *args: Any) -> Any:
        self._conn.send((command, args))
        if not self._conn.poll(20):
            raise TimeoutError(f"producer did not answer {command!r}")
        status, value = self._conn.recv()
        if status != "ok":
            raise AssertionError(f"producer {command!r} failed: {value}")
        return value

    def publish(self, seed: int, shape: tuple[int, ...], dtype: str = "float32") -> NixlRegion:
        region: NixlRegion = self._call("publish", seed, shape, dtype)
        return region

    def reap_until_idle(self) -> tuple[int, int, int]:
        """Returns (leases freed, live leases, free slots)."""
        result: tuple[int, int, int] = self._call("reap_until_idle")
        return result

    def release(self, lease_id: str) -> None:
        self._call("release", lease_id)


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    process = context.Process(target=_producer_main, args=(child_conn,), daemon=True)
    process.start()
    try:
        assert parent_conn.poll(30), "producer process did not start"
        parent_conn.recv()  # the arena is up once it reports its address
        yield Producer(parent_conn)
        parent_conn.send(("close", ()))
        process.join(10)
    finally:
        if process.is_alive():
            process.kill()


@pytest.fixture(scope="module")
def fetcher() -> Iterator[EmbeddingFetcher]:
    fetcher = EmbeddingFetcher(agent_name="test-consumer", buffer_bytes=FETCH_BUFFER_BYTES)
    yield fetcher
    fetcher.close()


# --- Two processes -------------------------------------------------------------------------


async def test_batch_fetch_reads_exact_bytes_and_frees_leases(
    producer: Producer, fetcher: EmbeddingFetcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = [
        (1, (1, 8), "float32"),
        (2, (37, 64), "bfloat16"),
        (3, (300, 1024), "float32"),  # 1.2 MB: a run of 19 slots
    ]
    regions = [producer.publish(*item) for item in items]
    posted_reads: list[tuple[Any, ...]] = []
    post_read = fetcher._agent.post_read  # type: ignore[union-attr]

    def counting_post_read(*args: Any) -> int:
        posted_reads.append(args)
        return post_read(*args)

    monkeypatch.setattr(fetcher._agent, "post_read", counting_post_read)

    fetched = await fetcher.fetch(regions)

    assert len(fetched) == len(items)
    for data, region, item in zip(fetched, regions, items, strict=True):
        expected = as_bytes(make_tensor(*item))
        assert region.nbytes == expected.numel()
        assert torch.equal(data, expected)
    assert len(posted_reads) == 1, "regions of one producer must go in one READ"
    notification = posted_reads[0][3]
    assert notification.decode().split(",") == [region.lease_id for region in regions]
    assert producer.reap_until_idle() == (3, 0, NUM_SLOTS)


async def test_freed_slot_is_reused_and_read_fresh(
    producer: Producer, fetcher: EmbeddingFetcher
) -> None:
    first = producer.publish(10, (16, 256))
    assert torch.equal((await fetcher.fetch([first]))[0], as_bytes(make_tensor(10, (16, 256))))
    assert producer.reap_until_idle()[1:] == (0, NUM_SLOTS)

    second = producer.publish(11, (16, 256))

    assert second.descriptors == first.descriptors, "expected the same slots to be reused"
    assert second.lease_id != first.lease_id
    assert torch.equal((await fetcher.fetch([second]))[0], as_bytes(make_tensor(11, (16, 256))))
    assert producer.reap_until_idle()[1:] == (0, NUM_SLOTS)


async def test_expired_region_raises_and_fetcher_stays_usable(
    producer: Producer, fetcher: EmbeddingFetcher
) -> None:
    region = producer.publish(20, (4, 64))
    expired = dataclasses.replace(region, expires_at_unix_ms=time.time_ns() // 1_000_000 - 1)

    with pytest.raises(TransferError, match="expired"):
        await fetcher.fetch([expired])

    assert torch.equal((await fetcher.fetch([region]))[0], as_bytes(make_tensor(20, (4, 64))))
    assert producer.reap_until_idle()[1:] == (0, NUM_SLOTS)


async def test_concurrent_fetches_wait_for_buffer_space(
    producer: Producer, fetcher: EmbeddingFetcher
) -> None:
    # Each item is 800 KiB, so the 2 MiB receive buffer holds only two at a time.
    seeds = [30, 31, 32, 33]
    regions = [producer.publish(seed, (200, 1024)) for seed in seeds]

    results = await asyncio.gather(*(fetcher.fetch([region]) for region in regions))

    for (data,), seed in zip(results, seeds, strict=True):
        assert torch.equal(data, as_bytes(make_tensor(seed, (200, 1024))))
    assert producer.reap_until_idle() == (4, 0, NUM_SLOTS)


async def test_fetch_larger_than_buffer_raises_value_error(
    producer: Producer, fetcher: EmbeddingFetcher
) -> None:
    region = producer.publish(40, (300, 1024))  # 1.2 MB; twice that exceeds the buffer

    with pytest.raises(ValueError, match="exceed"):
        await fetcher.fetch([region, region])

    producer.release(region.lease_id)
    assert producer.reap_until_idle()[1:] == (0, NUM_SLOTS)


async def test_unreachable_producer_raises_transfer_error(producer: Producer) -> None:
    region = producer.publish(50, (4, 64))
    producer.release(region.lease_id)
    with socket.socket() as probe:  # a port nothing listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    ghost = dataclasses.replace(region, agent_name="ghost", agent_address=f"127.0.0.1:{dead_port}")
    short_fetcher = EmbeddingFetcher(
        agent_name="test-impatient", buffer_bytes=1 << 20, timeout_s=1.0
    )
    try:
        with pytest.raises(TransferError, match="ghost"):
            await short_fetcher.fetch([ghost])
    finally:
        short_fetcher.close()


# --- Arena bookkeeping (one process) ------------------------------------------------------


@pytest.fixture
def small_arena() -> Iterator[EmbeddingArena]:
    arena = EmbeddingArena(agent_name="test-small", slot_bytes=1024, num_slots=4, lease_ttl_s=30.0)
    yield arena
    arena.close()


def test_unconsumed_lease_expires() -> None:
    arena = EmbeddingArena(agent_name="test-ttl", slot_bytes=1024, num_slots=4, lease_ttl_s=0.2)
    try:
        region = arena.publish(torch.zeros(300))  # 1200 bytes: two slots
        assert region.expires_at_unix_ms <= time.time_ns() // 1_000_000 + 200
        assert arena.reap() == 0
        assert (arena.leased_count, arena.free_slots) == (1, 2)

        time.sleep(0.25)

        assert arena.reap() == 1
        assert (arena.leased_count, arena.free_slots) == (0, 4)
    finally:
        arena.close()


def test_full_arena_raises_until_slots_are_freed(small_arena: EmbeddingArena) -> None:
    held = small_arena.publish(torch.zeros(768))  # 3072 bytes: three of four slots

    with pytest.raises(ArenaFullError) as excinfo:
        small_arena.publish(torch.zeros(512))  # needs two slots
    assert 0 <= excinfo.value.retry_after_s <= 1.0

    small_arena.release(held.lease_id)
    small_arena.publish(torch.zeros(512))
    assert (small_arena.leased_count, small_arena.free_slots) == (1, 2)


def test_runs_of_slots_must_be_contiguous(small_arena: EmbeddingArena) -> None:
    leases = [small_arena.publish(torch.zeros(256)).lease_id for _ in range(4)]
    small_arena.release(leases[1])
    small_arena.release(leases[3])

    with pytest.raises(ArenaFullError):  # two free slots, but not adjacent
        small_arena.publish(torch.zeros(512))

    small_arena.release(leases[2])
    small_arena.publish(torch.zeros(512))


def test_tensor_that_can_never_fit_raises_value_error(small_arena: EmbeddingArena) -> None:
    with pytest.raises(ValueError):
        small_arena.publish(torch.zeros(4 * 1024 + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        small_arena.publish(torch.zeros(0))
    assert small_arena.free_slots == 4


def test_unknown_lease_release_is_a_no_op(small_arena: EmbeddingArena) -> None:
    small_arena.release("no-such-lease")
    assert (small_arena.leased_count, small_arena.free_slots) == (0, 4)


async def test_expired_lease_is_refused_then_reaped() -> None:
    arena = EmbeddingArena(
        agent_name="test-expiring", slot_bytes=1024, num_slots=4, lease_ttl_s=0.2
    )
    fetcher = EmbeddingFetcher(agent_name="test-late", buffer_bytes=1 << 16, expiry_margin_s=0.0)
    try:
        region = arena.publish(torch.ones(16))
        await asyncio.sleep(0.25)

        with pytest.raises(TransferError, match="expired"):
            await fetcher.fetch([region])

        assert arena.reap() == 1
        assert arena.free_slots == 4
    finally:
        fetcher.close()
        arena.close()

"""The embedding transport over real NIXL: a producer's arena in a child process, a reader here.

The producer process does what an encoder engine's connector does (lease a slot, write the slot
header and rows into the shared arena, publish the location); this process reads like a
consumer engine's connector. The consumer-side scheduling (pages, header checks, refusing what
it cannot load) is tested with the real reader, on plain request records.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from epd.domain import InlineEmbedding, NixlLocation
from epd.transport.arena import EmbeddingArena, SharedCounters
from epd.transport.ec_config import ConnectorConfig
from epd.transport.ec_consumer import ConsumerScheduler
from epd.transport.ec_params import ExpectedItem, expected_to_params
from epd.transport.nixl import LeaseReleaser, NixlReader, Read
from epd.transport.shared_buffer import SharedBuffer
from epd.transport.slot_header import HEADER_BYTES, SlotHeader, SlotStatus
from tests.transport_producer import make_rows, producer_main

pytestmark = pytest.mark.timeout(90)


@dataclasses.dataclass
class Producer:
    process: multiprocessing.Process
    conn: Connection
    address: str

    def __call__(self, command: str, *args: Any) -> Any:
        self.conn.send((command, args))
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value


def _start_producer(agent_name: str | None = None, ttl_s: float = 30.0) -> Producer:
    parent, child = multiprocessing.get_context("spawn").Pipe()
    agent_name = agent_name or f"test-producer-{uuid.uuid4().hex[:6]}"
    process = multiprocessing.get_context("spawn").Process(target=producer_main, args=(child, agent_name, ttl_s), daemon=True)
    process.start()
    return Producer(process, parent, parent.recv())


def _stop(producer: Producer) -> None:
    producer.conn.send(("close", ()))
    producer.process.join(10)


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    producer = _start_producer()
    yield producer
    _stop(producer)


@pytest.fixture(scope="module")
def releaser() -> Iterator[LeaseReleaser]:
    releaser = LeaseReleaser(f"test-releaser-{uuid.uuid4().hex[:6]}")
    yield releaser
    releaser.close()


@pytest.fixture
def receive_buffer() -> Iterator[SharedBuffer]:
    buffer = SharedBuffer.create(f"test-receive-{uuid.uuid4().hex[:8]}", 4 * 1024 * 1024)
    yield buffer
    buffer.close()


@pytest.fixture
def reader(receive_buffer: SharedBuffer) -> Iterator[NixlReader]:
    reader = NixlReader(receive_buffer.tensor, agent_name=f"test-reader-{uuid.uuid4().hex[:8]}", timeout_s=3.0)
    yield reader
    reader.close()


def _drain(reader: NixlReader, count: int, timeout_s: float = 10.0) -> dict:
    finished: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < count and time.monotonic() < deadline:
        finished.update(reader.poll())
        time.sleep(0.001)
    assert len(finished) == count, f"only {len(finished)} of {count} reads ended"
    return finished


def _rows_at(buffer: SharedBuffer, offset: int, rows: int, width: int, dtype: str) -> torch.Tensor:
    nbytes = rows * width * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return buffer.tensor[offset + HEADER_BYTES : offset + HEADER_BYTES + nbytes].view(getattr(torch, dtype)).view(rows, width)


# --- The reader against the producer -------------------------------------------------------


def test_one_batched_read_brings_exact_rows_and_headers_and_ends_the_leases(producer, reader, receive_buffer):
    shapes = [(11, 3, 128, "float32"), (12, 70, 256, "bfloat16"), (13, 1, 64, "float16")]
    locations = [producer("publish", *shape) for shape in shapes]
    offsets, next_offset = [], SharedCounters.BYTES
    for location in locations:
        offsets.append(next_offset)
        next_offset += -(-location.nbytes // 4096) * 4096
    reader.submit([Read(i, location, offset) for i, (location, offset) in enumerate(zip(locations, offsets, strict=True))])
    assert _drain(reader, 3) == {0: None, 1: None, 2: None}
    for (seed, rows, width, dtype), location, offset in zip(shapes, locations, offsets, strict=True):
        header = SlotHeader.unpack_from(receive_buffer.tensor, offset)
        assert (header.status, header.generation, header.rows, header.width, header.dtype) == (SlotStatus.READY, int(location.lease_id, 16), rows, width, dtype)
        assert torch.equal(_rows_at(receive_buffer, offset, rows, width, dtype), make_rows(seed, rows, width, dtype))
    # The READ's notification carried all three lease ids back.
    assert producer("reap_until_idle") == 0


def test_a_reused_slot_reads_back_another_generation(producer, reader, receive_buffer, releaser):
    """Reading a handle whose lease ended and whose slot was reused returns the new item's
    header, which the consumer sees is not the promised one."""
    stale = producer("publish", 21, 4, 128, "float32")
    fresh = producer("overwrite", stale, 22, 4, 128, "float32")
    assert fresh.descriptors == stale.descriptors and fresh.lease_id != stale.lease_id
    reader.submit([Read("stale", stale, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"stale": None}
    header = SlotHeader.unpack_from(receive_buffer.tensor, SharedCounters.BYTES)
    assert header.generation == int(fresh.lease_id, 16) != int(stale.lease_id, 16)
    releaser.release(fresh.agent_name, fresh.agent_address, [fresh.lease_id])
    assert producer("reap_until_idle") == 0


def test_expiring_lease_is_refused_without_a_read(producer, reader, releaser):
    location = producer("publish", 31, 2, 64, "float32")
    expired = dataclasses.replace(location, expires_at_unix_ms=int(time.time() * 1000))
    reader.submit([Read("old", expired, SharedCounters.BYTES)])
    (error,) = _drain(reader, 1).values()
    assert "expire" in error
    # Nothing was read, so the lease is still live until its owner ends it.
    assert producer("leases") == 1
    releaser.release(location.agent_name, location.agent_address, [location.lease_id])
    assert producer("reap_until_idle") == 0


def test_unreachable_producer_fails_its_reads_and_the_reader_stays_usable(producer, reader):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    ghost = NixlLocation("ghost-agent", f"127.0.0.1:{dead_port}", b"\x01" + b"\x00" * 20, 100, "00" * 8, int(time.time() * 1000) + 60_000)
    reader.submit([Read("ghost", ghost, SharedCounters.BYTES)])
    started = time.monotonic()
    (error,) = _drain(reader, 1).values()
    assert error and time.monotonic() - started < 6
    location = producer("publish", 41, 2, 64, "float32")
    reader.submit([Read("real", location, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"real": None}
    assert producer("reap_until_idle") == 0


def test_a_restarted_producer_is_reached_at_its_new_address(reader, receive_buffer):
    name = f"test-restarting-{uuid.uuid4().hex[:6]}"
    first = _start_producer(name)
    try:
        location = first("publish", 51, 2, 64, "float32")
        reader.submit([Read("a", location, SharedCounters.BYTES)])
        assert _drain(reader, 1) == {"a": None}
    finally:
        _stop(first)
    second = _start_producer(name)
    try:
        # The same agent name at another port: the reader must drop the old metadata.
        moved = second("publish", 52, 2, 64, "float32")
        assert moved.agent_address != location.agent_address
        reader.submit([Read("b", moved, SharedCounters.BYTES)])
        assert _drain(reader, 1) == {"b": None}
        assert torch.equal(_rows_at(receive_buffer, SharedCounters.BYTES, 2, 64, "float32"), make_rows(52, 2, 64))
    finally:
        _stop(second)


# --- The consumer's scheduling, with the real reader ---------------------------------------


@dataclasses.dataclass
class _Position:
    embeds: int

    def get_num_embeds(self) -> int:
        return self.embeds


@dataclasses.dataclass
class _Feature:
    identifier: str
    mm_position: _Position


@dataclasses.dataclass
class _Request:
    """The fields of vLLM's Request the consumer reads."""

    request_id: str
    mm_features: list[_Feature]
    ec_transfer_params: Any


@dataclasses.dataclass
class _SchedulerOutput:
    free_encoder_mm_hashes: list[str] = dataclasses.field(default_factory=list)


@pytest.fixture
def consumer() -> Iterator[ConsumerScheduler]:
    consumer = ConsumerScheduler(ConnectorConfig(engine_id=f"test-{uuid.uuid4().hex[:8]}", buffer_bytes=SharedCounters.BYTES + 1024 * 1024, read_timeout_s=3.0))
    yield consumer
    consumer.close()


def _wait_available(consumer: ConsumerScheduler, request: _Request, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if consumer.ensure_cache_available(request):
            return True
        if request.request_id in consumer.take_unavailable_requests():
            return False
        time.sleep(0.002)
    raise AssertionError("the request neither became available nor failed")


def test_consumer_loads_installs_and_frees_once_nothing_refers_to_the_item(producer, consumer):
    location = producer("publish", 61, 5, 128, "float32")
    params = expected_to_params({"h1": ExpectedItem(5, 128, "float32", location)})
    request = _Request("r1", [_Feature("h1", _Position(5))], params)
    assert _wait_available(consumer, request)
    assert consumer.has_cache_item("h1")
    consumer.update_state_after_alloc(request, 0)
    (install,) = consumer.build_installs(_SchedulerOutput())
    assert (install.mm_hash, install.rows, install.width) == ("h1", 5, 128)
    consumer.request_finished(request)
    assert consumer.counters.get("items") == 1  # vLLM's encoder cache still holds it
    consumer.build_installs(_SchedulerOutput(free_encoder_mm_hashes=["h1"]))
    assert consumer.counters.get("items") == 0 and not consumer.has_cache_item("h1")
    consumer.build_installs(_SchedulerOutput())  # pages come back one step later
    assert consumer.counters.get("free_pages") == consumer.counters.get("num_pages")


def test_consumer_refuses_a_slot_that_no_longer_holds_the_promised_item(producer, consumer, releaser):
    stale = producer("publish", 71, 4, 128, "float32")
    fresh = producer("overwrite", stale, 72, 4, 128, "float32")
    request = _Request("r2", [_Feature("h2", _Position(4))], expected_to_params({"h2": ExpectedItem(4, 128, "float32", stale)}))
    assert not _wait_available(consumer, request)
    consumer.request_finished(request)
    assert consumer.counters.get("failed_loads") == 1
    releaser.release(fresh.agent_name, fresh.agent_address, [fresh.lease_id])
    assert producer("reap_until_idle") == 0


@pytest.mark.parametrize(
    "params",
    [None, {"h3": {"epd": {"version": 99}}}, {"other": "x"}],
    ids=["no_params", "unknown_version", "no_entry_for_the_item"],
)
def test_consumer_refuses_requests_without_a_usable_handle(consumer, params):
    request = _Request("r3", [_Feature("h3", _Position(2))], params)
    assert not consumer.ensure_cache_available(request)
    assert consumer.take_unavailable_requests() == {"r3"}


def test_consumer_refuses_a_handle_whose_rows_disagree_with_the_layout(consumer):
    request = _Request("r4", [_Feature("h4", _Position(6))], expected_to_params({"h4": ExpectedItem(5, 16, "float32", InlineEmbedding(b"\0" * 320))}))
    assert not consumer.ensure_cache_available(request)
    assert consumer.take_unavailable_requests() == {"r4"}


def test_inline_embeddings_are_copied_in_without_nixl(consumer):
    rows = make_rows(81, 3, 16)
    request = _Request("r5", [_Feature("h5", _Position(3))], expected_to_params({"h5": ExpectedItem(3, 16, "float32", InlineEmbedding(rows.numpy().tobytes()))}))
    assert consumer.ensure_cache_available(request)
    consumer.update_state_after_alloc(request, 0)
    (install,) = consumer.build_installs(_SchedulerOutput())
    view = SharedBuffer.attach(f"{consumer._config.engine_id}-receive").tensor
    assert torch.equal(view[install.offset : install.offset + rows.numel() * 4].view(torch.float32).view(3, 16), rows)
    assert [type(r).__name__ for r in consumer._readers.values()] == ["InlineReader"]  # no NIXL agent was needed


# --- The arena alone -----------------------------------------------------------------------


@pytest.fixture
def small_arena() -> EmbeddingArena:
    return EmbeddingArena(torch.zeros(SharedCounters.BYTES + 4 * 1024, dtype=torch.uint8), slot_bytes=1024, lease_ttl_s=0.2)


def test_full_arena_gives_no_lease_until_one_ends(small_arena):
    leases = [small_arena.reserve(1024) for _ in range(4)]
    assert all(leases) and small_arena.reserve(1) is None
    assert small_arena.release(leases[0].lease_id) and small_arena.reserve(1) is not None
    assert not small_arena.release(leases[0].lease_id)  # already ended: a no-op


def test_runs_are_contiguous_and_never_fitting_is_an_error(small_arena):
    a, b, c, _ = (small_arena.reserve(1024) for _ in range(4))
    small_arena.release(a.lease_id)
    small_arena.release(c.lease_id)
    assert small_arena.reserve(2048) is None  # two free slots, but not adjacent
    small_arena.release(b.lease_id)
    assert small_arena.reserve(2048).offset == SharedCounters.BYTES
    with pytest.raises(ValueError):
        small_arena.reserve(5 * 1024)


def test_pinned_leases_never_expire_published_ones_do(small_arena):
    pinned = small_arena.reserve(10)
    published = small_arena.reserve(10)
    expires_at = small_arena.start_expiry(published.lease_id)
    assert expires_at > time.time()
    time.sleep(0.3)
    assert small_arena.expire() == 1
    assert small_arena.leased_count == 1 and small_arena.release(pinned.lease_id)
    assert small_arena.counters.get("leases") == 0

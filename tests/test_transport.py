"""The embedding transport over real NIXL: a producer's arena in a child process, a reader here.

The producer process does what an encoder engine's connector does (lease a slot, write the slot
header and rows into the shared arena, publish the location); this process reads like a
consumer engine's connector. The consumer-side scheduling (pages, header checks, refusing what
it cannot load) is tested with the real reader, on plain request records.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hmac
import multiprocessing
import os
import socket
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import grpc
import psutil
import pytest
import torch
from google.protobuf import timestamp_pb2
from nixl import _bindings as nixlb

from devkit.vllm_requests import Feature, Position, Request, SchedulerOutput
from epd import wire
from epd.domain import InlineEmbedding, NixlLocation
from epd.errors import InvalidArgument
from epd.ports import free_port
from epd.transport.connector.ec_config import ConnectorConfig
from epd.transport.connector.ec_consumer import ConsumerScheduler
from epd.transport.connector.ec_params import ExpectedItem, expected_to_params
from epd.transport.desk import ConnectorDeskClient, LeaseHeld, is_engine_id_of, open_desk
from epd.transport.memory.arena import EmbeddingArena, SharedCounters
from epd.transport.memory.claims import ClaimLedger
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import HEADER_BYTES, SlotHeader, SlotStatus
from epd.transport.wire.credentials import TransferCredentials
from epd.transport.wire.errors import TransferError
from epd.transport.wire.location import LocationSigner, decode_descriptors, encode_descriptors
from epd.transport.wire.nixl import LeaseReleaser, NixlReader, Read
from epd.v1 import encoder_pb2_grpc, multimodal_pb2
from tests.transport_producer import ARENA_BYTES, SLOT_BYTES, make_rows, producer_main

pytestmark = pytest.mark.timeout(90)


@dataclasses.dataclass
class Producer:
    process: multiprocessing.Process
    conn: Connection
    address: str  # of its gRPC server (GetTransferMetadata), as an encoder's

    def __call__(self, command: str, *args: Any) -> Any:
        self.conn.send((command, args))
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value


def _start_producer(agent_name: str | None = None, ttl_s: float = 30.0, grpc_port: int = 0) -> Producer:
    parent, child = multiprocessing.get_context("spawn").Pipe()
    agent_name = agent_name or f"test-producer-{uuid.uuid4().hex[:6]}"
    process = multiprocessing.get_context("spawn").Process(target=producer_main, args=(child, agent_name, ttl_s, grpc_port), daemon=True)
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
def releaser(producer) -> Iterator[LeaseReleaser]:
    """What the encoder service runs for ReleaseEmbeddings, with the credentials it reads from
    shared memory beside its engine."""
    releaser = LeaseReleaser(f"test-releaser-{uuid.uuid4().hex[:6]}", producer("credentials"), bind_host="127.0.0.1")
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
        assert (header.status, header.generation, header.rows, header.width, header.dtype) == (SlotStatus.READY, location.slot_generation, rows, width, dtype)
        assert torch.equal(_rows_at(receive_buffer, offset, rows, width, dtype), make_rows(seed, rows, width, dtype))
    # The READ's notification carried all three lease ids back.
    assert producer("reap_until_idle") == 0


def test_a_reused_slot_reads_back_another_generation(producer, reader, receive_buffer, releaser):
    """Reading a handle whose lease ended and whose slot was reused returns the new item's
    header, which the consumer sees is not the promised one (see the consumer's test below)."""
    stale = producer("publish", 21, 4, 128, "float32")
    fresh = producer("overwrite", stale, 22, 4, 128, "float32")
    assert fresh.descriptors == stale.descriptors and fresh.lease_id != stale.lease_id
    reader.submit([Read("stale", stale, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"stale": None}
    header = SlotHeader.unpack_from(receive_buffer.tensor, SharedCounters.BYTES)
    assert header.generation == fresh.slot_generation != stale.slot_generation
    releaser.release([fresh.lease_id])
    assert producer("reap_until_idle") == 0


def test_expiring_lease_is_refused_without_a_read(producer, reader, releaser):
    location = producer("publish", 31, 2, 64, "float32")
    # Re-tagged, as only the producer could: the expiry check itself is what is under test.
    signer = LocationSigner(producer("credentials").location_key)
    expires = int(time.time() * 1000)
    expired = dataclasses.replace(location, expires_at_unix_ms=expires)
    expired = dataclasses.replace(expired, tag=signer.tag(expired))
    reader.submit([Read("old", expired, SharedCounters.BYTES)])
    (error,) = _drain(reader, 1).values()
    assert "expire" in error
    # Nothing was read, so the lease is still live until its owner ends it.
    assert producer("leases") == 1
    releaser.release([location.lease_id])
    assert producer("reap_until_idle") == 0


def _moved(location: NixlLocation, *, by: int = 0, grown_by: int = 0) -> NixlLocation:
    """The location with its range moved or grown, and everything else (its tag) kept."""
    ((address, length, device),) = decode_descriptors(location.descriptors)
    return dataclasses.replace(location, descriptors=encode_descriptors([(address + by, length + grown_by, device)]), nbytes=length + grown_by)


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda own, other: _moved(own, by=-SLOT_BYTES), id="address_moved_back_one_slot"),
        pytest.param(lambda own, other: dataclasses.replace(own, descriptors=other.descriptors), id="another_leases_rows"),
        pytest.param(lambda own, other: dataclasses.replace(own, lease_id=other.lease_id), id="another_leases_id"),
        pytest.param(lambda own, other: _moved(own, grown_by=SLOT_BYTES), id="grown_past_its_slot"),
        pytest.param(lambda own, other: dataclasses.replace(other, tag=own.tag), id="another_location_with_own_tag"),
    ],
)
def test_a_location_altered_in_any_field_is_refused_before_any_read(producer, reader, receive_buffer, forge):
    """The field finding: a Prefill whose descriptor address was moved back one slot read
    another request's image. Every location is bound to its lease by the encoder's tag."""
    other = producer("publish", 91, 4, 128, "float32")  # another request's item, one slot before
    own = producer("publish", 92, 4, 128, "float32")
    assert decode_descriptors(own.descriptors)[0][0] - decode_descriptors(other.descriptors)[0][0] == SLOT_BYTES
    receive_buffer.tensor.fill_(0xAB)
    reader.submit([Read("forged", forge(own, other), SharedCounters.BYTES)])
    (error,) = _drain(reader, 1).values()
    assert "does not verify" in error and "nothing was read" in error
    assert "embedding.nixl.location_tag" in error
    assert bool((receive_buffer.tensor == 0xAB).all())  # not one byte landed
    assert producer("leases") == 2  # no notification went out: both leases are live
    # The genuine location still reads: the refusal cost the producer's cache nothing.
    reader.submit([Read("own", own, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"own": None}
    assert torch.equal(_rows_at(receive_buffer, SharedCounters.BYTES, 4, 128, "float32"), make_rows(92, 4, 128))
    reader.release(other)
    reader.poll()
    assert producer("reap_until_idle") == 0


def test_a_consumed_handle_replayed_is_refused_without_a_read(producer, reader, receive_buffer):
    """A handle's READ ends its lease, but a fill the encoder keeps as its cache would still
    answer it until it expires: the reader refuses a lease it has read once."""
    location = producer("publish", 35, 2, 64, "float32")
    reader.submit([Read("first", location, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"first": None}
    receive_buffer.tensor.fill_(0xAB)
    reader.submit([Read("replay", location, SharedCounters.BYTES)])
    (error,) = _drain(reader, 1).values()
    assert "was read here already" in error, error
    assert bool((receive_buffer.tensor == 0xAB).all())
    assert producer("reap_until_idle") == 0


def test_a_forged_lease_id_frees_nothing(producer, reader, releaser):
    """Lease ids are 128 random bits; ending a lease takes its exact id, through either path."""
    victim = producer("publish", 93, 2, 64, "float32")
    assert len(victim.lease_id) == 32
    near = victim.lease_id[:-1] + ("0" if victim.lease_id[-1] != "0" else "1")
    # Through ReleaseEmbeddings (the encoder's releaser): ids of no lease, malformed ones.
    assert releaser.release([near, uuid.uuid4().hex, "not-a-lease", victim.lease_id[:16]]) == 2
    # Through a consumer's release of a location whose lease id was swapped: that id names no lease.
    reader.release(dataclasses.replace(victim, lease_id=near))
    reader.poll()
    time.sleep(0.3)
    assert producer("reap_until_idle", 0.3) == 1  # the victim's lease is still live
    releaser.release([victim.lease_id])
    assert producer("reap_until_idle") == 0


def test_a_foreign_agent_cannot_get_the_metadata_or_read_the_arena(producer, reader):
    """NIXL authenticates nothing, so the producer must not hand its metadata to anyone who asks:
    it opens no NIXL listener, and its UCX endpoints listen on the service's host only."""
    location = producer("publish", 94, 2, 64, "float32")
    listening = [c.laddr for c in psutil.Process(producer.process.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip.removeprefix("::ffff:") == "127.0.0.1" for addr in listening), listening  # never 0.0.0.0
    foreign, _ = _listening_agent(f"test-foreign-{uuid.uuid4().hex[:6]}")
    # The way in that NIXL offers works against an agent with a listener (what encoders ran):
    exposed_name = f"test-exposed-{uuid.uuid4().hex[:6]}"
    _exposed, exposed_port = _listening_agent(exposed_name)
    foreign.fetchRemoteMD(exposed_name, "127.0.0.1", exposed_port, "")
    assert _has_metadata(foreign, exposed_name)
    # ... and gets nothing from the producer, on any port it listens on or NIXL's default one.
    for port in {addr.port for addr in listening} | {nixlb.nixlAgentConfig().listenPort}:
        foreign.fetchRemoteMD(location.agent_name, "127.0.0.1", port, "")
    assert not _has_metadata(foreign, location.agent_name)
    target = torch.zeros(location.nbytes, dtype=torch.uint8)
    foreign.registerMem(nixlb.nixlRegDList(nixlb.DRAM_SEG, [(target.data_ptr(), target.numel(), 0, "")]), [])
    with pytest.raises(Exception, match="NIXL_ERR"):
        foreign.createXferReq(
            nixlb.NIXL_READ,
            nixlb.nixlXferDList(nixlb.DRAM_SEG, [(target.data_ptr(), location.nbytes, 0)]),
            nixlb.nixlXferDList(nixlb.DRAM_SEG, decode_descriptors(location.descriptors)),
            location.agent_name,
            b"",
            [],
        )
    # A consumer that fetched the credentials over gRPC reads it.
    reader.submit([Read("item", location, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"item": None}
    assert producer("reap_until_idle") == 0


def _listening_agent(name: str) -> tuple[Any, int]:
    """A raw NIXL agent with NIXL's metadata listener on, as an attacker (or old EPD) runs one."""
    config = nixlb.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = True
    config.listenPort = free_port("127.0.0.1")
    config.lthrDelay = 10_000
    agent = nixlb.nixlAgent(name, config)
    agent.createBackend("UCX", {})
    return agent, config.listenPort


def _has_metadata(agent, peer: str, timeout_s: float = 1.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if agent.checkRemoteMD(peer, nixlb.nixlXferDList(nixlb.DRAM_SEG)) == nixlb.NIXL_SUCCESS:
            return True
        time.sleep(0.01)
    return False


def _silent_port() -> socket.socket:
    """A port that accepts TCP connections and never answers: a peer that hangs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def test_bad_encoder_addresses_fail_only_their_own_reads_and_stall_nobody(producer, reader):
    """The field finding: a Prefill naming the real encoder's agent at 127.0.0.1:1 dropped its
    cached metadata and stalled every prefill for 10 s behind a per-peer lock."""
    warm = producer("publish", 95, 2, 64, "float32")
    reader.submit([Read("warm", warm, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"warm": None}
    with _silent_port() as silent:
        good = producer("publish", 96, 2, 64, "float32")
        refused = dataclasses.replace(good, encoder_address="127.0.0.1:1")  # the real agent's name
        hanging = dataclasses.replace(good, encoder_address=f"127.0.0.1:{silent.getsockname()[1]}")
        malformed = dataclasses.replace(good, encoder_address="no-port")
        started = time.monotonic()
        reader.submit([Read("hanging", hanging, 0), Read("refused", refused, 0), Read("malformed", malformed, 0)])
        reader.submit([Read("good", good, SharedCounters.BYTES)])
        finished: dict = {}
        while "good" not in finished and time.monotonic() - started < 5:
            finished.update(reader.poll())
        assert finished.get("good", "missing") is None and time.monotonic() - started < 1.0
        assert "hanging" not in finished  # still waiting for its own encoder, alone
        finished.update(_drain(reader, 4 - len(finished), timeout_s=6.0))
    assert "UNAVAILABLE" in finished["refused"] and "127.0.0.1:1" in finished["refused"]
    assert "DEADLINE_EXCEEDED" in finished["hanging"]
    assert "encoder_address must be 'host:port'" in finished["malformed"]
    # The real encoder's cached credentials survived the forged addresses: another read needs
    # no new fetch (it would show up as a new gRPC call).
    again = producer("publish", 97, 2, 64, "float32")
    started = time.monotonic()
    reader.submit([Read("again", again, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"again": None} and time.monotonic() - started < 0.5
    assert producer("reap_until_idle") == 0


@dataclasses.dataclass
class _AgentCalls:
    """What a reader asked of its NIXL agent: prepared lists and READs of each kind."""

    prepared: list[tuple[str | None, int]] = dataclasses.field(default_factory=list)  # (peer, handle)
    released: list[int] = dataclasses.field(default_factory=list)
    prepared_reads: int = 0
    own_descriptor_reads: int = 0


def _record(reader: NixlReader, monkeypatch) -> _AgentCalls:
    calls, agent, real = _AgentCalls(), reader._agent, type(reader._agent)

    def prepare(peer, *args):
        handle = real.prepare(agent, peer, *args)
        calls.prepared.append((peer, handle))
        return handle

    def release_prepared(handle):
        calls.released.append(handle)
        real.release_prepared(agent, handle)

    def post_prepared_read(*args):
        calls.prepared_reads += 1
        return real.post_prepared_read(agent, *args)

    def post_read(*args):
        calls.own_descriptor_reads += 1
        return real.post_read(agent, *args)

    for name, method in [("prepare", prepare), ("release_prepared", release_prepared), ("post_prepared_read", post_prepared_read), ("post_read", post_read)]:
        monkeypatch.setattr(agent, name, method)
    return calls


class _ImpostorEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """A peer that answers GetTransferMetadata with the real encoder's metadata under a name of
    its own."""

    def __init__(self, credentials) -> None:
        self._credentials = dataclasses.replace(credentials, agent_name="impostor")

    def GetTransferMetadata(self, request, context):
        return self._credentials.to_wire()


def test_a_forged_peer_cannot_evict_the_real_encoders_agent(producer, reader, receive_buffer):
    """The field finding: a Prefill naming an address that serves the real encoder's metadata as
    another agent made the consumer drop the real agent (NIXL then failed the real encoder's
    READs with NIXL_ERR_NOT_FOUND, and the gateway retried them). The forged read fails; the
    real agent stays loaded, bound to the address it came from."""
    warm = producer("publish", 97, 2, 64, "float32")
    reader.submit([Read("warm", warm, SharedCounters.BYTES)])
    assert _drain(reader, 1) == {"warm": None}
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(_ImpostorEncoder(producer("credentials")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        good = producer("publish", 98, 2, 64, "float32")
        forged = dataclasses.replace(good, encoder_address=f"127.0.0.1:{port}", agent_name="impostor")
        reader.submit([Read("forged", forged, 0)])
        (error,) = _drain(reader, 1).values()
        assert "sent metadata of agent" in error and "as 'impostor'" in error, error
        reader.submit([Read("good", good, SharedCounters.BYTES)])
        assert _drain(reader, 1) == {"good": None}
        assert torch.equal(_rows_at(receive_buffer, SharedCounters.BYTES, 2, 64, "float32"), make_rows(98, 2, 64))
    finally:
        server.stop(None)
    assert producer("reap_until_idle") == 0


def test_the_producers_credentials_describe_its_arena(producer, releaser):
    credentials = producer("credentials")
    assert (credentials.arena_bytes, credentials.arena_unit_bytes) == (ARENA_BYTES - SharedCounters.BYTES, SLOT_BYTES)
    location = producer("publish", 41, 2, 64, "float32")
    ((address, _, _),) = decode_descriptors(location.descriptors)
    assert (address - credentials.arena_address) % SLOT_BYTES == 0 and 0 <= address - credentials.arena_address < credentials.arena_bytes
    # What the encoder service reads from shared memory carries them too.
    name = f"test-credentials-{uuid.uuid4().hex[:8]}"
    saved = credentials.save(name)
    try:
        assert TransferCredentials.load(name) == credentials
    finally:
        saved.close()
    releaser.release([location.lease_id])
    assert producer("reap_until_idle") == 0


def test_reads_select_pages_of_lists_prepared_once_and_exact_bytes_otherwise(producer, reader, receive_buffer, monkeypatch):
    calls = _record(reader, monkeypatch)
    receive_buffer.tensor.fill_(0xAB)
    shapes = [(43, 3, 128, "float32"), (44, 70, 256, "bfloat16")]
    locations = [producer("publish", *shape) for shape in shapes]
    offsets = [SharedCounters.BYTES, SharedCounters.BYTES + 4096]  # 1600 bytes, then 35904: one page, then nine
    reader.submit([Read(i, location, offset) for i, (location, offset) in enumerate(zip(locations, offsets, strict=True))])
    assert _drain(reader, 2) == {0: None, 1: None}
    later = producer("publish", 45, 2, 64, "float32")
    reader.submit([Read("later", later, 16 * 4096)])
    assert _drain(reader, 1) == {"later": None}
    # The arena was prepared once, when the producer's metadata was loaded; both READs (one
    # batched, one single) named pages of it and of the receive buffer.
    assert [peer for peer, _ in calls.prepared] == [later.agent_name]
    assert (calls.prepared_reads, calls.own_descriptor_reads) == (2, 0)
    for (seed, rows, width, dtype), offset in zip(shapes, offsets, strict=True):
        assert torch.equal(_rows_at(receive_buffer, offset, rows, width, dtype), make_rows(seed, rows, width, dtype))
    # Rounded up to whole pages, never past them: the page after the batch's is untouched.
    assert bool((receive_buffer.tensor[SharedCounters.BYTES + 10 * 4096 : 16 * 4096] == 0xAB).all())
    # A destination off a page boundary cannot take whole pages: that READ carries its own
    # descriptors and writes exactly the item's bytes.
    odd = producer("publish", 46, 2, 64, "float32")
    offset = 20 * 4096 + 64
    reader.submit([Read("odd", odd, offset)])
    assert _drain(reader, 1) == {"odd": None}
    assert (calls.prepared_reads, calls.own_descriptor_reads, len(calls.prepared)) == (2, 1, 1)
    assert torch.equal(_rows_at(receive_buffer, offset, 2, 64, "float32"), make_rows(46, 2, 64))
    assert bool((receive_buffer.tensor[offset + odd.nbytes : 22 * 4096] == 0xAB).all())
    assert bool((receive_buffer.tensor[20 * 4096 : offset] == 0xAB).all())
    assert producer("reap_until_idle") == 0
    assert calls.released == []  # the producer's metadata is still loaded


@pytest.mark.parametrize("same_agent_name", [False, True], ids=["new_agent_name", "same_agent_name"])
def test_a_restarted_producer_at_the_same_address_is_fetched_afresh(reader, receive_buffer, same_agent_name, monkeypatch):
    calls = _record(reader, monkeypatch)
    first = _start_producer(f"test-restarting-{uuid.uuid4().hex[:6]}")
    try:
        location = first("publish", 51, 2, 64, "float32")
        reader.submit([Read("a", location, SharedCounters.BYTES)])
        assert _drain(reader, 1) == {"a": None}
    finally:
        _stop(first)
    ((first_agent, first_arena),) = calls.prepared
    assert first_agent == location.agent_name and calls.released == []
    port = int(first.address.rpartition(":")[2])
    second = _start_producer(location.agent_name if same_agent_name else None, grpc_port=port)
    try:
        moved = second("publish", 52, 2, 64, "float32")
        assert moved.encoder_address == location.encoder_address
        # Its locations do not verify under the cached key: the reader fetches the new
        # credentials, drops the old agent's metadata and READs from the new process.
        reader.submit([Read("b", moved, SharedCounters.BYTES)])
        assert _drain(reader, 1) == {"b": None}
        assert torch.equal(_rows_at(receive_buffer, SharedCounters.BYTES, 2, 64, "float32"), make_rows(52, 2, 64))
        # The dead process's prepared arena was released with its metadata, and the new one's
        # prepared (NIXL refuses READs from a list prepared before a reload, even of one name).
        assert calls.released == [first_arena]
        assert [peer for peer, _ in calls.prepared] == [first_agent, moved.agent_name]
        assert (calls.prepared_reads, calls.own_descriptor_reads) == (2, 0)
        # A handle of the dead process is refused, not read from the new one's memory.
        reader.submit([Read("old", location, SharedCounters.BYTES)])
        (error,) = _drain(reader, 1).values()
        assert "does not verify" in error
        assert second("reap_until_idle") == 0
    finally:
        _stop(second)


def test_a_producer_whose_metadata_nixl_refused_is_loaded_afresh_for_the_next_read(producer, reader, receive_buffer, releaser, monkeypatch):
    """The field failure: a consumer whose UCX could not reach the encoder (a wrong network
    device) got NIXL_ERR_BACKEND loading its metadata. That read failed, but every later read
    from that encoder waited for a fetch that never came, until the client's deadline."""
    agent, real_load = reader._agent, type(reader._agent).load_peer
    refusals = []

    def load_peer_refused_once(metadata):
        if not refusals:  # what NIXL's loadRemoteMD answered there, raised as the agent raises it
            refusals.append(metadata)
            raise TransferError("NIXL refused a peer's metadata: nixlBackendError('NIXL_ERR_BACKEND')")
        return real_load(agent, metadata)

    monkeypatch.setattr(agent, "load_peer", load_peer_refused_once)
    refused = producer("publish", 61, 2, 64, "float32")
    reader.submit([Read("refused", refused, SharedCounters.BYTES)])
    assert "NIXL_ERR_BACKEND" in _drain(reader, 1)["refused"]
    served = producer("publish", 62, 2, 64, "float32")
    started = time.monotonic()
    reader.submit([Read("served", served, SharedCounters.BYTES)])
    assert _drain(reader, 1, timeout_s=5.0) == {"served": None} and time.monotonic() - started < 2.0
    assert torch.equal(_rows_at(receive_buffer, SharedCounters.BYTES, 2, 64, "float32"), make_rows(62, 2, 64))
    assert len(refusals) == 1
    releaser.release([refused.lease_id])  # never read: its owner ends it, as the gateway does
    assert producer("reap_until_idle") == 0


# --- The consumer's scheduling, with the real reader ---------------------------------------


@pytest.fixture
def consumer() -> Iterator[ConsumerScheduler]:
    consumer = ConsumerScheduler(ConnectorConfig(engine_id=f"test-{uuid.uuid4().hex[:8]}", buffer_bytes=SharedCounters.BYTES + 1024 * 1024, read_timeout_s=3.0))
    yield consumer
    consumer.close()


def _wait_available(consumer: ConsumerScheduler, request: Request, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if consumer.ensure_cache_available(request, 0):
            return True
        if request.request_id in consumer.take_unavailable_requests():
            return False
        time.sleep(0.002)
    raise AssertionError("the request neither became available nor failed")


def test_consumer_loads_installs_and_frees_once_nothing_refers_to_the_item(producer, consumer):
    location = producer("publish", 61, 5, 128, "float32", "h1")
    params = expected_to_params({"h1": ExpectedItem(5, 128, "float32", location)})
    request = Request("r1", [Feature("h1", Position(5))], params)
    assert _wait_available(consumer, request)
    assert consumer.has_cache_item("h1")
    consumer.update_state_after_alloc(request, 0)
    (install,) = consumer.build_installs(SchedulerOutput())
    assert (install.mm_hash, install.rows, install.width) == ("h1", 5, 128)
    consumer.request_finished(request)
    assert consumer.counters.get("items") == 1  # vLLM's encoder cache still holds it
    consumer.build_installs(SchedulerOutput(free_encoder_mm_hashes=["h1"]))
    assert consumer.counters.get("items") == 0 and not consumer.has_cache_item("h1")
    consumer.build_installs(SchedulerOutput())  # pages come back one step later
    assert consumer.counters.get("free_pages") == consumer.counters.get("num_pages")


def test_consumer_refuses_a_slot_that_no_longer_holds_the_promised_item(producer, consumer, releaser):
    stale = producer("publish", 71, 4, 128, "float32", "h2")
    fresh = producer("overwrite", stale, 72, 4, 128, "float32", "h2")
    request = Request("r2", [Feature("h2", Position(4))], expected_to_params({"h2": ExpectedItem(4, 128, "float32", stale)}))
    assert not _wait_available(consumer, request)
    consumer.request_finished(request)
    assert consumer.counters.get("failed_loads") == 1
    releaser.release([fresh.lease_id])
    assert producer("reap_until_idle") == 0


def test_consumer_refuses_a_genuine_handle_under_another_items_content_hash(producer, consumer, releaser):
    """The poisoning attack: a caller's own genuine handle, sent under another image's content
    hash, would enter vLLM's encoder cache as that image's embedding. The slot names the item
    the encoder wrote; the consumer checks the name against the hash before vLLM sees it."""
    own = producer("publish", 75, 4, 128, "float32", "the-callers-own-image")
    request = Request("r8", [Feature("a-victims-image", Position(4))], expected_to_params({"a-victims-image": ExpectedItem(4, 128, "float32", own)}))
    assert not _wait_available(consumer, request)
    assert not consumer.has_cache_item("a-victims-image")
    consumer.request_finished(request)
    assert consumer.counters.get("failed_loads") == 1 and consumer.counters.get("items") == 0
    assert producer("reap_until_idle") == 0  # the READ ended the lease, as any read does


def test_a_handle_crosses_vllms_params_with_every_field():
    """ec_params writes a location's fields one by one (dataclasses.asdict cost 40 us each): a
    field added to NixlLocation and not carried fails here."""
    from epd.transport.connector.ec_params import expected_from_params

    values = {"str": "x", "bytes": b"\x01\x02", "int": 7}
    location = NixlLocation(**{f.name: values[f.type] for f in dataclasses.fields(NixlLocation)})
    assert expected_from_params(expected_to_params({"h": ExpectedItem(3, 4, "float32", location)})) == {"h": ExpectedItem(3, 4, "float32", location)}


@pytest.mark.parametrize(
    "params",
    [None, {"h3": {"epd": {"version": 99}}}, {"other": "x"}],
    ids=["no_params", "unknown_version", "no_entry_for_the_item"],
)
def test_consumer_refuses_requests_without_a_usable_handle(consumer, params):
    request = Request("r3", [Feature("h3", Position(2))], params)
    assert not consumer.ensure_cache_available(request, 0)
    assert consumer.take_unavailable_requests() == {"r3"}


def test_a_request_whose_items_are_all_in_its_kv_needs_no_handles(consumer):
    """A decode engine's request with a KV handoff: the prompt's KV, items included, came from
    the prefill, so nothing is loaded; should vLLM still have an item's tokens to compute, the
    missing handles fail the request."""
    request = Request("kv", [Feature("h7", Position(4, offset=3))], None)
    assert consumer.ensure_cache_available(request, 7)
    assert consumer.take_unavailable_requests() == set() and consumer.counters.get("items") == 0
    consumer.request_finished(request)
    assert not consumer.ensure_cache_available(request, 6)
    assert consumer.take_unavailable_requests() == {"kv"}


def test_consumer_refuses_a_handle_whose_rows_disagree_with_the_layout(consumer):
    request = Request("r4", [Feature("h4", Position(6))], expected_to_params({"h4": ExpectedItem(5, 16, "float32", InlineEmbedding(b"\0" * 320))}))
    assert not consumer.ensure_cache_available(request, 0)
    assert consumer.take_unavailable_requests() == {"r4"}


def test_consumer_refuses_a_shape_smaller_than_its_location_before_reading(producer, consumer, releaser):
    """The pages are sized from the item's shape (the caller's metadata); a genuine location of
    a larger item would otherwise be READ past them, over other requests' items."""
    location = producer("publish", 73, 8, 128, "float32")
    request = Request("r6", [Feature("h6", Position(8))], expected_to_params({"h6": ExpectedItem(8, 16, "float32", location)}))
    assert not consumer.ensure_cache_available(request, 0)
    assert consumer.take_unavailable_requests() == {"r6"}
    assert producer("leases") == 1  # nothing was read
    releaser.release([location.lease_id])
    assert producer("reap_until_idle") == 0


def _wire_location(**changes: Any) -> multimodal_pb2.EmbeddingHandle:
    fields = {
        "agent_name": "epd-encoder-1",
        "encoder_address": "10.0.0.7:50061",
        "descriptors": encode_descriptors([(1 << 20, 4160, 0)]),
        "nbytes": 4160,
        "lease_id": "ab" * 16,
        "location_tag": b"\x01" * 32,
    }
    return multimodal_pb2.EmbeddingHandle(nixl=multimodal_pb2.NixlEmbedding(**{**fields, **changes}))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"encoder_address": "127.0.0.1"}, "encoder_address"),
        ({"lease_id": "0123456789abcdef"}, "lease_id"),  # 64 bits: guessable
        ({"location_tag": b""}, "location_tag"),
        ({"descriptors": b"\x02" + b"\x00" * 20}, "descriptors"),
        ({"nbytes": 8192}, "nbytes"),
        ({"agent_name": ""}, "agent_name"),
    ],
)
def test_a_malformed_location_is_invalid_argument_at_the_edge(changes, field):
    with pytest.raises(InvalidArgument) as caught:
        wire.embedding_location_from_wire(_wire_location(**changes), "items[2].embedding")
    assert [v.field for v in caught.value.violations] == [f"items[2].embedding.nixl.{field}"]


def test_a_well_formed_location_converts_both_ways():
    location = wire.embedding_location_from_wire(_wire_location())
    assert isinstance(location, NixlLocation) and location.tag == b"\x01" * 32
    assert wire.embedding_location_from_wire(wire._handle_to_wire(location)) == location


def test_a_location_tag_is_hmac_sha256_of_its_length_prefixed_fields():
    """The tag's format, spelled out independently of LocationSigner: producers and consumers of
    different EPD builds must agree on it, and no field may bleed into its neighbour."""
    key = bytes(range(32))
    location = wire.embedding_location_from_wire(_wire_location(slot_generation=7, expires_at=timestamp_pb2.Timestamp(seconds=1_800_000_000)))
    fields = [location.agent_name.encode(), location.lease_id.encode(), location.descriptors]
    fields += [str(value).encode() for value in (location.nbytes, location.expires_at_unix_ms, location.slot_generation)]
    message = b"epd-nixl-location-v2" + b"".join(len(field).to_bytes(4, "little") + field for field in fields)
    signer = LocationSigner(key)
    assert signer.tag(location) == hmac.digest(key, message, "sha256")
    assert signer.verifies(dataclasses.replace(location, tag=signer.tag(location)))
    moved = dataclasses.replace(location, lease_id=location.lease_id[1:] + "0", tag=signer.tag(location))
    assert not signer.verifies(moved) and not LocationSigner(key[::-1]).verifies(dataclasses.replace(location, tag=signer.tag(location)))


def test_inline_embeddings_are_copied_in_without_nixl(consumer):
    rows = make_rows(81, 3, 16)
    request = Request("r5", [Feature("h5", Position(3))], expected_to_params({"h5": ExpectedItem(3, 16, "float32", InlineEmbedding(rows.numpy().tobytes()))}))
    assert consumer.ensure_cache_available(request, 0)
    consumer.update_state_after_alloc(request, 0)
    (install,) = consumer.build_installs(SchedulerOutput())
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
    expires_at = small_arena.publish(published.lease_id)
    assert expires_at > time.time()
    time.sleep(0.3)
    assert small_arena.expire() == 1
    assert small_arena.leased_count == 1 and small_arena.release(pinned.lease_id)
    assert small_arena.counters.get("leases") == 0


# --- The encoder-output cache (the arena's published fills, kept under their content hash) ---


@pytest.fixture
def caching_arena() -> EmbeddingArena:
    return EmbeddingArena(torch.zeros(SharedCounters.BYTES + 4 * 1024, dtype=torch.uint8), slot_bytes=1024, lease_ttl_s=60, cache_bytes=4 * 1024)


def _published(arena: EmbeddingArena, key: str, nbytes: int = 1000):
    lease = arena.reserve(nbytes, key)
    arena.publish(lease.lease_id)
    return lease


def test_a_published_fill_outlives_its_lease_and_is_shared_by_its_key(caching_arena):
    first = _published(caching_arena, "a")
    assert caching_arena.release(first.lease_id) and caching_arena.leased_count == 0
    assert caching_arena.is_published("a") and caching_arena.counters.get("cache_bytes") == 1024
    again = caching_arena.share("a")
    assert (again.offset, again.nbytes, again.generation) == (first.offset, first.nbytes, first.generation)
    assert again.lease_id != first.lease_id and caching_arena.share("b") is None
    # A fill still being written is shared too (a concurrent miss waits for one result), but
    # only a published one counts as present (vLLM may skip the tower only for that).
    pending = caching_arena.reserve(1000, "b")
    assert caching_arena.share("b").offset == pending.offset and not caching_arena.is_published("b")


def test_room_is_made_by_evicting_the_least_recently_used_unleased_fill(caching_arena):
    for key in "abc":
        caching_arena.release(_published(caching_arena, key).lease_id)
    caching_arena.release(caching_arena.share("a").lease_id)  # "a" is now the most recently used
    held = caching_arena.reserve(1000, "d")
    assert held is not None and caching_arena.counters.get("cache_evictions") == 0  # a free slot was left
    assert caching_arena.reserve(1000, "e") is not None  # evicts "b", the oldest use
    assert [caching_arena.is_published(k) for k in "abc"] == [True, False, True]
    assert caching_arena.counters.get("cache_evictions") == 1
    pinned = caching_arena.share("a")
    assert caching_arena.reserve(2048) is None  # "c" alone could never make a run of two slots: kept
    assert caching_arena.counters.get("cache_evictions") == 1 and caching_arena.is_published("a") and caching_arena.is_published("c")
    caching_arena.release(pinned.lease_id)


def test_a_fill_that_cannot_fit_evicts_nothing(caching_arena):
    caching_arena.release(_published(caching_arena, "a").lease_id)
    held = caching_arena.reserve(2048)  # two of the four slots stay leased
    assert caching_arena.reserve(3 * 1024) is None  # one free and one idle slot: never three
    assert caching_arena.is_published("a") and caching_arena.counters.get("cache_evictions") == 0
    caching_arena.release(held.lease_id)


def test_the_cache_keeps_at_most_its_bytes_and_off_frees_at_once():
    def arena(cache_bytes: int) -> EmbeddingArena:
        return EmbeddingArena(torch.zeros(SharedCounters.BYTES + 4 * 1024, dtype=torch.uint8), slot_bytes=1024, lease_ttl_s=60, cache_bytes=cache_bytes)

    bounded = arena(1024)
    for key in "ab":
        bounded.release(_published(bounded, key).lease_id)
    assert (bounded.is_published("a"), bounded.is_published("b")) == (False, True)
    assert bounded.counters.get("cache_bytes") == 1024 and bounded.counters.get("free_slots") == 3
    off = arena(0)
    off.release(_published(off, "a").lease_id)
    assert off.share("a") is None and off.counters.get("free_slots") == 4 and off.counters.get("cache_bytes") == 0


def test_leased_fills_do_not_count_against_the_cache():
    """In-flight fills would be in the arena with the cache off too: under load they must not
    squeeze the idle entries out."""
    arena = EmbeddingArena(torch.zeros(SharedCounters.BYTES + 4 * 1024, dtype=torch.uint8), slot_bytes=1024, lease_ttl_s=60, cache_bytes=1024)
    in_flight = [_published(arena, key) for key in "ab"]
    arena.release(_published(arena, "c").lease_id)
    assert [arena.is_published(k) for k in "abc"] == [True, True, True]
    assert arena.counters.get("cache_bytes") == 1024 and arena.counters.get("cache_evictions") == 0
    for lease in in_flight:
        arena.release(lease.lease_id)  # now idle too: over the cap, the least recently used go
    assert [arena.is_published(k) for k in "abc"] == [False, True, False]
    assert arena.counters.get("cache_bytes") == 1024 and arena.counters.get("cache_evictions") == 2


def test_a_lease_is_written_only_when_its_own_fill_is(caching_arena):
    """The key can name a newer published fill than the one a lease holds (the held one was
    dropped unwritten): whether rows are there to copy is asked per lease."""
    pending = caching_arena.reserve(1000, "a")
    sharer = caching_arena.share("a")
    caching_arena.discard(pending.lease_id)
    newer = _published(caching_arena, "a")
    assert caching_arena.is_published("a") and caching_arena.is_written(newer.lease_id)
    assert not caching_arena.is_written(sharer.lease_id) and sharer.offset != newer.offset


def test_a_fill_that_was_not_written_is_never_shared_again(caching_arena):
    pending = caching_arena.reserve(1000, "a")
    sharer = caching_arena.share("a")
    caching_arena.discard(pending.lease_id)
    assert caching_arena.share("a") is None
    caching_arena.discard(sharer.lease_id)
    assert caching_arena.counters.get("free_slots") == 4 and caching_arena.counters.get("cache_bytes") == 0
    fresh = caching_arena.reserve(1000, "a")
    assert fresh.generation != pending.generation


# --- The connector desk's channel ----------------------------------------------------------


def test_the_connector_desk_answers_its_questions_and_its_client_survives_a_restart():
    name = f"test-desk-{uuid.uuid4().hex[:8]}"
    client = ConnectorDeskClient(name, timeout_s=2.0)
    try:
        assert client.lease(["a"]) is None  # no desk yet: the engine path serves the request
        asked: list[list[str]] = []

        def grant(keys: list[str]) -> dict | None:
            asked.append(keys)
            return {key: {"rows": len(key), "tag": key.encode()} for key in keys} if all(k.startswith("held") for k in keys) else None

        desk = open_desk(name)
        desk.answer(LeaseHeld, lambda lease: grant(lease.keys))
        assert desk.path.stat().st_mode & 0o777 == 0o600
        assert client.lease(["held-1", "held-22"]) == {"held-1": {"rows": 6, "tag": b"held-1"}, "held-22": {"rows": 7, "tag": b"held-22"}}
        assert client.lease(["held-1", "new"]) is None
        assert client.why_failed("r1") is None  # nothing noted: nil, and the channel stays up
        desk.release()
        assert not desk.path.exists()
        assert client.lease(["held-1"]) is None  # the engine restarted: its old desk is gone
        desk = open_desk(name)
        desk.answer(LeaseHeld, lambda lease: grant(lease.keys))
        # A prefill's EC consumer and KV connector share their engine core's desk.
        kv_side = open_desk(name)
        assert kv_side is desk
        # vLLM's id for the service's "r1"; a request's first reason stands.
        kv_side.failures.record("r1-0123abcd", "the producer is unreachable")
        kv_side.failures.record("r1-0123abcd", "what followed from it")
        kv_side.failures.record("r10-0123abcd", "another request's reason")
        kv_side.release()
        assert desk.path.exists()  # the EC side still holds it
        assert client.lease(["held-1"]) == {"held-1": {"rows": 6, "tag": b"held-1"}}
        assert client.why_failed("r1") == "the producer is unreachable"
        assert client.why_failed("r1") is None
        desk.release()
        assert not desk.path.exists()
        assert asked == [["held-1", "held-22"], ["held-1", "new"], ["held-1"]]
    finally:
        client.close()


def test_a_claim_given_up_on_frees_its_leases_whichever_side_comes_first():
    ledger = ClaimLedger(matches=is_engine_id_of)
    # Granted first (vLLM's id for the service's "r1"), then given up on: the grant is handed back.
    assert ledger.granted("r1-0123abcd", ["lease-a", "lease-b"])
    assert ledger.granted("r10-0123abcd", ["lease-c"])
    assert ledger.give_up("r1") == ["lease-a", "lease-b"]
    assert ledger.give_up("r1") == []  # once
    # Given up on first: the grant is refused (free its leases at once), once.
    assert ledger.give_up("r2") == []
    assert not ledger.granted("r2-89abcdef", ["lease-d"])
    assert ledger.granted("r2-fedcba98", ["lease-e"])
    # Another request's grant is never handed back, nor one only sharing a prefix.
    assert ledger.give_up("r10") == ["lease-c"]
    assert ledger.give_up("r2-fedcba9") == []
    # Exact keys by default (the encoder service's release keys).
    keys = ClaimLedger()
    assert keys.granted("k", ["lease-f"]) and keys.give_up("k-") == [] and keys.give_up("k") == ["lease-f"]


def test_ucx_starts_without_memory_hooks_unless_the_operator_asks(monkeypatch):
    """epd.transport.wire.agent.configure_ucx: NIXL hands UCX every buffer's registration, so
    UCX's memory hooks (0.4 s of every engine's start) are off by default; an operator's own
    UCX_MEM_EVENTS is kept."""
    from epd.transport.wire.agent import configure_ucx

    monkeypatch.delenv("UCX_MEM_EVENTS", raising=False)
    configure_ucx("127.0.0.1")
    assert os.environ["UCX_MEM_EVENTS"] == "no"
    monkeypatch.setenv("UCX_MEM_EVENTS", "yes")
    configure_ucx("127.0.0.1")
    assert os.environ["UCX_MEM_EVENTS"] == "yes"

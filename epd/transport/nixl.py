"""Embedding transport over NIXL: a producer-side arena of leased slots, a consumer-side fetcher.

The encoder copies each embedding into an :class:`EmbeddingArena` (one buffer, registered with
NIXL once at startup) and hands the returned :class:`NixlRegion` to the prefill service, which
READs it one-sidedly with an :class:`EmbeddingFetcher`. The READ carries a NIXL notification
listing the lease ids it consumed; the arena frees those slots on its next
:meth:`EmbeddingArena.reap`. Leases that nobody consumes are freed once they expire.

Agent metadata is exchanged through NIXL's peer-to-peer side channel. Every agent runs NIXL's
metadata listener thread. The arena's listener port is advertised in
:attr:`NixlRegion.agent_address`; the first time a fetcher sees a producer agent it asks that
listener for the agent's metadata and then keeps it, until a READ from that agent fails. The
fetcher's own listener port is never advertised: NIXL needs the thread only because it runs the
outgoing metadata requests on it.

Clocks: :attr:`NixlRegion.expires_at_unix_ms` is wall-clock time, because it crosses processes
and hosts; the arena itself frees slots on a monotonic deadline that falls no earlier. A fetcher
refuses regions that expire within its ``expiry_margin_s``, since a READ that races the producer
freeing and reusing the slot would return another item's bytes. Across hosts, the margin must
also cover clock skew.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epd.transport._agent import NixlAgent, Row
from epd.transport._slots import SlotAllocator
from epd.transport.errors import ArenaFullError, TransferError

__all__ = [
    "ArenaFullError",
    "EmbeddingArena",
    "EmbeddingFetcher",
    "NixlRegion",
    "TransferError",
]

logger = logging.getLogger(__name__)

# NixlRegion.descriptors format: a version byte, then one packed row per contiguous range. Our
# own format rather than NIXL's get_serialized_descs, which is a pickle: consumers would be
# unpickling bytes that arrived over the network.
_DESCRIPTORS_VERSION = 1
_DESCRIPTOR_ROW = struct.Struct("<QQI")  # address, length, device id

# A lease id list travels as one notification message, ids joined by this separator.
_LEASE_SEPARATOR = ","

# Hint given with ArenaFullError; leases normally end by notification within milliseconds.
_RETRY_HINT_S = 0.05
# Attempts at starting the arena's listener on a port we picked (see _start_listening_agent).
_PORT_ATTEMPTS = 5

# The fetcher's receive buffer is handed out in pages; each region in a fetch starts aligned.
_PAGE_BYTES = 4096
_REGION_ALIGN = 64
# Polling: spin (yielding to the event loop) this long, which covers most READs, then sleep.
_SPIN_S = 0.001
_POLL_S = 0.001
_METADATA_POLL_S = 0.002


@dataclass(frozen=True)
class NixlRegion:
    """Where one leased embedding lives; travels inside EmbeddingHandle (protobuf).

    All fields are plain types so the service can copy them into and out of protobuf.

    Attributes:
        agent_name: The producer's NIXL agent name.
        agent_address: ``host:port`` of the producer agent's NIXL metadata listener.
        descriptors: The producer memory holding exactly this embedding, in this module's
            serialized descriptor format.
        nbytes: Size of the embedding in bytes.
        lease_id: Identifies the lease; the consumer's READ notification returns it.
        expires_at_unix_ms: Wall-clock time after which the producer may reuse the memory.
    """

    agent_name: str
    agent_address: str
    descriptors: bytes
    nbytes: int
    lease_id: str
    expires_at_unix_ms: int


@dataclass(slots=True)
class _Lease:
    first_slot: int
    num_slots: int
    deadline: float  # time.monotonic()


class EmbeddingArena:
    """Producer side: one buffer registered once at startup, split into fixed-size slots.

    An item that needs more than one slot takes a contiguous run of slots, so every region is a
    single NIXL descriptor. All methods are thread-safe. The arena owns its agent's notification
    queue: :meth:`reap` consumes every notification and treats each as a list of lease ids.
    Its agent runs a UCX progress thread, which READs of the arena depend on; it sleeps while
    idle (about 3% of a core, measured).
    """

    def __init__(
        self,
        *,
        agent_name: str,
        slot_bytes: int,
        num_slots: int,
        lease_ttl_s: float,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        """Allocates and registers the arena and starts the agent's metadata listener.

        Args:
            agent_name: NIXL agent name, unique among the agents its consumers talk to.
            slot_bytes: Size of one slot.
            num_slots: Number of slots; the arena holds ``slot_bytes * num_slots`` bytes.
            lease_ttl_s: How long a published region stays readable if nobody consumes it.
            listen_host: Host consumers should dial for metadata; it goes into every region's
                ``agent_address``. NIXL's listener binds all interfaces regardless.
            listen_port: Listener port. 0 picks a free one (see :func:`_start_listening_agent`).

        Raises:
            ValueError: If a size or the TTL is not positive.
            RuntimeError: If NIXL cannot start, e.g. ``listen_port`` is taken.
        """
        if slot_bytes <= 0 or num_slots <= 0 or lease_ttl_s <= 0:
            raise ValueError("slot_bytes, num_slots and lease_ttl_s must be positive")
        self._slot_bytes = slot_bytes
        self._ttl_s = lease_ttl_s
        self._slots = SlotAllocator(num_slots)
        self._leases: dict[str, _Lease] = {}  # insertion order is expiry order: one TTL for all
        self._lock = threading.Lock()
        self._agent: NixlAgent | None
        self._agent, port = _start_listening_agent(agent_name, listen_port)
        self._address = f"{listen_host}:{port}"
        self._buffer = torch.empty(slot_bytes * num_slots, dtype=torch.uint8)
        self._base_address = self._buffer.data_ptr()
        self._registration = self._agent.register(self._buffer)

    @property
    def agent_address(self) -> str:
        """The ``host:port`` advertised in every region."""
        return self._address

    @property
    def leased_count(self) -> int:
        """Number of live leases."""
        with self._lock:
            return len(self._leases)

    @property
    def free_slots(self) -> int:
        """Number of slots not held by a lease."""
        with self._lock:
            return self._slots.free_slots

    def publish(self, tensor: torch.Tensor) -> NixlRegion:
        """Copies a tensor's bytes into free slots and leases them.

        Args:
            tensor: Any tensor; its bytes are copied in row-major order (made contiguous first).

        Returns:
            The region a consumer passes to :meth:`EmbeddingFetcher.fetch`.

        Raises:
            ArenaFullError: If no run of free slots is large enough right now, even after
                reaping consumed and expired leases.
            ValueError: If the tensor is empty or larger than the whole arena.
            RuntimeError: If the arena is closed.
        """
        agent = self._require_open()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        if not 0 < nbytes <= self._slot_bytes * self._slots.num_slots:
            raise ValueError(
                f"a {nbytes}-byte tensor can never fit an arena of "
                f"{self._slots.num_slots} x {self._slot_bytes}-byte slots"
            )
        num_slots = -(-nbytes // self._slot_bytes)
        # Read the wall clock before the lease takes its monotonic deadline, so that the
        # advertised expiry never falls after the moment the arena may free the slots.
        expires_at_unix_ms = time.time_ns() // 1_000_000 + int(self._ttl_s * 1000)
        leased = self._try_lease(num_slots)
        if leased is None:
            self.reap()  # consumers may have finished since the service's last periodic reap
            leased = self._try_lease(num_slots)
        if leased is None:
            raise ArenaFullError(
                f"no run of {num_slots} free slots (free: {self.free_slots})",
                retry_after_s=self._retry_hint(),
            )
        lease_id, first_slot = leased
        offset = first_slot * self._slot_bytes
        try:
            self._buffer[offset : offset + nbytes].copy_(data)
        except BaseException:
            self.release(lease_id)
            raise
        return NixlRegion(
            agent_name=agent.name,
            agent_address=self._address,
            descriptors=_encode_descriptors([(self._base_address + offset, nbytes, 0)]),
            nbytes=nbytes,
            lease_id=lease_id,
            expires_at_unix_ms=expires_at_unix_ms,
        )

    def reap(self) -> int:
        """Frees leases whose READ notification arrived or whose expiry passed.

        Cheap enough to call every few milliseconds.

        Returns:
            How many leases were freed.
        """
        agent = self._agent
        if agent is None:
            return 0
        notifications = agent.take_notifications()
        now = time.monotonic()
        with self._lock:
            freed = 0
            for messages in notifications.values():
                for message in messages:
                    for lease_id in message.decode("ascii", "replace").split(_LEASE_SEPARATOR):
                        freed += self._end_lease(lease_id)
            expired = [
                lease_id
                for lease_id, _ in itertools.takewhile(
                    lambda item: item[1].deadline <= now, self._leases.items()
                )
            ]
            for lease_id in expired:
                freed += self._end_lease(lease_id)
        return freed

    def release(self, lease_id: str) -> None:
        """Frees a lease now, e.g. because its request was aborted. Unknown ids are ignored."""
        with self._lock:
            self._end_lease(lease_id)

    def close(self) -> None:
        """Deregisters the arena and stops the agent. Idempotent; live leases are dropped."""
        with self._lock:
            agent, self._agent = self._agent, None
            self._leases.clear()
        if agent is not None:
            agent.deregister(self._registration)

    def _require_open(self) -> NixlAgent:
        agent = self._agent
        if agent is None:
            raise RuntimeError("the embedding arena is closed")
        return agent

    def _try_lease(self, num_slots: int) -> tuple[str, int] | None:
        with self._lock:
            first_slot = self._slots.alloc(num_slots)
            if first_slot is None:
                return None
            lease_id = uuid.uuid4().hex
            self._leases[lease_id] = _Lease(first_slot, num_slots, time.monotonic() + self._ttl_s)
            return lease_id, first_slot

    def _end_lease(self, lease_id: str) -> int:
        """Frees one lease's slots; returns 1 if it was live, else 0. Caller holds the lock."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return 0
        self._slots.free(lease.first_slot, lease.num_slots)
        return 1

    def _retry_hint(self) -> float:
        with self._lock:
            oldest = next(iter(self._leases.values()), None)
        if oldest is None:
            return _RETRY_HINT_S
        return min(_RETRY_HINT_S, max(oldest.deadline - time.monotonic(), 0.0))


@dataclass(frozen=True, slots=True)
class _PlannedRead:
    region: NixlRegion
    remote: list[Row]
    offset: int  # into this fetch's share of the receive buffer


class EmbeddingFetcher:
    """Consumer side: one receive buffer registered once at startup, reused for every fetch.

    Concurrent :meth:`fetch` calls on one event loop run their READs in parallel: each call
    takes its own run of pages of the receive buffer, and waits for pages to come free when
    the buffer is full. Peer metadata is fetched once per producer agent and cached. The agent
    has no progress thread: a fetch drives its READs by polling them from the event loop.
    """

    def __init__(
        self,
        *,
        agent_name: str,
        buffer_bytes: int,
        timeout_s: float = 10.0,
        expiry_margin_s: float = 0.5,
    ) -> None:
        """Allocates and registers the receive buffer and starts the agent.

        Args:
            agent_name: NIXL agent name, unique among the producers' peers.
            buffer_bytes: Receive buffer size; bounds the total size of one fetch.
            timeout_s: Limit on one fetch: metadata, waiting for buffer space and the READs.
            expiry_margin_s: Regions expiring sooner than this are refused rather than read.

        Raises:
            ValueError: If ``buffer_bytes`` or ``timeout_s`` is not positive.
        """
        if buffer_bytes <= 0 or timeout_s <= 0:
            raise ValueError("buffer_bytes and timeout_s must be positive")
        self._timeout_s = timeout_s
        self._expiry_margin_ms = int(expiry_margin_s * 1000)
        self._pages = SlotAllocator(-(-buffer_bytes // _PAGE_BYTES))
        self._space_freed = asyncio.Event()
        self._peers: dict[str, str] = {}  # agent name -> address its metadata came from
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._agent: NixlAgent | None = NixlAgent(
            agent_name, listen_port=0, progress_thread=False
        )
        self._buffer = torch.empty(self._pages.num_slots * _PAGE_BYTES, dtype=torch.uint8)
        self._base_address = self._buffer.data_ptr()
        self._registration = self._agent.register(self._buffer)

    async def fetch(self, regions: Sequence[NixlRegion]) -> list[torch.Tensor]:
        """Reads regions, one batched READ per producer agent, and ends their leases.

        Args:
            regions: Regions from :meth:`EmbeddingArena.publish`, from any number of producers.

        Returns:
            One flat ``torch.uint8`` tensor per region, in order, holding a copy of its bytes.

        Raises:
            TransferError: If a lease has expired or is about to, a producer is unreachable,
                a READ fails, or the fetch times out. The fetcher stays usable.
            ValueError: If a region is malformed or the regions together exceed the buffer.
            RuntimeError: If the fetcher is closed.
        """
        agent = self._require_open()
        if not regions:
            return []
        reads, total_bytes = _plan_reads(regions)
        num_pages = -(-total_bytes // _PAGE_BYTES)
        if num_pages > self._pages.num_slots:
            raise ValueError(
                f"{total_bytes} bytes of regions exceed the {self._buffer.numel()}-byte buffer"
            )
        self._check_leases(regions)  # fail fast, before contacting producers
        by_peer: dict[str, list[_PlannedRead]] = {}
        for read in reads:
            by_peer.setdefault(read.region.agent_name, []).append(read)
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        await asyncio.gather(
            *(
                self._ensure_peer(agent, peer, peer_reads[0].region.agent_address, deadline)
                for peer, peer_reads in by_peer.items()
            )
        )
        first_page = await self._reserve_pages(num_pages, deadline)
        start = first_page * _PAGE_BYTES
        handles: list[tuple[str, int]] = []
        try:
            self._check_leases(regions)  # the waits above may have run a lease down
            for peer, peer_reads in by_peer.items():
                handles.append((peer, self._post_read(agent, peer, peer_reads, start)))
            await self._wait_done(agent, handles, deadline)
            received = self._buffer[start : start + total_bytes]
            return [
                received[read.offset : read.offset + read.region.nbytes].clone() for read in reads
            ]
        finally:
            self._finish(agent, handles, first_page, num_pages)

    def close(self) -> None:
        """Deregisters the buffer and stops the agent. Idempotent; no fetch may be running."""
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.deregister(self._registration)

    def _require_open(self) -> NixlAgent:
        agent = self._agent
        if agent is None:
            raise RuntimeError("the embedding fetcher is closed")
        return agent

    def _check_leases(self, regions: Sequence[NixlRegion]) -> None:
        cutoff_ms = time.time_ns() // 1_000_000 + self._expiry_margin_ms
        for region in regions:
            if region.expires_at_unix_ms <= cutoff_ms:
                raise TransferError(
                    f"lease {region.lease_id} from agent {region.agent_name!r} has expired "
                    f"or expires within {self._expiry_margin_ms} ms"
                )

    async def _ensure_peer(
        self, agent: NixlAgent, peer: str, address: str, deadline: float
    ) -> None:
        """Loads ``peer``'s metadata from its listener at ``address`` unless already cached."""
        if self._peers.get(peer) == address:
            return
        async with self._peer_locks.setdefault(peer, asyncio.Lock()):
            if self._peers.get(peer) == address:
                return
            # A known agent at a new address has restarted; its old metadata is stale.
            self._forget_peer(agent, peer)
            ip, port = await _resolve_ipv4(address)
            agent.request_metadata(peer, ip, port)
            loop = asyncio.get_running_loop()
            while not agent.has_metadata(peer):
                if loop.time() >= deadline:
                    raise TransferError(f"no metadata from NIXL agent {peer!r} at {address}")
                await asyncio.sleep(_METADATA_POLL_S)
            self._peers[peer] = address

    def _forget_peer(self, agent: NixlAgent, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            return
        try:
            agent.forget_peer(peer)
        except Exception:  # already gone on NIXL's side; nothing left to drop
            logger.debug("NIXL had no metadata left for agent %r", peer, exc_info=True)

    async def _reserve_pages(self, num_pages: int, deadline: float) -> int:
        loop = asyncio.get_running_loop()
        while (first_page := self._pages.alloc(num_pages)) is None:
            # No await between the failed alloc and the wait, so no free can slip in between.
            self._space_freed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TransferError("timed out waiting for receive-buffer space")
            try:
                await asyncio.wait_for(self._space_freed.wait(), remaining)
            except TimeoutError:
                pass  # the loop re-checks, then raises
        return first_page

    def _post_read(
        self, agent: NixlAgent, peer: str, reads: Sequence[_PlannedRead], start: int
    ) -> int:
        local: list[Row] = []
        remote: list[Row] = []
        for read in reads:
            address = self._base_address + start + read.offset
            for remote_row in read.remote:
                remote.append(remote_row)
                local.append((address, remote_row[1], 0))
                address += remote_row[1]
        notification = _LEASE_SEPARATOR.join(read.region.lease_id for read in reads).encode()
        try:
            return agent.post_read(peer, local, remote, notification)
        except TransferError:
            self._forget_peer(agent, peer)  # most refusals mean the peer restarted or left
            raise

    async def _wait_done(
        self, agent: NixlAgent, handles: Sequence[tuple[str, int]], deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        spin_until = loop.time() + _SPIN_S
        pending = list(handles)
        while pending:
            still_running = []
            for peer, handle in pending:
                state = agent.state(handle)
                if state == "ERR":
                    self._forget_peer(agent, peer)
                    raise TransferError(f"READ from NIXL agent {peer!r} failed")
                if state == "PROC":
                    still_running.append((peer, handle))
            pending = still_running
            if not pending:
                return
            now = loop.time()
            if now >= deadline:
                raise TransferError(f"READ timed out after {self._timeout_s} s")
            await asyncio.sleep(0 if now < spin_until else _POLL_S)

    def _finish(
        self, agent: NixlAgent, handles: Sequence[tuple[str, int]], first_page: int, num_pages: int
    ) -> None:
        """Releases the transfer handles, then the pages, unless a READ may still land there."""
        all_released = True
        for peer, handle in handles:
            try:
                agent.release(handle)
            except Exception:
                logger.exception("could not cancel a READ from NIXL agent %r", peer)
                all_released = False
        if all_released:
            self._pages.free(first_page, num_pages)
            self._space_freed.set()
        else:
            logger.error("retiring %d receive-buffer pages that a READ may still write", num_pages)


def _start_listening_agent(name: str, listen_port: int) -> tuple[NixlAgent, int]:
    """Starts the arena's agent, its metadata listener on ``listen_port`` or a free port if 0.

    NIXL can bind port 0 but cannot tell which port the OS chose, so we pick a free port
    ourselves. Another process may take it between our probe and NIXL's bind; NIXL then fails
    to start and we retry on a fresh port.

    Returns:
        The agent and its listener port.
    """

    def start(port: int) -> tuple[NixlAgent, int]:
        return NixlAgent(name, listen_port=port, progress_thread=True), port

    if listen_port:
        return start(listen_port)
    for _ in range(_PORT_ATTEMPTS - 1):
        port = _free_tcp_port()
        try:
            return start(port)
        except RuntimeError:
            logger.warning("NIXL listener could not bind port %d; retrying on another", port)
    return start(_free_tcp_port())


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))  # NIXL binds all interfaces, so probe them all too
        port: int = probe.getsockname()[1]
        return port


async def _resolve_ipv4(address: str) -> tuple[str, int]:
    """Splits ``host:port`` and resolves the host: NIXL's side channel takes only IPv4 literals.

    Raises:
        ValueError: If ``address`` is not ``host:port``.
        TransferError: If the host name does not resolve.
    """
    host, separator, port_text = address.rpartition(":")
    if not separator or not host or not port_text.isdigit():
        raise ValueError(f"agent_address must be 'host:port', got {address!r}")
    port = int(port_text)
    try:
        ip = str(ipaddress.IPv4Address(host))
    except ValueError:  # a host name
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
        except OSError as exc:
            raise TransferError(f"cannot resolve producer host {host!r}: {exc}") from exc
        ip = str(infos[0][4][0])
    return ip, port


def _encode_descriptors(rows: Sequence[Row]) -> bytes:
    return bytes([_DESCRIPTORS_VERSION]) + b"".join(_DESCRIPTOR_ROW.pack(*row) for row in rows)


def _decode_descriptors(blob: bytes) -> list[Row]:
    version, body = blob[:1], blob[1:]
    if version != bytes([_DESCRIPTORS_VERSION]) or not body or len(body) % _DESCRIPTOR_ROW.size:
        raise ValueError("malformed region descriptors")
    rows = _DESCRIPTOR_ROW.iter_unpack(body)
    return [(address, length, device) for address, length, device in rows]


def _plan_reads(regions: Sequence[NixlRegion]) -> tuple[list[_PlannedRead], int]:
    """Decodes each region's descriptors and lays the regions out in one receive range.

    Returns:
        One planned READ per region, in order, and the total bytes the layout spans.

    Raises:
        ValueError: If a region's descriptors are malformed or disagree with its size.
    """
    reads = []
    offset = 0
    for region in regions:
        remote = _decode_descriptors(region.descriptors)
        if region.nbytes <= 0 or sum(row[1] for row in remote) != region.nbytes:
            raise ValueError(
                f"descriptors of region {region.lease_id} do not cover its {region.nbytes} bytes"
            )
        reads.append(_PlannedRead(region, remote, offset))
        offset += -(-region.nbytes // _REGION_ALIGN) * _REGION_ALIGN
    return reads, offset

"""The NIXL transport: a publisher that exposes a producer's arena, a reader that READs from it.

Both are driven by polling, never by blocking: they run inside vLLM's scheduler loop (see
:mod:`epd.transport.ec_connector`), where a wait on one slow or forged peer would stall every
request of the engine.

Agent metadata is exchanged through NIXL's peer-to-peer side channel. The publisher's agent
runs the metadata listener at the address every location advertises; the first time a reader
sees a producer agent it asks that listener for the agent's metadata, then keeps it until a
READ from that agent fails or the agent shows up at another address (it restarted).

Descriptors travel in this module's own format (a version byte, then packed rows), not NIXL's
``get_serialized_descs``, which is a pickle: a consumer would otherwise unpickle bytes that
arrived over the network.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Hashable, Sequence

import torch

from epd.domain import NixlLocation
from epd.ports import free_port
from epd.transport._agent import NixlAgent, Row
from epd.transport.arena import Lease
from epd.transport.base import Read
from epd.transport.errors import TransferError

logger = logging.getLogger(__name__)

_DESCRIPTORS_VERSION = 1
_DESCRIPTOR_ROW = struct.Struct("<QQI")  # address, length, device id
# A lease id list travels as one notification message, ids joined by this separator.
_LEASE_SEPARATOR = ","
_PORT_ATTEMPTS = 5


class NixlPublisher:
    """Producer side: one agent with a metadata listener, the arena buffer registered once."""

    def __init__(self, buffer: torch.Tensor, *, agent_name: str, listen_host: str, listen_port: int = 0) -> None:
        self._agent, port = _start_listening_agent(agent_name, listen_port)
        self.agent_name = agent_name
        self.address = f"{listen_host}:{port}"
        self._base = buffer.data_ptr()
        self._registration = self._agent.register(buffer)

    def location(self, lease: Lease, expires_at_unix_s: float) -> NixlLocation:
        """How a consumer reaches a published lease: exactly its header and rows."""
        return NixlLocation(
            agent_name=self.agent_name,
            agent_address=self.address,
            descriptors=encode_descriptors([(self._base + lease.offset, lease.nbytes, 0)]),
            nbytes=lease.nbytes,
            lease_id=lease.lease_id,
            expires_at_unix_ms=int(expires_at_unix_s * 1000),
        )

    def ended_leases(self) -> list[str]:
        """Lease ids that consumers READ, or that their owner released, since the last call."""
        ended: list[str] = []
        for messages in self._agent.take_notifications().values():
            for message in messages:
                ended += [lease for lease in message.decode("ascii", "replace").split(_LEASE_SEPARATOR) if lease]
        return ended

    def close(self) -> None:
        self._agent.deregister(self._registration)


@dataclasses.dataclass
class _Peer:
    address: str
    resolving: concurrent.futures.Future | None = None
    requested_at: float | None = None  # when metadata was asked for; None until then
    ready: bool = False
    queued: list[Read] = dataclasses.field(default_factory=list)
    releases: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Transfer:
    peer: str
    handle: int
    keys: list[Hashable]
    started: float


class NixlReader:
    """Consumer side: one agent, one registered buffer, one batched READ per producer per call.

    :meth:`submit` queues reads and posts them as soon as the producer's metadata is loaded;
    :meth:`poll` progresses metadata fetches and transfers and reports finished reads. A read
    fails (never blocks) when its lease is about to expire, the producer cannot be reached, or
    the READ errs or outlives ``timeout_s``.
    """

    def __init__(self, buffer: torch.Tensor, *, agent_name: str, timeout_s: float = 10.0, expiry_margin_s: float = 0.5) -> None:
        self._agent = NixlAgent(agent_name, listen_port=0, progress_thread=False)
        self._base = buffer.data_ptr()
        self._registration = self._agent.register(buffer)
        self._timeout_s = timeout_s
        self._expiry_margin_ms = int(expiry_margin_s * 1000)
        self._peers: dict[str, _Peer] = {}
        self._transfers: list[_Transfer] = []
        self._finished: list[tuple[Hashable, str | None]] = []
        self._resolver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nixl-resolve")

    @property
    def busy(self) -> bool:
        """Whether any read or release is in progress, or ended and not yet reported."""
        return bool(self._transfers or self._finished) or any(p.queued or p.releases for p in self._peers.values())

    def submit(self, reads: Sequence[Read]) -> None:
        for read in reads:
            self._peer(read.location).queued.append(read)

    def release(self, location: NixlLocation) -> None:
        """Ends a lease without reading it (its item is already here)."""
        self._peer(location).releases.append(location.lease_id)

    def poll(self) -> list[tuple[Hashable, str | None]]:
        """Progresses everything once; returns (key, error or None) for reads that ended."""
        now = time.monotonic()
        for name, peer in list(self._peers.items()):
            self._progress_peer(name, peer, now)
        self._progress_transfers(now)
        finished, self._finished = self._finished, []
        return finished

    def close(self) -> None:
        for transfer in self._transfers:
            self._release_handle(transfer)
        self._transfers.clear()
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self._agent.deregister(self._registration)

    # ---- internals ----------------------------------------------------------------------

    def _peer(self, location: NixlLocation) -> _Peer:
        peer = self._peers.get(location.agent_name)
        if peer is not None and peer.address != location.agent_address:
            # A known agent at a new address has restarted: its old metadata is stale.
            self._fail_peer(location.agent_name, peer, f"agent {location.agent_name!r} moved to {location.agent_address}")
            peer = None
        if peer is None:
            peer = self._peers[location.agent_name] = _Peer(location.agent_address)
        return peer

    def _progress_peer(self, name: str, peer: _Peer, now: float) -> None:
        if not peer.ready:
            if not self._load_metadata(name, peer, now):
                return
        if peer.releases:
            try:
                self._agent.notify(name, _LEASE_SEPARATOR.join(peer.releases).encode())
            except TransferError as exc:
                logger.warning("could not release %d leases on %r (they expire by TTL): %s", len(peer.releases), name, exc)
            peer.releases.clear()
        if peer.queued:
            reads, peer.queued = peer.queued, []
            self._post(name, reads, now)

    def _load_metadata(self, name: str, peer: _Peer, now: float) -> bool:
        """Advances the metadata fetch; True once loaded. Fails the peer on error or timeout."""
        try:
            if peer.requested_at is None:
                if peer.resolving is None:
                    peer.resolving = self._resolver.submit(_resolve_ipv4, peer.address)
                if not peer.resolving.done():
                    return False
                ip, port = peer.resolving.result()
                self._agent.request_metadata(name, ip, port)
                peer.requested_at = now
            if self._agent.has_metadata(name):
                peer.ready = True
                return True
            if now - peer.requested_at > self._timeout_s:
                raise TransferError(f"no metadata from NIXL agent {name!r} at {peer.address} within {self._timeout_s} s")
        except (TransferError, ValueError, OSError) as exc:
            self._fail_peer(name, peer, str(exc))
        return False

    def _post(self, name: str, reads: list[Read], now: float) -> None:
        cutoff_ms = time.time_ns() // 1_000_000 + self._expiry_margin_ms
        local: list[Row] = []
        remote: list[Row] = []
        posted: list[Read] = []
        for read in reads:
            if read.location.expires_at_unix_ms <= cutoff_ms:
                self._finished.append((read.key, f"lease {read.location.lease_id} from {name!r} expired or expires within {self._expiry_margin_ms} ms"))
                continue
            try:
                rows = decode_descriptors(read.location.descriptors)
            except ValueError as exc:
                self._finished.append((read.key, str(exc)))
                continue
            address = self._base + read.offset
            for row in rows:
                remote.append(row)
                local.append((address, row[1], 0))
                address += row[1]
            posted.append(read)
        if not posted:
            return
        notification = _LEASE_SEPARATOR.join(read.location.lease_id for read in posted).encode()
        try:
            handle = self._agent.post_read(name, local, remote, notification)
        except TransferError as exc:
            self._forget(name)  # most refusals mean the producer restarted or left
            self._finished += [(read.key, str(exc)) for read in posted]
            return
        self._transfers.append(_Transfer(name, handle, [read.key for read in posted], now))

    def _progress_transfers(self, now: float) -> None:
        running = []
        for transfer in self._transfers:
            state = self._agent.state(transfer.handle)
            if state == "PROC" and now - transfer.started <= self._timeout_s:
                running.append(transfer)
                continue
            error = None
            if state == "ERR":
                error = f"READ from NIXL agent {transfer.peer!r} failed"
                self._forget(transfer.peer)
            elif state == "PROC":
                error = f"READ from NIXL agent {transfer.peer!r} timed out after {self._timeout_s} s"
            if not self._release_handle(transfer) and error is None:
                error = "could not release the transfer handle"
            self._finished += [(key, error) for key in transfer.keys]
        self._transfers = running

    def _release_handle(self, transfer: _Transfer) -> bool:
        try:
            self._agent.release(transfer.handle)
            return True
        except Exception:
            logger.exception("could not cancel a READ from NIXL agent %r", transfer.peer)
            return False

    def _fail_peer(self, name: str, peer: _Peer, reason: str) -> None:
        self._finished += [(read.key, reason) for read in peer.queued]
        if peer.releases:
            logger.warning("could not release %d leases on %r (they expire by TTL): %s", len(peer.releases), name, reason)
        self._forget(name)

    def _forget(self, name: str) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None and peer.ready:
            try:
                self._agent.forget_peer(name)
            except Exception:  # already gone on NIXL's side
                logger.debug("NIXL had no metadata left for agent %r", name, exc_info=True)


class LeaseReleaser:
    """Ends a producer's leases without reading them, with the notification a READ would send.

    The encoder service uses it for leases the gateway gives back (a request failed or was
    aborted before its consumer read them). Calls block on the first contact with a producer
    (fetching its metadata, bounded by ``timeout_s``), so callers run them off the event loop.
    """

    def __init__(self, agent_name: str, *, timeout_s: float = 5.0) -> None:
        # A progress thread sends the notifications: nothing else here drives this agent.
        self._agent = NixlAgent(agent_name, listen_port=0, progress_thread=True)
        self._timeout_s = timeout_s
        self._known: dict[str, str] = {}  # agent name -> address its metadata came from

    def release(self, peer: str, address: str, lease_ids: Sequence[str]) -> None:
        """Raises TransferError if the producer cannot be reached (its leases then expire)."""
        if self._known.get(peer) != address:
            if peer in self._known:
                self._agent.forget_peer(peer)
                del self._known[peer]
            try:
                ip, port = _resolve_ipv4(address)
            except (ValueError, OSError) as exc:
                raise TransferError(f"cannot reach NIXL agent {peer!r} at {address}: {exc}") from exc
            self._agent.request_metadata(peer, ip, port)
            deadline = time.monotonic() + self._timeout_s
            while not self._agent.has_metadata(peer):
                if time.monotonic() > deadline:
                    raise TransferError(f"no metadata from NIXL agent {peer!r} at {address} within {self._timeout_s} s")
                time.sleep(0.002)
            self._known[peer] = address
        self._agent.notify(peer, _LEASE_SEPARATOR.join(lease_ids).encode())

    def close(self) -> None:
        for peer in self._known:
            try:
                self._agent.forget_peer(peer)
            except Exception:  # already gone on NIXL's side
                logger.debug("NIXL had no metadata left for agent %r", peer, exc_info=True)
        self._known.clear()


def encode_descriptors(rows: Sequence[Row]) -> bytes:
    return bytes([_DESCRIPTORS_VERSION]) + b"".join(_DESCRIPTOR_ROW.pack(*row) for row in rows)


def decode_descriptors(blob: bytes) -> list[Row]:
    """Raises ValueError for anything but this module's format."""
    version, body = blob[:1], blob[1:]
    if version != bytes([_DESCRIPTORS_VERSION]) or not body or len(body) % _DESCRIPTOR_ROW.size:
        raise ValueError("malformed NIXL descriptors")
    return [(address, length, device) for address, length, device in _DESCRIPTOR_ROW.iter_unpack(body)]


def _start_listening_agent(name: str, listen_port: int) -> tuple[NixlAgent, int]:
    """Starts an agent whose metadata listener is on ``listen_port``, or on a free port if 0.

    NIXL can bind port 0 but cannot tell which port it got, so we probe for a free port
    ourselves; another process may take it before NIXL binds, so a failed start is retried.
    """

    def start(port: int) -> tuple[NixlAgent, int]:
        return NixlAgent(name, listen_port=port, progress_thread=True), port

    if listen_port:
        return start(listen_port)
    for _ in range(_PORT_ATTEMPTS - 1):
        port = free_port()  # NIXL binds all interfaces, so probe them all
        try:
            return start(port)
        except RuntimeError:
            logger.warning("NIXL listener could not bind port %d; retrying on another", port)
    return start(free_port())


def _resolve_ipv4(address: str) -> tuple[str, int]:
    """Splits ``host:port`` and resolves the host: NIXL's side channel takes IPv4 literals only.

    Raises:
        ValueError: ``address`` is not ``host:port``.
        OSError: the host name does not resolve.
    """
    host, separator, port_text = address.rpartition(":")
    if not separator or not host or not port_text.isdigit():
        raise ValueError(f"agent_address must be 'host:port', got {address!r}")
    try:
        return str(ipaddress.IPv4Address(host)), int(port_text)
    except ValueError:
        infos = socket.getaddrinfo(host, int(port_text), family=socket.AF_INET, type=socket.SOCK_STREAM)
        return str(infos[0][4][0]), int(port_text)

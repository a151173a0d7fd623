"""The NIXL transport: a publisher that exposes a producer's arena, a reader that READs from it.

Both are driven by polling, never by blocking: they run inside vLLM's scheduler loop (see
:mod:`epd.transport.connector.ec_connector`), where a wait on one slow or forged peer would stall every
request of the engine.

Trust. NIXL authenticates nothing: whoever holds an agent's metadata and can reach its host can
READ all of its registered memory. So:

- no agent opens NIXL's metadata listener; a producer's metadata, and a random per-process key
  that authenticates its locations (:class:`TransferCredentials`), travel only over the encoder's
  gRPC channel (``EncoderService.GetTransferMetadata``), which TLS credentials protect where
  configured;
- every location carries an HMAC (:class:`LocationSigner`) over its agent, lease id, descriptors,
  size, expiry and slot generation; a reader READs nothing whose tag does not verify under the key the encoder
  at the location's ``encoder_address`` gave it, so a handle cannot be moved onto another
  request's slot or lease;
- after every READ the consumer checks the slot header's generation against the location's
  (:mod:`epd.transport.connector.ec_consumer`), so a replayed handle whose slot was refilled is refused.

The reader fetches a producer's credentials with a non-blocking gRPC call whose future it polls,
caches them per encoder address, and fetches them again when a location does not verify or a
READ fails: a restarted encoder (a new process at the same address) has a new agent name, new
metadata and a new key, and the old ones are dropped.

Prepared descriptor lists. NIXL checks a READ's descriptors against both sides' registered
memory and prepares them for its backend; the reader has that done once rather than per READ:
its receive buffer, in 4 KiB pages, right after registering it, and each producer's arena (whose
address, length and slot size come with its credentials), in 4 KiB pages, when its metadata is
loaded. A READ then names pages by index, and NIXL merges consecutive ones into one range. Such
a READ is rounded up to whole pages: on the producer it stays within the item's own slots (an
item starts on a slot boundary and owns whole slots, which whole pages tile), on the consumer
within the pages the item was given. A batch holding a read that cannot be put so (a producer
that gave no arena, a destination off a page boundary) is read with descriptors of its own, as
before. A producer's prepared list is released before its metadata is dropped, and never while
a READ made from it runs (NIXL's cleanup order).

Locations' wire-level pieces (descriptor format, tag) live in :mod:`epd.transport.wire.location`,
which services can import without NIXL.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import time
from collections.abc import Hashable, Sequence

import grpc
import numpy as np
import torch

from epd.domain import NixlLocation
from epd.transport.memory.arena import ARENA_COUNTERS, Lease, SharedCounters
from epd.transport.memory.slots import PAGE_BYTES
from epd.transport.wire.agent import NixlAgent, Row
from epd.transport.wire.base import Read
from epd.transport.wire.credentials import TransferCredentials
from epd.transport.wire.errors import TransferError
from epd.transport.wire.location import LEASE_ID, LocationSigner, decode_descriptors, encode_descriptors

logger = logging.getLogger(__name__)

# A lease id list travels as one notification message, ids joined by this separator.
_LEASE_SEPARATOR = ","
# Lease ids a reader remembers having read, to refuse replays: far more than are live at once
# (a lease lives --lease-ttl-s at most), so a replay within a handle's life is always caught.
_CONSUMED_KEPT = 65536
_KEY_BYTES = 32


# ---- producer side ----------------------------------------------------------------------------


class NixlPublisher:
    """Producer side: one agent (no metadata listener), the arena buffer registered once."""

    def __init__(self, buffer: torch.Tensor, *, agent_name: str, bind_host: str) -> None:
        """Args:
        buffer: the :class:`~epd.transport.memory.arena.EmbeddingArena`'s whole buffer, made before
            this: the arena's slot layout, which the credentials tell consumers, is read from
            the counters the arena wrote at the buffer's start (a buffer without them gives
            consumers no arena; they then READ with per-READ descriptors).
        """
        self._agent = NixlAgent(agent_name, bind_host=bind_host, progress_thread=True)
        self.agent_name = agent_name
        self._base = buffer.data_ptr()
        self._registration = self._agent.register(buffer)
        # Registered once, so the metadata never changes for the life of this process.
        self.credentials = TransferCredentials(agent_name, self._agent.metadata(), secrets.token_bytes(_KEY_BYTES), *_arena_layout(buffer))
        self._signer = LocationSigner(self.credentials.location_key)

    def location(self, lease: Lease, expires_at_unix_s: float) -> NixlLocation:
        """How a consumer reaches a published lease: exactly its header and rows.

        ``encoder_address`` is left empty: the engine does not know its service's gRPC address;
        the encoder service fills it in before handing the location out.
        """
        descriptors = encode_descriptors([(self._base + lease.offset, lease.nbytes, 0)])
        location = NixlLocation(
            agent_name=self.agent_name,
            encoder_address="",
            descriptors=descriptors,
            nbytes=lease.nbytes,
            lease_id=lease.lease_id,
            slot_generation=lease.generation,
            expires_at_unix_ms=int(expires_at_unix_s * 1000),
            tag=b"",
        )
        return dataclasses.replace(location, tag=self._signer.tag(location))

    def ended_leases(self) -> list[str]:
        """Lease ids that consumers READ, or that their owner released, since the last call.
        Only peers that got the metadata over gRPC can notify; a lease ends only by its id."""
        ended: list[str] = []
        for messages in self._agent.take_notifications().values():
            for message in messages:
                ended += [lease for lease in message.decode("ascii", "replace").split(_LEASE_SEPARATOR) if LEASE_ID.fullmatch(lease)]
        return ended

    def close(self) -> None:
        self._agent.deregister(self._registration)


def _arena_layout(buffer: torch.Tensor) -> tuple[int, int, int]:
    """(address of the first slot, bytes of all slots, slot bytes) of the arena over ``buffer``,
    as :class:`~epd.transport.memory.arena.EmbeddingArena` lays it out (slots after its counters), or
    zeros when the buffer holds no arena's counters."""
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes < SharedCounters.BYTES:
        return 0, 0, 0
    counters = SharedCounters(buffer.view(torch.uint8), ARENA_COUNTERS)
    unit, slots = counters.get("slot_bytes"), counters.get("num_slots")
    if not unit or not slots or SharedCounters.BYTES + unit * slots > nbytes:
        return 0, 0, 0
    return buffer.data_ptr() + SharedCounters.BYTES, unit * slots, unit


class LeaseReleaser:
    """Ends a producer's leases without reading them, with the notification a READ would send.

    The encoder service uses it for leases the gateway gives back (a request failed or was
    aborted before its consumer read them). Its producer is the engine beside it, whose
    credentials it reads from shared memory: no network fetch.
    """

    def __init__(self, agent_name: str, credentials: TransferCredentials, *, bind_host: str) -> None:
        # A progress thread sends the notifications: nothing else here drives this agent.
        self._agent = NixlAgent(agent_name, bind_host=bind_host, progress_thread=True)
        self._peer = self._agent.load_peer(credentials.agent_metadata)

    def release(self, lease_ids: Sequence[str]) -> int:
        """Sends the well-formed ids (others can name no lease); returns how many.

        Raises:
            TransferError: NIXL could not notify the producer (its leases then expire).
        """
        valid = [lease for lease in lease_ids if LEASE_ID.fullmatch(lease)]
        if valid:
            self._agent.notify(self._peer, _LEASE_SEPARATOR.join(valid).encode())
        return len(valid)

    def close(self) -> None:
        try:
            self._agent.forget_peer(self._peer)
        except Exception:  # already gone on NIXL's side
            logger.debug("NIXL had no metadata left for agent %r", self._peer, exc_info=True)


# ---- consumer side ----------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Pending:
    read: Read
    needs_epoch: int  # the producer's credentials must have been fetched this many times first
    refetched: bool = False  # already waited for credentials fetched after it failed to verify


@dataclasses.dataclass
class _Producer:
    """One encoder address, as the reader knows it."""

    address: str
    channel: grpc.Channel
    credentials: TransferCredentials | None = None  # loaded into the agent
    signer: LocationSigner | None = None  # checks locations under the loaded credentials' key
    epoch: int = 0  # completed credential fetches
    fetch: grpc.Future | None = None
    incoming: TransferCredentials | None = None  # fetched; loaded once no READ from the old agent runs
    reload: bool = False  # a READ failed: load the metadata afresh even if it did not change
    pending: list[_Pending] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class _Arena:
    """A producer's arena, prepared in pages (see :meth:`NixlAgent.prepare`)."""

    prepared: int
    address: int  # of page 0
    pages: int
    unit_bytes: int  # the producer's slot size, a whole number of pages


@dataclasses.dataclass(slots=True)
class _Transfer:
    producer: str  # encoder address
    agent: str
    handle: int
    keys: list[Hashable]
    started: float


class NixlReader:
    """Consumer side: one agent, one registered buffer, one batched READ per producer per call.

    :meth:`submit` queues reads; :meth:`poll` progresses credential fetches and transfers and
    reports finished reads. Producers are independent: nothing waits on one producer while
    another's reads are ready, and no call blocks on the network. A read fails (never blocks)
    when its location does not verify, its lease is about to expire, its encoder cannot be
    reached, or the READ errs or outlives ``timeout_s``.

    A read's destination is the whole pages (``PAGE_BYTES``, counted from the buffer's start)
    that its bytes touch, as :class:`~epd.transport.connector.ec_consumer.ConsumerScheduler` allocates
    them: a READ through the prepared lists fills the last one to its end, with bytes of the
    item's own slot on the producer.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        *,
        agent_name: str,
        bind_host: str = "127.0.0.1",
        timeout_s: float = 10.0,
        expiry_margin_s: float = 0.5,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """Args:
        channel_credentials: TLS credentials for the gRPC calls to encoders (from
            :meth:`epd.transport.connector.ec_config.ConnectorConfig.channel_credentials`); None means
            plaintext, acceptable only where a network policy confines the encoders' port.
        """
        self._agent = NixlAgent(agent_name, bind_host=bind_host, progress_thread=False)
        self._base = buffer.data_ptr()
        self._registration = self._agent.register(buffer)
        self._pages = buffer.numel() * buffer.element_size() // PAGE_BYTES
        # 0, 1, 2, ... up to the most pages of this buffer or a producer's arena: a READ's page
        # indices are slices of it, made without allocating (see _page_indices).
        self._page_numbers = np.arange(self._pages, dtype=np.int32)
        try:
            self._local = self._agent.prepare(None, self._base, PAGE_BYTES, self._pages)
        except TransferError:
            self._agent.deregister(self._registration)
            raise
        self._arenas: dict[str, _Arena] = {}  # NIXL agent name -> its arena, prepared while its metadata is loaded
        # Prepared arenas whose agent was dropped while a READ made from them ran: released
        # once none does (agent name, handle).
        self._retired: list[tuple[str, int]] = []
        # Agents with a READ whose handle NIXL would not release (it may still run): their
        # prepared lists, and this buffer's, are never released.
        self._stuck: set[str] = set()
        self._timeout_s = timeout_s
        self._expiry_margin_ms = int(expiry_margin_s * 1000)
        self._channel_credentials = channel_credentials
        self._producers: dict[str, _Producer] = {}
        self._loaded: dict[str, str] = {}  # NIXL agent name -> encoder address it was loaded for
        self._transfers: list[_Transfer] = []
        self._finished: list[tuple[Hashable, str | None]] = []
        # Leases read here, newest last: a handle is good for one read (see _post).
        self._consumed: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def busy(self) -> bool:
        """Whether any read or release is in progress, or ended and not yet reported."""
        return bool(self._transfers or self._finished) or any(p.pending for p in self._producers.values())

    def submit(self, reads: Sequence[Read]) -> None:
        for read in reads:
            producer = self._producer(read.location.encoder_address)
            if producer is None:
                self._finished.append((read.key, f"encoder_address must be 'host:port', got {read.location.encoder_address!r}"))
            else:
                producer.pending.append(_Pending(read, producer.epoch + 1 if producer.reload else 1))

    def release(self, location: NixlLocation) -> None:
        """Ends a lease without reading it (its item is already here), by the encoder's
        ReleaseEmbeddings call, in the background. Not by a NIXL notification: to an encoder
        this agent has not talked to yet, that waits on a connection only polling would set
        up, and nothing polls once no READ is left."""
        from epd.v1 import encoder_pb2, encoder_pb2_grpc

        producer = self._producer(location.encoder_address)
        if producer is None:
            return
        stub = encoder_pb2_grpc.EncoderServiceStub(producer.channel)
        call = stub.ReleaseEmbeddings.future(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[location.lease_id]), timeout=self._timeout_s)
        call.add_done_callback(lambda done: _log_release_failure(done, location))

    def poll(self) -> list[tuple[Hashable, str | None]]:
        """Progresses everything once; returns (key, error or None) for reads that ended."""
        now = time.monotonic()
        for producer in list(self._producers.values()):
            self._progress_producer(producer, now)
        self._progress_transfers(now)
        finished, self._finished = self._finished, []
        return finished

    def close(self) -> None:
        for transfer in self._transfers:
            self._release_handle(transfer)
        self._transfers.clear()
        for name in list(self._arenas):
            self._release_arena(name)
        self._release_retired()
        if not self._stuck:
            self._agent.release_prepared(self._local)
        for producer in self._producers.values():
            if producer.fetch is not None:
                producer.fetch.cancel()
            producer.channel.close()
        self._producers.clear()
        self._agent.deregister(self._registration)

    # ---- internals ----------------------------------------------------------------------

    def _producer(self, address: str) -> _Producer | None:
        producer = self._producers.get(address)
        if producer is None:
            host, separator, port = address.rpartition(":")
            if not separator or not host or not port.isdigit():
                return None
            if self._channel_credentials is None:
                channel = grpc.insecure_channel(address)
            else:
                channel = grpc.secure_channel(address, self._channel_credentials)
            producer = self._producers[address] = _Producer(address, channel)
        return producer

    def _progress_producer(self, producer: _Producer, now: float) -> None:
        if producer.fetch is not None and producer.fetch.done():
            self._fetched(producer)
            if producer.address not in self._producers:
                return  # unreachable and unknown: dropped
        if producer.incoming is not None:
            self._load_incoming(producer)
        if not producer.pending:
            return
        wanted = max((p.needs_epoch for p in producer.pending), default=0)
        if producer.reload and wanted:
            wanted = producer.epoch + 1
        if wanted > producer.epoch and producer.fetch is None and producer.incoming is None:
            self._start_fetch(producer)
        if producer.credentials is None or producer.incoming is not None:
            return
        ready = [p for p in producer.pending if p.needs_epoch <= producer.epoch]
        if not ready:
            return
        producer.pending = [p for p in producer.pending if p.needs_epoch > producer.epoch]
        verified = []
        for pending in ready:
            if self._verifies(pending.read.location, producer):
                verified.append(pending.read)
            elif not pending.refetched:
                # Checked against credentials cached before this read came: the encoder may have
                # restarted since (new agent, new key). Fetch them once more before refusing it.
                producer.pending.append(_Pending(pending.read, producer.epoch + 1, refetched=True))
            else:
                self._finished.append((pending.read.key, _refusal(pending.read.location, producer)))
        if verified:
            self._post(producer, verified, now)

    def _start_fetch(self, producer: _Producer) -> None:
        from epd.v1 import encoder_pb2, encoder_pb2_grpc

        stub = encoder_pb2_grpc.EncoderServiceStub(producer.channel)
        producer.fetch = stub.GetTransferMetadata.future(encoder_pb2.GetTransferMetadataRequest(), timeout=self._timeout_s)

    def _fetched(self, producer: _Producer) -> None:
        """A credential fetch ended: on failure only this producer's reads fail."""
        fetch, producer.fetch = producer.fetch, None
        try:
            response = fetch.result()
        except grpc.RpcError as exc:
            reason = f"no transfer metadata from the encoder at {producer.address}: {exc.code().name} {exc.details()}"
            self._fail_waiting(producer, reason)
            if producer.credentials is None and not self._has_transfers(producer.address):
                producer.channel.close()
                del self._producers[producer.address]
            return
        fetched = TransferCredentials.from_wire(response)
        if fetched == producer.credentials and not producer.reload:
            producer.epoch += 1
            return
        owner = self._loaded.get(fetched.agent_name)
        if owner is not None and owner != producer.address:
            # Agent names are unique per process; another address claiming a loaded one is
            # forged or misconfigured, and must not take the real producer's metadata away.
            self._fail_waiting(producer, f"the encoder at {producer.address} claims NIXL agent {fetched.agent_name!r}, already served by {owner}")
            return
        producer.incoming = fetched

    def _load_incoming(self, producer: _Producer) -> None:
        """Swaps in newly fetched credentials once no READ from the old agent is running (NIXL
        must not drop an agent's metadata under a running transfer), and prepares the new
        agent's arena."""
        old = producer.credentials
        if old is not None:
            if any(t.agent == old.agent_name for t in self._transfers):
                return
            self._forget_agent(old.agent_name)
        incoming, producer.incoming, producer.reload = producer.incoming, None, False
        producer.credentials, producer.signer = None, None  # set together again once the new agent is loaded
        try:
            name = self._agent.load_peer(incoming.agent_metadata)
            if name != incoming.agent_name:
                # An agent's metadata stays bound to the address it was first fetched from: one
                # another address serves (a forged peer replaying a real encoder's metadata)
                # is never dropped for it.
                if self._loaded.get(name, producer.address) == producer.address:
                    self._forget_agent(name)
                raise TransferError(f"the encoder at {producer.address} sent metadata of agent {name!r} as {incoming.agent_name!r}")
        except TransferError as exc:
            # Nothing is loaded now, so the next read must fetch and load afresh: without
            # ``reload`` it would wait for a fetch that counts as done and never comes.
            producer.epoch += 1
            producer.reload = True
            self._fail_waiting(producer, str(exc))
            return
        if old is not None:
            logger.info("encoder at %s: NIXL agent %r replaced by %r (restarted)", producer.address, old.agent_name, name)
        self._loaded[name] = producer.address
        self._prepare_arena(producer, name, incoming)
        producer.credentials, producer.signer = incoming, LocationSigner(incoming.location_key)
        producer.epoch += 1

    def _prepare_arena(self, producer: _Producer, name: str, credentials: TransferCredentials) -> None:
        """Prepares the producer's arena in pages, if whole pages tile its slots; else its READs
        carry their own descriptors."""
        address, nbytes, unit = credentials.arena_address, credentials.arena_bytes, credentials.arena_unit_bytes
        self._release_arena(name)  # one list per agent, prepared from the metadata loaded now
        if not unit or unit % PAGE_BYTES or not nbytes or nbytes % unit:
            return
        try:
            prepared = self._agent.prepare(name, address, PAGE_BYTES, nbytes // PAGE_BYTES)
        except TransferError as exc:  # e.g. an arena outside the registered memory: a broken producer
            logger.warning("encoder at %s: its arena cannot be prepared, so each READ carries its own descriptors: %s", producer.address, exc)
            return
        self._arenas[name] = _Arena(prepared, address, nbytes // PAGE_BYTES, unit)
        if nbytes // PAGE_BYTES > len(self._page_numbers):
            self._page_numbers = np.arange(nbytes // PAGE_BYTES, dtype=np.int32)

    def _verifies(self, location: NixlLocation, producer: _Producer) -> bool:
        return location.agent_name == producer.credentials.agent_name and producer.signer.verifies(location)

    def _post(self, producer: _Producer, reads: list[Read], now: float) -> None:
        agent = producer.credentials.agent_name
        cutoff_ms = time.time_ns() // 1_000_000 + self._expiry_margin_ms
        posted: list[tuple[Read, list[Row]]] = []
        for read in reads:
            if read.location.lease_id in self._consumed:
                # A replayed handle: its READ ended the lease, and a fill the encoder keeps as its
                # cache would still answer it until the handle expires.
                self._finished.append((read.key, f"lease {read.location.lease_id} from {agent!r} was read here already: a handle is good for one read"))
                continue
            if read.location.expires_at_unix_ms <= cutoff_ms:
                self._finished.append(
                    (read.key, f"lease {read.location.lease_id} from {agent!r} expired or expires within {self._expiry_margin_ms} ms")
                )
                continue
            try:
                rows = decode_descriptors(read.location.descriptors)
            except ValueError as exc:
                self._finished.append((read.key, str(exc)))
                continue
            posted.append((read, rows))
        if not posted:
            return
        notification = _LEASE_SEPARATOR.join(read.location.lease_id for read, _ in posted).encode()
        arena = self._arenas.get(agent)
        indices = self._page_indices(arena, posted) if arena is not None else None
        try:
            if indices is not None:
                handle = self._agent.post_prepared_read(agent, self._local, indices[0], arena.prepared, indices[1], notification)
            else:
                handle = self._agent.post_read(agent, *self._ranges(posted), notification)
        except TransferError as exc:
            self._needs_reload(producer)  # most refusals mean the producer restarted or left
            self._finished += [(read.key, str(exc)) for read, _ in posted]
            return
        self._transfers.append(_Transfer(producer.address, agent, handle, [read.key for read, _ in posted], now))
        for read, _ in posted:
            self._consumed[read.location.lease_id] = None
        while len(self._consumed) > _CONSUMED_KEPT:
            self._consumed.popitem(last=False)

    def _page_indices(self, arena: _Arena, posted: list[tuple[Read, list[Row]]]) -> tuple[np.ndarray, np.ndarray] | None:
        """(local, remote) page indices for the prepared lists, each item rounded up to whole
        pages, or None when some read cannot be put so safely: then the batch's READ carries
        descriptors of exactly its reads' bytes (:meth:`_ranges`), as one READ still.

        Rounding is safe when the item is one range starting on a slot of the arena (it owns
        whole slots, and whole pages tile a slot) and its destination starts on a page of this
        buffer (it owns the pages its bytes touch). Producers publish every item so, and
        :class:`~epd.transport.connector.ec_consumer.ConsumerScheduler` puts every item on a page.
        """
        numbers = self._page_numbers
        local, remote = [], []
        for read, rows in posted:
            if len(rows) != 1:
                return None
            address, length, device = rows[0]
            into_arena = address - arena.address
            pages = -(-length // PAGE_BYTES)
            first_local, off_page = divmod(read.offset, PAGE_BYTES)
            first_remote, off_slot = divmod(into_arena, arena.unit_bytes)
            first_remote *= arena.unit_bytes // PAGE_BYTES
            if device or length <= 0 or off_page or read.offset < 0 or first_local + pages > self._pages:
                return None
            if into_arena < 0 or off_slot or first_remote + pages > arena.pages:
                return None
            local.append(numbers[first_local : first_local + pages])
            remote.append(numbers[first_remote : first_remote + pages])
        if len(posted) == 1:
            return local[0], remote[0]
        return np.concatenate(local), np.concatenate(remote)

    def _ranges(self, posted: list[tuple[Read, list[Row]]]) -> tuple[list[Row], list[Row]]:
        """(local, remote) descriptors of exactly the reads' bytes, for a READ of its own."""
        local: list[Row] = []
        remote: list[Row] = []
        for read, rows in posted:
            address = self._base + read.offset
            for row in rows:
                remote.append(row)
                local.append((address, row[1], 0))
                address += row[1]
        return local, remote

    def _progress_transfers(self, now: float) -> None:
        running = []
        for transfer in self._transfers:
            state = self._agent.state(transfer.handle)
            if state == "PROC" and now - transfer.started <= self._timeout_s:
                running.append(transfer)
                continue
            error = None
            if state == "ERR":
                error = f"READ from NIXL agent {transfer.agent!r} failed"
            elif state == "PROC":
                error = f"READ from NIXL agent {transfer.agent!r} timed out after {self._timeout_s} s"
            if error is not None and transfer.producer in self._producers:
                self._needs_reload(self._producers[transfer.producer])
            if not self._release_handle(transfer) and error is None:
                error = "could not release the transfer handle"
            self._finished += [(key, error) for key in transfer.keys]
        self._transfers = running
        if self._retired:
            self._release_retired()

    def _release_handle(self, transfer: _Transfer) -> bool:
        try:
            self._agent.release(transfer.handle)
            return True
        except Exception:
            logger.exception("could not cancel a READ from NIXL agent %r", transfer.agent)
            self._stuck.add(transfer.agent)
            return False

    def _needs_reload(self, producer: _Producer) -> None:
        """A READ failed: fetch the credentials and load the metadata afresh before the next one
        (the encoder may have restarted; a broken connection needs new metadata anyway)."""
        producer.reload = True
        for pending in producer.pending:
            pending.needs_epoch = max(pending.needs_epoch, producer.epoch + 1)

    def _has_transfers(self, address: str) -> bool:
        return any(t.producer == address for t in self._transfers)

    def _fail_waiting(self, producer: _Producer, reason: str) -> None:
        """Fails the reads that wait for this producer's credentials; verified ones keep going."""
        waiting = [p for p in producer.pending if p.needs_epoch > producer.epoch or producer.credentials is None]
        producer.pending = [p for p in producer.pending if p not in waiting]
        self._finished += [(p.read.key, reason) for p in waiting]

    def _forget_agent(self, name: str) -> None:
        # Its prepared arena goes with the metadata it was prepared from: NIXL refuses READs
        # from it afterwards, even if the same agent is loaded again.
        self._release_arena(name)
        self._loaded.pop(name, None)
        try:
            self._agent.forget_peer(name)
        except Exception:  # already gone on NIXL's side
            logger.debug("NIXL had no metadata left for agent %r", name, exc_info=True)

    def _release_arena(self, name: str) -> None:
        """Drops an agent's prepared arena: released now, or once no READ made from it runs."""
        arena = self._arenas.pop(name, None)
        if arena is not None:
            self._retired.append((name, arena.prepared))
            self._release_retired()

    def _release_retired(self) -> None:
        running = {t.agent for t in self._transfers} | self._stuck  # a stuck READ may still run
        kept = []
        for name, prepared in self._retired:
            if name in running:
                kept.append((name, prepared))
            else:
                self._agent.release_prepared(prepared)
        self._retired = kept


def _log_release_failure(call: grpc.Future, location: NixlLocation) -> None:
    if call.cancelled() or call.exception() is not None:
        error = "cancelled" if call.cancelled() else f"{call.exception().code().name} {call.exception().details()}"
        logger.warning("could not release lease %s on the encoder at %s (it expires by TTL): %s", location.lease_id, location.encoder_address, error)


def _refusal(location: NixlLocation, producer: _Producer) -> str:
    field = "agent_name" if location.agent_name != producer.credentials.agent_name else "location_tag"
    return (
        f"embedding.nixl.{field}: the location does not verify under the credentials of the encoder at {producer.address} "
        f"(agent {producer.credentials.agent_name!r}): forged, altered, or from another encoder process; nothing was read"
    )

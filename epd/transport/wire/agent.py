"""Thin adapter over the NIXL agent bindings, limited to what the embedding transport uses.

Why the bindings rather than ``nixl._api.nixl_agent``: that wrapper hardcodes a progress thread
that polls with a zero timeout, which keeps one core at 100% for as long as the agent lives. The
bindings accept a wakeup period. Everything else here maps one-to-one onto a wrapper method, so
if the bindings change, only this module needs to follow.

No agent here opens NIXL's metadata listener: that listener hands this agent's metadata (the keys
to its registered memory) to anyone who connects, unauthenticated. Metadata travels only over
EPD's gRPC channel instead (see :mod:`epd.transport.wire.nixl`), as bytes from :meth:`NixlAgent.metadata`
loaded with :meth:`NixlAgent.load_peer`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import psutil
import torch
from nixl import _bindings as nixlb

from epd.transport.wire.errors import TransferError
from epd.transport.wire.location import Row

logger = logging.getLogger(__name__)

# The progress thread sleeps in poll() on UCX's event fds, so it wakes as soon as there is work;
# this is only its fallback wakeup (NIXL rounds it up to whole milliseconds).
PROGRESS_WAKEUP_US = 1_000

# UCX's shared-memory transports (posix, sysv) declare no peer-failure handling unless told to,
# and NIXL's UCX backend asks for it, so by default every notification between two agents of one
# host went over TCP loopback: 30-50 µs on each READ, and a slower READ after it. With these, the
# notifications take shared memory; a killed peer is still reported (NIXL_ERR_REMOTE_DISCONNECT),
# data still moves by CMA, and other hosts are still reached over TCP.
_UCX_SHARED_MEMORY_DEFAULTS = {"UCX_POSIX_ERROR_HANDLING": "y", "UCX_SYSV_ERROR_HANDLING": "y"}
# UCX's memory hooks, which its registration caches need to see memory unmapped, are installed
# when its first context starts, by patching the relocations of every library loaded: with
# torch's loaded that took 0.41 s of every encoder, prefill and decode start (10 ms without).
# NIXL hands UCX the registration of every buffer it moves (registered once, at start), so no
# cache is consulted and nothing needs the hooks; NIXL upstream turns them off alike
# (ai-dynamo/nixl#1762).
_UCX_NO_MEMORY_HOOKS = {"UCX_MEM_EVENTS": "no"}

XferState = Literal["DONE", "PROC", "ERR"]


class NixlAgent:
    """One NIXL agent with the UCX backend, and no metadata listener."""

    def __init__(self, name: str, *, bind_host: str, progress_thread: bool) -> None:
        """Creates the agent and starts its progress thread, if asked.

        Args:
            name: Agent name; peers address this agent by it, so it must be unique among peers.
            bind_host: The service's host: UCX's TCP endpoints listen only on the network device
                that carries this address (see :func:`configure_ucx`).
            progress_thread: Whether a thread progresses UCX in the background. A READ's target
                needs one: nothing else would answer connection setup, take in notifications
                or, over TCP, serve the READ itself. An initiator progresses its transfers by
                polling their state; a background thread there only competes for the worker.

        Raises:
            RuntimeError: If NIXL cannot start its UCX backend.
        """
        configure_ucx(bind_host)
        config = nixlb.nixlAgentConfig()
        config.useProgThread = progress_thread
        config.pthrDelay = PROGRESS_WAKEUP_US
        config.useListenThread = False
        # Callers publish and reap from different threads, besides NIXL's own two threads.
        config.syncMode = nixlb.NIXL_THREAD_SYNC_STRICT
        self.name = name
        self._agent = nixlb.nixlAgent(name, config)
        self._agent.createBackend("UCX", {})

    def register(self, buffer: torch.Tensor) -> Any:
        """Registers a contiguous CPU buffer for transfers.

        Each registration changes this agent's metadata, which peers would have to fetch again,
        so register once, at startup.

        Returns:
            An opaque token for :meth:`deregister`.
        """
        registration = nixlb.nixlRegDList(
            nixlb.DRAM_SEG, [(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0, "")]
        )
        self._agent.registerMem(registration, [])
        return registration

    def deregister(self, registration: Any) -> None:
        """Undoes :meth:`register`."""
        self._agent.deregisterMem(registration, [])

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Returns and clears the notifications received so far, keyed by sender agent name."""
        notifications: dict[str, list[bytes]] = self._agent.getNotifs({}, [])
        return notifications

    def metadata(self) -> bytes:
        """This agent's metadata: what a peer must load to READ its registered memory. A secret:
        whoever holds it (and can reach this host) can read that memory."""
        return bytes(self._agent.getLocalMD())

    def load_peer(self, metadata: bytes) -> str:
        """Loads a peer's metadata (from :meth:`metadata`); returns the peer's agent name.

        Local work only (UCX connects lazily, on the first transfer or notification).

        Raises:
            TransferError: NIXL refused the bytes.
        """
        try:
            return bytes(self._agent.loadRemoteMD(metadata)).decode()
        except Exception as exc:  # the bindings raise one exception class per NIXL status
            raise TransferError(f"NIXL refused a peer's metadata: {exc!r}") from exc

    def notify(self, peer: str, message: bytes) -> None:
        """Sends ``peer`` a notification outside any transfer; its metadata must be loaded.

        Raises:
            TransferError: NIXL refused (peer unknown or gone).
        """
        try:
            self._agent.genNotif(peer, message)
        except Exception as exc:
            raise TransferError(f"notifying NIXL agent {peer!r} failed: {exc!r}") from exc

    def forget_peer(self, peer: str) -> None:
        """Drops ``peer``'s metadata and connection, so the next contact starts afresh."""
        self._agent.invalidateRemoteMD(peer)

    def post_read(
        self, peer: str, local: Sequence[Row], remote: Sequence[Row], notification: bytes
    ) -> int:
        """Starts one READ of ``remote`` ranges of ``peer`` into ``local`` ranges, pairwise.

        ``peer`` receives ``notification`` once the whole READ is complete. NIXL checks and
        prepares both lists for this READ alone; :meth:`post_prepared_read` skips that work.

        Returns:
            The transfer handle; pass it to :meth:`state` and always to :meth:`release`.

        Raises:
            TransferError: If NIXL refuses the READ (unknown peer, ranges outside its
                registered memory, peer disconnected). No handle is left behind.
        """
        try:
            handle = int(
                self._agent.createXferReq(
                    nixlb.NIXL_READ, _xfer_list(local), _xfer_list(remote), peer, notification, []
                )
            )
        except Exception as exc:  # the bindings raise one exception class per NIXL status
            raise TransferError(f"NIXL refused a READ from agent {peer!r}: {exc!r}") from exc
        return self._post(handle, peer)

    def prepare(self, peer: str | None, address: int, unit: int, count: int) -> int:
        """Prepares ``count`` consecutive ``unit``-byte ranges from ``address``, once, for
        :meth:`post_prepared_read` to select by index: of this agent's registered memory
        (``peer`` None) or of a loaded peer's.

        NIXL keeps the list compressed (one strided entry), so its size does not depend on
        ``count``. It holds the peer's metadata as loaded now: after :meth:`forget_peer` it is
        unusable (NIXL refuses READs made from it) and must be released.

        Returns:
            A handle for :meth:`post_prepared_read` and :meth:`release_prepared`.

        Raises:
            TransferError: NIXL refused (peer not loaded, ranges outside its registered memory).
        """
        rows = np.array([[address, unit, 0, unit, count]], dtype=np.uint64)  # address, length, device, stride, count
        try:
            return int(self._agent.prepXferDlist(nixlb.NIXL_INIT_AGENT if peer is None else peer, nixlb.DRAM_SEG, rows, []))
        except Exception as exc:  # the bindings raise one exception class per NIXL status
            raise TransferError(f"NIXL refused to prepare {count} x {unit} bytes of {peer or 'this agent'!r}: {exc!r}") from exc

    def release_prepared(self, prepared: int) -> None:
        """Frees a list from :meth:`prepare`. Release the transfers made from it first (NIXL's
        cleanup order); a later READ from it would use freed memory."""
        self._agent.releasedDlistH(prepared)

    def post_prepared_read(
        self,
        peer: str,
        local: int,
        local_indices: np.ndarray,
        remote: int,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> int:
        """Like :meth:`post_read`, with ranges selected from prepared lists (:meth:`prepare`):
        ``remote_indices`` of ``peer``'s list ``remote`` into ``local_indices`` of this agent's
        list ``local``, pairwise (int32 arrays; NIXL merges runs of consecutive indices into
        one range).

        Returns:
            The transfer handle; pass it to :meth:`state` and always to :meth:`release`.

        Raises:
            TransferError: If NIXL refuses the READ (an index out of range, ``peer``'s metadata
                forgotten or reloaded since ``remote`` was prepared, peer disconnected). No
                handle is left behind.
        """
        try:
            handle = int(self._agent.makeXferReq(nixlb.NIXL_READ, local, local_indices, remote, remote_indices, notification, [], False))
        except Exception as exc:  # the bindings raise one exception class per NIXL status
            raise TransferError(f"NIXL refused a READ from agent {peer!r}: {exc!r}") from exc
        return self._post(handle, peer)

    def _post(self, handle: int, peer: str) -> int:
        """Posts a READ made by :meth:`post_read` or :meth:`post_prepared_read`; on failure,
        releases it."""
        try:
            status = self._agent.postXferReq(handle, b"")  # empty keeps the notification it was made with
        except Exception as exc:
            self._agent.releaseXferReq(handle)
            raise TransferError(f"posting a READ from agent {peer!r} failed: {exc!r}") from exc
        if status not in (nixlb.NIXL_SUCCESS, nixlb.NIXL_IN_PROG):
            self._agent.releaseXferReq(handle)
            raise TransferError(f"posting a READ from agent {peer!r} failed: {status}")
        return handle

    def state(self, handle: int) -> XferState:
        """Progresses the transfer and reports whether it is done, in progress or failed."""
        try:
            status = self._agent.getXferStatus(handle)
        except Exception:  # e.g. the peer disconnected mid-transfer
            return "ERR"
        if status == nixlb.NIXL_SUCCESS:
            return "DONE"
        if status == nixlb.NIXL_IN_PROG:
            return "PROC"
        return "ERR"

    def release(self, handle: int) -> None:
        """Frees a transfer handle, cancelling the transfer if it is still running.

        Raises:
            RuntimeError: If NIXL could not cancel it (the bindings may raise their own error
                class instead); the READ may then still write into local memory.
        """
        status = self._agent.releaseXferReq(handle)
        if status != nixlb.NIXL_SUCCESS:
            raise RuntimeError(f"releasing NIXL transfer handle failed: {status}")


def _xfer_list(rows: Sequence[Row]) -> Any:
    return nixlb.nixlXferDList(nixlb.DRAM_SEG, list(rows))


def configure_ucx(bind_host: str) -> None:
    """Sets this process's UCX knobs; UCX reads them from the environment when a backend starts,
    so call it before the first one (vLLM's KV agent's, or EPD's). An operator's own setting wins.

    - Notifications between agents of one host take shared memory (see
      ``_UCX_SHARED_MEMORY_DEFAULTS``).
    - No memory hooks (``_UCX_NO_MEMORY_HOOKS``).
    - UCX listens only on the network device that carries ``bind_host``. It opens a TCP listener
      on every device by default (0.0.0.0 in effect). Shared-memory transports between processes
      of one host are unaffected. A wildcard host, or one no local device carries (an address
      behind NAT), leaves UCX's default, with a warning for the latter.
    """
    for name, value in (_UCX_SHARED_MEMORY_DEFAULTS | _UCX_NO_MEMORY_HOOKS).items():
        os.environ.setdefault(name, value)
    if "UCX_NET_DEVICES" in os.environ or bind_host in ("", "0.0.0.0"):
        return
    try:
        ip = ipaddress.IPv4Address(socket.gethostbyname(bind_host))
    except (OSError, ValueError):
        logger.warning("cannot resolve NIXL bind host %r; UCX listens on every network device", bind_host)
        return
    for device, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and ipaddress.IPv4Address(a.address) == ip for a in addresses):
            os.environ["UCX_NET_DEVICES"] = device
            return
    logger.warning("no network device carries %s; UCX listens on every one (set UCX_NET_DEVICES)", ip)

"""Thin adapter over the NIXL agent bindings, limited to what the embedding transport uses.

Why the bindings rather than ``nixl._api.nixl_agent``: that wrapper hardcodes two thread timings
that are wrong for CPU serving hosts. Its UCX progress thread polls with a zero timeout, which
keeps one core at 100% for as long as the agent lives, and its metadata listener sleeps 100 ms
between rounds, so every first contact with a peer takes over 100 ms. The bindings accept both
settings. Everything else here maps one-to-one onto a wrapper method, so if the bindings change,
only this module needs to follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from nixl import _bindings as nixlb

from epd.transport.errors import TransferError

# The progress thread sleeps in poll() on UCX's event fds, so it wakes as soon as there is work;
# this is only its fallback wakeup (NIXL rounds it up to whole milliseconds).
_PROGRESS_WAKEUP_US = 1_000
# How long a metadata request can wait for the listener thread, once per peer. The thread also
# executes this agent's own outgoing metadata requests.
_LISTENER_WAKEUP_US = 10_000

Row = tuple[int, int, int]
"""One contiguous DRAM range as NIXL describes it: (address, length in bytes, device id)."""

XferState = Literal["DONE", "PROC", "ERR"]


class NixlAgent:
    """One NIXL agent with the UCX backend and a metadata listener thread."""

    def __init__(self, name: str, *, listen_port: int, progress_thread: bool) -> None:
        """Creates the agent and starts its threads.

        Args:
            name: Agent name; peers address this agent by it, so it must be unique among peers.
            listen_port: TCP port for the metadata listener, bound on all interfaces. 0 lets the
                OS choose, but NIXL cannot report which port it got.
            progress_thread: Whether a thread progresses UCX in the background. A READ's target
                needs one: nothing else would answer connection setup, take in notifications
                or, over TCP, serve the READ itself. An initiator progresses its transfers by
                polling their state; a background thread there only competes for the worker.

        Raises:
            RuntimeError: If NIXL cannot start, e.g. the listener port is taken.
        """
        config = nixlb.nixlAgentConfig()
        config.useProgThread = progress_thread
        config.pthrDelay = _PROGRESS_WAKEUP_US
        config.useListenThread = True
        config.listenPort = listen_port
        config.lthrDelay = _LISTENER_WAKEUP_US
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

    def request_metadata(self, peer: str, ip: str, port: int) -> None:
        """Asks the listener at ``ip:port`` for ``peer``'s metadata; it loads asynchronously."""
        self._agent.fetchRemoteMD(peer, ip, port, "")

    def has_metadata(self, peer: str) -> bool:
        """Whether ``peer``'s metadata is loaded, i.e. READs from it can be posted."""
        status = self._agent.checkRemoteMD(peer, nixlb.nixlXferDList(nixlb.DRAM_SEG))
        return bool(status == nixlb.NIXL_SUCCESS)

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

        ``peer`` receives ``notification`` once the whole READ is complete.

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
        try:
            status = self._agent.postXferReq(handle, b"")  # empty keeps the notification above
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

"""The encoder-output cache's fast path: leases on outputs the arena already holds, granted
without an engine step.

A repeated item needs neither its media decoded, nor vLLM's processor, nor the tower: only a
lease on the arena fill that holds its output, and what vLLM published of the item when its tower
ran. Asking the engine for that would still cost a step, and an encoder engine's step is a tower
run (hundreds of ms for one large image on a CPU), so a hit would wait behind other requests'
misses. The producer (beside vLLM's scheduler, where the arena lives) therefore answers such
lookups from a thread of its own, over a Unix socket that only this user may open, named like the
engine's shared buffers. The encoder service asks it first and runs the engine only for requests
with an item it does not hold.

Frames are msgpack: a list of content hashes in; out, the items' ``ec_transfer_params`` as a
finished engine request returns them, or nil. All or nothing: a request the desk cannot serve
whole gets no lease from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Any

import msgspec

from epd.transport.shared_buffer import find, owned_path

logger = logging.getLogger(__name__)


class CacheDesk:
    """The engine side: ``grant(keys)`` runs on the desk's threads, never on vLLM's scheduler's."""

    def __init__(self, name: str, grant: Callable[[list[str]], dict[str, Any] | None]) -> None:
        self._grant = grant
        self.path = owned_path(name)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(str(self.path))
        os.chmod(self.path, 0o600)  # the leases it grants let a reader into the arena
        self._socket.listen()
        self._peers: set[socket.socket] = set()
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, name="epd-ec-desk", daemon=True).start()

    def close(self) -> None:
        """Stops answering: the listener and every open connection are shut down."""
        with self._lock:
            self._closed = True
            sockets, self._peers = [self._socket, *self._peers], set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
        self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept_loop(self) -> None:
        while True:
            try:
                peer, _ = self._socket.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    peer.close()
                    return
                self._peers.add(peer)
            threading.Thread(target=self._serve, args=(peer,), name="epd-ec-desk-peer", daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        with Connection(os.dup(peer.fileno())) as conn:
            try:
                self._answer(conn)
            finally:
                with self._lock:
                    self._peers.discard(peer)
                peer.close()

    def _answer(self, conn: Connection) -> None:
        while True:
            try:
                keys = msgspec.msgpack.decode(conn.recv_bytes(), type=list[str])
            except (EOFError, OSError):
                return
            except msgspec.DecodeError:
                logger.warning("EPD cache desk: a malformed lookup; closing its connection")
                return
            try:
                granted = self._grant(keys)
            except Exception:
                logger.exception("EPD cache desk: granting leases failed")
                granted = None
            try:
                conn.send_bytes(msgspec.msgpack.encode(granted))
            except OSError:
                return


class CacheDeskClient:
    """The encoder service's side: one connection, one lookup at a time (each takes microseconds)."""

    def __init__(self, name: str, timeout_s: float = 1.0) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def lease(self, keys: list[str]) -> dict[str, Any] | None:
        """Leases on every key's held output with what was published of it, or None when the desk
        holds not all of them or cannot be reached (the engine then serves the request). Blocks:
        call it off the event loop."""
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = Client(str(find(self._name)), family="AF_UNIX")
                self._conn.send_bytes(msgspec.msgpack.encode(keys))
                if not self._conn.poll(self._timeout_s):
                    # Leases it grants after this expire by their TTL: nobody will read them.
                    raise TimeoutError(f"no answer within {self._timeout_s} s")
                return msgspec.msgpack.decode(self._conn.recv_bytes())
            except (OSError, EOFError, TimeoutError, msgspec.DecodeError) as exc:
                logger.warning("EPD cache desk unavailable (%s); the encoder engine serves the request", exc)
                self._close()
                return None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

"""The engine core's desk: questions the service asks of the connectors inside the engine core,
answered from a thread of its own beside vLLM's scheduler, over a Unix socket that only this user
may open, named like the engine's shared buffers. One desk serves every connector of an engine
core (a prefill's EC consumer and KV producer share it: :func:`open_desk`). Three questions:

- ``LeaseHeld`` (an encoder's producer; the encoder-output cache's fast path). A repeated item needs
  neither its media decoded, nor vLLM's processor, nor the tower: only a lease on the arena fill
  that holds its output, and what vLLM published of the item when its tower ran. Asking the
  engine for that would still cost a step, and an encoder engine's step is a tower run (hundreds
  of ms for one large image on a CPU), so a hit would wait behind other requests' misses. The
  answer is the items' ``ec_transfer_params`` as a finished engine request returns them, or nil:
  all or nothing, a request the desk cannot serve whole gets no lease from it.
- ``WhyFailed`` (any engine). vLLM ends a request it failed with finish reason "error" and nothing
  more; the connector that failed it knows why (an EC consumer: an encoder it could not reach, a
  lease that ran out; the KV connector: a prefill it could not handshake with, a READ that failed)
  and notes it in the desk's :class:`FailureLedger`, for the status the client gets.
- ``GaveUp`` (an encoder's producer). The encoder service stopped waiting for a request (its caller
  cancelled, or it waited past its queue timeout). Its engine request may have finished already,
  its output on the way to a caller that is gone, or finish before vLLM sees the abort: either
  way the producer frees the leases it published, which nobody would read before their TTL
  (:class:`epd.transport.memory.claims.ClaimLedger`).

Frames are msgpack, the question tagged by its type.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import Any

import msgspec

from epd.transport.memory.shared_buffer import find, owned_path

logger = logging.getLogger(__name__)


class LeaseHeld(msgspec.Struct, tag=True):
    keys: list[str]  # content hashes


class WhyFailed(msgspec.Struct, tag=True):
    request_id: str


class GaveUp(msgspec.Struct, tag=True):
    request_id: str


Question = LeaseHeld | WhyFailed | GaveUp

# What a reason noted for the caller's input, not for a transfer that failed, says: the service
# reports such a failure as INVALID_ARGUMENT on the field named (CALLER_FAULTS), not UNAVAILABLE.
HANDOFF_REFUSED = "its kv_handoff does not fit this engine's KV cache"  # the KV connector's
EMBEDDING_REFUSED = "an embedding handle holds another item than its content hash names"  # the EC consumer's
CALLER_FAULTS = {HANDOFF_REFUSED: "kv_handoff", EMBEDDING_REFUSED: "items"}

# Reasons kept for requests the service has not asked about yet (it asks at once, so this only
# bounds what requests nobody asks about, such as aborted ones, leave behind).
_FAILURES_KEPT = 1024


def is_engine_id_of(internal_id: str, request_id: str) -> bool:
    """Whether vLLM's engine core knows the service's request ``request_id`` as ``internal_id``:
    that id plus "-" and 8 random characters (or it alone, with the randomization turned off)."""
    return internal_id == request_id or (internal_id.startswith(f"{request_id}-") and len(internal_id) == len(request_id) + 9)


class FailureLedger:
    """Why the engine core failed its latest requests, by vLLM's request id; thread-safe."""

    def __init__(self) -> None:
        self._reasons: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, reason: str) -> None:
        """Notes why vLLM's request ``request_id`` failed; its first reason stands (the cause, not
        what followed from it)."""
        with self._lock:
            self._reasons.setdefault(request_id, reason)
            while len(self._reasons) > _FAILURES_KEPT:
                self._reasons.popitem(last=False)

    def take(self, request_id: str) -> str | None:
        """Why the service's request ``request_id`` failed, if a connector noted it."""
        with self._lock:
            for internal_id in reversed(self._reasons):
                if is_engine_id_of(internal_id, request_id):
                    return self._reasons.pop(internal_id)
        return None


_open_desks: dict[str, ConnectorDesk] = {}
_open_desks_lock = threading.Lock()


def open_desk(name: str) -> ConnectorDesk:
    """This process's desk called ``name``, made by its first opener; each opener calls
    :meth:`ConnectorDesk.release` once, and the last one closes it."""
    with _open_desks_lock:
        desk = _open_desks.get(name)
        if desk is None:
            desk = _open_desks[name] = ConnectorDesk(name)
        desk._holders += 1
        return desk


class ConnectorDesk:
    """The engine side: each answer runs on the desk's threads, never on vLLM's scheduler's.
    ``WhyFailed`` is answered from :attr:`failures`; a connector registers the other answers it
    gives (:meth:`answer`), and a question nobody answers gets nil."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failures = FailureLedger()
        self._answers: dict[type, Callable[[Any], Any]] = {WhyFailed: lambda question: self.failures.take(question.request_id)}
        self._holders = 0
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
        threading.Thread(target=self._accept_loop, name="epd-desk", daemon=True).start()

    def answer(self, question: type, how: Callable[[Any], Any]) -> None:
        self._answers[question] = how

    def release(self) -> None:
        """One opener is done with the desk; the last one closes it."""
        with _open_desks_lock:
            self._holders -= 1
            if self._holders > 0:
                return
            _open_desks.pop(self.name, None)
        self._close()

    def _close(self) -> None:
        """Stops answering: the listener and every open connection are shut down. Only the last
        :meth:`release` calls it, so that no opener is left holding a closed desk."""
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
            threading.Thread(target=self._serve, args=(peer,), name="epd-desk-peer", daemon=True).start()

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
                question = _QUESTIONS.decode(conn.recv_bytes())
            except (EOFError, OSError):
                return
            except msgspec.DecodeError:
                logger.warning("EPD connector desk: a malformed question; closing its connection")
                return
            answer = self._answers.get(type(question))
            try:
                answered = answer(question) if answer is not None else None
            except Exception:
                logger.exception("EPD connector desk: answering %s failed", type(question).__name__)
                answered = None
            try:
                conn.send_bytes(msgspec.msgpack.encode(answered))
            except OSError:
                return


_QUESTIONS = msgspec.msgpack.Decoder(Question)


class ConnectorDeskClient:
    """The service's side: one connection, one question at a time (each takes microseconds).
    Its calls block: make them off the event loop."""

    def __init__(self, name: str, timeout_s: float = 1.0) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def lease(self, keys: list[str]) -> dict[str, Any] | None:
        """Leases on every key's held output with what was published of it, or None when the desk
        holds not all of them or cannot be reached (the engine then serves the request)."""
        # Leases granted after a timeout expire by their TTL: nobody will read them.
        return self._ask(LeaseHeld(keys), "the encoder engine serves the request")

    def why_failed(self, request_id: str) -> str | None:
        """Why the connector could not serve a request vLLM failed, if it knows."""
        return self._ask(WhyFailed(request_id), "the reason stays in the engine's log")

    def gave_up(self, request_id: str) -> None:
        """Frees what the request published, or will publish: the service will not read it."""
        self._ask(GaveUp(request_id), "its leases end by their TTL")

    def _ask(self, question: Question, otherwise: str) -> Any:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = Client(str(find(self._name)), family="AF_UNIX")
                self._conn.send_bytes(msgspec.msgpack.encode(question))
                if not self._conn.poll(self._timeout_s):
                    raise TimeoutError(f"no answer within {self._timeout_s} s")
                return msgspec.msgpack.decode(self._conn.recv_bytes())
            except (OSError, EOFError, TimeoutError, msgspec.DecodeError) as exc:
                logger.warning("EPD connector desk unavailable (%s); %s", exc, otherwise)
                self._close()
                return None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

"""The encoder-output cache's shared tier: published outputs in a Mooncake Store that every
encoder of a deployment reads, so an item encoded once is not encoded again when its owner is
gone, overloaded, or has evicted it (issue 10).

Why Mooncake Store: it is the seed system's choice, its TCP transport runs on hosts without RDMA
or GPUs, and its objects live in segments that a separate holder process contributes (``epd
shared-cache``), so they outlive the encoder that wrote them. Encoders join as clients that
contribute no memory: a dead encoder takes no object with it.

What moves is the arena fill itself (the slot header, then the rows), put from and got into the
arena buffer, which is registered with the store so no copy is made on either side. The header
travels along so the reader can check the shape and dtype before anything uses the rows.

Keys are ``epd/<namespace>/<content hash>``; the namespace names the checkpoint, its revision,
the engine's dtype and the vLLM release, so encoders of other checkpoints, dtypes or releases never
share outputs.

Puts run on a background thread, each under a lease that pins its fill until the bytes are
out. Pinned fills cannot be evicted, so the bytes waiting to be put are bounded: past the bound
an output is not shared (a tier that is slow or gone must not pin the arena full). Gets run on
the scheduler's thread, in the step that admits the request (about 1–8 ms for 1 MiB over
loopback TCP), which spares the tower its run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# The store client's own staging buffer. Puts and gets use the registered arena instead; this
# only backs the client's small internal transfers.
_LOCAL_BUFFER_BYTES = 1 << 20
# Lookups run on vLLM's scheduler thread: after one that failed or was this slow (a holder gone,
# its connections timing out), the tier is skipped for a while rather than stall every step.
_SLOW_LOOKUP_S = 0.5
_SKIP_AFTER_TROUBLE_S = 10.0


@dataclasses.dataclass(frozen=True)
class SharedTierConfig:
    master: str  # the Mooncake master's host:port
    metadata_server: str  # its HTTP metadata server, http://host:port/metadata
    local_host: str  # where this client's transfer engine listens (the engine's NIXL host)


class SharedTier:
    """One encoder engine's client of the shared tier, over its arena buffer."""

    def __init__(self, config: SharedTierConfig, buffer: torch.Tensor, namespace: str, on_put: Callable[[], None], max_waiting_bytes: int) -> None:
        """Args:
        buffer: the arena buffer (uint8); every offset below is into it.
        namespace: what outputs of this engine are shared under (see :func:`namespace_for`).
        on_put: called after each output the tier took, for the counters.
        max_waiting_bytes: the most bytes of outputs waiting to be put (each pins its fill).

        Raises:
            RuntimeError: the store client is not installed, or the master cannot be reached.
        """
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise RuntimeError("--shared-cache-master needs Mooncake Store: pip install 'epd[shared-cache]' (and libibverbs1)") from exc
        # Mooncake's TCP transport binds to the host's address unless told otherwise.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_host)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(config.local_host, config.metadata_server, 0, _LOCAL_BUFFER_BYTES, "tcp", "", config.master)
        if rc != 0:
            raise RuntimeError(f"could not join the shared encoder cache at {config.master} (metadata {config.metadata_server}): error {rc}")
        self._base = buffer.data_ptr()
        rc = self._store.register_buffer(self._base, buffer.numel())
        if rc != 0:
            raise RuntimeError(f"could not register the arena with the shared encoder cache: error {rc}")
        self._namespace = namespace
        self._on_put = on_put
        self._puts: queue.Queue[tuple[str, int, int, Callable[[], None]] | None] = queue.Queue()
        self._max_waiting_bytes = max_waiting_bytes
        self._waiting_bytes = 0
        self._waiting_lock = threading.Lock()
        self._skip_until = 0.0  # monotonic: no lookups before then
        self._writer = threading.Thread(target=self._write_loop, name="epd-shared-tier", daemon=True)
        self._writer.start()
        logger.info("EPD EC producer: sharing encoder outputs through Mooncake Store at %s (namespace %s)", config.master, namespace)

    def get_into(self, content_hash: str, offset: int, nbytes: int) -> bool:
        """Copies the tier's output for the item into the arena at ``offset`` when it holds
        one of exactly ``nbytes``; False otherwise (a miss, the tier is unreachable, or it is
        skipped after a lookup that failed or was slow)."""
        started = time.monotonic()
        if started < self._skip_until:
            return False
        key = self._key(content_hash)
        try:
            found = self._store.is_exist(key) == 1 and self._store.get_into(key, self._base + offset, nbytes) == nbytes
            trouble = time.monotonic() - started > _SLOW_LOOKUP_S
        except Exception:
            logger.warning("EPD EC producer: reading %s from the shared encoder cache failed; encoding it", key, exc_info=True)
            found, trouble = False, True
        if trouble:
            logger.warning("EPD EC producer: the shared encoder cache is failing or slow; not looking there for %.0f s", _SKIP_AFTER_TROUBLE_S)
            self._skip_until = time.monotonic() + _SKIP_AFTER_TROUBLE_S
        return found

    def offer(self, content_hash: str, offset: int, nbytes: int, done: Callable[[], None]) -> None:
        """Puts a published fill into the tier, in the background; ``done`` is called once its
        bytes are no longer needed (the caller's pin on the fill may end)."""
        with self._waiting_lock:
            room = self._waiting_bytes + nbytes <= self._max_waiting_bytes
            if room:
                self._waiting_bytes += nbytes
        if not room:
            logger.warning("EPD EC producer: %d bytes already wait for the shared encoder cache; not sharing %s", self._waiting_bytes, content_hash)
            done()
            return
        self._puts.put((self._key(content_hash), offset, nbytes, done))

    @property
    def waiting_bytes(self) -> int:
        return self._waiting_bytes

    def close(self) -> None:
        self._puts.put(None)
        self._writer.join(timeout=5)
        if self._writer.is_alive():  # stuck in a put: closing the client under it could crash
            logger.warning("EPD EC producer: a put to the shared encoder cache is still running; leaving its client open")
            return
        self._store.close()

    def _key(self, content_hash: str) -> str:
        return f"epd/{self._namespace}/{content_hash}"

    def _write_loop(self) -> None:
        while (job := self._puts.get()) is not None:
            key, offset, nbytes, done = job
            try:
                if self._store.is_exist(key) == 1:
                    continue  # another encoder shared it first: the bytes are the same
                rc = self._store.put_from(key, self._base + offset, nbytes)
                if rc == 0:
                    self._on_put()
                else:
                    logger.warning("EPD EC producer: the shared encoder cache refused %s: error %d", key, rc)
            except Exception:
                logger.warning("EPD EC producer: putting %s into the shared encoder cache failed", key, exc_info=True)
            finally:
                with self._waiting_lock:
                    self._waiting_bytes -= nbytes
                try:
                    done()
                except Exception:  # the writer must outlive any one output
                    logger.exception("EPD EC producer: ending the pin on %s failed", key)


def namespace_for(model: str, revision: str | None, dtype: str) -> str:
    """Outputs are shared only between engines of one checkpoint (by its path, the same in every
    pod of a deployment), revision, dtype and vLLM release: vLLM's media loaders and processors
    decide which frames and pixels an item's hash stands for, and they change between releases,
    so encoders of two releases in one rolling upgrade never trade outputs."""
    import vllm

    return hashlib.sha256(f"{os.path.normpath(model)}\0{revision or ''}\0{dtype}\0{vllm.__version__}".encode()).hexdigest()[:16]

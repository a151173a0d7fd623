"""Handoff through the connector, encoder arena to consumer encoder cache, against inline gRPC and
an in-process copy.

A producer process does what the encoder engine's EC connector does (:mod:`epd.transport.connector.ec_producer`
and its worker side): it leases arena slots (:class:`~epd.transport.memory.arena.EmbeddingArena` over a
``/dev/shm`` :class:`~epd.transport.memory.shared_buffer.SharedBuffer` registered with NIXL once), writes
each item's 64-byte :class:`~epd.transport.memory.slot_header.SlotHeader` and rows, starts the lease's TTL
and publishes its location (:class:`~epd.transport.wire.nixl.NixlPublisher`); consumers' READ
notifications end the leases. This process is the consumer. Per payload size, each method is
timed per item, from the consumer's first call until the rows are usable as a tensor:

- ``ec_consumer``: the real consumer path, :class:`~epd.transport.connector.ec_consumer.ConsumerScheduler`
  driven as vLLM's scheduler drives it (``ensure_cache_available`` until the item is here: handle
  parsing, receive-buffer pages, one batched READ per producer through
  :class:`~epd.transport.wire.nixl.NixlReader`, header check), then ``update_state_after_alloc`` and
  ``build_installs``, then the view of the shared receive buffer the worker hands vLLM's encoder
  cache (no copy).
- ``nixl_reader``: :class:`~epd.transport.wire.nixl.NixlReader` alone (submit, poll until done, header
  check, view): the transport without the scheduler's bookkeeping.
- ``raw_read``: one NIXL READ of the same bytes through the agent wrapper
  (:class:`~epd.transport.wire.agent.NixlAgent` ``post_read``, ``state`` until DONE, ``release``),
  with the same lease notification: the floor for any NIXL path, so ``ec_consumer - raw_read`` is
  our path's fixed per-fetch cost.
- ``grpc_inline``: the same rows inline in an ``EncodeResponse`` (``InlineEmbedding`` items) from a
  ``grpc.aio`` server in the producer process, with the project's message limits, then what the
  consumer does with inline rows (:class:`~epd.transport.wire.inline.InlineReader`: ``bytearray`` of
  the field, copied into the receive buffer) and the view.
- ``memcpy``: ``Tensor.copy_`` of the same size within this process, the ceiling for any handoff
  (source and target stay in this core's caches up to a few MiB).
- ``memcpy_fresh``: the same copy from a different region each time, cycling through a buffer at
  least as large as the producer's arena: an in-process copy of bytes this core did not just touch.

This process runs torch with one thread, as a vLLM engine core serves on a small CPU host. The
goals (see DESIGN.md): ``ec_consumer`` at least half memcpy's throughput at every size from 1 MiB,
and at least 10 times faster than inline gRPC at 1 MiB; ``ec_consumer - raw_read`` should stay
near a raw READ's own cost.

The batched part compares many small items in one transfer (one request whose items all come
from one producer: one READ; one message) against one transfer per item, back to back.

Every NIXL fetch is checked: the header must show the promised lease generation and shape, and
the rows must equal what the producer wrote (each publish is stamped with a unique counter, so a
stale or reused slot is caught). gRPC and memcpy results are checked once per size. A mismatch
raises :class:`HandoffMismatchError`.

Run ``python -m bench.handoff [--quick] [--iterations N] [--results-dir DIR]``. The package:
:mod:`.payload` (sizes, methods, goals, the stamped rows), :mod:`.producer` (the producer
process), :mod:`.consumers` (this process's paths), :mod:`.measure` (the timing) and
:mod:`.experiment` (run, analysis, report).
"""

from bench.handoff.experiment import analyze, main, report, run
from bench.handoff.payload import (
    BATCHED_METHODS,
    BATCHES,
    METHODS,
    MIB,
    QUICK_ITERATIONS,
    QUICK_SIZES,
    HandoffMismatchError,
    check_bytes,
    payload,
    stamp_bytes,
)

# The experiment's surface (bench.common's registry runs and reports it), and what its smoke
# test checks.
__all__ = [
    "BATCHED_METHODS",
    "BATCHES",
    "METHODS",
    "MIB",
    "QUICK_ITERATIONS",
    "QUICK_SIZES",
    "HandoffMismatchError",
    "analyze",
    "check_bytes",
    "main",
    "payload",
    "report",
    "run",
    "stamp_bytes",
]

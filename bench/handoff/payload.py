"""Payload sizes, methods and goals; the stamped rows every method moves and checks."""

from __future__ import annotations

import numpy as np
import torch

from bench.formatting import KIB, MIB
from epd.transport.connector.ec_config import ConnectorConfig

FULL_SIZES = [KIB * 4**i for i in range(9)]  # 1 KiB, 4 KiB, ... 64 MiB
QUICK_SIZES = [KIB, 64 * KIB, MIB]
BATCHES = [(64, 16 * KIB), (256, 4 * KIB)]  # (items, bytes per item)
FULL_ITERATIONS = 200
QUICK_ITERATIONS = 20
# Large sizes take fewer samples: at most this many bytes per (method, size), but never fewer
# than MIN_ITERATIONS samples (or --iterations, if that is lower).
BYTES_PER_MEASUREMENT = 2 * 1024 * MIB
MIN_ITERATIONS = 20
REFERENCE_BYTES = MIB  # where the gRPC ratio is taken; the memcpy ratio at every size from here up
METHODS = ("ec_consumer", "nixl_reader", "raw_read", "grpc_inline", "memcpy", "memcpy_fresh")
NIXL_METHODS = ("ec_consumer", "nixl_reader", "raw_read")
BATCHED_METHODS = ("ec_consumer", "raw_read", "grpc_inline")
# What the project needs of its path (see DESIGN.md, performance facts).
GOAL_MEMCPY_FRACTION = 0.5  # ec_consumer throughput over memcpy's, at every size >= 1 MiB
GOAL_GRPC_SPEEDUP = 10.0  # ec_consumer over inline gRPC at 1 MiB
# What our code adds on top of NIXL, which any host shows (issue 32).
GOAL_RAW_READ_FRACTION = 0.85  # ec_consumer throughput over a raw READ's, at every size >= 1 MiB
GOAL_FIXED_COST_US = 25.0  # ec_consumer's median over a raw READ's, at every size <= SMALL_BYTES
SMALL_BYTES = 64 * KIB

_DTYPE = "float32"
_ROW_FLOATS = 1024  # rows of 4 KiB, like a 1024-wide fp32 encoder output
_SLOT_BYTES = ConnectorConfig.slot_bytes  # the production default
# Published items wait at most one chunk of fetches; this is far longer, so none expires.
_LEASE_TTL_S = 300.0
_PEER_START_TIMEOUT_S = 120.0  # spawn + importing torch and NIXL on a loaded 2-core machine
_PEER_CALL_TIMEOUT_S = 60.0
_ARENA_FULL_WAIT_S = 10.0  # how long a publish waits for READ notifications to end leases
_FETCH_TIMEOUT_S = 30.0
_STAMP_BYTES = 8
_FRESH_RING_BYTES = 64 * MIB
# The consumer side runs in a vLLM engine core, which serves with one torch thread on a small CPU
# host; a parallel copy on a busy host also waits for its slowest thread (milliseconds).
_TORCH_THREADS = 1
# The benchmark's own gRPC method; messages are the project's (epd.v1), so the payload is
# framed exactly like an encoder's inline response.
_GRPC_SERVICE = "epd.bench.v1.HandoffBench"
_GRPC_METHOD = f"/{_GRPC_SERVICE}/Fetch"


class HandoffMismatchError(AssertionError):
    """Bytes arrived different from what was sent: the benchmark's numbers would be meaningless."""


def payload(nbytes: int) -> torch.Tensor:
    """Deterministic random bytes for a size; both processes derive the same ones from ``nbytes``,
    so the consumer can check what arrived without a reference copy travelling alongside."""
    return torch.frombuffer(bytearray(np.random.default_rng(nbytes).bytes(nbytes)), dtype=torch.uint8)


def stamp_bytes(stamp: int) -> torch.Tensor:
    """The first bytes of a stamped publish: unique per publish, so stale slots are detected."""
    return torch.frombuffer(bytearray(stamp.to_bytes(_STAMP_BYTES, "little")), dtype=torch.uint8)


def check_bytes(method: str, received: torch.Tensor, base: torch.Tensor, stamp: int | None = None) -> None:
    """Raises :class:`HandoffMismatchError` unless ``received`` equals ``base`` (its first bytes
    replaced by ``stamp``, if given)."""
    head = stamp_bytes(stamp) if stamp is not None else base[:_STAMP_BYTES]
    if (
        received.dtype != torch.uint8
        or received.numel() != base.numel()
        or not torch.equal(received[:_STAMP_BYTES], head)
        or not torch.equal(received[_STAMP_BYTES:], base[_STAMP_BYTES:])
    ):
        raise HandoffMismatchError(
            f"{method}: a {base.numel()}-byte payload arrived as {received.numel()} bytes that differ from what was sent"
            + (f" (publish stamp {stamp})" if stamp is not None else "")
        )


def item_shape(nbytes: int) -> tuple[int, int]:
    """(rows, width) of a float32 item of ``nbytes``: 4 KiB rows, or one row for smaller items."""
    width = min(_ROW_FLOATS, nbytes // 4)
    rows, rest = divmod(nbytes, 4 * width)
    if rest or not rows:
        raise ValueError(f"{nbytes} bytes is not a whole number of float32 rows")
    return rows, width


def _paged(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def _request_key(items: int, item_bytes: int) -> str:
    return f"{items}x{item_bytes}"



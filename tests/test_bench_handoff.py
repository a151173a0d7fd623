"""The handoff microbenchmark (bench/handoff.py): a quick run writes a complete, well-formed result
with bytes verified, and a corrupted payload is caught rather than timed."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
from typing import Any

import pytest
import torch

from bench import handoff

pytestmark = pytest.mark.timeout(120)

SUMMARY_KEYS = {"count", "mean", "median", "p99"}
ENVELOPE_KEYS = {"schema_version", "name", "command", "finished_at", "machine"}
PAYLOAD_KEYS = {"experiment", "config", "results", "batched", "first_contact_ms", "ratios"}


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_summary(summary: Any, count: int) -> None:
    assert isinstance(summary, dict) and set(summary) == SUMMARY_KEYS
    assert summary["count"] == count
    assert all(positive(summary[key]) for key in ("mean", "median", "p99")), summary
    assert summary["p99"] >= summary["median"]


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    results_dir = tmp_path_factory.mktemp("handoff")
    path = handoff.run(quick=True, results_dir=results_dir, command="test")
    return path, json.loads(path.read_text())


def test_quick_run_writes_the_documented_schema(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    path, doc = quick_result
    assert path.name == "handoff.json"
    assert set(doc) == ENVELOPE_KEYS | PAYLOAD_KEYS
    assert (doc["name"], doc["experiment"], doc["command"]) == ("handoff", "handoff", "test")

    config = doc["config"]
    assert config["sizes"] == handoff.QUICK_SIZES
    iterations = config["iterations"]
    assert iterations == handoff.QUICK_ITERATIONS
    assert config["skipped"] == []  # every quick size fits a gRPC message

    results = doc["results"]
    assert [(r["method"], r["bytes"]) for r in results] == [(m, size) for size in handoff.QUICK_SIZES for m in handoff.METHODS]
    for result in results:
        assert set(result) == {"method", "bytes", "latency_us", "gb_per_s"}
        check_summary(result["latency_us"], iterations)
        assert positive(result["gb_per_s"])
        assert result["gb_per_s"] == pytest.approx(result["bytes"] / result["latency_us"]["median"] / 1e3)

    batched = doc["batched"]
    assert [(b["method"], b["items"], b["item_bytes"]) for b in batched] == [
        (method, items, item_bytes) for items, item_bytes in handoff.BATCHES for method in ("nixl_read", "grpc_inline")
    ]
    for entry in batched:
        assert set(entry) == {"method", "items", "item_bytes", "one_transfer_us", "per_item_transfers_us", "speedup"}
        check_summary(entry["one_transfer_us"], config["batched_iterations"])
        check_summary(entry["per_item_transfers_us"], config["batched_iterations"])
        assert entry["speedup"] == pytest.approx(entry["per_item_transfers_us"]["median"] / entry["one_transfer_us"]["median"])

    assert set(doc["first_contact_ms"]) == {"nixl_read", "grpc_inline"}
    assert all(positive(v) for v in doc["first_contact_ms"].values())
    assert set(doc["ratios"]) == {"nixl_vs_grpc_at_1MiB", "nixl_vs_memcpy_at_1MiB"}
    assert all(positive(v) for v in doc["ratios"].values())


def test_quick_run_verified_every_size(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    _, doc = quick_result
    item_sizes = {item_bytes for _, item_bytes in handoff.BATCHES}
    verified = doc["config"]["verified"]
    assert set(verified["nixl_read"]) == set(handoff.QUICK_SIZES) | item_sizes
    assert set(verified["grpc_inline"]) == set(handoff.QUICK_SIZES) | item_sizes
    assert set(verified["memcpy"]) == set(handoff.QUICK_SIZES)


def test_quick_run_plots_when_matplotlib_is_installed(quick_result: tuple[pathlib.Path, dict[str, Any]]) -> None:
    path, _ = quick_result
    plot = path.with_name("handoff.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert not plot.exists()
    else:
        assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_check_bytes_catches_corruption_and_stale_slots() -> None:
    base = handoff.payload(4096)
    assert torch.equal(base, handoff.payload(4096)), "both processes must derive the same payload"
    fresh = base.clone()
    fresh[:8] = handoff.stamp_bytes(7)
    handoff.check_bytes("nixl_read", fresh, base, 7)

    flipped = fresh.clone()
    flipped[-1] ^= 1
    with pytest.raises(handoff.HandoffMismatchError, match="nixl_read"):
        handoff.check_bytes("nixl_read", flipped, base, 7)
    with pytest.raises(handoff.HandoffMismatchError, match="stamp 8"):  # an older publish's bytes
        handoff.check_bytes("nixl_read", fresh, base, 8)
    with pytest.raises(handoff.HandoffMismatchError):
        handoff.check_bytes("grpc_inline", base[:-1], base)

"""Smoke test of the encoder cold-start benchmark (bench/cold_start.py) on the tiny checkpoint.

It runs the quick variant end to end (zygote, forked loads, page-cache control) and checks the
result document against the schema the benchmark suite reads, plus the property the benchmark
exists to show: the encoder reads fewer shards and bytes than a full load.
"""

from __future__ import annotations

import json
import math
import pathlib

from bench import cold_start
from tests.conftest import CHECKPOINT_ROOT

ENVELOPE = {"schema_version", "name", "command", "finished_at", "machine"}
PAYLOAD = {"experiment", "config", "checkpoint", "results", "ratios"}
SECONDS = {"count", "mean", "median", "p99"}


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_quick_run_writes_the_schema(tmp_path: pathlib.Path) -> None:
    path = cold_start.run(quick=True, results_dir=tmp_path, command="pytest", checkpoint_root=CHECKPOINT_ROOT)

    assert path == tmp_path / "cold_start.json"
    doc = json.loads(path.read_text())
    assert set(doc) == ENVELOPE | PAYLOAD
    assert doc["experiment"] == doc["name"] == "cold_start"
    assert doc["command"] == "pytest"

    config = doc["config"]
    assert set(config) == {"checkpoint", "repeats", "page_cache"}
    assert config["checkpoint"] == "qwen2_5_vl-s0" and config["repeats"] == 2
    # "cold" alone is never written: warm runs always happen, cold ones where eviction works.
    assert config["page_cache"] in ("warm", "both")

    checkpoint = doc["checkpoint"]
    assert set(checkpoint) == {"shards", "bytes", "vision_bytes", "language_bytes"}
    assert all(is_int(v) and v > 0 for v in checkpoint.values())
    assert checkpoint["shards"] == 3
    assert checkpoint["bytes"] == checkpoint["vision_bytes"] + checkpoint["language_bytes"]

    caches = ("warm", "cold") if config["page_cache"] == "both" else ("warm",)
    results = {(r["page_cache"], r["mode"]): r for r in doc["results"]}
    assert len(results) == len(doc["results"])
    assert set(results) == {(cache, mode) for cache in caches for mode in ("encoder_only", "full_checkpoint")}
    for result in doc["results"]:
        assert set(result) == {"mode", "page_cache", "shards_read", "bytes_read", "seconds"}
        assert is_int(result["shards_read"]) and is_int(result["bytes_read"])
        assert set(result["seconds"]) == SECONDS
        assert result["seconds"]["count"] == 2
        assert all(is_number(result["seconds"][k]) and result["seconds"][k] > 0 for k in ("mean", "median", "p99"))

    for cache in caches:
        encoder, full = results[cache, "encoder_only"], results[cache, "full_checkpoint"]
        # The encoder reads exactly the vision tower; the full load reads everything.
        assert encoder["bytes_read"] == checkpoint["vision_bytes"] < full["bytes_read"] == checkpoint["bytes"]
        assert encoder["shards_read"] == 1 < checkpoint["shards"] == full["shards_read"]

    ratios = doc["ratios"]
    assert set(ratios) == {"seconds_full_over_encoder_warm", "bytes_full_over_encoder", "seconds_full_over_encoder_cold"}
    assert is_number(ratios["seconds_full_over_encoder_warm"]) and ratios["seconds_full_over_encoder_warm"] > 0
    assert math.isclose(ratios["bytes_full_over_encoder"], checkpoint["bytes"] / checkpoint["vision_bytes"])
    if config["page_cache"] == "both":
        assert is_number(ratios["seconds_full_over_encoder_cold"]) and ratios["seconds_full_over_encoder_cold"] > 0
    else:
        assert ratios["seconds_full_over_encoder_cold"] is None


def test_resident_fraction_sees_a_read_file(tmp_path: pathlib.Path) -> None:
    # What both page-cache states are checked with: a file just written and read is resident.
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (3 * 4096 + 5))
    path.read_bytes()
    assert cold_start.resident_fraction([path]) == 1.0

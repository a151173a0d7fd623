"""Smoke test of the cold-start benchmark (bench/cold_start.py) on the tiny checkpoint.

It starts the real services once each (the vLLM encoder-only service and a full engine) from an
evicted page cache, checks the result document against the schema the report reads, and the
property the benchmark exists to show: the encoder reads fewer shards, from its log and from the
disk, than the full engine. The warm page cache is the same code path minus the eviction.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from bench import cold_start
from bench.report import write_report

pytestmark = pytest.mark.timeout(600)

ENVELOPE = {"schema_version", "name", "command", "finished_at", "machine"}
PAYLOAD = {"experiment", "config", "checkpoint", "results", "ratios"}
SUMMARY = {"count", "mean", "median", "p99"}


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_quick_cold_run_writes_the_schema(tmp_path: pathlib.Path) -> None:
    # A private checkpoint: other tests read the shared one meanwhile, which would fill the page cache.
    path = cold_start.run(quick=True, results_dir=tmp_path, command="pytest", checkpoint_root=tmp_path / "checkpoints", page_caches=("cold",))

    assert path == tmp_path / "cold_start.json"
    doc = json.loads(path.read_text())
    assert set(doc) == ENVELOPE | PAYLOAD
    assert doc["experiment"] == doc["name"] == "cold_start" and doc["command"] == "pytest"

    config = doc["config"]
    assert set(config) == {"checkpoint", "repeats", "page_cache", "cold_left_out", "commands"}
    assert config["checkpoint"] == "qwen2_5_vl-s0" and config["repeats"] == 1
    assert set(config["commands"]) == set(cold_start.MODES)
    if config["cold_left_out"]:
        pytest.skip("the checkpoint could not be evicted from the page cache here")
    assert config["page_cache"] == "cold"

    checkpoint = doc["checkpoint"]
    assert set(checkpoint) == {"shards", "bytes", "smallest_shard_bytes", "largest_shard_bytes"}
    assert checkpoint["shards"] == 3 and all(is_int(v) and v > 0 for v in checkpoint.values())

    results = {r["mode"]: r for r in doc["results"]}
    assert set(results) == set(cold_start.MODES) and len(doc["results"]) == 2
    for result in doc["results"]:
        assert result["page_cache"] == "cold"
        assert set(result) == {
            "mode",
            "page_cache",
            "shards_read",
            "shards_total",
            "seconds_to_ready",
            "seconds_to_listening",
            "weights_seconds",
            "load_model_seconds",
            "phases_seconds",
            "shards_read_from_disk",
            "bytes_read_from_disk",
        }
        for key in ("seconds_to_ready", "seconds_to_listening", "weights_seconds", "load_model_seconds"):
            assert set(result[key]) == SUMMARY and result[key]["count"] == 1 and is_number(result[key]["median"]), key
        assert 0 < result["seconds_to_listening"]["median"] < result["seconds_to_ready"]["median"]
        assert result["shards_total"] == checkpoint["shards"]
        # Every phase's end line is printed by a start; the phases add up to the time to ready.
        assert list(result["phases_seconds"]) == [name for name, _ in cold_start.PHASES]
        assert sum(result["phases_seconds"].values()) == pytest.approx(result["seconds_to_ready"]["median"])

    encoder, full = results["encoder_only"], results["full_engine"]
    # The encoder-only engine reads the tower's shard alone, by its own account and by the disk's.
    assert encoder["shards_read"] == encoder["shards_read_from_disk"] == 1
    assert full["shards_read"] == full["shards_read_from_disk"] == checkpoint["shards"]
    assert encoder["bytes_read_from_disk"] < full["bytes_read_from_disk"]

    ratios = doc["ratios"]
    assert ratios["shards_full_over_encoder"] == 3
    assert is_number(ratios["ready_full_over_encoder_cold"]) and ratios["ready_full_over_encoder_warm"] is None

    report = write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    assert "## Encoder cold start" in report and "Command: `pytest`" in report and "| encoder_only | cold | 1 of 3 | 1," in report
    assert "| mode | page cache | imports and gRPC port |" in report
    assert "Goal: the encoder-only service ready in ≤ ×0.6 of a full engine's time, page cache warm and cold: cold ×" in report


def _start(cache: str, mode: str, ready: float, before_the_engine: float) -> dict:
    phases = {"imports and gRPC port": 1.0, "vLLM import and config": before_the_engine - 1.0, "model load": 0.5}
    return {"page_cache": cache, "mode": mode, "seconds_to_ready": {"median": ready}, "phases_seconds": phases}


def test_the_goal_is_judged_per_page_cache_against_what_no_engine_setting_removes() -> None:
    met = cold_start.goal_lines([_start("warm", "full_engine", 10, 6), _start("warm", "encoder_only", 5, 4)])
    assert met == ["Goal: the encoder-only service ready in ≤ ×0.6 of a full engine's time, page cache warm and cold: warm ×0.50: met.", ""]
    # Warm misses the goal; its imports before the engine alone take more than the goal allows.
    judged, floor, _ = cold_start.goal_lines(
        [_start("warm", "full_engine", 10, 6), _start("warm", "encoder_only", 9, 7), _start("cold", "full_engine", 10, 6), _start("cold", "encoder_only", 5, 4)]
    )
    assert judged.endswith(": warm ×0.90, cold ×0.50: NOT met.")
    assert "already spent ×0.70 (warm) and ×0.40 (cold) of a full engine's time" in floor
    assert floor.endswith("removing engine work cannot meet the goal on this host.")
    # Imports within the goal: what is left is the engine's.
    _, engine_bound, _ = cold_start.goal_lines([_start("warm", "full_engine", 10, 6), _start("warm", "encoder_only", 8, 5)])
    assert engine_bound.endswith("what is left to cut is in the engine's own start.")


def test_a_start_is_read_from_the_services_own_lines() -> None:
    lines = [
        (0.4, 'EPD_LISTENING {"service": "encoder", "port": 1, "metrics_port": null}'),
        (20.0, "(EngineCore pid=1) INFO 12-01 05:38:01 [cpu_model_runner.py:68] Starting to load model /m..."),
        (20.25, "(EngineCore pid=1) INFO 12-01 05:38:01 [default_loader.py:501] Loading weights took 0.21 seconds"),
        (23.3, "EPD_ENCODER_LOAD read 1 of 16 safetensors shards"),
        (23.4, 'EPD_READY {"service": "encoder"}'),
    ]
    start = cold_start.parse_start(lines, "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00]\n")
    assert start == {
        "seconds_to_listening": 0.4,
        "seconds_to_ready": 23.4,
        "weights_seconds": 0.21,
        "load_model_seconds": pytest.approx(0.25),
        "shards_read": 1,
        "shards_total": 16,
        # Phases whose line is missing are merged into the next one.
        "phases": {"imports and gRPC port": 0.4, "engine core set-up": pytest.approx(19.6), "model load": pytest.approx(0.25), "service after the engine": pytest.approx(3.15)},
    }
    # A full engine prints no EPD_ENCODER_LOAD line: vLLM's shard progress counts instead.
    full = cold_start.parse_start(lines[:3] + lines[4:], "Loading safetensors checkpoint shards: 100% Completed | 16/16 [00:01<00:00]\n")
    assert (full["shards_read"], full["shards_total"]) == (16, 16)


def test_resident_fraction_sees_a_read_file(tmp_path: pathlib.Path) -> None:
    # What both page-cache states are checked with: a file just written and read is resident.
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (3 * 4096 + 5))
    path.read_bytes()
    assert cold_start.resident_fraction([path]) == 1.0

"""The benchmark suite's structure, without running anything: every experiment the suite runs is
registered with a run and a report section, and a result file named after it (import circles
are tests/test_layout.py's, bench's included)."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys

from bench import common, report, serving


def test_every_experiment_runs_and_reports_through_the_registry() -> None:
    for name, experiment in common.EXPERIMENTS.items():
        module = experiment.module()
        assert callable(module.run) and callable(module.report), name
        parameters = inspect.signature(module.run).parameters
        assert {"quick", "results_dir", "command", *experiment.options, *dict(experiment.fixed)} <= parameters.keys(), name
    assert set(serving.EXPERIMENTS) == set(common.SERVING_EXPERIMENTS)


def test_report_names_missing_and_stale_results(tmp_path: pathlib.Path) -> None:
    (tmp_path / "handoff.json").write_text('{"schema_version": 1, "name": "handoff"}')
    text = report.write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    assert "Stale: `handoff.json` has schema v1" in text
    for name in list(common.EXPERIMENTS)[1:]:
        assert f"Not run: no `{name}.json`" in text and f"`python -m bench --only {name}`" in text


def test_each_experiment_records_the_command_that_reruns_it_alone(monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench", "--quick", "--only", "handoff,serving", "--results-dir", "/tmp/r"])
    assert common.command_line(only="serving").endswith("-m bench --only serving --quick --results-dir /tmp/r")
    monkeypatch.setattr("sys.argv", ["bench", "--only=cold_start", "--repeats", "2"])
    assert common.command_line(only="cold_start").endswith("-m bench --only cold_start --repeats 2")
    assert common.command_line().endswith("-m bench --only=cold_start --repeats 2")


def test_the_gpu_check_dry_run_names_every_experiment_with_a_gpu_note(tmp_path: pathlib.Path) -> None:
    """bench/gpu_check.sh runs on CPU with --dry-run: it checks what it can, prints each
    experiment's note and the command a GPU host would run, and starts nothing."""
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    done = subprocess.run([str(script), "--dry-run"], env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    noted = [name for name, experiment in common.EXPERIMENTS.items() if experiment.gpu_note]
    assert {"handoff", "cold_start", "encoder_throughput", "serving"} <= set(noted)
    assert f"-m bench --quick --only {','.join(noted)} --results-dir bench/results-gpu" in done.stdout
    assert "dry run: nothing started" in done.stdout
    text = report.write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    assert "## What a GPU host changes" in text and all(f"- **{name}**: " in text for name in noted)

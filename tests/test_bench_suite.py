"""The benchmark suite's structure, without running anything: every experiment the suite runs is
registered with a run and a report section, and a result file named after it (import circles
are tests/test_layout.py's, bench's included)."""

from __future__ import annotations

import inspect
import pathlib

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

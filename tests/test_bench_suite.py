"""The benchmark suite's structure, without running anything: no import cycle among bench's
modules (function-level imports included), and every experiment the suite runs has a report
section and a result file named after it."""

from __future__ import annotations

import ast
import inspect
import pathlib

from bench import common, report, serving

BENCH = pathlib.Path(common.__file__).resolve().parent


def bench_imports() -> dict[str, set[str]]:
    """Module -> the bench modules it imports anywhere in its body (``bench.x`` names)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(BENCH.glob("*.py")):
        module = f"bench.{path.stem}"
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            imported |= {name for name in names if name.startswith("bench.") and (BENCH / f"{name.removeprefix('bench.')}.py").exists()}
        graph[module] = imported - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_bench_modules_import_no_cycle() -> None:
    graph = bench_imports()
    assert {"bench.__main__", "bench.report", "bench.serving", "bench.handoff"} <= graph.keys()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"bench.a": {"bench.b"}, "bench.b": {"bench.c"}, "bench.c": {"bench.a"}}) == ["bench.a", "bench.b", "bench.c", "bench.a"]
    assert find_cycle({"bench.a": {"bench.b"}, "bench.b": set()}) is None


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

"""The layout shows the architecture: the ``epd`` library stands alone, the services and the
gateway stand on it and not on each other, the CLI (the composition root) stands on them all,
and the development kit serves no service. No module imports itself back through others, not
even for type checking only. Read from the source (``ast``), so nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("epd", "services", "gateway", "cli", "devkit", "bench")
# What each package may import of the others (its own modules always).
ALLOWED = {
    "epd": set(),
    "services": {"epd"},
    "gateway": {"epd"},
    "devkit": {"epd"},
    "cli": {"epd", "services", "gateway", "devkit"},
    "bench": {"epd", "services", "gateway", "cli", "devkit"},
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[:2] == ("epd", "v1"):
                continue  # generated stubs
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (functions and
    ``TYPE_CHECKING`` blocks included): a submodule where one is named, else its package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            members: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            bases, members = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            if base.split(".")[0] not in PACKAGES:
                continue
            wanted = [f"{base}.{m}" for m in members if f"{base}.{m}" in modules] or [base]
            for target in wanted:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    targets.add(target)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_each_package_imports_only_the_layers_below_it():
    wrong = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for target in targets
        if (mine := name.split(".")[0]) != (theirs := target.split(".")[0]) and theirs not in ALLOWED[mine]
    ]
    assert not wrong, wrong


def test_no_module_imports_itself_back():
    assert not _circles(_graph()), _circles(_graph())


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components: every component of more than one module is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles

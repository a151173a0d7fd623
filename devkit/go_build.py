"""Go modules built offline: their dependencies vendored from Debian's Go sources.

The Go module proxy is not reachable from this project's machines, but Debian ships the sources
of grpc-go, protobuf and their dependencies in /usr/share/gocode, each with its go.mod. This
writes ``<module>/vendor`` (links to those sources, and ``modules.txt``) for
``go build -mod=vendor``: the module's own go.mod, with the versions a user's ``go get`` resolves
through the proxy, is built unchanged. Modules the go.mod replaces with a local directory (the SDK
for the example clients) are vendored from that directory. ``modules.txt`` labels each module
with its go.mod's version; the sources are Debian's release of it (grpc-go 1.33.3 and protobuf
1.28.1 exactly; golang.org/x/sys, genproto a few months older than the label).

    python3 -m devkit.go_build sdk/go clients/go   # vendor, then go vet and go build each
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

GOCODE = pathlib.Path("/usr/share/gocode/src")


def debian_modules() -> dict[str, pathlib.Path]:
    """Module path -> source directory, for every module in Debian's Go sources."""
    modules = {}
    for go_mod in GOCODE.rglob("go.mod"):
        if "testdata" in go_mod.parts or "internal" in go_mod.relative_to(GOCODE).parts[:-1]:
            continue
        match = re.search(r"^module\s+(\S+)", go_mod.read_text(), re.MULTILINE)
        if match:
            modules[match.group(1)] = go_mod.parent
    return modules


def module_file(directory: pathlib.Path) -> dict:
    """``go mod edit -json``: the module's path, requirements and replacements."""
    return json.loads(subprocess.run(["go", "mod", "edit", "-json"], cwd=directory, check=True, capture_output=True, text=True).stdout)


def vendor(directory: pathlib.Path) -> None:
    """Writes ``directory/vendor``: links to every package the module imports, and ``modules.txt``."""
    directory = directory.resolve()
    out = directory / "vendor"
    shutil.rmtree(out, ignore_errors=True)
    spec = module_file(directory)
    versions = {requirement["Path"]: requirement["Version"] for requirement in spec.get("Require") or ()}
    # Modules the go.mod replaces with a local directory, as it writes the directory.
    replaced = {r["Old"]["Path"]: r["New"]["Path"] for r in spec.get("Replace") or () if r["New"]["Path"].startswith(".")}
    roots = {**debian_modules(), **{module: (directory / path).resolve() for module, path in replaced.items()}}
    lines = []
    for module, packages in sorted(_imported_packages(directory, spec["Module"]["Path"], roots, replaced).items()):
        lines.append(f"# {module} {versions.get(module, 'v0.0.0')}" + (f" => {replaced[module]}" if module in replaced else ""))  # go checks no indirect version
        # The language version the module's sources are compiled at is its go.mod's.
        lines.append("; ".join(["## explicit"] * (module in versions) + [f"go {_go_version(roots[module])}"]))
        for package in sorted(packages):
            lines.append(package)
            target = out / package
            target.mkdir(parents=True, exist_ok=True)
            source = roots[module] / package[len(module) :].lstrip("/")
            for file in source.iterdir():  # the package's files only; its subpackages are their own entries
                if file.is_file():
                    (target / file.name).symlink_to(file)
    lines += [f"# {module} => {path}" for module, path in sorted(replaced.items())]  # go.mod replaces every version
    out.mkdir(exist_ok=True)
    (out / "modules.txt").write_text("\n".join(lines) + "\n")


def _imported_packages(directory: pathlib.Path, own_path: str, roots: dict[str, pathlib.Path], replaced: dict[str, str]) -> dict[str, list[str]]:
    """Module -> the packages of it the module at ``directory`` imports, directly or not, found in
    GOPATH mode over a tree that places each module at its path: the sources the vendored build
    will compile."""
    own = sorted(  # the module's packages by import path
        "/".join((own_path, *d.relative_to(directory).parts))
        for d in {f.parent for f in directory.rglob("*.go")}
        if not {"vendor", "testdata"} & set(d.relative_to(directory).parts)
    )
    with tempfile.TemporaryDirectory(prefix="epd-go-list-") as gopath:
        for path in (own_path, *replaced):
            _mirror(roots.get(path, directory), pathlib.Path(gopath, "src", path))
        env = dict(os.environ, GO111MODULE="off", GOPROXY="off", GOFLAGS="", GOPATH=f"{gopath}:{GOCODE.parent}")
        listed = subprocess.run(["go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", *own], env=env, check=True, capture_output=True, text=True)
    packages: dict[str, list[str]] = {}
    for package in listed.stdout.split():
        if package == own_path or package.startswith(own_path + "/"):
            continue
        module = max((m for m in roots if package == m or package.startswith(m + "/")), key=len, default=None)
        if module is None:
            raise SystemExit(f"{package}: no module in {GOCODE} or the go.mod's local replacements provides it")
        packages.setdefault(module, []).append(package)
    return packages


def _mirror(source: pathlib.Path, target: pathlib.Path) -> None:
    """Links ``source``'s Go files into ``target``, leaving out its vendor directory (GOPATH mode
    would resolve imports from it)."""
    for file in source.rglob("*"):
        relative = file.relative_to(source)
        if file.is_file() and relative.parts[0] != "vendor":
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            (target / relative).symlink_to(file)


def _go_version(source: pathlib.Path) -> str:
    match = re.search(r"^go\s+(\S+)", (source / "go.mod").read_text(), re.MULTILINE)
    return match.group(1) if match else "1.16"  # what Go assumes for a go.mod without the directive


OFFLINE = {"GOPROXY": "off", "GOFLAGS": "-mod=vendor", "GO111MODULE": "on"}


def build(directory: pathlib.Path, binary: pathlib.Path | None = None) -> None:
    """Vendors the module at ``directory``, then vets and builds it in module mode, offline:
    every package, or with ``binary`` the command in the module's root, written there."""
    vendor(directory)
    env = dict(os.environ, **OFFLINE)
    subprocess.run(["go", "vet", "./..."], cwd=directory, env=env, check=True, timeout=600)
    subprocess.run(["go", "build", "-o", str(binary or os.devnull), "." if binary else "./..."], cwd=directory, env=env, check=True, timeout=600)


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        build(pathlib.Path(argument))

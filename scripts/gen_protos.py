#!/usr/bin/env python3
"""Generates the typed Python stubs for protos/epd/v1 into epd/v1/ (never committed).

Run by the install scripts; run it again after editing a .proto file.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"


def main() -> int:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "epd" / "v1").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    # mypy-protobuf's plugins live beside this interpreter, which may not be on PATH.
    bindir = pathlib.Path(sys.executable).parent
    args = [
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        f"--mypy_out={ROOT}",
        f"--mypy_grpc_out={ROOT}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A protoc plugin that runs grpcio-tools' gRPC Python generator, for ``buf generate``.

grpcio-tools builds its ``grpc_python`` generator into its bundled protoc instead of shipping a
``protoc-gen-grpc_python`` executable, and buf's ``protoc_builtin`` only knows protoc's own
languages. This bridge takes buf's CodeGeneratorRequest, hands the descriptors to that same
bundled protoc (``--descriptor_set_in``, so nothing is re-parsed) and returns what it wrote.
The generator is grpcio-tools' own: the output equals ``python -m grpc_tools.protoc
--grpc_python_out``.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def main() -> int:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        descriptors = root / "descriptors.binpb"
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=request.proto_file).SerializeToString())
        out = root / "out"
        out.mkdir()
        option = f"--grpc_python_opt={request.parameter}" if request.parameter else None
        args = ["grpc_tools.protoc", f"--descriptor_set_in={descriptors}", f"--grpc_python_out={out}", *([option] if option else []), *request.file_to_generate]
        if protoc.main(args) != 0:
            response.error = "grpc_tools.protoc --grpc_python_out failed (see its message above)"
        else:
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                response.file.add(name=str(path.relative_to(out)), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generated protobuf and gRPC stubs for ``protos/epd/v1`` (created by scripts/gen_protos.py)."""

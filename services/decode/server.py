"""Decode entry point (decode mode for E/P/D, combined mode for E+PD)."""

from __future__ import annotations

import dataclasses

from epd.engine import EngineConfig, KvRole
from epd.models import load_family
from epd.server import GrpcHost, ServerConfig
from epd.v1 import decode_pb2, decode_pb2_grpc
from services.decode.servicer import DecodeMode, DecodeServicer
from services.engine_server import EmbeddingReceiveConfig, embedding_source, serve_engine
from services.forwarded_media import ForwardedMediaLayout


async def serve(mode: DecodeMode, engine: EngineConfig, receive: EmbeddingReceiveConfig, server: ServerConfig) -> None:
    if mode is DecodeMode.DECODE:
        # The KV already holds the media; this engine never sees an embedding.
        engine = dataclasses.replace(engine, kv_role=KvRole.CONSUMER)
        source = None
    else:
        engine = dataclasses.replace(engine, kv_role=KvRole.NONE)
        source = embedding_source(receive, "decode")
    host = GrpcHost(server, service_name=f"decode-{mode.value}", full_service_name=decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name)
    family = load_family(engine.model)
    servicer = DecodeServicer(mode, family, source, ForwardedMediaLayout(engine.model, family))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, host.server)
    await serve_engine(host, servicer, engine, source)

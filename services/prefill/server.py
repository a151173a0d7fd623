"""Prefill entry point."""

from __future__ import annotations

import dataclasses

from epd.engine import EngineConfig, KvRole
from epd.models import load_family
from epd.server import GrpcHost, ServerConfig
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from services.engine_server import EmbeddingReceiveConfig, embedding_source, serve_engine
from services.forwarded_media import ForwardedMediaLayout
from services.prefill.servicer import PrefillServicer


async def serve(engine: EngineConfig, receive: EmbeddingReceiveConfig, server: ServerConfig) -> None:
    engine = dataclasses.replace(engine, kv_role=KvRole.PRODUCER)
    host = GrpcHost(server, service_name="prefill", full_service_name=prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name)
    source = embedding_source(receive, "prefill")
    family = load_family(engine.model)
    servicer = PrefillServicer(family, source, ForwardedMediaLayout(engine.model, family))
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, host.server)
    await serve_engine(host, servicer, engine, source)

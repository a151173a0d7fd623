"""Prefill entry point: an EC consumer (embeddings from the encoder) and KV producer."""

from __future__ import annotations

import dataclasses

from epd.engine import Engine, EngineConfig, EngineRole
from epd.server import GrpcHost, ServerConfig, run_service
from epd.v1 import prefill_pb2
from services.engine_stage import EngineStage, HandoffSeal
from services.prefill.servicer import PrefillServicer


async def serve(engine_config: EngineConfig, server: ServerConfig, *, allow_inline: bool = False, handoff_key_file: str = "") -> None:
    host = GrpcHost(server, service_name="prefill", full_service_name=prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name)
    servicer = PrefillServicer()
    host.add_servicer(servicer)
    engine = Engine(dataclasses.replace(engine_config, role=EngineRole.PREFILL))
    seal = HandoffSeal.from_file(handoff_key_file)

    def on_ready(engine: Engine) -> None:
        servicer.stage = EngineStage(engine, allow_inline=allow_inline, handoff_seal=seal)

    await run_service(host, engine, on_ready=on_ready)

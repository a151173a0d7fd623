"""Decode entry point: a KV and EC consumer for E/P/D and E+PD, or (combined) an EC consumer for E+PD only."""

from __future__ import annotations

import dataclasses
import enum

from epd.engine import Engine, EngineConfig, EngineRole
from epd.server import GrpcHost, ServerConfig, run_service
from epd.v1 import decode_pb2
from services.decode.servicer import DecodeServicer
from services.engine_stage import EngineStage, HandoffSeal


class DecodeMode(enum.Enum):
    DECODE = "decode"  # E/P/D (KV from a prefill engine, media only as metadata), and E+PD
    COMBINED = "combined"  # E+PD only: reads embeddings itself and prefills too; no KV connector


async def serve(mode: DecodeMode, engine_config: EngineConfig, server: ServerConfig, *, allow_inline: bool = False, handoff_key_file: str = "") -> None:
    host = GrpcHost(server, service_name=f"decode-{mode.value}", full_service_name=decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name)
    servicer = DecodeServicer()
    host.add_servicer(servicer)
    role = EngineRole.DECODE if mode is DecodeMode.DECODE else EngineRole.COMBINED
    engine = Engine(dataclasses.replace(engine_config, role=role))
    seal = HandoffSeal.from_file(handoff_key_file) if mode is DecodeMode.DECODE else None

    def on_ready(engine: Engine) -> None:
        servicer.stage = EngineStage(engine, allow_inline=allow_inline, handoff_seal=seal)

    await run_service(host, engine, on_ready=on_ready)

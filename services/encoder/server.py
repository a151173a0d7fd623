"""Encoder entry point: config -> gRPC host -> encoder-only vLLM engine -> ready -> shutdown."""

from __future__ import annotations

import dataclasses
import logging

from epd.engine import Engine, EngineConfig, EngineRole
from epd.server import GrpcHost, ServerConfig, run_service
from epd.v1 import encoder_pb2
from services.encoder.runner import EncoderConfig, EncoderRunner
from services.encoder.servicer import EncoderServicer

logger = logging.getLogger(__name__)


async def serve(engine_config: EngineConfig, config: EncoderConfig, server: ServerConfig) -> None:
    host = GrpcHost(server, service_name="encoder", full_service_name=encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name)
    servicer = EncoderServicer()
    host.add_servicer(servicer)
    engine = Engine(dataclasses.replace(engine_config, role=EngineRole.ENCODER))

    def on_ready(engine: Engine) -> None:
        counters = engine.connector_counters
        read, total = counters["shards_read"](), counters["shards_total"]()
        report = f"read {read} of {total} safetensors shards" if total else "shards read unknown (the engine's workers run in other processes)"
        logger.info("encoder-only load: %s", report)
        print(f"EPD_ENCODER_LOAD {report}", flush=True)
        advertised = config.advertise_host or engine.config.nixl_listen_host
        servicer.runner = EncoderRunner(config, engine, address=f"{advertised}:{host.port}")

    def on_stop() -> None:
        if servicer.runner is not None:
            servicer.runner.close()

    await run_service(host, engine, on_ready=on_ready, on_stop=on_stop)

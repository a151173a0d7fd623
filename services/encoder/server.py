"""Encoder entry point: config -> gRPC host -> tower -> ready -> ordered shutdown."""

from __future__ import annotations

import asyncio
import logging

from epd.server import GrpcHost, ServerConfig
from epd.v1 import encoder_pb2, encoder_pb2_grpc
from services.encoder.runner import EncoderConfig, EncoderRunner
from services.encoder.servicer import EncoderServicer

logger = logging.getLogger(__name__)


async def serve(config: EncoderConfig, server: ServerConfig) -> None:
    host = GrpcHost(server, service_name="encoder", full_service_name=encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name)
    servicer = EncoderServicer()
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, host.server)
    await host.start()
    runner = None
    try:
        # Load off the event loop so health checks answer NOT_SERVING meanwhile.
        runner = await asyncio.to_thread(EncoderRunner, config)
        logger.info("encoder-only load: %s", runner.load_report)
        print(f"EPD_ENCODER_LOAD {runner.load_report}", flush=True)
        runner.start()
        servicer.runner = runner
        await host.set_ready()
        await host.wait_for_termination()
    finally:
        await host.stop()
        if runner is not None:
            await runner.close()

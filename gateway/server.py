"""Gateway entry point: config -> pipeline for the chosen mode -> gRPC host -> shutdown."""

from __future__ import annotations

import asyncio
import dataclasses

from epd.media import MediaLimits
from epd.media.decode import MediaDecoder
from epd.models import load_family
from epd.server import GrpcHost, ServerConfig
from epd.v1 import decode_pb2_grpc, encoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc
from gateway.pipeline import DisaggregatedPipeline, Mode, MonolithicPipeline
from gateway.prompt import PromptRenderer
from gateway.router import StagePool
from gateway.servicer import GatewayServicer


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    model: str
    mode: Mode
    encoders: tuple[str, ...] = ()
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    limits: MediaLimits = MediaLimits()
    forward_media: bool = False  # benchmarks' media-forwarding baseline


async def _build_pipeline(config: GatewayConfig, engine_config):
    family = load_family(config.model)
    renderer = PromptRenderer(config.model)
    if config.mode is Mode.MONOLITHIC:
        from epd.engine import Engine

        engine = Engine(engine_config)
        await asyncio.to_thread(engine.start)  # health answers NOT_SERVING meanwhile
        return MonolithicPipeline(family, renderer, config.limits, MediaDecoder.for_model(config.model, config.limits), engine)
    return DisaggregatedPipeline(
        config.mode,
        family,
        renderer,
        config.limits,
        encoders=StagePool("encoder", list(config.encoders), encoder_pb2_grpc.EncoderServiceStub),
        prefills=StagePool("prefill", list(config.prefills), prefill_pb2_grpc.PrefillServiceStub) if config.mode is Mode.EPD else None,
        decodes=StagePool("decode", list(config.decodes), decode_pb2_grpc.DecodeServiceStub),
        forward_media=config.forward_media,
    )


async def serve(config: GatewayConfig, server: ServerConfig, engine_config=None) -> None:
    """``engine_config`` is used in monolithic mode only."""
    host = GrpcHost(server, service_name="gateway", full_service_name=gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name)
    servicer = GatewayServicer(pipeline=None)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, host.server)
    await host.start()
    pipeline = None
    try:
        pipeline = await _build_pipeline(config, engine_config)
        servicer.pipeline = pipeline
        await host.set_ready()
        await host.wait_for_termination()
    finally:
        await host.stop()
        if pipeline is not None:
            await pipeline.close()

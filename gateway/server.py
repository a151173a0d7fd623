"""Gateway entry point: config -> pipeline for the chosen mode -> gRPC host -> shutdown."""

from __future__ import annotations

import dataclasses

import grpc

from epd.engine import Engine, EngineConfig, EngineRole
from epd.media import MediaLimits
from epd.media.decode import MediaDecoder
from epd.prompt import PromptRenderer
from epd.security import BearerTokenInterceptor, channel_credentials, read_token
from epd.server import GrpcHost, ServerConfig, run_service
from epd.v1 import decode_pb2_grpc, encoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc, prefill_pb2_grpc
from gateway.pipeline import DisaggregatedPipeline, Mode, MonolithicPipeline
from gateway.router import StagePool
from gateway.servicer import GatewayServicer
from gateway.stages import DecodeClient, EncoderClient, PrefillClient


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    model: str
    mode: Mode
    encoders: tuple[str, ...] = ()
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    limits: MediaLimits = MediaLimits()
    forward_media: bool = False  # benchmarks' media-forwarding baseline
    auth_token_file: str = ""  # clients must send this file's token; empty: no token required


def _disaggregated(config: GatewayConfig, credentials: grpc.ChannelCredentials | None) -> DisaggregatedPipeline:
    """``credentials``: how to dial the stages (None: plaintext)."""
    prefills = None
    if config.mode is Mode.EPD:
        prefills = PrefillClient(StagePool("prefill", list(config.prefills), prefill_pb2_grpc.PrefillServiceStub, credentials=credentials))
    return DisaggregatedPipeline(
        config.mode,
        PromptRenderer(config.model),
        config.limits,
        encoders=EncoderClient(StagePool("encoder", list(config.encoders), encoder_pb2_grpc.EncoderServiceStub, credentials=credentials)),
        prefills=prefills,
        decodes=DecodeClient(StagePool("decode", list(config.decodes), decode_pb2_grpc.DecodeServiceStub, credentials=credentials)),
        forward_media=config.forward_media,
    )


async def serve(config: GatewayConfig, server: ServerConfig, engine_config: EngineConfig | None = None) -> None:
    """``engine_config`` is used in monolithic mode only."""
    # Read before listening: a missing or empty token file stops the gateway at start.
    interceptors = [BearerTokenInterceptor(read_token(config.auth_token_file))] if config.auth_token_file else []
    full_name = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
    host = GrpcHost(server, service_name="gateway", full_service_name=full_name, interceptors=interceptors)
    servicer = GatewayServicer(pipeline=None)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, host.server)
    engine = None
    if config.mode is Mode.MONOLITHIC:
        engine = Engine(dataclasses.replace(engine_config or EngineConfig(config.model), model=config.model, role=EngineRole.MONOLITHIC))

    def on_ready(engine: Engine | None) -> None:
        if engine is None:
            # Our own certificate doubles as the client certificate stages with mTLS require.
            servicer.pipeline = _disaggregated(config, channel_credentials(server.tls))
        else:
            decoder = MediaDecoder.for_model(config.model, config.limits)
            servicer.pipeline = MonolithicPipeline(PromptRenderer(config.model), config.limits, decoder, engine)

    async def close_pipeline() -> None:
        if servicer.pipeline is not None:
            await servicer.pipeline.close()

    await run_service(host, engine, on_ready=on_ready, on_stop=close_pipeline)

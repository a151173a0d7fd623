"""Gateway entry point: config -> pipeline for the chosen mode -> gRPC host (and the
OpenAI-compatible HTTP front on the same loop) -> shutdown."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from epd.engine import Engine, EngineConfig, EngineRole
from epd.media.decode import MediaDecoder
from epd.prompt import PromptRenderer
from epd.security import BearerTokenInterceptor, channel_credentials, read_token
from epd.server import GrpcHost, ServerConfig, limit_malloc_arenas, release_freed_heap_periodically, run_service
from epd.v1 import decode_pb2, decode_pb2_grpc, encoder_pb2, encoder_pb2_grpc, gateway_pb2, prefill_pb2, prefill_pb2_grpc
from gateway.config import GatewayConfig
from gateway.pipeline import DisaggregatedPipeline, Mode, MonolithicPipeline
from gateway.router import StagePool, read_routing_secret
from gateway.run import wait_for_wind_downs
from gateway.servicer import GatewayServicer
from gateway.stages import DecodeClient, EncoderClient, PrefillClient


def _disaggregated(config: GatewayConfig, host: GrpcHost, credentials: grpc.ChannelCredentials | None, secret: bytes) -> DisaggregatedPipeline:
    """The stage clients, their pools watching every instance's health; the gateway is ready
    while every stage it needs has an instance that can take work (prefill is not needed with
    the local-prefill fallback). ``credentials``: how to dial the stages (None: plaintext);
    ``secret``: keys every pool's ring."""
    pools: list[StagePool] = []

    def follow_stages() -> None:
        needed = [p for p in pools if not (p.stage == "prefill" and config.local_prefill_fallback)]
        asyncio.get_running_loop().create_task(host.set_serving(all(pool.available for pool in needed)))

    def pool(stage: str, addresses: tuple[str, ...], pb2, service: str, stub_class) -> StagePool:
        health_service = pb2.DESCRIPTOR.services_by_name[service].full_name
        pools.append(
            StagePool(
                stage,
                list(addresses),
                stub_class,
                health_service=health_service,
                credentials=credentials,
                on_availability_change=follow_stages,
                affinity=config.affinity_routing,
                routing_secret=secret,
            )
        )
        pools[-1].watch_health()
        return pools[-1]

    prefills = None
    if config.mode is Mode.EPD:
        prefills = PrefillClient(pool("prefill", config.prefills, prefill_pb2, "PrefillService", prefill_pb2_grpc.PrefillServiceStub))
    return DisaggregatedPipeline(
        config.mode,
        config.limits,
        encoders=EncoderClient(pool("encoder", config.encoders, encoder_pb2, "EncoderService", encoder_pb2_grpc.EncoderServiceStub)),
        prefills=prefills,
        decodes=DecodeClient(pool("decode", config.decodes, decode_pb2, "DecodeService", decode_pb2_grpc.DecodeServiceStub)),
        retry=config.retry,
        max_prompt_bytes=config.max_prompt_bytes,
        forward_media=config.forward_media,
        local_prefill_fallback=config.local_prefill_fallback,
    )


async def serve(config: GatewayConfig, server: ServerConfig, engine_config: EngineConfig | None = None) -> None:
    """``engine_config`` is used in monolithic mode only."""
    if config.mode is not Mode.MONOLITHIC:
        # Before gRPC starts its threads: floods must not leave the gateway larger. Not where
        # the gateway holds the oracle's engine, whose torch threads the benchmarks compare.
        limit_malloc_arenas()
    # Read before listening: a missing or empty token file stops the gateway at start.
    token = read_token(config.auth_token_file) if config.auth_token_file else None
    try:
        secret = read_routing_secret(config.affinity_key_file)
    except ValueError as exc:
        raise SystemExit(f"epd gateway: {exc}") from None
    interceptors = [BearerTokenInterceptor(token)] if token is not None else []
    full_name = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
    host = GrpcHost(server, service_name="gateway", full_service_name=full_name, interceptors=interceptors)
    servicer = GatewayServicer(pipeline=None)
    host.add_servicer(servicer)
    front = None
    if config.http_port >= 0:
        from gateway.openai_front import OpenAIFront  # FastAPI and uvicorn: only when served

        # Bound before the host announces its ports, so EPD_LISTENING carries this one too.
        front = OpenAIFront(config, server, token, lambda: servicer.pipeline)
        host.announce["http_port"] = front.start(config.http_port, host.wait_for_termination())
    engine = None
    if config.mode is Mode.MONOLITHIC:
        engine = Engine(dataclasses.replace(engine_config or EngineConfig(config.model), model=config.model, role=EngineRole.MONOLITHIC))

    def on_ready(engine: Engine | None) -> None:
        if engine is None:
            # Our own certificate doubles as the client certificate stages with mTLS require.
            servicer.pipeline = _disaggregated(config, host, channel_credentials(server.tls), secret)
        else:
            decoder = MediaDecoder.for_model(config.model, config.limits)
            renderer = PromptRenderer(config.model, max_prompt_tokens=config.max_prompt_tokens)
            servicer.pipeline = MonolithicPipeline(renderer, config.limits, decoder, engine, max_prompt_bytes=config.max_prompt_bytes)

    async def close_pipeline() -> None:
        if front is not None:
            await front.stop()
        if servicer.pipeline is not None:
            await wait_for_wind_downs()
            await servicer.pipeline.close()

    # What floods left free in the C heap goes back to the OS; like the arena limit, not where
    # the gateway holds the oracle's engine.
    heap_release = asyncio.create_task(release_freed_heap_periodically()) if config.mode is not Mode.MONOLITHIC else None
    try:
        await run_service(host, engine, on_ready=on_ready, on_stop=close_pipeline)
    finally:
        if heap_release is not None:
            heap_release.cancel()

"""Entry point shared by the two vLLM-backed services (prefill, decode): config -> gRPC host
-> engine -> ready -> ordered shutdown. Each service's server module only picks its servicer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid

from epd.embeddings import EmbeddingSource
from epd.engine import Engine, EngineConfig
from epd.server import GrpcHost

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EmbeddingReceiveConfig:
    """The consumer side of the embedding handoff (prefill and combined decode)."""

    buffer_bytes: int = 64 * 1024 * 1024
    allow_inline: bool = False
    agent_name: str = ""


def embedding_source(config: EmbeddingReceiveConfig, role: str) -> EmbeddingSource:
    from epd.transport.nixl import EmbeddingFetcher

    fetcher = EmbeddingFetcher(agent_name=config.agent_name or f"epd-{role}-{uuid.uuid4().hex[:8]}", buffer_bytes=config.buffer_bytes)
    return EmbeddingSource(fetcher, allow_inline=config.allow_inline)


async def serve_engine(host: GrpcHost, servicer, engine_config: EngineConfig, source: EmbeddingSource | None) -> None:
    """Serves until SIGTERM; the servicer must already be registered on ``host.server``.
    ``source`` (the servicer's embedding reader, if any) is closed last."""
    await host.start()
    engine = Engine(engine_config)
    try:
        await asyncio.to_thread(engine.start)
        servicer.engine = engine
        await host.set_ready()
        await host.wait_for_termination()
    finally:
        await host.stop()
        engine.shutdown()
        if source is not None and source.fetcher is not None:
            source.fetcher.close()


"""The gateway's configuration: one dataclass, which the ``epd gateway`` flags are made from."""

from __future__ import annotations

import dataclasses

from epd.media import MediaLimits
from gateway.pipeline import Mode
from gateway.router import RetryPolicy


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    model: str  # monolithic: the checkpoint it serves; otherwise the model's name in the HTTP front (no files are read)
    mode: Mode
    encoders: tuple[str, ...] = ()
    prefills: tuple[str, ...] = ()
    decodes: tuple[str, ...] = ()
    limits: MediaLimits = MediaLimits()
    retry: RetryPolicy = RetryPolicy()
    forward_media: bool = False  # benchmarks' media-forwarding baseline
    affinity_routing: bool = True  # off (benchmarks' baseline): least in-flight for every stage
    affinity_key_file: str = ""  # the routing secret replicas share (gateway.router.read_routing_secret); empty: a random one
    # E/P/D: with no live prefill instance, decode instances prefill requests themselves (E+PD)
    # rather than failing them; the gateway then stays ready while encoders and decodes are.
    local_prefill_fallback: bool = False
    auth_token_file: str = ""  # clients must send this file's token; empty: no token required
    max_prompt_bytes: int = 1024 * 1024  # text of one chat, checked before tokenizing
    max_prompt_tokens: int = 0  # the model's context (the CLI passes --max-model-len): monolithic refuses longer prompts; the HTTP front's default max_tokens
    http_port: int = -1  # the OpenAI-compatible HTTP front (gateway/openai_front.py) on --host; -1: off, 0: a free port
    allowed_media_domains: tuple[str, ...] = ()  # hosts the HTTP front fetches media URLs from; empty: URLs refused
    media_fetch_timeout_s: float = 10.0  # for all remote media of one request, redirects included

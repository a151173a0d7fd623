"""The ``epd`` command: one place that defines every flag and turns them into config objects.

Subcommands: ``encoder``, ``prefill``, ``decode``, ``gateway`` (run one service),
``shared-cache`` (the encoder-output cache's shared tier), ``up`` (the whole stack on loopback),
``generate`` (a streaming client) and ``build-checkpoint``.

Service flags are derived from the config dataclasses (``EngineConfig``, ``EncoderConfig``,
``MediaLimits``, ``ServerConfig``, ``TlsConfig``): a flag's name, type and default are its field's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import pathlib
from collections.abc import Sequence

from devkit.checkpoints import ALL_FAMILIES as TINY_FAMILIES  # cheap: its heavy imports are lazy

DEFAULT_CHECKPOINT_ROOT = pathlib.Path("checkpoints")
DEFAULT_FAMILY = "qwen2_5_vl"

# Field groups per service. Flags are --field-name.
_ENGINE_FIELDS = (
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_gib",
    "max_images_per_prompt",
    "max_videos_per_prompt",
    "max_audios_per_prompt",
    "caches",
    "seed",
    "engine_core",
    "batch_invariant",
)
_KV_FIELDS = ("nixl_side_channel_port", "kv_lease_s")
_ARENA_FIELDS = (
    "embedding_transport",
    "embedding_buffer_bytes",
    "arena_slot_bytes",
    "lease_ttl_s",
    "encoder_cache_bytes",
    "shared_cache_master",
    "shared_cache_metadata",
)
_RECEIVE_FIELDS = ("embedding_buffer_bytes", "embedding_read_timeout_s")
_SERVER_FIELDS = {
    "port": "port",
    "metrics_port": "metrics_port",
    "otlp_endpoint": "otlp_endpoint",
    "grace_s": "drain_grace_s",
    "max_concurrent_streams": "max_concurrent_streams",
}
# The gateway's public port: clients multiplex little, and a lower bound keeps a rapid-reset
# flood's backlog small (epd.server.ServerConfig.max_concurrent_streams).
_GATEWAY_MAX_CONCURRENT_STREAMS = 100
_HELP = {
    "caches": "vLLM's prefix and multimodal processor caches, and the encoder-output cache (--no-caches for benchmarks)",
    "engine_core": "where vLLM's engine core runs: thread (in this service's process: starts faster, no serialization) or process (vLLM's own)",
    "batch_invariant": "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT): greedy tokens independent of the batch; give it to every stage "
    "and the monolithic oracle alike. CUDA only: refused at start on CPU",
    "kv_cache_gib": "CPU only: the KV cache, in GiB (fractions allowed)",
    "nixl_side_channel_port": "vLLM NixlConnector side channel; 0 picks one",
    "kv_lease_s": "prefill: seconds computed KV waits for a decode to pull it before vLLM frees it (queued decodes extend it; "
    "keep it well above 3: a decode refuses a handoff with under 3 s left)",
    "embedding_transport": "nixl, or inline (embeddings in the messages: benchmarks, hosts without NIXL)",
    "embedding_buffer_bytes": "shared buffer of the EC connector: the encoder's arena, a consumer's receive buffer",
    "arena_slot_bytes": "the arena's allocation unit",
    "lease_ttl_s": "how long a published embedding waits for its consumer",
    "encoder_cache_bytes": "arena bytes that published embeddings no request holds keep for reuse by later requests for the same item (LRU; 0: off)",
    "shared_cache_master": "the shared tier of the encoder-output cache: a Mooncake master's host:port (as `epd shared-cache` announces it); empty: this encoder's arena only",
    "shared_cache_metadata": "that tier's metadata server, http://host:port/metadata",
    "segment_bytes": "memory the shared tier holds encoder outputs in (oldest evicted when full)",
    "metadata_port": "the Mooncake master's HTTP metadata server; 0 picks a free one",
    "embedding_read_timeout_s": "limit on one encoder's NIXL metadata fetch or READ",
    "advertise_host": "host consumers dial for this encoder's NIXL metadata, written into every embedding location (a name its TLS certificate covers); default: --host",
    "queue_timeout_s": "how long an Encode may wait for arena space or the engine before RESOURCE_EXHAUSTED",
    "affinity_routing": "send items to encoders by their affinity key (a BLAKE3 content digest, placed on the ring by a keyed MAC) and requests to prefills by prompt prefix (consistent hashing, bounded load); --no-affinity-routing: least in-flight (benchmarks' baseline)",
    "local_prefill_fallback": "epd mode: while no prefill instance is live, decode instances prefill requests themselves (E+PD) instead of failing them; readiness then needs no prefill",
    "max_prompt_bytes": "refuse chats with more text than this, before tokenizing (0: no limit)",
    "max_attempts": "tries per request, on other instances, when a stage is UNAVAILABLE before the first token",
    "retry_backoff_s": "first retry's backoff ceiling (doubles per try, full jitter, within the deadline)",
    "max_image_pixels": "per image and per video frame",
    "max_video_frames": "frames in the source video, before sampling",
    "max_audio_s": "the model's own window caps it too",
    "tls_cert": "PEM certificate chain: this service's identity, served and presented to the peers it dials",
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM CA that signs peers: verifies the servers this dials (TLS to them) and, with --require-client-cert, its clients",
    "require_client_cert": "mTLS: refuse clients without a certificate signed by --tls-ca",
    "allowed_peers": "comma-separated certificate names (a SAN or the CN) of the only callers this service answers, PERMISSION_DENIED for others (health and reflection stay open); stages: the gateway's, and the encoder also its consumers' (prefill, decode); needs --require-client-cert; empty: any certificate --tls-ca signs",
    "http_port": "serve the OpenAI-compatible API (/v1/chat/completions, /v1/models) on --host at this port; 0 picks a free one, -1: off",
    "allowed_media_domains": "comma-separated hosts (exact names, no subdomains) the HTTP front may fetch media URLs from; empty: URLs refused",
    "media_fetch_timeout_s": "limit on fetching all remote media of one request, redirects included",
}
_HANDOFF_KEY_HELP = (
    "the key every prefill and decode of a deployment shares (a file; its text is hashed): prefills seal each KV handoff with it, "
    "decodes take only sealed ones; empty: handoffs are not sealed (said at start)"
)
_SERVER_TLS_FIELDS = ("tls_cert", "tls_key", "tls_ca", "require_client_cert", "allowed_peers")
_HTTP_FIELDS = ("http_port", "allowed_media_domains", "media_fetch_timeout_s")
_CLIENT_TLS_FIELDS = ("tls_ca", "tls_cert", "tls_key")


def _flags(parser: argparse.ArgumentParser, cls: type, names: Sequence[str]) -> None:
    """Adds ``--name`` flags for dataclass fields, typed and defaulted by the fields (a tuple
    field takes a comma-separated list)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name in names:
        default = defaults[name]
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(name))
        elif isinstance(default, enum.Enum):
            parser.add_argument(flag, type=type(default), choices=list(type(default)), default=default, help=_HELP.get(name))
        elif isinstance(default, tuple):
            parser.add_argument(flag, type=_comma_separated, default=default, help=_HELP.get(name))
        else:
            parser.add_argument(flag, type=type(default), default=default, help=_HELP.get(name))


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _values(args: argparse.Namespace, names: Sequence[str]) -> dict:
    return {name: getattr(args, name) for name in names}


def _server_flags(p: argparse.ArgumentParser, *, max_concurrent_streams: int | None = None) -> None:
    from epd.server import ServerConfig

    defaults = ServerConfig()
    p.add_argument("--host", default=defaults.host, help="address to bind (0.0.0.0 inside a pod)")
    p.add_argument("--port", type=int, default=defaults.port, help="gRPC port; 0 picks a free one and prints it")
    p.add_argument("--metrics-port", type=int, default=defaults.metrics_port, help="serve Prometheus /metrics on this port")
    p.add_argument("--otlp-endpoint", default=defaults.otlp_endpoint, help="export traces over OTLP/gRPC to this endpoint")
    p.add_argument("--drain-grace-s", type=float, default=defaults.grace_s, help="on SIGTERM, how long in-flight calls may finish")
    p.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=max_concurrent_streams or defaults.max_concurrent_streams,
        help="streams one client connection may hold open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): bounds a rapid-reset flood",
    )
    p.add_argument("--log-level", default="INFO")
    _tls_flags(p, _SERVER_TLS_FIELDS)


def _tls_flags(p: argparse.ArgumentParser, names: Sequence[str]) -> None:
    from epd.security import TlsConfig

    _flags(p, TlsConfig, names)


def _engine_flags(p: argparse.ArgumentParser, *extra: Sequence[str], model_help: str = "local checkpoint directory") -> None:
    from epd.engine import EngineConfig

    p.add_argument("--model", required=True, help=model_help)
    _flags(p, EngineConfig, [name for group in (_ENGINE_FIELDS, *extra) for name in group])


def _media_limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits on media a request may carry; the gateway checks sizes, the decoder the rest."""
    from epd.media import MediaLimits

    _flags(p, MediaLimits, [f.name for f in dataclasses.fields(MediaLimits)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encoder", help="run the encoder service (vLLM encoder-only EC producer)")
    _server_flags(enc)
    _engine_flags(enc, _ARENA_FIELDS)
    _flags(enc, _encoder_config_class(), ["queue_timeout_s", "advertise_host"])
    _media_limit_flags(enc)

    pre = sub.add_parser("prefill", help="run the prefill service (EC consumer, KV producer)")
    _server_flags(pre)
    _engine_flags(pre, _KV_FIELDS, _RECEIVE_FIELDS)
    pre.add_argument("--allow-inline-embeddings", action="store_true", help="accept embeddings inline in gRPC (benchmarks)")
    pre.add_argument("--handoff-key-file", default="", help=_HANDOFF_KEY_HELP)

    dec = sub.add_parser("decode", help="run the decode service (E/P/D from a KV handoff, and E+PD; --mode combined: E+PD only)")
    _server_flags(dec)
    _engine_flags(dec, _KV_FIELDS, _RECEIVE_FIELDS)
    dec.add_argument("--mode", choices=["decode", "combined"], default="decode")
    dec.add_argument("--allow-inline-embeddings", action="store_true", help="E+PD requests: accept embeddings inline in gRPC (benchmarks)")
    dec.add_argument("--handoff-key-file", default="", help=_HANDOFF_KEY_HELP)

    gw = sub.add_parser("gateway", help="run the public gateway")
    gw.add_argument(
        "--affinity-key-file",
        default="",
        help="the secret that keys routing (where items and prompt prefixes land among instances): gateway replicas route alike only when they share it; "
        "default: a random key of the process's own",
    )
    _server_flags(gw, max_concurrent_streams=_GATEWAY_MAX_CONCURRENT_STREAMS)
    _engine_flags(gw, model_help="monolithic: the checkpoint directory it serves; epd, epd-combined: only the model's name in the HTTP front (no file is read)")
    gw.add_argument("--mode", choices=["epd", "epd-combined", "monolithic"], default="epd")
    instances = "host:port of one instance, or dns:///name:port for every address the name resolves to (re-resolved every 5 s and after a failure); repeat for several"
    gw.add_argument("--encoder", action="append", default=[], help=f"encoder: {instances}")
    gw.add_argument("--prefill", action="append", default=[], help=f"prefill: {instances}")
    gw.add_argument("--decode", action="append", default=[], help=f"decode: {instances}")
    gw.add_argument(
        "--forward-media",
        action="store_true",
        help="benchmarks' baseline: also send every item's media to prefill and decode, which lay it out from the media",
    )
    _flags(gw, _retry_policy_class(), ["max_attempts", "retry_backoff_s"])
    _flags(gw, _gateway_config_class(), ["max_prompt_bytes", "affinity_routing", "local_prefill_fallback", *_HTTP_FIELDS])
    gw.add_argument(
        "--auth-token-file",
        default="",
        help="require 'authorization: Bearer <token>' (the file's content) on every gRPC call but health and reflection, and on every HTTP route",
    )
    _media_limit_flags(gw)

    shared = sub.add_parser("shared-cache", help="run the encoder-output cache's shared tier (a Mooncake Store master and the holder of its memory)")
    _flags(shared, _shared_cache_config_class(), ["host", "port", "metadata_port", "metrics_port", "segment_bytes"])
    shared.add_argument("--log-level", default="INFO")

    up = sub.add_parser("up", help="build the tiny checkpoint if needed and run the whole stack on loopback")
    up.add_argument("--model", default=None, help="checkpoint directory (default: the tiny built-in one)")
    up.add_argument("--family", default=DEFAULT_FAMILY, choices=TINY_FAMILIES, help="tiny checkpoint family when --model is not given")
    up.add_argument("--mode", choices=["epd", "epd-combined", "monolithic"], default="epd")
    up.add_argument("--encoders", type=int, default=1)
    up.add_argument("--prefills", type=int, default=1)
    up.add_argument("--decodes", type=int, default=1)
    up.add_argument("--shared-cache", action="store_true", help="also run the encoder-output cache's shared tier, and have every encoder use it")
    up.add_argument("--demo", action="store_true", help="send one request with media the model takes, print the stream, then stop")
    _flags(up, _gateway_config_class(), ["http_port"])

    gen = sub.add_parser("generate", help="stream a reply from a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50051")
    gen.add_argument("--media", action="append", default=[], help="image, video or audio file, in prompt order (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    _tls_flags(gen, _CLIENT_TLS_FIELDS)
    gen.add_argument("--auth-token-file", default="", help="send 'authorization: Bearer <token>' (the file's content); needs --tls-ca")

    ckpt = sub.add_parser("build-checkpoint", help="build a tiny random-weight checkpoint")
    ckpt.add_argument("--family", default=DEFAULT_FAMILY, choices=TINY_FAMILIES)
    ckpt.add_argument("--out", required=True)
    ckpt.add_argument("--seed", type=int, default=0)
    ckpt.add_argument("--vision-seed", type=int, default=None)
    # The scales devkit.checkpoints builds (SCALES), spelled out like TINY_FAMILIES.
    ckpt.add_argument("--scale", choices=["tiny", "bench"], default="tiny", help="bench: same tower, a 0.9 GB LM in 16 shards (for benchmarks)")
    return parser


def _encoder_config_class():
    from services.encoder.runner import EncoderConfig

    return EncoderConfig


def _gateway_config_class():
    from gateway.config import GatewayConfig

    return GatewayConfig


def _shared_cache_config_class():
    from epd.shared_cache import SharedCacheConfig

    return SharedCacheConfig


def _retry_policy_class():
    from gateway.router import RetryPolicy

    return RetryPolicy


def _server_config(args):
    from epd.server import ServerConfig

    return ServerConfig(
        host=args.host, tls=_tls_config(args, _SERVER_TLS_FIELDS), **{field: getattr(args, flag) for field, flag in _SERVER_FIELDS.items()}
    )


def _tls_config(args, names: Sequence[str]):
    from epd.security import TlsConfig

    return TlsConfig(**_values(args, names))


def _engine_config(args, *extra: Sequence[str]):
    from epd.engine import EngineConfig

    # Peers dial the advertised host; a wildcard bind is reachable on loopback at least.
    advertised = args.host if args.host != "0.0.0.0" else "127.0.0.1"
    values = _values(args, [name for group in (_ENGINE_FIELDS, *extra) for name in group])
    tls = _tls_config(args, _SERVER_TLS_FIELDS)
    return EngineConfig(model=args.model, nixl_side_channel_host=advertised, nixl_listen_host=advertised, tls=tls, **values)


def _media_limits(args):
    from epd.media import MediaLimits

    return MediaLimits(**_values(args, [f.name for f in dataclasses.fields(MediaLimits)]))


def _run_service(args) -> None:
    from cli.launcher import exit_with_launcher
    from epd.server import configure_logging

    configure_logging(args.log_level)
    exit_with_launcher()
    server = _server_config(args)
    if args.command == "encoder":
        from services.encoder.runner import EncoderConfig
        from services.encoder.server import serve

        asyncio.run(
            serve(
                _engine_config(args, _ARENA_FIELDS),
                EncoderConfig(limits=_media_limits(args), queue_timeout_s=args.queue_timeout_s, advertise_host=args.advertise_host),
                server,
            )
        )
    elif args.command == "prefill":
        from services.prefill.server import serve

        asyncio.run(serve(_engine_config(args, _KV_FIELDS, _RECEIVE_FIELDS), server, allow_inline=args.allow_inline_embeddings, handoff_key_file=args.handoff_key_file))
    elif args.command == "decode":
        from services.decode.server import DecodeMode, serve

        engine = _engine_config(args, _KV_FIELDS, _RECEIVE_FIELDS)
        asyncio.run(serve(DecodeMode(args.mode), engine, server, allow_inline=args.allow_inline_embeddings, handoff_key_file=args.handoff_key_file))
    else:
        from gateway.pipeline import Mode
        from gateway.server import serve

        config = _gateway_config_class()(
            model=args.model,
            mode=Mode(args.mode),
            encoders=tuple(args.encoder),
            prefills=tuple(args.prefill),
            decodes=tuple(args.decode),
            limits=_media_limits(args),
            retry=_retry_policy_class()(**_values(args, ["max_attempts", "retry_backoff_s"])),
            forward_media=args.forward_media,
            auth_token_file=args.auth_token_file,
            max_prompt_bytes=args.max_prompt_bytes,
            affinity_routing=args.affinity_routing,
            affinity_key_file=args.affinity_key_file,
            local_prefill_fallback=args.local_prefill_fallback,
            max_prompt_tokens=args.max_model_len,
            **_values(args, _HTTP_FIELDS),
        )
        asyncio.run(serve(config, server, _engine_config(args)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("encoder", "prefill", "decode", "gateway"):
        _run_service(args)
        return 0
    if args.command == "shared-cache":
        from cli.launcher import exit_with_launcher
        from epd.server import configure_logging
        from epd.shared_cache import serve

        configure_logging(args.log_level)
        exit_with_launcher()
        return serve(_shared_cache_config_class()(**_values(args, ["host", "port", "metadata_port", "metrics_port", "segment_bytes"])))
    if args.command == "build-checkpoint":
        from devkit.checkpoints import build_tiny_checkpoint

        print(build_tiny_checkpoint(args.family, args.out, seed=args.seed, vision_seed=args.vision_seed, scale=args.scale))
        return 0
    if args.command == "generate":
        from epd.client import generate_cli
        from epd.security import channel_credentials, read_token

        token = read_token(args.auth_token_file) if args.auth_token_file else None
        credentials = channel_credentials(_tls_config(args, _CLIENT_TLS_FIELDS), token=token)
        media = [pathlib.Path(p) for p in args.media]
        return asyncio.run(generate_cli(args.gateway, args.prompt, media, args.max_tokens, args.temperature, credentials=credentials))
    from cli.launcher import up_cli

    return up_cli(args)

"""The ``epd`` command: one place that defines every flag and turns them into config objects.

Subcommands: ``encoder``, ``prefill``, ``decode``, ``gateway`` (run one service), ``up`` (the
whole stack on loopback), ``generate`` (a streaming client) and ``build-checkpoint``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

DEFAULT_CHECKPOINT_ROOT = pathlib.Path("checkpoints")
DEFAULT_FAMILY = "qwen2_5_vl"
TINY_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_audio")  # what epd.checkpoints builds


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 inside a pod)")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one and prints it")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--otlp-endpoint", default=None, help="export traces over OTLP/gRPC to this endpoint")
    p.add_argument("--drain-grace-s", type=float, default=5.0, help="on SIGTERM, how long in-flight calls may finish")
    p.add_argument("--log-level", default="INFO")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local checkpoint directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="CPU only: KV cache size")
    p.add_argument("--max-images-per-prompt", type=int, default=8)
    p.add_argument("--max-videos-per-prompt", type=int, default=2)
    p.add_argument("--max-audios-per-prompt", type=int, default=4)
    p.add_argument("--nixl-side-channel-port", type=int, default=0, help="vLLM NixlConnector side channel; 0 picks one")
    p.add_argument("--no-caches", action="store_true", help="disable vLLM's prefix and multimodal processor caches (benchmarks)")


def _media_limit_flags(p: argparse.ArgumentParser) -> None:
    """Limits on media a request may carry; the gateway checks sizes, the decoder the rest."""
    from epd.media import MediaLimits

    d = MediaLimits()
    p.add_argument("--max-item-bytes", type=int, default=d.max_item_bytes)
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, help="per image and per video frame")
    p.add_argument("--max-video-frames", type=int, default=d.max_video_frames, help="frames in the source video, before sampling")
    p.add_argument("--max-audio-s", type=float, default=d.max_audio_s, help="the model's own cap applies too")


def _media_limits(args):
    from epd.media import MediaLimits

    return MediaLimits(args.max_item_bytes, args.max_request_bytes, args.max_image_pixels, args.max_video_frames, args.max_audio_s)


def _receive_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embedding-buffer-bytes", type=int, default=64 * 1024 * 1024, help="NIXL receive buffer, registered once")
    p.add_argument("--allow-inline-embeddings", action="store_true", help="accept embeddings inline in gRPC (benchmarks)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    enc = sub.add_parser("encoder", help="run the encoder service")
    _server_flags(enc)
    enc.add_argument("--model", required=True)
    enc.add_argument("--dtype", default="float32")
    enc.add_argument("--transport", choices=["nixl", "inline"], default="nixl")
    enc.add_argument("--arena-slot-bytes", type=int, default=256 * 1024)
    enc.add_argument("--arena-slots", type=int, default=256)
    enc.add_argument("--lease-ttl-s", type=float, default=60.0)
    enc.add_argument("--max-batch-items", type=int, default=16)
    enc.add_argument("--batch-wait-ms", type=float, default=5.0)
    _media_limit_flags(enc)

    pre = sub.add_parser("prefill", help="run the prefill service (KV producer)")
    _server_flags(pre)
    _engine_flags(pre)
    _receive_flags(pre)

    dec = sub.add_parser("decode", help="run the decode service (KV consumer, or combined E+PD)")
    _server_flags(dec)
    _engine_flags(dec)
    _receive_flags(dec)
    dec.add_argument("--mode", choices=["decode", "combined"], default="decode")

    gw = sub.add_parser("gateway", help="run the public gateway")
    _server_flags(gw)
    _engine_flags(gw)
    gw.add_argument("--mode", choices=["epd", "epd-combined", "monolithic"], default="epd")
    gw.add_argument("--encoder", action="append", default=[], help="encoder address (repeat for several)")
    gw.add_argument("--prefill", action="append", default=[], help="prefill address (repeat for several)")
    gw.add_argument("--decode", action="append", default=[], help="decode address (repeat for several)")
    gw.add_argument(
        "--forward-media",
        action="store_true",
        help="benchmarks' baseline: also send the media to prefill and decode, which re-derive the layout with the processor",
    )
    _media_limit_flags(gw)

    up = sub.add_parser("up", help="build the tiny checkpoint if needed and run the whole stack on loopback")
    up.add_argument("--model", default=None, help="checkpoint directory (default: the tiny built-in one)")
    up.add_argument("--family", default=DEFAULT_FAMILY, choices=TINY_FAMILIES, help="tiny checkpoint family when --model is not given")
    up.add_argument("--mode", choices=["epd", "epd-combined", "monolithic"], default="epd")
    up.add_argument("--encoders", type=int, default=1)
    up.add_argument("--prefills", type=int, default=1)
    up.add_argument("--decodes", type=int, default=1)
    up.add_argument("--demo", action="store_true", help="send one request with media the model takes, print the stream, then stop")

    gen = sub.add_parser("generate", help="stream a reply from a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default="127.0.0.1:50051")
    gen.add_argument("--media", action="append", default=[], help="image, video or audio file, in prompt order (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)

    ckpt = sub.add_parser("build-checkpoint", help="build a tiny random-weight checkpoint")
    ckpt.add_argument("--family", default=DEFAULT_FAMILY, choices=TINY_FAMILIES)
    ckpt.add_argument("--out", required=True)
    ckpt.add_argument("--seed", type=int, default=0)
    ckpt.add_argument("--vision-seed", type=int, default=None)
    # The scales epd.checkpoints builds (SCALES), spelled out like TINY_FAMILIES.
    ckpt.add_argument("--scale", choices=["tiny", "bench"], default="tiny", help="bench: same tower, a 0.9 GB LM in 16 shards (for benchmarks)")
    return parser


def _server_config(args):
    from epd.server import ServerConfig

    return ServerConfig(
        host=args.host, port=args.port, metrics_port=args.metrics_port, otlp_endpoint=args.otlp_endpoint, grace_s=args.drain_grace_s
    )


def _engine_config(args):
    from epd.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        max_images_per_prompt=args.max_images_per_prompt,
        max_videos_per_prompt=args.max_videos_per_prompt,
        max_audios_per_prompt=args.max_audios_per_prompt,
        nixl_side_channel_host=args.host if args.host != "0.0.0.0" else "127.0.0.1",
        nixl_side_channel_port=args.nixl_side_channel_port,
        caches=not args.no_caches,
    )


def _receive_config(args):
    from services.engine_server import EmbeddingReceiveConfig

    return EmbeddingReceiveConfig(buffer_bytes=args.embedding_buffer_bytes, allow_inline=args.allow_inline_embeddings)


def _run_service(args) -> None:
    from epd.server import configure_logging

    configure_logging(args.log_level)
    if args.command == "encoder":
        from services.encoder.runner import EncoderConfig
        from services.encoder.server import serve

        config = EncoderConfig(
            model=args.model,
            dtype=args.dtype,
            transport=args.transport,
            arena_slot_bytes=args.arena_slot_bytes,
            arena_slots=args.arena_slots,
            lease_ttl_s=args.lease_ttl_s,
            max_batch_items=args.max_batch_items,
            batch_wait_s=args.batch_wait_ms / 1000,
            nixl_listen_host=args.host if args.host != "0.0.0.0" else "127.0.0.1",
            limits=_media_limits(args),
        )
        asyncio.run(serve(config, _server_config(args)))
    elif args.command == "prefill":
        from services.prefill.server import serve

        asyncio.run(serve(_engine_config(args), _receive_config(args), _server_config(args)))
    elif args.command == "decode":
        from services.decode.server import serve
        from services.decode.servicer import DecodeMode

        asyncio.run(serve(DecodeMode(args.mode), _engine_config(args), _receive_config(args), _server_config(args)))
    else:
        from gateway.pipeline import Mode
        from gateway.server import GatewayConfig, serve

        config = GatewayConfig(
            model=args.model,
            mode=Mode(args.mode),
            encoders=tuple(args.encoder),
            prefills=tuple(args.prefill),
            decodes=tuple(args.decode),
            limits=_media_limits(args),
            forward_media=args.forward_media,
        )
        asyncio.run(serve(config, _server_config(args), _engine_config(args)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("encoder", "prefill", "decode", "gateway"):
        _run_service(args)
        return 0
    if args.command == "build-checkpoint":
        from epd.checkpoints import build_tiny_checkpoint

        print(build_tiny_checkpoint(args.family, args.out, seed=args.seed, vision_seed=args.vision_seed, scale=args.scale))
        return 0
    if args.command == "generate":
        from epd.client import generate_cli

        return asyncio.run(generate_cli(args.gateway, args.prompt, [pathlib.Path(p) for p in args.media], args.max_tokens, args.temperature))
    from epd.launcher import up_cli

    return up_cli(args)


if __name__ == "__main__":
    sys.exit(main())

"""The compiled gateway (``gateway/go``, built by ``scripts/build_gateway.sh`` into
``build/epd-gateway``): ``epd gateway --impl go`` runs it in place of this process, with the
flags ``epd gateway`` parsed, so both gateways share one command line.

It serves the epd and epd-combined modes. What it does not implement is refused here, before
it starts, rather than ignored: the monolithic oracle and the OpenAI-compatible HTTP front run
in the Python gateway only.
"""

from __future__ import annotations

import argparse
import os
import pathlib

BINARY = pathlib.Path(os.environ.get("EPD_GATEWAY_BINARY", pathlib.Path(__file__).resolve().parents[1] / "build" / "epd-gateway"))


def argv(args: argparse.Namespace) -> list[str]:
    """The compiled gateway's command line for parsed ``epd gateway`` arguments.

    Raises:
        ValueError: an option it does not implement.
    """
    if args.mode not in ("epd", "epd-combined"):
        raise ValueError(f"--impl go serves --mode epd and epd-combined; {args.mode} runs in the Python gateway (--impl python)")
    if args.http_port >= 0:
        raise ValueError("--impl go has no OpenAI-compatible HTTP front (--http-port); run it with --impl python")
    flags: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "drain-grace-s": args.drain_grace_s,
        "mode": args.mode,
        "max-attempts": args.max_attempts,
        "retry-backoff-s": args.retry_backoff_s,
        "max-prompt-bytes": args.max_prompt_bytes,
        "affinity-routing": args.affinity_routing,
        "local-prefill-fallback": args.local_prefill_fallback,
        "forward-media": args.forward_media,
        "max-item-bytes": args.max_item_bytes,
        "max-request-bytes": args.max_request_bytes,
        "require-client-cert": args.require_client_cert,
    }
    optional = {
        "metrics-port": args.metrics_port,
        "otlp-endpoint": args.otlp_endpoint,
        "tls-cert": args.tls_cert,
        "tls-key": args.tls_key,
        "tls-ca": args.tls_ca,
        "auth-token-file": args.auth_token_file,
        "affinity-key-file": args.affinity_key_file,
    }
    flags.update({name: value for name, value in optional.items() if value not in (None, "")})
    command = [str(BINARY), *(f"--{name}={str(value).lower() if isinstance(value, bool) else value}" for name, value in flags.items())]
    for stage in ("encoder", "prefill", "decode"):
        command += [f"--{stage}={address}" for address in getattr(args, stage)]
    return command


def exec_gateway(args: argparse.Namespace) -> None:
    """Replaces this process with the compiled gateway (same PID, so launchers and process
    managers keep their handle on it)."""
    try:
        command = argv(args)
    except ValueError as exc:
        raise SystemExit(f"epd gateway: {exc}") from None
    if not BINARY.is_file():
        raise SystemExit(f"epd gateway --impl go: {BINARY} is missing; build it with scripts/build_gateway.sh (or point EPD_GATEWAY_BINARY at it)")
    os.execv(command[0], command)

"""Transport security in one place: TLS and mTLS credentials for servers and channels, and the
gateway's bearer-token check.

One set of flags per service, used in both directions: ``--tls-cert``/``--tls-key`` are the
service's own identity (its server certificate, and its client certificate when it dials a
peer); ``--tls-ca`` is the CA that signs its peers (it verifies the servers a service dials,
and the clients of a service started with ``--require-client-cert``). ``--allowed-peers`` then
narrows who may call a service to the identities named: a gateway's clients may hold
certificates from the same CA, and must not open the stages behind it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import pathlib

import grpc

logger = logging.getLogger(__name__)

# Probes and tooling must reach these without a token (Kubernetes, grpc_health_probe, grpcurl).
_OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """Paths to PEM files; empty means not given. The CLI derives its flags from these fields."""

    tls_cert: str = ""  # this service's certificate chain
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # the CA that signs peers
    require_client_cert: bool = False  # refuse clients without a certificate signed by tls_ca
    allowed_peers: tuple[str, ...] = ()  # callers' certificate names (SAN or CN) let in; empty: any

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.require_client_cert and not (self.tls_cert and self.tls_ca):
            raise ValueError("--require-client-cert needs --tls-cert, --tls-key and --tls-ca (the CA that signs client certificates)")
        if self.allowed_peers and not self.require_client_cert:
            raise ValueError("--allowed-peers names callers by their certificates: it needs --require-client-cert")

    @property
    def serves_tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def dials_tls(self) -> bool:
        """Peers are dialled over TLS once there is a CA to verify them with."""
        return bool(self.tls_ca)


def _read(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path!r}: {exc.strerror}") from exc


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The listening port's credentials: our certificate, and client verification if required."""
    identity = (_read(tls.tls_key, "TLS key"), _read(tls.tls_cert, "TLS certificate"))
    client_ca = _read(tls.tls_ca, "TLS CA") if tls.require_client_cert else None
    return grpc.ssl_server_credentials([identity], root_certificates=client_ca, require_client_auth=tls.require_client_cert)


def channel_credentials(tls: TlsConfig, *, token: str | None = None) -> grpc.ChannelCredentials | None:
    """Credentials to dial a peer: verify it with the CA, present our certificate (for peers that
    require client certificates) and, if given, send ``authorization: Bearer <token>`` on every
    call. None means plaintext."""
    if not tls.dials_tls:
        if token is not None:
            raise ValueError("a bearer token is only sent over TLS: give --tls-ca too")
        if tls.tls_cert:
            logger.warning("--tls-cert without --tls-ca: peers are dialled in PLAINTEXT (give --tls-ca to dial them over TLS)")
        return None
    key, cert = (_read(tls.tls_key, "TLS key"), _read(tls.tls_cert, "TLS certificate")) if tls.tls_cert else (None, None)
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls.tls_ca, "TLS CA"), private_key=key, certificate_chain=cert)
    if token is not None:
        credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
    return credentials


def peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    """The names the caller's verified certificate carries: its subject alternative names (DNS,
    URI, IP) and common name. Empty without a client certificate."""
    auth = context.auth_context()
    return {value.decode(errors="replace") for key in ("x509_subject_alternative_name", "x509_common_name") for value in auth.get(key, ())}


async def require_peer(context: grpc.aio.ServicerContext, allowed: frozenset[str]) -> None:
    """Ends the call with PERMISSION_DENIED unless the caller's certificate names an allowed peer."""
    names = peer_names(context)
    if not names & allowed:
        shown = ", ".join(sorted(names)[:8])[:200] or "no verified certificate"
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"this service takes calls only from the peers it is configured for (--allowed-peers); the caller's certificate names {shown}"
        )


def read_secret(path: str, what: str) -> bytes:
    """A key shared through a file: the SHA-256 of its text (surrounding whitespace ignored, so a
    trailing newline is fine), whatever its length.

    Raises:
        ValueError: the file cannot be read or holds only whitespace.
    """
    text = _read(path, what).strip()
    if not text:
        raise ValueError(f"the {what} {path!r} is empty")
    return hashlib.sha256(text).digest()


def read_token(path: str) -> str:
    """The bearer token in a file (surrounding whitespace ignored, so a trailing newline is fine)."""
    token = _read(path, "auth token file").decode().strip()
    if not token:
        raise ValueError(f"the auth token file {path!r} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with ``authorization: Bearer <token>``; health and reflection
    stay open. The comparison takes the same time wherever a wrong token differs."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        presented = [value for key, value in handler_call_details.invocation_metadata or () if key == "authorization"]
        if len(presented) == 1 and bearer_matches(presented[0], self._expected):
            return await continuation(handler_call_details)
        reason = "missing 'authorization: Bearer <token>' metadata" if not presented else "invalid bearer token"
        return _refusal(await continuation(handler_call_details), reason)


def bearer_matches(presented: str | bytes, expected: bytes) -> bool:
    """Whether an authorization value is ``expected`` (``Bearer <token>``), in a time that does
    not depend on where a wrong value differs. The gateway's gRPC and HTTP fronts both use it."""
    return hmac.compare_digest(_as_bytes(presented), expected)


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _refusal(handler: grpc.RpcMethodHandler | None, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as the method's that ends the call with UNAUTHENTICATED.

    Unknown methods are refused the same way, so an unauthenticated peer learns nothing about
    which methods exist."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(refuse)
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(refuse, **codec)

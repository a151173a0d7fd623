"""Servicer-side plumbing: one decorator maps domain errors to rich gRPC statuses and traces.

Every RPC handler is wrapped, so a handler body never builds a status itself, an unexpected
exception is logged and becomes INTERNAL (a bug), the request counter is always updated, and
the handler runs in a SERVER span that continues the caller's trace.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging

import grpc
from google.protobuf import descriptor_pool, message, message_factory
from grpc_status import rpc_status
from opentelemetry import trace

from epd import telemetry
from epd.errors import EpdError, Internal, internal_status, to_rpc_status
from epd.security import require_peer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Received:
    """What :func:`add_servicer`'s parsers hand :func:`rpc_method` (rather than raise, so that
    a body that does not parse gets its status here): the request and its size."""

    request: object | None  # the parsed message; None when the body does not parse as message_name
    nbytes: int
    message_name: str


_REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("epd_request_bytes", default=0)


def request_bytes() -> int:
    """The serialized size of the request the calling handler serves, as it arrived.

    Known from the bytes themselves: ``ByteSize()`` would encode the whole message again to
    measure it (upb), which for a request of megabytes cost the gateway up to a millisecond."""
    return _REQUEST_BYTES.get()


def add_servicer(server: grpc.aio.Server, full_service_name: str, servicer, *, allowed_peers: frozenset[str] = frozenset()) -> None:
    """Registers ``servicer``'s handler for every method of the service, as the generated
    ``add_*Servicer_to_server`` does, but parsing each request itself; with ``allowed_peers``,
    every method first checks that the caller's certificate names one of them (health and
    reflection, registered apart, stay open to probes).

    grpcio answers a body that does not parse with UNKNOWN and a Python repr ("Unexpected <class
    'google.protobuf.message.DecodeError'>: ..."); gRPC's status-code table gives a request that
    does not parse INTERNAL, which :func:`rpc_method` answers with a clean message. And the
    request's size comes along from its bytes (:func:`request_bytes`).
    """
    service = descriptor_pool.Default().FindServiceByName(full_service_name)
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not served here")
        handler = getattr(servicer, method.name)
        if not getattr(handler, "_unwraps_requests", False):
            raise TypeError(f"{method.full_name}: the handler must be an @rpc_method, which takes the parsed request")
        if allowed_peers:
            handler = _for_peers(handler, allowed_peers, method.server_streaming)
        request_class = message_factory.GetMessageClass(method.input_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            handler,
            request_deserializer=_parser(request_class),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(full_service_name, handlers),))
    server.add_registered_method_handlers(full_service_name, handlers)


def _for_peers(handler, allowed: frozenset[str], streaming: bool):
    """``handler``, answering only callers whose certificate names an allowed peer."""
    if streaming:

        async def stream(request, context):
            await require_peer(context, allowed)
            async for response in handler(request, context):
                yield response

        return stream

    async def unary(request, context):
        await require_peer(context, allowed)
        return await handler(request, context)

    return unary


def _parser(request_class):
    def parse(data: bytes) -> _Received:
        try:
            parsed = request_class.FromString(data)
        except message.DecodeError:
            parsed = None
        return _Received(parsed, len(data), request_class.DESCRIPTOR.full_name)

    return parse


def _unwrap(received: _Received):
    """The handler's request, its size recorded for :func:`request_bytes`; a request that does
    not parse raises INTERNAL, gRPC's status for it."""
    _REQUEST_BYTES.set(received.nbytes)
    if received.request is None:
        raise Internal(f"the request does not parse as {received.message_name}")
    return received.request


async def _abort(context: grpc.aio.ServicerContext, error: EpdError | None, exc: BaseException) -> None:
    status = to_rpc_status(error) if error is not None else internal_status(f"internal error ({type(exc).__name__}); the service's log has the details")
    await context.abort_with_status(rpc_status.to_status(status))


def rpc_method(service: str):
    """Decorates a unary or server-streaming aio handler ``(self, request, context)``."""

    def decorate(handler):
        method = handler.__name__

        def span(servicer, context):
            return telemetry.server_span(f"/{_grpc_service(servicer)}/{method}", context.invocation_metadata())

        def record(code: grpc.StatusCode) -> None:
            telemetry.REQUESTS.labels(service=service, method=method, code=code.name).inc()

        async def handle_failure(context, exc: BaseException) -> None:
            if isinstance(exc, EpdError):
                logger.info("%s.%s failed: %s %s", service, method, exc.code.name, exc.message)
                record(exc.code)
                await _abort(context, exc, exc)
            else:
                logger.exception("%s.%s crashed", service, method)
                record(grpc.StatusCode.INTERNAL)
                await _abort(context, None, exc)

        if inspect.isasyncgenfunction(handler):

            @functools.wraps(handler)
            async def stream_wrapper(self, request, context):
                telemetry.IN_FLIGHT.labels(service=service).inc()
                server_span = span(self, context)
                responses = None
                try:
                    responses = handler(self, _unwrap(request), context)
                    while True:
                        # Current only while the handler runs, never across a yield: the stream
                        # may be resumed or closed from another Context (a cancelled client).
                        with trace.use_span(server_span):
                            try:
                                response = await anext(responses)
                            except StopAsyncIteration:
                                break
                        yield response
                    record(grpc.StatusCode.OK)
                except Exception as exc:  # noqa: BLE001 - mapped to a status right here
                    await handle_failure(context, exc)
                finally:
                    if responses is not None:
                        await responses.aclose()
                    server_span.end()
                    telemetry.IN_FLIGHT.labels(service=service).dec()

            stream_wrapper._unwraps_requests = True
            return stream_wrapper

        @functools.wraps(handler)
        async def unary_wrapper(self, request, context):
            telemetry.IN_FLIGHT.labels(service=service).inc()
            try:
                request = _unwrap(request)
                with trace.use_span(span(self, context), end_on_exit=True):
                    response = await handler(self, request, context)
                record(grpc.StatusCode.OK)
                return response
            except Exception as exc:  # noqa: BLE001 - mapped to a status right here
                await handle_failure(context, exc)
            finally:
                telemetry.IN_FLIGHT.labels(service=service).dec()

        unary_wrapper._unwraps_requests = True
        return unary_wrapper

    return decorate


def _grpc_service(servicer) -> str:
    """The full gRPC service name a servicer implements (its generated base class's)."""
    for cls in type(servicer).__mro__:
        if cls.__module__.startswith("epd.v1.") and cls.__name__.endswith("Servicer"):
            return f"epd.v1.{cls.__name__.removesuffix('Servicer')}"
    return type(servicer).__name__

"""Servicer-side plumbing: one decorator maps domain errors to rich gRPC statuses and traces.

Every RPC handler is wrapped, so a handler body never builds a status itself, an unexpected
exception is logged and becomes INTERNAL (a bug), the request counter is always updated, and
the handler runs in a SERVER span that continues the caller's trace.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc
from grpc_status import rpc_status
from opentelemetry import trace

from epd import telemetry
from epd.errors import EpdError, internal_status, to_rpc_status

logger = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, error: EpdError | None, exc: BaseException) -> None:
    status = to_rpc_status(error) if error is not None else internal_status(f"internal error: {type(exc).__name__}: {exc}")
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
                responses = handler(self, request, context)
                try:
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
                    await responses.aclose()
                    server_span.end()
                    telemetry.IN_FLIGHT.labels(service=service).dec()

            return stream_wrapper

        @functools.wraps(handler)
        async def unary_wrapper(self, request, context):
            telemetry.IN_FLIGHT.labels(service=service).inc()
            try:
                with trace.use_span(span(self, context), end_on_exit=True):
                    response = await handler(self, request, context)
                record(grpc.StatusCode.OK)
                return response
            except Exception as exc:  # noqa: BLE001 - mapped to a status right here
                await handle_failure(context, exc)
            finally:
                telemetry.IN_FLIGHT.labels(service=service).dec()

        return unary_wrapper

    return decorate


def _grpc_service(servicer) -> str:
    """The full gRPC service name a servicer implements (its generated base class's)."""
    for cls in type(servicer).__mro__:
        if cls.__module__.startswith("epd.v1.") and cls.__name__.endswith("Servicer"):
            return f"epd.v1.{cls.__name__.removesuffix('Servicer')}"
    return type(servicer).__name__

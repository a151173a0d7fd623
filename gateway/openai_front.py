"""OpenAI-compatible HTTP front of the gateway: ``POST /v1/chat/completions`` and ``GET /v1/models``.

It runs in the gateway's process and event loop, beside the gRPC server: uvicorn's
``Server.serve()`` is one more task on that loop, so a chat reaches the very pipeline object
``GatewayServicer`` calls, with no thread or second loop between them, and both APIs give the
same tokens. JSON <-> domain conversion is in ``gateway.openai_wire``; remote media in
``gateway.media_fetch``.

- Security follows the gRPC side: the gateway's TLS files serve HTTPS (client certificates
  required with ``--require-client-cert``) and its bearer token is required on every route.
- Each chat runs in its own task, as ``GatewayServicer`` runs it: when the client goes away,
  wherever the request waits (encoder, prefill, decode), the task is cancelled, which aborts
  every stage.
- A streamed reply starts once the first token is there, so an error before it (bad media, a
  full encoder, no live stage) still gets its HTTP status; a later one ends the stream with an
  error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from epd import telemetry
from epd.errors import EpdError, Unavailable
from epd.security import bearer_matches
from epd.server import ServerConfig
from gateway import openai_wire
from gateway.media_fetch import MediaFetcher
from gateway.pipeline import Delta, Event, Finished
from gateway.run import PipelineRun, RunCancelled

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

_SSE_DONE = b"data: [DONE]\n\n"
# A body may hold the request's media limit in base64 and its text limit JSON-escaped (a
# \\uXXXX escape is 6 bytes a byte), plus this much for everything else.
_BODY_SLACK_BYTES = 1024 * 1024


class HttpError(Exception):
    """A refusal by the front itself: token, model, body, route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
        rpc_code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,  # for epd_requests_total
    ):
        super().__init__(message)
        self.status = status
        self.rpc_code = rpc_code
        self.body = openai_wire.error_json(message, error_type, param=param, code=code)
        self.headers = headers or {}


class _ClientGone(Exception):
    pass


async def _cancel_when_gone(request: Request, run: PipelineRun) -> None:
    # The body is read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.cancel()


class _Tracker:
    """epd_requests_in_flight and epd_requests_total for one chat, as rpc_method keeps them for
    gRPC calls (service "gateway", method "ChatCompletions"), and its SERVER span: a child of
    the client's ``traceparent`` header when it sends one, the parent of every stage call."""

    def __init__(self, headers) -> None:
        telemetry.IN_FLIGHT.labels(service="gateway").inc()
        self.span = telemetry.server_span("POST /v1/chat/completions", headers.items())
        self.code = grpc.StatusCode.CANCELLED  # until the reply is complete or an error is known
        self._open = True

    def finish(self) -> None:
        if self._open:
            self._open = False
            telemetry.IN_FLIGHT.labels(service="gateway").dec()
            telemetry.REQUESTS.labels(service="gateway", method="ChatCompletions", code=self.code.name).inc()
            self.span.set_attribute("rpc.grpc.status_code", self.code.value[0])
            self.span.end()


class _EventStream(StreamingResponse):
    """A server-sent-events reply that ends its chat however the exchange ends: complete, the
    client gone (Starlette then cancels the body), or the body never started."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _InLoopServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gRPC host owns SIGTERM and SIGINT, and the front
    stops when the host drains."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class OpenAIFront:
    """The HTTP front: :meth:`start` binds and serves, :meth:`stop` drains.

    ``pipeline`` returns the gateway's pipeline, None while it starts.
    """

    def __init__(self, config: GatewayConfig, server: ServerConfig, token: str | None, pipeline: Callable[[], object | None]):
        self._pipeline = pipeline
        self._server_config = server
        self.model_id = pathlib.Path(config.model).name
        self._model_names = {self.model_id, config.model, str(pathlib.Path(config.model).resolve())}
        self._created = int(time.time())
        self._context_tokens = config.max_prompt_tokens
        self._expected = f"Bearer {token}".encode() if token is not None else None
        limits = config.limits
        text_bytes = config.max_prompt_bytes or limits.max_request_bytes
        self._max_body_bytes = -(-limits.max_request_bytes // 3) * 4 + 6 * text_bytes + _BODY_SLACK_BYTES
        self._fetcher = (
            MediaFetcher(
                config.allowed_media_domains,
                max_item_bytes=limits.max_item_bytes,
                max_request_bytes=limits.max_request_bytes,
                timeout_s=config.media_fetch_timeout_s,
            )
            if config.allowed_media_domains
            else None
        )
        self.app = self._app()
        tls = server.tls
        tls_options: dict = {}
        if tls.serves_tls:
            tls_options = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key}
            if tls.require_client_cert:
                tls_options.update(ssl_ca_certs=tls.tls_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        uv_config = uvicorn.Config(
            self.app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=server.grace_s, **tls_options
        )
        uv_config.load()  # builds the SSL context now: an unreadable file stops the gateway at start
        self._uvicorn = _InLoopServer(uv_config)
        self._task: asyncio.Task | None = None

    def start(self, port: int, stopping: Awaitable[None]) -> int:
        """Binds the gateway's host at ``port`` (0: a free one), serves on this loop until
        ``stopping`` completes (the gateway drains: new connections are then refused and replies
        in progress get the drain grace, as gRPC streams do), and returns the bound port."""
        host = self._server_config.host
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        bound = sock.getsockname()[1]
        scheme = "https" if self._server_config.tls.serves_tls else "http"
        logger.info(
            "gateway: OpenAI-compatible API on %s://%s:%d/v1 (remote media: %s)",
            scheme,
            host,
            bound,
            ", ".join(sorted(self._fetcher.allowed_hosts)) if self._fetcher else "refused",
        )

        async def serve() -> None:
            serving = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
            until = asyncio.ensure_future(stopping)
            await asyncio.wait({serving, until}, return_when=asyncio.FIRST_COMPLETED)
            until.cancel()
            self._uvicorn.should_exit = True
            await serving

        self._task = asyncio.create_task(serve())
        return bound

    async def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._task is not None:
            await self._task
        if self._fetcher is not None:
            await self._fetcher.close()

    # ---- the application ----------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI(title="EPD gateway (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
        authorized = [Depends(self._authorize)]
        app.add_api_route("/v1/models", self._models, methods=["GET"], dependencies=authorized)
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"], dependencies=authorized)
        app.add_exception_handler(HttpError, _http_error)
        app.add_exception_handler(EpdError, _epd_error)
        app.add_exception_handler(StarletteHTTPException, _route_error)
        app.add_exception_handler(Exception, _internal_error)
        return app

    def _authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        presented = request.headers.getlist("authorization")
        if len(presented) == 1 and bearer_matches(presented[0], self._expected):
            return
        message = "missing 'Authorization: Bearer <token>' header" if not presented else "invalid bearer token"
        raise HttpError(401, message, error_type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self._created, "owned_by": "epd"}]}

    async def _chat(self, request: Request) -> Response:
        tracker = _Tracker(request.headers)
        try:
            # Current while the chat's pipeline task starts (it inherits the context), so every
            # stage call is the span's child; attached and detached in this one task.
            with trace.use_span(tracker.span, end_on_exit=False):
                response = await self._answer(request, tracker)
        except (EpdError, HttpError) as exc:
            tracker.code = exc.code if isinstance(exc, EpdError) else exc.rpc_code
            tracker.finish()
            raise
        except (_ClientGone, RunCancelled):
            tracker.finish()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except BaseException:
            tracker.code = grpc.StatusCode.INTERNAL
            tracker.finish()
            raise
        if not isinstance(response, _EventStream):
            tracker.finish()
        return response

    async def _answer(self, request: Request, tracker: _Tracker) -> Response:
        chat = openai_wire.chat_completion_from_json(await self._json_body(request), default_max_tokens=self._context_tokens)
        if chat.model not in self._model_names:
            raise HttpError(
                404,
                f"the model {chat.model!r} does not exist; this gateway serves {self.model_id!r}",
                param="model",
                code="model_not_found",
                rpc_code=grpc.StatusCode.NOT_FOUND,
            )
        pipeline = self._pipeline()
        if pipeline is None:
            raise Unavailable("gateway is still starting")
        chat_id = f"chatcmpl-{uuid.uuid4().hex}"
        generate = await openai_wire.generate_request(chat, chat_id, self._fetcher.fetch_all if self._fetcher else None)
        head = {"id": chat_id, "created": int(time.time()), "model": self.model_id}
        # The client sets no deadline over HTTP; a dropped connection is what ends a chat early.
        run = PipelineRun(pipeline.generate(generate, None))
        watch = asyncio.create_task(_cancel_when_gone(request, run))
        try:
            if not chat.stream:
                body = await _completion(chat, head, run)
                tracker.code = grpc.StatusCode.OK
                return JSONResponse(body)
            first = await run.next()  # errors before the first token keep their HTTP status
        except BaseException:
            run.cancel()
            raise
        finally:
            watch.cancel()  # from here on Starlette's StreamingResponse watches for the disconnect

        def close() -> None:
            run.cancel()
            tracker.finish()

        return _EventStream(_chunks(chat, head, run, first, tracker), close)

    async def _json_body(self, request: Request) -> object:
        too_large = HttpError(413, f"the request body is over this gateway's limit of {self._max_body_bytes} bytes", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self._max_body_bytes:
                    raise too_large
        except ClientDisconnect as exc:
            raise _ClientGone from exc
        try:
            # Megabytes of base64 media: parsed off the event loop.
            return await asyncio.to_thread(json.loads, body)
        except ValueError as exc:
            raise HttpError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from exc


async def _completion(chat: openai_wire.ChatCompletionRequest, head: dict, run: PipelineRun) -> dict:
    texts: list[str] = []
    token_ids: list[int] = []
    finished = None
    while (event := await run.next()) is not None:
        if isinstance(event, Delta):
            texts.append(event.text)
            token_ids += event.token_ids
        else:
            finished = event
    return openai_wire.completion_json(chat, head, "".join(texts), token_ids, finished)


async def _chunks(
    chat: openai_wire.ChatCompletionRequest, head: dict, run: PipelineRun, event: Event | None, tracker: _Tracker
) -> AsyncIterator[bytes]:
    yield _sse(openai_wire.chunk_json(chat, head, {"role": "assistant", "content": ""}))
    try:
        while event is not None:
            if isinstance(event, Finished):
                yield _sse(openai_wire.chunk_json(chat, head, {}, finished=event))
            else:
                yield _sse(openai_wire.chunk_json(chat, head, {"content": event.text}, token_ids=event.token_ids))
            event = await run.next()
        tracker.code = grpc.StatusCode.OK
    except EpdError as exc:  # after the first token the status is already 200
        tracker.code = exc.code
        yield _sse(openai_wire.error_response(exc)[1])
    yield _SSE_DONE


async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


async def _epd_error(request: Request, exc: EpdError) -> JSONResponse:
    logger.info("ChatCompletions failed: %s %s", exc.code.name, exc.message)
    status, body, headers = openai_wire.error_response(exc)
    return JSONResponse(body, status_code=status, headers=headers)


async def _route_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        openai_wire.error_json(str(exc.detail), "invalid_request_error", code="unknown_route"), status_code=exc.status_code, headers=exc.headers
    )


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback: an exception that is not an EpdError is a bug.
    return JSONResponse(openai_wire.error_json(f"internal error: {type(exc).__name__}", "server_error", code="internal"), status_code=500)

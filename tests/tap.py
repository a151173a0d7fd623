"""A recording gRPC proxy for tests: forwards raw bytes to a target and keeps every request,
so a test can inspect exactly what crossed a hop."""

from __future__ import annotations

import grpc


class RecordingProxy:
    """Transparent proxy for unary-unary and unary-stream methods (``streaming`` names the latter)."""

    def __init__(self, target: str, *, streaming: frozenset[str] = frozenset()):
        self.target = target
        self.streaming = streaming
        self.requests: list[tuple[str, bytes]] = []
        self._server = grpc.aio.server()
        self._channel = grpc.aio.insecure_channel(target)
        self._server.add_generic_rpc_handlers((_Forwarder(self),))
        self.address = ""

    async def start(self) -> str:
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        await self._server.stop(0)
        await self._channel.close()

    def requests_for(self, method_suffix: str) -> list[bytes]:
        return [body for method, body in self.requests if method.endswith(method_suffix)]


class _Forwarder(grpc.GenericRpcHandler):
    def __init__(self, proxy: RecordingProxy):
        self.proxy = proxy

    def service(self, details):
        method = details.method
        proxy = self.proxy
        if method.rsplit("/", 1)[-1] in proxy.streaming:

            async def stream(request: bytes, context):
                proxy.requests.append((method, request))
                try:
                    async for response in proxy._channel.unary_stream(method)(request, timeout=context.time_remaining()):
                        yield response
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details())

            return grpc.unary_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context):
            proxy.requests.append((method, request))
            try:
                return await proxy._channel.unary_unary(method)(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details())

        return grpc.unary_unary_rpc_method_handler(unary)


async def generate_through_taps(stack, request, mode: str, *, extra=(), timeout: float = 180) -> tuple:
    """Generates ``request`` through a temporary ``mode`` gateway of ``stack`` (a
    :class:`tests.conftest.FamilyStack`) whose prefill (E/P/D) and decode hops pass through
    recording proxies. Returns the result and the Prefill and Decode request bodies."""
    from cli.launcher import gateway_args
    from epd.client import generate
    from tests.helpers import gateway_stub

    decode_tap = RecordingProxy(stack.decode.address, streaming=frozenset({"Decode"}))
    prefill_tap = RecordingProxy(stack.prefill.address) if mode == "epd" else None
    prefills = [await prefill_tap.start()] if prefill_tap else []
    args = gateway_args(stack.model, mode, encoders=[stack.encoder.address], prefills=prefills, decodes=[await decode_tap.start()], extra=extra)
    try:
        with stack.stack.temporary(f"gateway-tapped-{mode}", args) as gateway:
            result = await generate(gateway_stub(gateway.address), request, timeout=timeout)
    finally:
        await decode_tap.stop()
        if prefill_tap:
            await prefill_tap.stop()
    return result, prefill_tap.requests_for("/Prefill") if prefill_tap else [], decode_tap.requests_for("/Decode")

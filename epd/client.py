"""A small client for the public API, used by ``epd generate``, ``epd up --demo`` and tests."""

from __future__ import annotations

import dataclasses
import mimetypes
import pathlib
import sys

import grpc

from epd.server import CLIENT_OPTIONS
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclasses.dataclass
class GenerateResult:
    """Everything one Generate stream returned."""

    token_ids: list[int]
    text: str
    finished: gateway_pb2.GenerateFinished


def chat_request(
    parts: list, *, max_tokens: int, temperature: float = 0.0, min_tokens: int = 0, request_id: str = ""
) -> gateway_pb2.GenerateRequest:
    """A single-user-message request. ``parts`` holds str (text) or (bytes, mime) (an image)."""
    content = [
        gateway_pb2.ContentPart(text=p) if isinstance(p, str) else gateway_pb2.ContentPart(image=gateway_pb2.Media(data=p[0], mime_type=p[1]))
        for p in parts
    ]
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        messages=[gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, parts=content)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, min_tokens=min_tokens),
    )


async def generate(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest, *, on_delta=None, timeout=None) -> GenerateResult:
    token_ids: list[int] = []
    text: list[str] = []
    finished = None
    async for response in stub.Generate(request, timeout=timeout):
        if response.HasField("delta"):
            token_ids += response.delta.token_ids
            text.append(response.delta.text)
            if on_delta is not None:
                on_delta(response.delta)
        else:
            finished = response.finished
    return GenerateResult(token_ids, "".join(text), finished)


async def generate_cli(address: str, prompt: str, images: list[pathlib.Path], max_tokens: int, temperature: float) -> int:
    parts: list = [(p.read_bytes(), mimetypes.guess_type(p.name)[0] or "application/octet-stream") for p in images]
    parts.append(prompt)
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            result = await generate(stub, chat_request(parts, max_tokens=max_tokens, temperature=temperature), on_delta=lambda d: print(d.text, end="", flush=True))
        except grpc.aio.AioRpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    f = result.finished
    print(
        f"\n[finish={common_pb2.FinishReason.Name(f.finish_reason)} prompt_tokens={f.usage.prompt_tokens} "
        f"completion_tokens={f.usage.completion_tokens} multimodal_tokens={f.usage.multimodal_tokens} "
        f"ttft={f.timings.time_to_first_token.ToNanoseconds() / 1e6:.1f}ms encode={f.timings.encode.ToNanoseconds() / 1e6:.1f}ms "
        f"prefill={f.timings.prefill.ToNanoseconds() / 1e6:.1f}ms total={f.timings.total.ToNanoseconds() / 1e6:.1f}ms]"
    )
    return 0

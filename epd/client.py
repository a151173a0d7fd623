"""A small client for the public API, used by ``epd generate``, ``epd up --demo`` and tests."""

from __future__ import annotations

import dataclasses
import mimetypes
import pathlib
import sys

import grpc

from epd.server import CLIENT_OPTIONS
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, multimodal_pb2


@dataclasses.dataclass
class GenerateResult:
    """Everything one Generate stream returned."""

    token_ids: list[int]
    text: str
    finished: gateway_pb2.GenerateFinished


def content_part(part) -> gateway_pb2.ContentPart:
    """A content part from str (text), (bytes, mime) (a media file, its modality taken from the
    MIME type), a ``Media`` message (an image part, whatever its MIME type), or a ``Video`` or
    ``Audio`` message (frames, PCM, sampling options)."""
    if isinstance(part, str):
        return gateway_pb2.ContentPart(text=part)
    if isinstance(part, multimodal_pb2.Media):
        return gateway_pb2.ContentPart(image=part)
    if isinstance(part, multimodal_pb2.Video):
        return gateway_pb2.ContentPart(video=part)
    if isinstance(part, multimodal_pb2.Audio):
        return gateway_pb2.ContentPart(audio=part)
    data, mime_type = part
    media = multimodal_pb2.Media(data=data, mime_type=mime_type)
    if mime_type.startswith("video/"):
        return gateway_pb2.ContentPart(video=multimodal_pb2.Video(file=media))
    if mime_type.startswith("audio/"):
        return gateway_pb2.ContentPart(audio=multimodal_pb2.Audio(file=media))
    return gateway_pb2.ContentPart(image=media)


def chat_request(
    parts: list, *, max_tokens: int, temperature: float = 0.0, min_tokens: int = 0, request_id: str = ""
) -> gateway_pb2.GenerateRequest:
    """A single-user-message request; ``parts`` as :func:`content_part` takes them."""
    content = [content_part(p) for p in parts]
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


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to a gateway; ``credentials`` from :func:`epd.security.channel_credentials`
    (TLS, a client certificate, a bearer token), None for plaintext."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CLIENT_OPTIONS)


async def generate_cli(
    address: str, prompt: str, media: list[pathlib.Path], max_tokens: int, temperature: float, *, credentials: grpc.ChannelCredentials | None = None
) -> int:
    """Streams a reply for media files (image, video or audio, by file type) and a prompt."""
    parts: list = [(p.read_bytes(), mimetypes.guess_type(p.name)[0] or "application/octet-stream") for p in media]
    parts.append(prompt)
    async with open_channel(address, credentials) as channel:
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

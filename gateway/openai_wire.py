"""OpenAI chat-completions JSON <-> domain types, in one place, for the HTTP front
(``gateway.openai_front``).

A chat becomes the very ``GenerateRequest`` a gRPC client would send for it: one domain content
part per OpenAI content part (so field paths map one to one), media items built as
``MediaInput``, and sampling checked by ``epd.wire.sampling_from_wire`` on the same protobuf
values a gRPC client would set. Both APIs therefore get the same tokens. Problems are
``InvalidArgument`` field violations named by their OpenAI fields
(``messages[0].content[1].image_url``); :func:`openai_field` renames those the pipeline reports
(``messages[0].parts[1].image.data``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import re
from collections.abc import Awaitable, Callable

import grpc

from epd import wire
from epd.domain import ChatMessage, FinishReason, GenerateRequest, MediaFile, MediaInput, Modality, Role, Sampling, TextPart
from epd.errors import EpdError, FieldViolation, InvalidArgument, ResourceExhausted, client_text
from epd.v1 import common_pb2
from gateway.media_fetch import MediaFetchError
from gateway.pipeline import Finished, Usage

FetchAll = Callable[[list[str]], Awaitable[list[MediaFile | MediaFetchError]]]

_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}
# OpenAI's image_url and vLLM's video_url parts hold a URL; input_audio holds base64 and a format.
_URL_PARTS = {"image_url": Modality.IMAGE, "video_url": Modality.VIDEO}
_AUDIO_FORMATS = {"wav": "audio/wav", "flac": "audio/flac"}
_PART_OBJECTS = {Modality.IMAGE: "image_url", Modality.VIDEO: "video_url", Modality.AUDIO: "input_audio"}
# Fields that would change the answer but are not implemented: refused rather than ignored.
# Their neutral values pass, as clients send some of them by default.
_UNSUPPORTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}
_UINT32 = 2**32 - 1
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclasses.dataclass(frozen=True)
class MediaRef:
    """A media part before its bytes are known: the base64 of a data: URI (or input_audio), or
    a URL to fetch."""

    modality: Modality
    field: str  # the part's OpenAI object, e.g. messages[0].content[1].image_url
    mime_type: str = ""  # a fetched item's comes from its server
    base64: str = ""
    url: str = ""


@dataclasses.dataclass(frozen=True)
class ChatCompletionRequest:
    model: str
    messages: tuple[tuple[Role, tuple[TextPart | MediaRef, ...]], ...]
    sampling: Sampling
    stream: bool
    return_token_ids: bool  # vLLM's extension: token ids in each choice and chunk
    cache_salt: str = ""  # vLLM's extension: the prefix cache's salt (epd.v1 GenerateRequest.cache_salt)

    @property
    def remote_media(self) -> list[MediaRef]:
        return [part for _, parts in self.messages for part in parts if isinstance(part, MediaRef) and part.url]


# ---- requests ---------------------------------------------------------------------------


def chat_completion_from_json(body: object, *, default_max_tokens: int) -> ChatCompletionRequest:
    """Validates a /v1/chat/completions body; every problem found is reported at once.

    ``default_max_tokens`` (the model's context; 0: unknown) applies when the body sets neither
    ``max_tokens`` nor ``max_completion_tokens``, as OpenAI then generates until the end.
    """
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    violations: list[FieldViolation] = []
    model = body.get("model")
    if not isinstance(model, str) or not model:
        violations.append(FieldViolation("model", "is required: the id /v1/models lists"))
    messages = _messages(body.get("messages"), violations)
    sampling = _sampling(body, default_max_tokens, violations)
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        violations.append(FieldViolation("n", "must be 1: this server returns one choice"))
    for name, neutral in _UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            violations.append(FieldViolation(name, "is not supported by this server"))
    stream, return_token_ids = (_flag(body, name, violations) for name in ("stream", "return_token_ids"))
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        violations.append(FieldViolation("cache_salt", "must be a non-empty string"))  # as vLLM's server says
    elif cache_salt is not None and (problem := wire.cache_salt_problem(cache_salt)):
        violations.append(FieldViolation("cache_salt", problem))
    if violations:
        raise InvalidArgument("invalid chat completion request: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return ChatCompletionRequest(model, messages, sampling, stream, return_token_ids, cache_salt or "")


async def generate_request(chat: ChatCompletionRequest, request_id: str, fetch: FetchAll | None) -> GenerateRequest:
    """The domain request: remote media fetched (refused when ``fetch`` is None), data: URIs
    decoded and every item hashed, the last off the event loop (megabytes of work)."""
    fetched: dict[str, MediaFile] = {}
    violations: list[FieldViolation] = []
    remote = chat.remote_media
    if remote and fetch is None:
        violations = [
            FieldViolation(
                ref.field,
                "is a remote URL, which this gateway does not fetch: send the media inline as a data: URI "
                "(the operator may allow hosts with --allowed-media-domains)",
            )
            for ref in remote
        ]
    elif remote:
        for ref, result in zip(remote, await fetch([ref.url for ref in remote]), strict=True):
            if isinstance(result, MediaFetchError):
                violations.append(FieldViolation(ref.field, f"URL {result}"))
            else:
                fetched[ref.field] = result
    if violations:
        raise InvalidArgument("invalid media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return await asyncio.to_thread(_build, chat, request_id, fetched)


def _build(chat: ChatCompletionRequest, request_id: str, fetched: dict[str, MediaFile]) -> GenerateRequest:
    violations: list[FieldViolation] = []
    messages = []
    for role, parts in chat.messages:
        built: list = []
        for part in parts:
            if isinstance(part, TextPart):
                built.append(part)
                continue
            source = fetched.get(part.field)
            if source is None:
                try:
                    source = MediaFile(base64.b64decode(part.base64, validate=True), part.mime_type)
                except (binascii.Error, ValueError):
                    violations.append(FieldViolation(part.field, "does not hold valid base64"))
                    continue
            if not source.data:
                violations.append(FieldViolation(part.field, "is empty"))
            built.append(MediaInput(part.modality, source))
        messages.append(ChatMessage(role, tuple(built)))
    if violations:
        raise InvalidArgument("invalid media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return GenerateRequest(request_id=request_id, messages=tuple(messages), sampling=chat.sampling, cache_salt=chat.cache_salt)


def _messages(value: object, violations: list[FieldViolation]) -> tuple:
    if not isinstance(value, list) or not value:
        violations.append(FieldViolation("messages", "must be a non-empty array of messages"))
        return ()
    messages = []
    has_content = False
    for mi, message in enumerate(value):
        field = f"messages[{mi}]"
        if not isinstance(message, dict):
            violations.append(FieldViolation(field, "must be an object"))
            continue
        role = _ROLES.get(message.get("role")) if isinstance(message.get("role"), str) else None
        if role is None:
            violations.append(FieldViolation(f"{field}.role", f"must be one of {', '.join(_ROLES)}, not {message.get('role')!r}"))
        parts = _content(message.get("content"), f"{field}.content", violations)
        has_content = has_content or any(not isinstance(p, TextPart) or p.text.strip() for p in parts)
        messages.append((role, tuple(parts)))
    if messages and not has_content and not violations:
        violations.append(FieldViolation("messages", "the prompt is empty: no text and no media"))
    return tuple(messages)


def _content(content: object, field: str, violations: list[FieldViolation]) -> list:
    if isinstance(content, str):
        return [TextPart(content)]
    if not isinstance(content, list) or not content:
        violations.append(FieldViolation(field, "must be a string or a non-empty array of content parts"))
        return []
    parts: list = []
    for pi, part in enumerate(content):
        part_field = f"{field}[{pi}]"
        kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
        payload = part.get(kind) if kind is not None else None
        if kind == "text":
            if isinstance(part.get("text"), str):
                parts.append(TextPart(part["text"]))
            else:
                violations.append(FieldViolation(f"{part_field}.text", "must be a string"))
        elif kind in _URL_PARTS:
            url = payload.get("url") if isinstance(payload, dict) else None
            if isinstance(url, str):
                parts.append(_media_url(_URL_PARTS[kind], url, f"{part_field}.{kind}", violations))
            else:
                violations.append(FieldViolation(f"{part_field}.{kind}.url", "is required"))
        elif kind == "input_audio":
            audio = payload if isinstance(payload, dict) else {}
            data, mime_type = audio.get("data"), _AUDIO_FORMATS.get(audio.get("format")) if isinstance(audio.get("format"), str) else None
            if not isinstance(data, str):
                violations.append(FieldViolation(f"{part_field}.input_audio.data", "is required: base64 of the file"))
            if mime_type is None:
                violations.append(FieldViolation(f"{part_field}.input_audio.format", f"must be one of {', '.join(_AUDIO_FORMATS)}"))
            parts.append(MediaRef(Modality.AUDIO, f"{part_field}.input_audio", mime_type or "", base64=data if isinstance(data, str) else ""))
        else:
            accepted = ", ".join(["text", *_URL_PARTS, "input_audio"])
            violations.append(FieldViolation(f"{part_field}.type", f"must be one of {accepted}, not {kind!r}"))
    return parts


def _media_url(modality: Modality, url: str, field: str, violations: list[FieldViolation]) -> MediaRef:
    scheme = url.partition(":")[0].lower()
    if scheme in ("http", "https"):
        return MediaRef(modality, field, url=url)
    if scheme != "data":
        violations.append(FieldViolation(field, "must be a data: URI or an http(s) URL"))
        return MediaRef(modality, field)
    header, comma, payload = url[len("data:") :].partition(",")
    mime_type, *parameters = (p.strip().lower() for p in header.split(";"))
    if not comma or "base64" not in parameters:
        violations.append(FieldViolation(field, "must be a base64 data: URI (data:<mime type>;base64,<data>)"))
    return MediaRef(modality, field, mime_type, base64=payload)


def _sampling(body: dict, default_max_tokens: int, violations: list[FieldViolation]) -> Sampling | None:
    """Sampling as a gRPC client would send it, checked by epd.wire's rules."""
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    names = {"max_tokens": max_name}
    found = len(violations)
    msg = common_pb2.SamplingParams()
    max_tokens = _integer(body, max_name, 1, _UINT32, violations)
    if max_tokens is None and body.get(max_name) is None:
        if not default_max_tokens:
            violations.append(FieldViolation(max_name, "is required: this gateway does not know the model's context"))
        max_tokens = default_max_tokens
    msg.max_tokens = max_tokens or 1
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            violations.append(FieldViolation(name, "must be a number"))
        elif value is not None:
            setattr(msg, name, value)
    # seed is OpenAI's; top_k and min_tokens are vLLM's extensions (min_tokens as in epd.v1).
    for name, low, high in (("seed", 0, 2**64 - 1), ("top_k", -(2**31), 2**31 - 1), ("min_tokens", 0, _UINT32)):
        if (value := _integer(body, name, low, high, violations)) is not None:
            setattr(msg, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        msg.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        msg.stop.extend(stop)
    elif stop is not None:
        violations.append(FieldViolation("stop", "must be a string or an array of strings"))
    if len(violations) > found:
        return None
    try:
        return wire.sampling_from_wire(msg)
    except InvalidArgument as exc:
        for v in exc.violations:
            name = v.field.removeprefix("sampling.")
            violations.append(FieldViolation(names.get(name, name), v.description))
        return None


def _integer(body: dict, name: str, low: int, high: int, violations: list[FieldViolation]) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        violations.append(FieldViolation(name, f"must be an integer from {low} to {high}"))
        return None
    return value


def _flag(body: dict, name: str, violations: list[FieldViolation]) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        violations.append(FieldViolation(name, "must be true or false"))
    return bool(value)


# ---- responses --------------------------------------------------------------------------


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def completion_json(chat: ChatCompletionRequest, head: dict, text: str, token_ids: list[int], finished: Finished) -> dict:
    """The non-streaming body; ``head`` holds id, created and model."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": _FINISH_REASONS[finished.reason], "logprobs": None}
    if chat.return_token_ids:
        choice["token_ids"] = token_ids
    return {**head, "object": "chat.completion", "choices": [choice], "usage": usage_json(finished.usage)}


def chunk_json(chat: ChatCompletionRequest, head: dict, delta: dict, *, token_ids: list[int] | None = None, finished: Finished | None = None) -> dict:
    """One chat.completion.chunk; the last (with ``finished``) carries the finish reason and
    the usage, whether or not the client asked for it with stream_options."""
    choice = {"index": 0, "delta": delta, "finish_reason": _FINISH_REASONS[finished.reason] if finished else None, "logprobs": None}
    if chat.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
    if finished is not None:
        chunk["usage"] = usage_json(finished.usage)
    return chunk


# HTTP status, OpenAI error type. The code in the body is the gRPC status name, lower case.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "server_error"),  # a race lost (KV lease ran out): retrying may succeed
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}


def error_json(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: EpdError) -> tuple[int, dict, dict[str, str]]:
    """HTTP status, OpenAI error body and headers for a domain error. ``param`` is the first
    violated field; the message lists them all, by their OpenAI names, bounded as a gRPC
    status is (:func:`epd.errors.client_text`)."""
    status, error_type = _HTTP_STATUS.get(error.code, (500, "server_error"))
    message, param = error.message, None
    if isinstance(error, InvalidArgument) and error.violations:
        fields = [openai_field(v.field) for v in error.violations]
        param = fields[0]
        message = "; ".join(f"{field}: {v.description}" for field, v in zip(fields, error.violations, strict=True))
    message = client_text(message)
    headers = {"Retry-After": str(max(1, round(error.retry_after_s)))} if isinstance(error, ResourceExhausted) else {}
    return status, error_json(message, error_type, param=param, code=error.code.name.lower()), headers


_PART_PATH = re.compile(r"messages\[(\d+)\]\.parts(\[(\d+)\](\.(image|video|audio)\b)?)?")
_MODALITIES = {m.value: m for m in Modality}


def openai_field(field: str) -> str:
    """The OpenAI name of a field the pipeline reports: ``messages[0].parts[1].image.data`` is
    ``messages[0].content[1].image_url``, ``sampling.top_p`` is ``top_p``."""
    match = _PART_PATH.match(field)
    if match is None:
        return field.removeprefix("sampling.")
    path = f"messages[{match[1]}].content"
    if match[3] is not None:
        path += f"[{match[3]}]"
    if match[5] is not None:
        return f"{path}.{_PART_OBJECTS[_MODALITIES[match[5]]]}"
    return path + field[match.end() :]

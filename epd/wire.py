"""Protobuf <-> domain conversion, in one place. Servicers call these at the edge; nothing
behind them sees a protobuf message. Parsing functions validate and raise
:class:`~epd.errors.InvalidArgument` with field paths relative to the request."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence

from google.protobuf import json_format, timestamp_pb2

from epd.domain import (
    ChatMessage,
    EmbeddingLocation,
    EncodedItem,
    EngineField,
    EngineRequest,
    FinishReason,
    GenerateRequest,
    GridThw,
    InlineEmbedding,
    ItemMarker,
    ItemMetadata,
    KvHandoff,
    MediaFile,
    MediaInput,
    Modality,
    NixlLocation,
    PcmAudio,
    PcmEncoding,
    Role,
    Sampling,
    TextPart,
    VideoFrames,
    VideoSampling,
)
from epd.errors import FieldViolation, InvalidArgument
from epd.transport import location_problems
from epd.v1 import (
    common_pb2,
    decode_pb2,
    encoder_pb2,
    engine_pb2,
    gateway_pb2,
    multimodal_pb2,
    prefill_pb2,
)

_MODALITY_FROM_WIRE = {
    multimodal_pb2.MODALITY_IMAGE: Modality.IMAGE,
    multimodal_pb2.MODALITY_VIDEO: Modality.VIDEO,
    multimodal_pb2.MODALITY_AUDIO: Modality.AUDIO,
}
_MODALITY_TO_WIRE = {v: k for k, v in _MODALITY_FROM_WIRE.items()}
_DTYPE_FROM_WIRE = {
    multimodal_pb2.TENSOR_DTYPE_FLOAT32: "float32",
    multimodal_pb2.TENSOR_DTYPE_FLOAT16: "float16",
    multimodal_pb2.TENSOR_DTYPE_BFLOAT16: "bfloat16",
}
_DTYPE_TO_WIRE = {v: k for k, v in _DTYPE_FROM_WIRE.items()}
_FINISH_TO_WIRE = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_WIRE = {v: k for k, v in _FINISH_TO_WIRE.items()}
_ROLE_FROM_WIRE = {
    gateway_pb2.ROLE_UNSPECIFIED: Role.USER,
    gateway_pb2.ROLE_SYSTEM: Role.SYSTEM,
    gateway_pb2.ROLE_USER: Role.USER,
    gateway_pb2.ROLE_ASSISTANT: Role.ASSISTANT,
}
_ROLE_TO_WIRE = {Role.SYSTEM: gateway_pb2.ROLE_SYSTEM, Role.USER: gateway_pb2.ROLE_USER, Role.ASSISTANT: gateway_pb2.ROLE_ASSISTANT}
_MEDIA_FIELDS = {"image": Modality.IMAGE, "video": Modality.VIDEO, "audio": Modality.AUDIO}
_PCM_FROM_WIRE = {multimodal_pb2.PCM_ENCODING_S16LE: PcmEncoding.S16LE, multimodal_pb2.PCM_ENCODING_F32LE: PcmEncoding.F32LE}
_PCM_TO_WIRE = {v: k for k, v in _PCM_FROM_WIRE.items()}
# OpenAI's range: above it sampling is noise, and vLLM would take any non-negative value.
MAX_TEMPERATURE = 2.0
# Frame rates a caller may declare or ask to sample at. Outside them timestamps and frame
# counts turn absurd (1e-300 fps dates frames 5e299 s in), so they are refused.
MIN_FRAME_RATE = 0.01
MAX_FRAME_RATE = 1000.0


# ---- sampling ---------------------------------------------------------------------------


def sampling_from_wire(msg: common_pb2.SamplingParams, field: str = "sampling") -> Sampling:
    violations = []
    if msg.max_tokens < 1:
        violations.append(FieldViolation(f"{field}.max_tokens", "must be at least 1"))
    if msg.HasField("temperature") and not 0 <= msg.temperature <= MAX_TEMPERATURE:  # also refuses NaN
        violations.append(FieldViolation(f"{field}.temperature", f"must be between 0 and {MAX_TEMPERATURE}"))
    if msg.HasField("top_p") and not 0 < msg.top_p <= 1:
        violations.append(FieldViolation(f"{field}.top_p", "must be in (0, 1]"))
    if msg.HasField("top_k") and (msg.top_k == 0 or msg.top_k < -1):
        violations.append(FieldViolation(f"{field}.top_k", "must be -1 (disabled) or >= 1"))
    if msg.min_tokens > msg.max_tokens:
        violations.append(FieldViolation(f"{field}.min_tokens", "must not exceed max_tokens"))
    if any(not s for s in msg.stop):
        violations.append(FieldViolation(f"{field}.stop", "must not contain empty strings"))
    if violations:
        raise InvalidArgument("invalid sampling parameters", violations)
    return Sampling(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else None,
        top_p=msg.top_p if msg.HasField("top_p") else None,
        top_k=msg.top_k if msg.HasField("top_k") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        min_tokens=msg.min_tokens,
    )


def sampling_to_wire(sampling: Sampling) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=sampling.max_tokens, stop=list(sampling.stop))
    if sampling.min_tokens:
        msg.min_tokens = sampling.min_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(sampling, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def finish_reason_to_wire(reason: FinishReason) -> int:
    return _FINISH_TO_WIRE[reason]


def finish_reason_from_wire(value: int) -> FinishReason:
    return _FINISH_FROM_WIRE[value]


# ---- public API -------------------------------------------------------------------------


def generate_request_from_wire(msg: gateway_pb2.GenerateRequest) -> GenerateRequest:
    """Validates a public request; every problem found is reported at once."""
    violations: list[FieldViolation] = []
    messages: list[ChatMessage] = []
    has_content = False
    if not msg.messages:
        violations.append(FieldViolation("messages", "must contain at least one message"))
    for mi, message in enumerate(msg.messages):
        parts: list = []
        if message.role not in _ROLE_FROM_WIRE:
            violations.append(FieldViolation(f"messages[{mi}].role", f"unknown role {message.role}"))
        if not message.parts:
            violations.append(FieldViolation(f"messages[{mi}].parts", "must contain at least one part"))
        for pi, part in enumerate(message.parts):
            field = f"messages[{mi}].parts[{pi}]"
            kind = part.WhichOneof("content")
            if kind is None:
                violations.append(FieldViolation(field, "has no content"))
            elif kind == "text":
                has_content = has_content or bool(part.text.strip())
                parts.append(TextPart(part.text))
            else:
                has_content = True
                item = _media_from_wire(kind, getattr(part, kind), field, violations)
                if item is not None:
                    parts.append(MediaInput(*item))
        messages.append(ChatMessage(_ROLE_FROM_WIRE.get(message.role, Role.USER), tuple(parts)))
    if msg.messages and not has_content:
        violations.append(FieldViolation("messages", "the prompt is empty: no text and no media"))
    try:
        sampling = sampling_from_wire(msg.sampling)
    except InvalidArgument as exc:
        violations += exc.violations
    if len(msg.continuation_token_ids) >= max(msg.sampling.max_tokens, 1):
        violations.append(
            FieldViolation("continuation_token_ids", f"holds {len(msg.continuation_token_ids)} tokens, leaving nothing of max_tokens {msg.sampling.max_tokens} to generate")
        )
    if problem := cache_salt_problem(msg.cache_salt):
        violations.append(FieldViolation("cache_salt", problem))
    if violations:
        raise InvalidArgument("invalid GenerateRequest: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return GenerateRequest(
        request_id=msg.request_id or uuid.uuid4().hex,
        messages=tuple(messages),
        sampling=sampling,
        continuation=tuple(msg.continuation_token_ids),
        cache_salt=msg.cache_salt,
    )


MAX_CACHE_SALT_CHARS = 256  # vLLM hashes the salt into the prompt's first block; a bound keeps that cheap


def cache_salt_problem(salt: str) -> str | None:
    """What is wrong with a cache salt, if anything (the OpenAI front checks its own by this)."""
    return f"holds {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}" if len(salt) > MAX_CACHE_SALT_CHARS else None


def media_paths(request: GenerateRequest) -> list[str]:
    """Public field paths of each media item's content part, in prompt order (stage errors
    name ``items[i].<field>``; the gateway rewrites ``items[i]`` into these)."""
    paths = []
    for mi, message in enumerate(request.messages):
        for pi, part in enumerate(message.parts):
            if isinstance(part, MediaInput):
                paths.append(f"messages[{mi}].parts[{pi}]")
    return paths


def _file_from_wire(msg: multimodal_pb2.Media, field: str, violations: list[FieldViolation]) -> MediaFile:
    if not msg.data:
        violations.append(FieldViolation(f"{field}.data", "is empty"))
    if not msg.mime_type:
        violations.append(FieldViolation(f"{field}.mime_type", "is required"))
    return MediaFile(msg.data, msg.mime_type.lower())


def _media_from_wire(kind: str, msg, field: str, violations: list[FieldViolation]):
    """Parses one image/video/audio message; returns (modality, source, video_sampling), or
    None when it has no source at all."""
    modality = _MEDIA_FIELDS[kind]
    field = f"{field}.{kind}"
    if modality is Modality.IMAGE:
        return modality, _file_from_wire(msg, field, violations), VideoSampling()
    source_kind = msg.WhichOneof("source")
    if source_kind is None:
        violations.append(FieldViolation(f"{field}.source", "is required: set file or " + ("frames" if modality is Modality.VIDEO else "pcm")))
        return None
    source_field = f"{field}.{source_kind}"
    sampling = VideoSampling()
    if source_kind == "file":
        source = _file_from_wire(msg.file, source_field, violations)
    elif source_kind == "frames":
        if not msg.frames.frames:
            violations.append(FieldViolation(f"{source_field}.frames", "must contain at least one frame"))
        if not MIN_FRAME_RATE <= msg.frames.fps <= MAX_FRAME_RATE:  # also refuses NaN
            violations.append(FieldViolation(f"{source_field}.fps", f"must be between {MIN_FRAME_RATE} and {MAX_FRAME_RATE} frames per second"))
        frames = tuple(_file_from_wire(f, f"{source_field}.frames[{k}]", violations) for k, f in enumerate(msg.frames.frames))
        source = VideoFrames(frames, msg.frames.fps)
    else:
        pcm = msg.pcm
        if not pcm.data:
            violations.append(FieldViolation(f"{source_field}.data", "is empty"))
        if pcm.sample_rate_hz == 0:
            violations.append(FieldViolation(f"{source_field}.sample_rate_hz", "is required"))
        if pcm.channels == 0:
            violations.append(FieldViolation(f"{source_field}.channels", "is required"))
        if pcm.encoding not in _PCM_FROM_WIRE:
            violations.append(FieldViolation(f"{source_field}.encoding", "must be PCM_ENCODING_S16LE or PCM_ENCODING_F32LE"))
        source = PcmAudio(pcm.data, pcm.sample_rate_hz, pcm.channels, _PCM_FROM_WIRE.get(pcm.encoding, PcmEncoding.S16LE))
    if modality is Modality.VIDEO:
        if not (msg.sampling.fps == 0 or MIN_FRAME_RATE <= msg.sampling.fps <= MAX_FRAME_RATE):  # also refuses NaN
            violations.append(FieldViolation(f"{field}.sampling.fps", f"must be 0 (the model's default) or between {MIN_FRAME_RATE} and {MAX_FRAME_RATE}"))
        sampling = VideoSampling(msg.sampling.fps or None, msg.sampling.max_frames or None)
    return modality, source, sampling


def media_item_into(msg: multimodal_pb2.MediaItem, item: MediaInput) -> None:
    """Writes an item into ``msg`` in place, without its content hash (the receiver computes it
    anyway: it never trusts one it is given, so hashing here would only cost the sender, the
    gateway, time).

    In place, so that each payload is copied once, into the message: built from constructors,
    a video's megabytes were copied again at every level of nesting (Media into Video into
    MediaItem into EncodeRequest), 0.45 ms of the gateway's time for a 1.8 MB request."""
    source = item.source
    if item.modality is Modality.IMAGE:
        _file_into(msg.image, source)
    elif item.modality is Modality.VIDEO:
        video = msg.video
        video.sampling.fps = item.video_sampling.fps or 0
        video.sampling.max_frames = item.video_sampling.max_frames or 0
        if isinstance(source, VideoFrames):
            video.frames.fps = source.fps
            for frame in source.frames:
                _file_into(video.frames.frames.add(), frame)
        else:
            _file_into(video.file, source)
    elif isinstance(source, PcmAudio):
        pcm = msg.audio.pcm
        pcm.data, pcm.sample_rate_hz, pcm.channels, pcm.encoding = source.data, source.sample_rate_hz, source.channels, _PCM_TO_WIRE[source.encoding]
    else:
        _file_into(msg.audio.file, source)


def _file_into(msg: multimodal_pb2.Media, source: MediaFile) -> None:
    msg.data, msg.mime_type = source.data, source.mime_type


# ---- encoder ----------------------------------------------------------------------------


def encode_request_to_wire(request_id: str, items: list[MediaInput], release_key: str) -> encoder_pb2.EncodeRequest:
    message = encoder_pb2.EncodeRequest(request_id=request_id, release_key=release_key)
    for item in items:
        media_item_into(message.items.add(), item)
    return message


def media_item_from_wire(item: multimodal_pb2.MediaItem, field: str, violations: list[FieldViolation]) -> MediaInput | None:
    """Parses one MediaItem, appending its problems to ``violations`` (None if unusable)."""
    kind = item.WhichOneof("media")
    if kind is None:
        violations.append(FieldViolation(f"{field}.media", "must be set: image, video or audio"))
        return None
    parsed = _media_from_wire(kind, getattr(item, kind), field, violations)
    if parsed is None:
        return None
    modality, source, sampling = parsed
    # Recomputed, never trusted: it keys the encoder-output cache, so a peer naming another
    # item's hash would read that item's embedding, or have its own bytes served under it.
    # Computed here even when the peer sent none: callers parse off the event loop, where
    # hashing costs no other call anything (hashlib releases the GIL); computed later, on first
    # use, it ran on the encoder's event loop while a batch formed (0.13 ms for a 143 KB JPEG).
    media = MediaInput(modality, source, sampling)
    if item.content_hash not in ("", media.content_hash):
        violations.append(FieldViolation(f"{field}.content_hash", "does not match the item: it must be the SHA-256 of its bytes and options (epd.domain.content_hash)"))
        return None
    return media


def media_items_from_wire(items) -> list[MediaInput]:
    violations: list[FieldViolation] = []
    result = [media_item_from_wire(item, f"items[{index}]", violations) for index, item in enumerate(items)]
    if not items:
        violations.append(FieldViolation("items", "must contain at least one item"))
    if violations:
        raise InvalidArgument("invalid EncodeRequest: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return result


MAX_RELEASE_KEY_CHARS = 64


def release_key_from_wire(key: str, field: str = "release_key") -> str:
    """An EncodeRequest's release key; bounded, since the encoder keeps it until its leases end."""
    if len(key) > MAX_RELEASE_KEY_CHARS:
        raise InvalidArgument.for_field(field, f"is {len(key)} characters; at most {MAX_RELEASE_KEY_CHARS}")
    return key


def release_keys_from_wire(keys) -> list[str]:
    """A ReleaseEmbeddingsRequest's release keys."""
    return [release_key_from_wire(key, f"release_keys[{index}]") for index, key in enumerate(keys)]


# ---- metadata and handles ---------------------------------------------------------------


_FIELD_DTYPES = {
    "int64": multimodal_pb2.FIELD_DTYPE_INT64,
    "int32": multimodal_pb2.FIELD_DTYPE_INT32,
    "bool": multimodal_pb2.FIELD_DTYPE_BOOL,
    "float32": multimodal_pb2.FIELD_DTYPE_FLOAT32,
    "float64": multimodal_pb2.FIELD_DTYPE_FLOAT64,
    "bfloat16": multimodal_pb2.FIELD_DTYPE_BFLOAT16,
    "float16": multimodal_pb2.FIELD_DTYPE_FLOAT16,
}
_FIELD_DTYPES_FROM_WIRE = {v: k for k, v in _FIELD_DTYPES.items()}
_FLOAT_FIELD_DTYPES = frozenset({"float32", "float64", "bfloat16", "float16"})


def metadata_to_wire(meta: ItemMetadata) -> multimodal_pb2.MultimodalMetadata:
    msg = multimodal_pb2.MultimodalMetadata(
        modality=_MODALITY_TO_WIRE[meta.modality],
        content_hash=meta.content_hash,
        placeholder_token_id=meta.placeholder_token_id,
        placeholder_count=meta.placeholder_count,
        placeholder_length=meta.placeholder_length,
        video_timestamps_s=list(meta.video_timestamps_s),
        audio_feature_length=meta.audio_feature_length,
        audio_token_count=meta.audio_token_count,
        embedding_shape=list(meta.embedding_shape),
        embedding_dtype=_DTYPE_TO_WIRE[meta.embedding_dtype],
        layout_needs_media=meta.layout_needs_media,
    )
    if meta.grid_thw is not None:
        msg.grid_thw.CopyFrom(multimodal_pb2.GridThw(t=meta.grid_thw.t, h=meta.grid_thw.h, w=meta.grid_thw.w))
    if meta.second_per_grid_ts is not None:
        msg.second_per_grid_ts = meta.second_per_grid_ts
    for name, value in meta.engine_fields.items():
        field = msg.engine_fields[name]
        field.dtype = _FIELD_DTYPES[value.dtype]
        field.shape.extend(value.shape)
        field.is_list = value.is_list
        if value.dtype in _FLOAT_FIELD_DTYPES:
            field.float_values.extend(float(v) for v in value.values)
        else:
            field.int_values.extend(int(v) for v in value.values)
    return msg


# Bounds on what a metadata-only item may carry: the engine that gets it lays the item out from
# these fields with vLLM's processor, so each is refused here before it could make that engine
# allocate without limit (every legitimate value is far inside them).
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}")
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_ENGINE_FIELDS = 32
_MAX_FIELD_VALUES = 65536
_MAX_FIELD_DIMS = 4
_MAX_FIELD_INT = 2**24
_MAX_FIELD_PRODUCT = 2**32  # a grid of more patches describes no item any context could hold


def metadata_from_wire(msg: multimodal_pb2.MultimodalMetadata, field: str) -> ItemMetadata:
    violations = []
    if msg.modality not in _MODALITY_FROM_WIRE:
        violations.append(FieldViolation(f"{field}.modality", "must be set"))
    if msg.embedding_dtype not in _DTYPE_FROM_WIRE:
        violations.append(FieldViolation(f"{field}.embedding_dtype", "must be set"))
    if not _CONTENT_HASH.fullmatch(msg.content_hash):
        # It names the item in every engine cache: the encoder's SHA-256, and nothing else.
        violations.append(FieldViolation(f"{field}.content_hash", "must be the item's SHA-256, 64 lowercase hex digits"))
    if len(msg.engine_fields) > _MAX_ENGINE_FIELDS:
        violations.append(FieldViolation(f"{field}.engine_fields", f"holds {len(msg.engine_fields)} fields, over {_MAX_ENGINE_FIELDS}"))
    if len(msg.embedding_shape) != 2 or msg.placeholder_count != (msg.embedding_shape[0] if msg.embedding_shape else -1):
        violations.append(FieldViolation(f"{field}.embedding_shape", f"must be [rows, width] with rows = placeholder_count ({msg.placeholder_count})"))
    engine_fields = {}
    for name, value in list(msg.engine_fields.items())[:_MAX_ENGINE_FIELDS]:
        if not _FIELD_NAME.fullmatch(name):
            violations.append(FieldViolation(f"{field}.engine_fields", "names a field that is not an identifier of at most 64 characters"))
            continue
        path = f"{field}.engine_fields['{name}']"
        dtype = _FIELD_DTYPES_FROM_WIRE.get(value.dtype)
        values = tuple(value.float_values) if dtype in _FLOAT_FIELD_DTYPES else tuple(value.int_values)
        if len(values) > _MAX_FIELD_VALUES or len(value.shape) > _MAX_FIELD_DIMS:
            violations.append(FieldViolation(path, f"holds more than {_MAX_FIELD_VALUES} values or {_MAX_FIELD_DIMS} dimensions"))
            continue
        expected = 1
        for dim in value.shape:
            expected *= dim
        if dtype is None or len(values) != expected or (value.is_list and len(value.shape) != 1):
            violations.append(FieldViolation(path, "needs a dtype and exactly as many values as its shape holds"))
            continue
        if dtype in _FLOAT_FIELD_DTYPES and not all(math.isfinite(v) for v in values):
            violations.append(FieldViolation(path, "must hold finite numbers"))
            continue
        if dtype not in _FLOAT_FIELD_DTYPES and (
            not all(abs(v) < _MAX_FIELD_INT for v in values) or math.prod(abs(v) for v in values if v) >= _MAX_FIELD_PRODUCT
        ):
            # Grids and lengths size what vLLM's processor builds for the item: a grid of 2**31
            # would be laid out as billions of placeholders before any other check ran.
            violations.append(FieldViolation(path, f"must hold integers below {_MAX_FIELD_INT} whose product is below {_MAX_FIELD_PRODUCT}"))
            continue
        engine_fields[name] = EngineField(dtype, tuple(value.shape), values, value.is_list)
    if violations:
        raise InvalidArgument("invalid multimodal metadata", violations)
    return ItemMetadata(
        modality=_MODALITY_FROM_WIRE[msg.modality],
        content_hash=msg.content_hash,
        placeholder_token_id=msg.placeholder_token_id,
        placeholder_count=msg.placeholder_count,
        placeholder_length=msg.placeholder_length,
        embedding_shape=tuple(msg.embedding_shape),
        embedding_dtype=_DTYPE_FROM_WIRE[msg.embedding_dtype],
        grid_thw=GridThw(msg.grid_thw.t, msg.grid_thw.h, msg.grid_thw.w) if msg.HasField("grid_thw") else None,
        video_timestamps_s=tuple(msg.video_timestamps_s),
        second_per_grid_ts=msg.second_per_grid_ts if msg.HasField("second_per_grid_ts") else None,
        audio_feature_length=msg.audio_feature_length,
        audio_token_count=msg.audio_token_count,
        engine_fields=engine_fields,
        layout_needs_media=msg.layout_needs_media,
    )


def _handle_to_wire(location: EmbeddingLocation) -> multimodal_pb2.EmbeddingHandle:
    if isinstance(location, InlineEmbedding):
        return multimodal_pb2.EmbeddingHandle(inline=multimodal_pb2.InlineEmbedding(data=location.data))
    expires = timestamp_pb2.Timestamp()
    expires.FromMilliseconds(location.expires_at_unix_ms)
    return multimodal_pb2.EmbeddingHandle(
        nixl=multimodal_pb2.NixlEmbedding(
            agent_name=location.agent_name,
            encoder_address=location.encoder_address,
            descriptors=location.descriptors,
            nbytes=location.nbytes,
            lease_id=location.lease_id,
            slot_generation=location.slot_generation,
            expires_at=expires,
            location_tag=location.tag,
        )
    )


def embedding_location_from_wire(msg: multimodal_pb2.EmbeddingHandle, field: str = "embedding") -> EmbeddingLocation | None:
    """Raises InvalidArgument for a NIXL location that cannot be right in form (whether it is
    genuine only the consumer engine can tell, with the encoder's key)."""
    kind = msg.WhichOneof("transport")
    if kind == "inline":
        return InlineEmbedding(msg.inline.data)
    if kind == "nixl":
        n = msg.nixl
        location = NixlLocation(
            agent_name=n.agent_name,
            encoder_address=n.encoder_address,
            descriptors=n.descriptors,
            nbytes=n.nbytes,
            lease_id=n.lease_id,
            slot_generation=n.slot_generation,
            expires_at_unix_ms=n.expires_at.ToMilliseconds(),
            tag=n.location_tag,
        )
        violations = [FieldViolation(f"{field}.nixl.{name}", problem) for name, problem in location_problems(location)]
        if violations:
            raise InvalidArgument("malformed NIXL embedding location", violations)
        return location
    return None


def encoded_item_to_wire(item: EncodedItem, *, with_embedding: bool = True) -> multimodal_pb2.EncodedItem:
    msg = multimodal_pb2.EncodedItem(metadata=metadata_to_wire(item.metadata))
    if with_embedding and item.embedding is not None:
        msg.embedding.CopyFrom(_handle_to_wire(item.embedding))
    if item.forwarded_media is not None:
        media_item_into(msg.forwarded_media, item.forwarded_media)
    return msg


def encoded_item_from_wire(msg: multimodal_pb2.EncodedItem, field: str) -> EncodedItem:
    forwarded = None
    if msg.HasField("forwarded_media"):
        violations: list[FieldViolation] = []
        forwarded = media_item_from_wire(msg.forwarded_media, f"{field}.forwarded_media", violations)
        if violations:
            raise InvalidArgument("invalid forwarded media", violations)
    return EncodedItem(metadata_from_wire(msg.metadata, f"{field}.metadata"), embedding_location_from_wire(msg.embedding, f"{field}.embedding"), forwarded)


def encoded_items_from_wire(items) -> list[EncodedItem]:
    return [encoded_item_from_wire(item, f"items[{i}]") for i, item in enumerate(items)]


# ---- engine requests --------------------------------------------------------------------


def kv_handoff_to_wire(kv: KvHandoff) -> engine_pb2.KvHandoff:
    msg = engine_pb2.KvHandoff(
        remote_engine_id=kv.remote_engine_id,
        remote_block_groups=[engine_pb2.KvBlockGroup(block_ids=list(g)) for g in kv.remote_block_groups],
        remote_host=kv.remote_host,
        remote_port=kv.remote_port,
        remote_request_id=kv.remote_request_id,
        remote_num_tokens=kv.remote_num_tokens,
        tp_size=kv.tp_size,
        expires_at_unix_ms=kv.expires_at_unix_ms,
        seal=kv.seal,
    )
    if kv.extra_params:
        msg.extra_params.update(kv.extra_params)
    return msg


_MAX_BLOCK_ID = 2**31  # vLLM's NixlConnector holds block ids as int32
_MAX_PARALLEL_SIZE = 1024  # of a tensor-, pipeline- or context-parallel group
_SEAL_BYTES = 32


def _parallel_size(value) -> bool:
    return isinstance(value, int) and 1 <= value <= _MAX_PARALLEL_SIZE


# The kv_transfer_params a prefill's vLLM (0.32) hands out beyond the typed fields, with what
# each may hold: vLLM's connector uses them as sizes and modes unchecked, so anything else is
# refused rather than passed on (a vLLM that adds a key needs it added here).
_KV_EXTRA_PARAMS = {
    "dcp_size": _parallel_size,
    "pp_size": _parallel_size,
    "transfer_mode": lambda value: value == "pull",  # the decode's NixlConnector pulls
    "remote_prefill_cached_tokens": lambda value: isinstance(value, int) and value >= 0,
    "remote_blocks_expiry_time": lambda value: value is None or (isinstance(value, int | float) and math.isfinite(value)),
}


def kv_handoff_from_wire(msg: engine_pb2.KvHandoff) -> KvHandoff:
    """Checks what a forged handoff could break the KV-consumer engine with before it gets there
    (vLLM's connector trusts these values; an empty block list made its engine core exit)."""
    violations = []
    if not msg.remote_engine_id:
        violations.append(FieldViolation("kv_handoff.remote_engine_id", "is required"))
    if not msg.remote_host:
        violations.append(FieldViolation("kv_handoff.remote_host", "is required"))
    if not 0 < msg.remote_port < 65536:
        violations.append(FieldViolation("kv_handoff.remote_port", "must be a TCP port (1-65535)"))
    if not msg.remote_request_id:
        violations.append(FieldViolation("kv_handoff.remote_request_id", "is required"))
    if len(msg.seal) > _SEAL_BYTES:
        violations.append(FieldViolation("kv_handoff.seal", f"must be at most {_SEAL_BYTES} bytes (an HMAC-SHA256)"))
    if not 1 <= msg.tp_size <= _MAX_PARALLEL_SIZE:
        # vLLM maps this engine's ranks onto the prefill's by it: 0 divided by zero in its
        # handshake, failing the request as if the prefill were unreachable.
        violations.append(FieldViolation("kv_handoff.tp_size", f"must be between 1 and {_MAX_PARALLEL_SIZE}"))
    if not any(group.block_ids for group in msg.remote_block_groups):
        # As vLLM's NixlConnector counts it: a handoff with no block at all has no KV to pull
        # (a group of its own may be empty, say a window that moved past every block).
        violations.append(FieldViolation("kv_handoff.remote_block_groups", "must hold at least one KV block"))
    for index, group in enumerate(msg.remote_block_groups):
        # vLLM's connector casts block ids to int32 (one of 2**31 or more made its engine core
        # exit with OverflowError), and a block named twice would be read twice into one.
        if any(block >= _MAX_BLOCK_ID for block in group.block_ids):
            violations.append(FieldViolation(f"kv_handoff.remote_block_groups[{index}].block_ids", f"must be below {_MAX_BLOCK_ID}"))
        if len(set(group.block_ids)) != len(group.block_ids):
            violations.append(FieldViolation(f"kv_handoff.remote_block_groups[{index}].block_ids", "must not name a block twice"))
    extras = _integral_floats_to_int(json_format.MessageToDict(msg.extra_params)) if msg.HasField("extra_params") else {}
    for name, value in extras.items():
        check = _KV_EXTRA_PARAMS.get(name)
        if check is None:
            violations.append(FieldViolation(f"kv_handoff.extra_params.{name[:64]}", "is not a parameter a prefill's vLLM hands out"))
        elif not check(value):
            violations.append(FieldViolation(f"kv_handoff.extra_params.{name}", "holds a value a prefill's vLLM never hands out"))
    if violations:
        raise InvalidArgument("invalid kv_handoff", violations)
    return KvHandoff(
        remote_engine_id=msg.remote_engine_id,
        remote_block_groups=tuple(tuple(g.block_ids) for g in msg.remote_block_groups),
        remote_host=msg.remote_host,
        remote_port=msg.remote_port,
        remote_request_id=msg.remote_request_id,
        remote_num_tokens=msg.remote_num_tokens,
        tp_size=msg.tp_size,
        extra_params=extras,
        expires_at_unix_ms=msg.expires_at_unix_ms,
        seal=msg.seal,
    )


def _integral_floats_to_int(values: dict) -> dict:
    """Struct stores every number as a double; engine extras are counts and ids, so integral
    values go back to int (vLLM uses them as sizes and indices)."""
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in values.items()}


def _engine_request_from_wire(msg) -> EngineRequest:
    if not msg.request_id:
        raise InvalidArgument.for_field("request_id", "is required")
    kv = kv_handoff_from_wire(msg.kv_handoff) if getattr(msg, "kv_handoff", None) and msg.HasField("kv_handoff") else None
    items = tuple(encoded_items_from_wire(msg.items))
    if problem := cache_salt_problem(msg.prompt.cache_salt):
        raise InvalidArgument.for_field("prompt.cache_salt", problem)
    return EngineRequest(
        request_id=msg.request_id,
        items=items,
        sampling=sampling_from_wire(msg.sampling),
        prompt_token_ids=tuple(msg.prompt.token_ids),
        chat=_engine_chat_from_wire(msg.prompt, items),
        kv_handoff=kv,
        continuation=tuple(msg.prompt.continuation_token_ids),
        cache_salt=msg.prompt.cache_salt,
    )


def _engine_chat_from_wire(prompt: engine_pb2.EnginePrompt, items: tuple[EncodedItem, ...]) -> tuple[ChatMessage, ...]:
    """The prompt's chat, checked: roles known, every part set, one marker per item, in order."""
    if bool(prompt.token_ids) == bool(prompt.chat):
        raise InvalidArgument.for_field("prompt", "set exactly one of token_ids and chat")
    violations: list[FieldViolation] = []
    messages: list[ChatMessage] = []
    markers: list[Modality] = []
    for mi, message in enumerate(prompt.chat):
        field = f"prompt.chat[{mi}]"
        if message.role not in _ROLE_FROM_WIRE:
            violations.append(FieldViolation(f"{field}.role", f"unknown role {message.role}"))
        parts: list = []
        for pi, part in enumerate(message.parts):
            kind = part.WhichOneof("content")
            if kind == "text":
                parts.append(TextPart(part.text))
            elif kind == "item" and part.item in _MODALITY_FROM_WIRE:
                markers.append(_MODALITY_FROM_WIRE[part.item])
                parts.append(ItemMarker(markers[-1]))
            else:
                violations.append(FieldViolation(f"{field}.parts[{pi}]", "is neither text nor an item of a known modality"))
        messages.append(ChatMessage(_ROLE_FROM_WIRE.get(message.role, Role.USER), tuple(parts)))
    if prompt.chat and markers != [item.metadata.modality for item in items]:
        violations.append(
            FieldViolation("prompt.chat", f"marks items {[m.value for m in markers]}, but the request's items are {[i.metadata.modality.value for i in items]}")
        )
    if violations:
        raise InvalidArgument("invalid prompt: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
    return tuple(messages)


def engine_prompt_to_wire(
    token_ids: Sequence[int] = (), chat: Sequence[ChatMessage] = (), continuation: Sequence[int] = (), cache_salt: str = ""
) -> engine_pb2.EnginePrompt:
    """An engine prompt: token ids, or a chat whose media parts are item markers; then the
    reply's tokens so far, if any, and the prefix cache's salt."""
    messages = [
        engine_pb2.EngineChatMessage(
            role=_ROLE_TO_WIRE[message.role],
            parts=[
                engine_pb2.EngineChatPart(text=part.text) if isinstance(part, TextPart) else engine_pb2.EngineChatPart(item=_MODALITY_TO_WIRE[part.modality])
                for part in message.parts
            ],
        )
        for message in chat
    ]
    return engine_pb2.EnginePrompt(token_ids=list(token_ids), chat=messages, continuation_token_ids=list(continuation), cache_salt=cache_salt)


def prefill_request_from_wire(msg: prefill_pb2.PrefillRequest) -> EngineRequest:
    return _engine_request_from_wire(msg)


def decode_request_from_wire(msg: decode_pb2.DecodeRequest) -> EngineRequest:
    return _engine_request_from_wire(msg)


def prefill_request_to_wire(request: EngineRequest) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request.request_id,
        prompt=engine_prompt_to_wire(request.prompt_token_ids, request.chat, request.continuation, request.cache_salt),
        items=[encoded_item_to_wire(i) for i in request.items],
        sampling=sampling_to_wire(request.sampling),
    )


def decode_request_to_wire(request: EngineRequest) -> decode_pb2.DecodeRequest:
    """Decode with a KV handoff gets metadata only; combined decode also gets the handles."""
    msg = decode_pb2.DecodeRequest(
        request_id=request.request_id,
        prompt=engine_prompt_to_wire(request.prompt_token_ids, request.chat, request.continuation, request.cache_salt),
        items=[encoded_item_to_wire(i, with_embedding=request.kv_handoff is None) for i in request.items],
        sampling=sampling_to_wire(request.sampling),
    )
    if request.kv_handoff is not None:
        msg.kv_handoff.CopyFrom(kv_handoff_to_wire(request.kv_handoff))
    return msg

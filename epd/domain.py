"""Domain types shared by every stage. Protobuf never crosses into domain code: the servicers
convert at the edge (``epd.wire``) and everything behind them works on these types."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import blake3


class Modality(enum.Enum):
    """Media kinds. Values are the keys vLLM uses in ``multi_modal_data``."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class GridThw:
    """Patch grid (before the spatial merge) of an image or video."""

    t: int
    h: int
    w: int

    def as_list(self) -> list[int]:
        return [self.t, self.h, self.w]


@dataclass(frozen=True)
class MediaFile:
    """Encoded media bytes (an image, video or audio file) with their MIME type."""

    data: bytes
    mime_type: str


@dataclass(frozen=True)
class VideoFrames:
    """A video as caller-decoded frames, each an encoded image, captured at ``fps``."""

    frames: tuple[MediaFile, ...]
    fps: float


@dataclass(frozen=True)
class VideoSampling:
    """Requested frame sampling; None takes the model's processor default."""

    fps: float | None = None
    max_frames: int | None = None


class PcmEncoding(enum.Enum):
    S16LE = "s16le"
    F32LE = "f32le"


@dataclass(frozen=True)
class PcmAudio:
    """Raw interleaved PCM samples with their declared format."""

    data: bytes
    sample_rate_hz: int
    channels: int
    encoding: PcmEncoding


MediaSource = MediaFile | VideoFrames | PcmAudio


@dataclass(frozen=True)
class MediaInput:
    """One media item as the gateway receives it. Only the encoder (and the monolithic oracle)
    ever decodes it."""

    modality: Modality
    source: MediaSource
    video_sampling: VideoSampling = VideoSampling()

    @functools.cached_property
    def content_hash(self) -> str:
        """The item's identity (:func:`content_hash`). Computed on first use: the encoder needs
        it, the gateway does not (it routes by :attr:`affinity_key`)."""
        return content_hash(self.source, self.video_sampling)

    @functools.cached_property
    def affinity_key(self) -> str:
        """What the gateway routes the item by, so that it meets its cached output: BLAKE3 over
        the same bytes as :attr:`content_hash`, about four times faster than SHA-256 here (a
        megabyte of media costs the gateway 0.14 ms, not 0.57), and as collision-resistant, so a
        client cannot pile distinct items onto one encoder's key."""
        digest = blake3.blake3()
        for chunk in _identity_chunks(self.source, self.video_sampling):
            digest.update(chunk)
        return digest.hexdigest()

    @property
    def nbytes(self) -> int:
        """Payload bytes, for the size limits."""
        if isinstance(self.source, VideoFrames):
            return sum(len(f.data) for f in self.source.frames)
        return len(self.source.data)


def content_hash(source: MediaSource, video_sampling: VideoSampling = VideoSampling()) -> str:
    """Hex SHA-256 of an item's bytes and of every option that shapes its embedding.

    It keys the engines' multimodal caches, so the same file sampled differently must hash
    differently. A plain file with default options hashes to the SHA-256 of its bytes.
    """
    digest = hashlib.sha256()
    for chunk in _identity_chunks(source, video_sampling):
        digest.update(chunk)
    return digest.hexdigest()


def _identity_chunks(source: MediaSource, video_sampling: VideoSampling) -> Iterator[bytes]:
    """The bytes that identify an item: its payload and every option that shapes its embedding."""
    if isinstance(source, MediaFile):
        yield source.data
    elif isinstance(source, VideoFrames):
        yield f"frames fps={source.fps!r}".encode()
        for frame in source.frames:
            yield len(frame.data).to_bytes(8, "little")
            yield frame.data
    else:
        yield f"pcm {source.encoding.value} {source.sample_rate_hz} {source.channels}".encode()
        yield source.data
    if video_sampling != VideoSampling():
        yield f"sampling fps={video_sampling.fps!r} max_frames={video_sampling.max_frames!r}".encode()


@dataclass(frozen=True)
class EngineField:
    """One per-item metadata value as vLLM keeps it: a small tensor, or a list of numbers."""

    dtype: str  # torch dtype name without the prefix: "int64", "float32", "float64", "bool"
    shape: tuple[int, ...]  # outermost first; () for a scalar
    values: tuple[int | float, ...]  # row-major
    is_list: bool = False  # vLLM holds it as a Python list (Qwen3-VL timestamps), not a tensor


@dataclass(frozen=True)
class ItemMetadata:
    """What stages after the encoder know about a media item (mirrors ``MultimodalMetadata``).

    Everything comes from the encoder's vLLM: the typed fields are the well-known ones among
    the per-item fields it publishes, ``engine_fields`` holds any other, by vLLM's name, and
    the placeholder fields describe the run vLLM's processor expanded the item into.
    """

    modality: Modality
    content_hash: str
    placeholder_token_id: int
    placeholder_count: int  # prompt positions that take embedding rows (= rows)
    placeholder_length: int  # tokens of the whole run (a Qwen3-VL video's also holds timestamp text)
    embedding_shape: tuple[int, ...]
    embedding_dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", "float16"
    grid_thw: GridThw | None = None
    video_timestamps_s: tuple[float, ...] = ()
    second_per_grid_ts: float | None = None
    audio_feature_length: int = 0
    audio_token_count: int = 0
    engine_fields: dict[str, EngineField] = field(default_factory=dict)
    layout_needs_media: bool = False  # vLLM has no metadata-only layout for this modality here


@dataclass(frozen=True)
class NixlLocation:
    """Where a producer's NIXL agent holds one published item, for a one-sided READ.

    Consumers READ only if ``tag`` verifies under the key the encoder at ``encoder_address``
    hands out over gRPC (:mod:`epd.transport.wire.nixl`), so no field can be altered on the way.
    """

    agent_name: str
    encoder_address: str  # host:port of the EncoderService that gives out the agent's metadata
    descriptors: bytes  # the item's memory, in epd.transport.wire.nixl's versioned format
    nbytes: int  # the slot header plus the rows
    lease_id: str  # 128 random bits in hex; the consumer's READ notification carries it back
    slot_generation: int  # what the region's header must read after the READ (one fill of it)
    expires_at_unix_ms: int  # after this the producer may reuse the memory
    tag: bytes  # HMAC of the fields above but encoder_address (epd.transport.wire.location.LocationSigner)


@dataclass(frozen=True)
class InlineEmbedding:
    """Embedding rows carried in the message (only when explicitly configured)."""

    data: bytes


EmbeddingLocation = NixlLocation | InlineEmbedding


@dataclass(frozen=True)
class EncodedItem:
    """An item after the encoder: metadata, plus where its embedding is (None for decode).

    ``forwarded_media`` is set when the consumers must see the media themselves: vLLM declares
    no metadata-only path for the item's modality on this model, or the benchmarks' media-
    forwarding baseline asks for it.
    """

    metadata: ItemMetadata
    embedding: EmbeddingLocation | None = None
    forwarded_media: MediaInput | None = None


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0

    def after(self, generated: int) -> Sampling:
        """The budget left once ``generated`` tokens of the reply exist: what an engine that
        continues after them is given, so the reply ends where an uninterrupted one would."""
        return dataclasses.replace(self, max_tokens=self.max_tokens - generated, min_tokens=max(0, self.min_tokens - generated))


@dataclass(frozen=True)
class KvHandoff:
    """Where a prefill engine left a request's KV (vLLM NixlConnector's kv_transfer_params)."""

    remote_engine_id: str
    remote_block_groups: tuple[tuple[int, ...], ...]  # one block-id list per KV-cache group
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_num_tokens: int
    tp_size: int
    extra_params: dict[str, Any] = field(default_factory=dict)
    expires_at_unix_ms: int = 0  # when the prefill frees the blocks unless a decode extends the lease; 0: unknown
    seal: bytes = b""  # the prefill's HMAC of the fields above (services.engine_stage.HandoffSeal); empty: unsealed


@dataclass(frozen=True)
class EngineRequest:
    """What the prefill and decode stages receive: a prompt with one placeholder per item,
    either as the chat (``chat``, rendered by the engine that gets it) or as the token ids it
    rendered to (``prompt_token_ids``); exactly one of the two is set."""

    request_id: str
    items: tuple[EncodedItem, ...]
    sampling: Sampling
    prompt_token_ids: tuple[int, ...] = ()
    chat: tuple[ChatMessage, ...] = ()
    kv_handoff: KvHandoff | None = None
    # The reply so far, appended after the rendered prompt (a resumed request); ``sampling`` is
    # then the budget left after them (:meth:`Sampling.after`).
    continuation: tuple[int, ...] = ()
    cache_salt: str = ""  # the request's (GenerateRequest.cache_salt): keys its prompt's KV in vLLM's prefix cache


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ItemMarker:
    """Where a media item sits in a chat sent to an engine: the item itself is the request's
    next :class:`EncodedItem`; its media went to the encoder only."""

    modality: Modality


ContentPart = TextPart | MediaInput | ItemMarker  # ItemMarker: in an EngineRequest's chat only


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    parts: tuple[ContentPart, ...]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: Sampling
    continuation: tuple[int, ...] = ()  # the reply's first tokens, from a run that broke off
    cache_salt: str = ""  # vLLM's prefix cache shares KV only among requests with the same salt

    def __post_init__(self) -> None:
        # Hashed where the request is built (in a worker thread, for a large one), never later on
        # the gateway's event loop, where routing reads the keys.
        for item in self.media:
            item.affinity_key  # noqa: B018 (a cached property)

    @property
    def media(self) -> list[MediaInput]:
        """Media items in prompt order."""
        return [p for m in self.messages for p in m.parts if isinstance(p, MediaInput)]

    def engine_chat(self) -> tuple[ChatMessage, ...]:
        """The chat as the engines get it: each media item replaced by its marker."""
        return tuple(
            ChatMessage(m.role, tuple(ItemMarker(p.modality) if isinstance(p, MediaInput) else p for p in m.parts)) for m in self.messages
        )


@dataclass(frozen=True)
class PublishedItem:
    """One item as the encoder's vLLM engine published it: its output's shape, what vLLM laid it
    out with, and where consumers read it."""

    modality: str
    rows: int
    width: int
    dtype: str
    placeholder_length: int
    placeholder_token_id: int
    fields: dict[str, EngineField]
    layout_needs_media: bool  # the model declares no metadata-only layout for the modality
    location: EmbeddingLocation | None  # None when publishing failed
    error: str = ""

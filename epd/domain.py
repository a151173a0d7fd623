"""Domain types shared by every stage. Protobuf never crosses into domain code: the servicers
convert at the edge (``epd.wire``) and everything behind them works on these types."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd.transport.nixl import NixlRegion


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
class TokenRange:
    offset: int
    length: int


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
    content_hash: str
    video_sampling: VideoSampling = VideoSampling()

    @classmethod
    def of(cls, modality: Modality, source: MediaSource, video_sampling: VideoSampling = VideoSampling()) -> MediaInput:
        return cls(modality, source, content_hash(source, video_sampling), video_sampling)

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
    if isinstance(source, MediaFile):
        digest.update(source.data)
    elif isinstance(source, VideoFrames):
        digest.update(f"frames fps={source.fps!r}".encode())
        for frame in source.frames:
            digest.update(len(frame.data).to_bytes(8, "little") + frame.data)
    else:
        digest.update(f"pcm {source.encoding.value} {source.sample_rate_hz} {source.channels}".encode())
        digest.update(source.data)
    if video_sampling != VideoSampling():
        digest.update(f"sampling fps={video_sampling.fps!r} max_frames={video_sampling.max_frames!r}".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class ItemMetadata:
    """What stages after the encoder know about a media item (mirrors ``MultimodalMetadata``)."""

    modality: Modality
    content_hash: str
    placeholder_token_id: int
    placeholder_count: int
    embedding_shape: tuple[int, ...]
    embedding_dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", "float16"
    grid_thw: GridThw | None = None
    placeholder_range: TokenRange | None = None
    video_timestamps_s: tuple[float, ...] = ()
    audio_feature_length: int = 0
    audio_token_count: int = 0
    engine_extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InlineEmbedding:
    """Embedding bytes carried in the message (only when explicitly configured)."""

    data: bytes


@dataclass(frozen=True)
class EncodedItem:
    """An item after the encoder: metadata, plus where its embedding is (None for decode)."""

    metadata: ItemMetadata
    embedding: NixlRegion | InlineEmbedding | None = None
    forwarded_media: MediaInput | None = None  # benchmarks' media-forwarding baseline only


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0


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


@dataclass(frozen=True)
class EngineRequest:
    """What the prefill and decode stages receive: a prompt with one placeholder per item."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    items: tuple[EncodedItem, ...]
    sampling: Sampling
    kv_handoff: KvHandoff | None = None


class Role(enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class TextPart:
    text: str


ContentPart = TextPart | MediaInput


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    parts: tuple[ContentPart, ...]


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: Sampling

    @property
    def media(self) -> list[MediaInput]:
        """Media items in prompt order."""
        return [p for m in self.messages for p in m.parts if isinstance(p, MediaInput)]

"""Media policy and decoding. The gateway checks sizes and MIME types before any work; the
encoder (and the monolithic oracle, which is given the raw media) decodes, within the limits.
No other stage ever sees media bytes."""

from __future__ import annotations

import collections
import dataclasses

from epd.domain import MediaFile, MediaInput, Modality, VideoFrames

SUPPORTED_MIME_TYPES: dict[Modality, frozenset[str]] = {
    Modality.IMAGE: frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/bmp", "image/gif"}),
    # Containers; the codec inside is whatever OpenCV's bundled FFmpeg decodes (H.264, HEVC,
    # MPEG-4 Part 2, VP8, VP9, AV1, MJPEG, ...). An undecodable codec is reported per item.
    Modality.VIDEO: frozenset({"video/mp4", "video/webm", "video/x-matroska", "video/quicktime", "video/x-msvideo"}),
    Modality.AUDIO: frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/flac", "audio/x-flac"}),
}


class MediaError(ValueError):
    """A media item cannot be used. ``field`` is relative to the item's content part, for
    example ``video.file.data``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What one request may ask of the encoder. Defaults suit a single accelerator; operators
    tune them per deployment (``--max-*`` flags on the gateway and the encoder)."""

    max_item_bytes: int = 32 * 1024 * 1024
    max_request_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096  # of the decoded source image (and of each video frame)
    max_video_frames: int = 4096  # frames in the source video, before sampling
    max_audio_s: float = 30.0  # the model's own cap applies too (Qwen2-Audio: 30 s)


def source_field(item: MediaInput) -> str:
    """Path of an item's source below its content part, for example ``video.file``."""
    if item.modality is Modality.IMAGE:
        return "image"
    kind = {MediaFile: "file", VideoFrames: "frames"}.get(type(item.source), "pcm")
    return f"{item.modality.value}.{kind}"


def check_sizes_and_types(items: list[MediaInput], limits: MediaLimits) -> list[tuple[int, MediaError]]:
    """The checks that need no decoding: MIME types and byte sizes. Returns (item index,
    problem) pairs; the caller turns them into field violations."""
    problems: list[tuple[int, MediaError]] = []
    for index, item in enumerate(items):
        field = source_field(item)
        files = item.source.frames if isinstance(item.source, VideoFrames) else (item.source,)
        for k, file in enumerate(files):
            if not isinstance(file, MediaFile):
                continue  # raw PCM has a typed format instead of a MIME type
            path = f"{field}.frames[{k}]" if isinstance(item.source, VideoFrames) else field
            accepted = SUPPORTED_MIME_TYPES[Modality.IMAGE if isinstance(item.source, VideoFrames) else item.modality]
            if file.mime_type not in accepted:
                problems.append(
                    (index, MediaError(f"{path}.mime_type", f"unsupported MIME type {file.mime_type!r}; accepted: {', '.join(sorted(accepted))}"))
                )
        if item.nbytes > limits.max_item_bytes:
            problems.append((index, MediaError(field, f"is {item.nbytes} bytes, over the per-item limit of {limits.max_item_bytes}")))
    total = sum(item.nbytes for item in items)
    if total > limits.max_request_bytes:
        problems.append((-1, MediaError("", f"media total {total} bytes, over the per-request limit of {limits.max_request_bytes}")))
    return problems


def check_items_per_prompt(items: list[MediaInput], limits: dict[str, int]) -> None:
    """Raises InvalidArgument on ``items`` when a modality has more items than one prompt takes."""
    from epd.errors import FieldViolation, InvalidArgument

    counts = collections.Counter(item.modality.value for item in items)
    violations = [
        FieldViolation("items", f"{count} {modality} items; one prompt takes at most {limits.get(modality, 0)} (--max-{modality}s-per-prompt)")
        for modality, count in sorted(counts.items())
        if count > limits.get(modality, 0)
    ]
    if violations:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in violations), violations)


def check_modalities(items: list[MediaInput], paths: list[str], accepted: frozenset[Modality]) -> None:
    """Raises one InvalidArgument naming every item of a modality the model does not take."""
    from epd.errors import FieldViolation, InvalidArgument

    violations = [
        FieldViolation(f"{path}.{item.modality.value}", f"this model does not take {item.modality.value} input")
        for path, item in zip(paths, items, strict=True)
        if item.modality not in accepted
    ]
    if violations:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in violations), violations)

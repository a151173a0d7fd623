"""Audio decoding: WAV or FLAC files, or raw PCM, to mono float32 samples at the rate the
model's feature extractor wants. Used by the encoder and by the monolithic oracle, so both
hand the very same samples to the tower.

Decoder choice: ``soundfile`` (libsndfile, bundled in its wheel). It reads WAV (8/16/24/32-bit
integer, 32/64-bit float, A-law, mu-law) and FLAC from memory. torchaudio and torchcodec do
not load on CPU torch, and PyAV would be a second, larger native stack for two containers.

Every failure is a ``ValueError`` with a message that can go back to the caller as is; the
caller adds the field path (see :mod:`epd.media.decode`).
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np

# Inclusive bounds, in Hz, of the source rates accepted: from telephone audio to the usual
# studio rate. Everything is resampled to the model's rate (16 kHz for Whisper-style
# towers), which already discards content above 8 kHz, so higher source rates only cost time.
SUPPORTED_SAMPLE_RATES = (8000, 48000)
MAX_PCM_CHANNELS = 8

# Declared MIME type -> libsndfile's name of the container it must hold.
_CONTAINERS = {
    "audio/wav": "WAV",
    "audio/x-wav": "WAV",
    "audio/wave": "WAV",
    "audio/vnd.wave": "WAV",
    "audio/flac": "FLAC",
    "audio/x-flac": "FLAC",
}
# libsndfile reports WAVE_FORMAT_EXTENSIBLE files as their own format.
_WAV_FORMATS = frozenset({"WAV", "WAVEX"})
_PCM_DTYPES = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}
# WAV writers that stream (or exceed 4 GiB, in RF64) leave the data chunk size unknown.
_UNKNOWN_CHUNK_SIZES = (0, 0xFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples in [-1, 1] (integer sources) and their rate."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def decode_audio_file(data: bytes, mime_type: str, target_rate: int) -> DecodedAudio:
    """Decodes a WAV or FLAC file to mono float32 at ``target_rate``.

    Raises:
        ValueError: the MIME type is not WAV or FLAC, the bytes are not that container, are
            truncated or corrupt, hold no samples, or have an unsupported sample rate.
    """
    import soundfile

    container = _CONTAINERS.get(mime_type)
    if container is None:
        raise ValueError(f"unsupported audio MIME type {mime_type!r}; accepted: {', '.join(sorted(_CONTAINERS))}")
    if not data:
        raise ValueError("is empty (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as file:
            found = "WAV" if file.format in _WAV_FORMATS else file.format
            if found != container:
                raise ValueError(f"is a {file.format} file, not the {container} its MIME type {mime_type!r} declares")
            rate, declared_frames = file.samplerate, file.frames
            _check_rate(rate)
            frames = file.read(dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError) as exc:
        raise ValueError(f"cannot be decoded as {container}: {_libsndfile_reason(exc)}") from None
    # libsndfile shortens a WAV whose data chunk is cut to what is there, without a word.
    truncation = _wav_truncation(data) if container == "WAV" else None
    if truncation is None and len(frames) < declared_frames:
        truncation = f"declares {declared_frames} frames but holds {len(frames)}"
    if truncation is not None:
        raise ValueError(f"is truncated: {truncation}")
    return _finish(frames, rate, target_rate)


def decode_pcm(data: bytes, sample_rate: int, channels: int, encoding: str, target_rate: int) -> DecodedAudio:
    """Decodes raw interleaved little-endian PCM (``"s16le"`` or ``"f32le"``) to mono float32
    at ``target_rate``.

    Raises:
        ValueError: an unknown encoding, a bad channel count or sample rate, no samples, or a
            byte count that is not a whole number of frames.
    """
    dtype = _PCM_DTYPES.get(encoding)
    if dtype is None:
        raise ValueError(f"unsupported PCM encoding {encoding!r}; accepted: {', '.join(_PCM_DTYPES)}")
    if not 1 <= channels <= MAX_PCM_CHANNELS:
        raise ValueError(f"has {channels} channels; 1 to {MAX_PCM_CHANNELS} are supported")
    _check_rate(sample_rate)
    if not data:
        raise ValueError("has no samples")
    frame_bytes = dtype.itemsize * channels
    if len(data) % frame_bytes:
        raise ValueError(f"holds {len(data)} bytes, not a whole number of {frame_bytes}-byte frames ({channels} channels of {encoding})")
    samples = np.frombuffer(data, dtype=dtype).reshape(-1, channels)
    if encoding == "s16le":
        # libsndfile's scaling of 16-bit WAV, so a clip sent as PCM decodes like its WAV.
        samples = samples.astype(np.float32) / np.float32(32768.0)
    return _finish(samples.astype(np.float32, copy=False), sample_rate, target_rate)


def _check_rate(sample_rate: int) -> None:
    low, high = SUPPORTED_SAMPLE_RATES
    if not low <= sample_rate <= high:
        raise ValueError(f"sample rate {sample_rate} Hz is outside the supported {low}–{high} Hz")


def _finish(frames: np.ndarray, sample_rate: int, target_rate: int) -> DecodedAudio:
    """Mixes ``[frames, channels]`` down to mono and resamples it to ``target_rate``."""
    if frames.shape[0] == 0:
        raise ValueError("has no samples")
    if not np.isfinite(frames).all():
        raise ValueError("holds samples that are NaN or infinite")
    mono = frames.mean(axis=1, dtype=np.float32) if frames.shape[1] > 1 else frames[:, 0]
    if sample_rate != target_rate:
        from scipy.signal import resample_poly

        # Polyphase filtering at the exact reduced ratio (e.g. 441/1600 for 44.1 -> 16 kHz)
        # with a Kaiser-windowed anti-aliasing filter: deterministic, no drift in length
        # (ceil(n * up / down) samples), and the same method as vLLM's "scipy" resampler.
        # vLLM's default, torchaudio, does not load on CPU torch.
        gcd = math.gcd(sample_rate, target_rate)
        mono = resample_poly(mono, target_rate // gcd, sample_rate // gcd).astype(np.float32)
    return DecodedAudio(np.ascontiguousarray(mono, dtype=np.float32), target_rate)


def _wav_truncation(data: bytes) -> str | None:
    """Why a RIFF/WAVE file's data chunk is shorter than its header says, or None."""
    position = 12  # after "RIFF", the RIFF size and "WAVE"
    while position + 8 <= len(data):
        chunk_id = data[position : position + 4]
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        if chunk_id == b"data":
            available = len(data) - position - 8
            if size not in _UNKNOWN_CHUNK_SIZES and available < size:
                return f"its data chunk declares {size} bytes but {available} follow"
            return None
        position += 8 + size + (size & 1)  # chunks are padded to an even size
    return None


def _libsndfile_reason(exc: Exception) -> str:
    """libsndfile's own words, without the Python object repr soundfile prefixes them with."""
    reason = getattr(exc, "error_string", None) or str(exc)
    return reason.strip().removeprefix("Error : ").rstrip(".") or type(exc).__name__

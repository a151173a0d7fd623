"""Media decoding, shared by the encoder and the monolithic oracle (no engines): audio files and
PCM, resampling, every decode error, and the decoded-size limits with the field they name."""

from __future__ import annotations

import numpy as np
import pytest

from devkit.media import (
    noise_flac,
    noise_samples,
    pcm_bytes,
    sine_samples,
    sine_wav,
    soundfile_bytes,
    synthetic_image_png,
    synthetic_video,
    wav_int16,
)
from epd.domain import MediaFile, MediaInput, Modality
from epd.media import MediaLimits
from epd.media.audio import decode_audio_file, decode_pcm
from epd.media.decode import MediaDecoder
from tests.conftest import checkpoint

RATE = 16000


def test_wav_and_flac_decode_to_the_samples_written() -> None:
    mono = sine_samples(0.5, RATE, seed=1)
    quantised = np.round(mono * 32768).clip(-32768, 32767) / 32768
    decoded = decode_audio_file(sine_wav(0.5, RATE, seed=1), "audio/wav", RATE)
    assert decoded.sample_rate == RATE and decoded.samples.dtype == np.float32 and decoded.duration_s == 0.5
    np.testing.assert_array_equal(decoded.samples, quantised.astype(np.float32))

    stereo = sine_samples(0.25, RATE, channels=2, seed=2)
    as_float = decode_audio_file(soundfile_bytes(stereo, RATE, subtype="FLOAT"), "audio/x-wav", RATE)
    np.testing.assert_array_equal(as_float.samples, stereo.mean(axis=1, dtype=np.float32))
    as_24_bit = decode_audio_file(soundfile_bytes(stereo, RATE, subtype="PCM_24"), "audio/wave", RATE)
    np.testing.assert_allclose(as_24_bit.samples, stereo.mean(axis=1), atol=2**-23)

    flac = decode_audio_file(noise_flac(0.3, RATE, seed=3), "audio/flac", RATE)
    np.testing.assert_allclose(flac.samples, noise_samples(0.3, RATE, seed=3), atol=2**-15)


def test_pcm_decodes_like_the_same_wav() -> None:
    stereo = sine_samples(0.2, RATE, channels=2, seed=4)
    from_wav = decode_audio_file(wav_int16(stereo, RATE), "audio/wav", RATE)
    from_pcm = decode_pcm(pcm_bytes(stereo, "s16le"), RATE, 2, "s16le", RATE)
    np.testing.assert_array_equal(from_pcm.samples, from_wav.samples)
    as_f32 = decode_pcm(pcm_bytes(stereo, "f32le"), RATE, 2, "f32le", RATE)
    np.testing.assert_array_equal(as_f32.samples, stereo.mean(axis=1, dtype=np.float32))


@pytest.mark.parametrize("source_rate", [8000, 22050, 44100, 48000])
def test_resampling_to_the_model_rate(source_rate: int) -> None:
    seconds = 1.5
    decoded = decode_audio_file(sine_wav(seconds, source_rate, 440.0, seed=5), "audio/wav", RATE)
    assert decoded.sample_rate == RATE and len(decoded.samples) == round(seconds * RATE)
    assert decoded.samples.dtype == np.float32
    # Still a 440 Hz tone: the spectrum peaks at its bin.
    spectrum = np.abs(np.fft.rfft(decoded.samples))
    assert abs(np.argmax(spectrum) * RATE / len(decoded.samples) - 440.0) < 2.0


@pytest.mark.parametrize(
    ("data", "mime_type", "message"),
    [
        (wav_int16(np.zeros(0, np.float32), RATE), "audio/wav", "has no samples"),
        (sine_wav(0.5, RATE)[:3000], "audio/wav", "is truncated: its data chunk declares 16000 bytes but 2956 follow"),
        (sine_wav(0.5, RATE)[:30], "audio/wav", "cannot be decoded as WAV"),
        (noise_flac(0.5, RATE)[:2000], "audio/flac", "cannot be decoded as FLAC|is truncated"),
        (b"", "audio/wav", "is empty"),
        (b"RIFF garbage, not audio at all" * 4, "audio/wav", "cannot be decoded as WAV: Format not recognised"),
        (sine_wav(0.5, 4000), "audio/wav", "sample rate 4000 Hz is outside the supported 8000–48000 Hz"),
        (sine_wav(0.5, 96000), "audio/wav", "sample rate 96000 Hz is outside"),
        (noise_flac(0.5, RATE), "audio/wav", "is a FLAC file, not the WAV"),
        (soundfile_bytes(np.zeros(100, np.float32), RATE, container="OGG", subtype="VORBIS"), "audio/ogg", "unsupported audio MIME type"),
        (soundfile_bytes(np.full(100, np.nan, np.float32), RATE), "audio/wav", "NaN or infinite"),
    ],
)
def test_bad_audio_files_are_value_errors(data: bytes, mime_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_audio_file(data, mime_type, RATE)


@pytest.mark.parametrize(
    ("data", "rate", "channels", "encoding", "message"),
    [
        (b"", RATE, 1, "s16le", "has no samples"),
        (b"\0" * 7, RATE, 2, "s16le", "holds 7 bytes, not a whole number of 4-byte frames"),
        (b"\0" * 8, 4000, 1, "s16le", "sample rate 4000 Hz is outside"),
        (b"\0" * 8, RATE, 0, "s16le", "has 0 channels"),
        (b"\0" * 8, RATE, 1, "mulaw", "unsupported PCM encoding"),
    ],
)
def test_bad_pcm_is_a_value_error(data: bytes, rate: int, channels: int, encoding: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_pcm(data, rate, channels, encoding, RATE)


def test_pixel_and_frame_limits_name_the_field():
    """Decoded-size limits are checked by the decoder that the encoder and the oracle share."""
    from devkit.media import synthetic_frames_png
    from epd.domain import VideoFrames
    from epd.media import MediaError

    decoder = MediaDecoder.for_model(checkpoint("qwen3_vl"), MediaLimits(max_image_pixels=100 * 80, max_video_frames=5))
    assert decoder.decode(MediaInput(Modality.IMAGE, MediaFile(synthetic_image_png(100, 80, seed=1), "image/png"))).size == (100, 80)
    cases = {
        "image.data": MediaInput(Modality.IMAGE, MediaFile(synthetic_image_png(101, 80, seed=1), "image/png")),
        "video.file.data": MediaInput(Modality.VIDEO, MediaFile(synthetic_video(32, 32, 6, fps=6.0, seed=1), "video/mp4")),
        "video.frames.frames": MediaInput(Modality.VIDEO, VideoFrames(tuple(MediaFile(f, "image/png") for f in synthetic_frames_png(32, 32, 6, seed=1)), 6.0)),
    }
    for field, item in cases.items():
        with pytest.raises(MediaError) as info:
            decoder.decode(item)
        assert info.value.field == field, str(info.value)


def test_images_decode_to_the_pixels_vllm_serve_gives_them():
    """The encoder's pixels are vLLM's for the same bytes: a transparent PNG on white (not the
    colour under its alpha), an EXIF-rotated JPEG upright, an RGB image untouched."""
    import io

    from PIL import Image

    from epd.media.image import decode_image

    transparent = Image.new("RGBA", (4, 2), (10, 20, 30, 0))
    transparent.putpixel((0, 0), (10, 20, 30, 255))
    png = io.BytesIO()
    transparent.save(png, format="PNG")
    decoded = decode_image(png.getvalue(), max_pixels=100)
    assert decoded.mode == "RGB"
    assert decoded.getpixel((0, 0)) == (10, 20, 30)
    assert decoded.getpixel((1, 0)) == (255, 255, 255)

    landscape = Image.new("RGB", (6, 2), (200, 0, 0))
    exif = landscape.getexif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    jpeg = io.BytesIO()
    landscape.save(jpeg, format="JPEG", exif=exif)
    assert decode_image(jpeg.getvalue(), max_pixels=100).size == (2, 6)

    rgb = io.BytesIO()
    landscape.save(rgb, format="PNG")
    assert decode_image(rgb.getvalue(), max_pixels=100).tobytes() == landscape.tobytes()


def test_vllms_processor_takes_a_decoded_image_as_it_is():
    """The decoder hands vLLM its loader's own result, image and source bytes together, as
    ``vllm serve`` does: vLLM's parser passes it to the processor as it is. A bare PIL image would
    be normalized once more, which copies every image."""
    from vllm.multimodal.media import MediaWithBytes
    from vllm.multimodal.parse import MultiModalDataParser

    from epd.media.image import decode_image

    data = synthetic_image_png(64, 48, seed=5)
    decoded = decode_image(data, max_pixels=1 << 20)
    assert isinstance(decoded, MediaWithBytes) and decoded.original_bytes == data and decoded.size == (64, 48)
    parsed = MultiModalDataParser().parse_mm_data({"image": [decoded]})
    assert parsed["image"].get(0) is decoded.media


# vLLM's video loaders EPD's tested families use: Qwen2-VL's (Qwen2.5-VL, both Omni thinkers),
# Qwen3-VL's, GLM-4.1V's duration-aware one, and the uniform OpenCV loader (InternVL, vLLM's default).
VIDEO_LOADERS = ("qwen2_vl", "qwen3_vl", "opencv_dynamic", None)


# A 5 s clip of 40 frames: (loader, requested fps, requested max_frames, frames vLLM samples).
# Qwen2-VL's loader rounds to whole temporal patches (4 of 5); GLM-4.1V's takes no frame cap.
_LOADED_FRAMES = [
    ("qwen2_vl", None, None, 10), ("qwen2_vl", 1.0, None, 4), ("qwen2_vl", None, 6, 6),
    ("qwen3_vl", None, None, 10), ("qwen3_vl", 1.0, None, 5), ("qwen3_vl", None, 6, 6),
    ("opencv_dynamic", None, None, 10), ("opencv_dynamic", 1.0, None, 5),
    (None, None, None, 32), (None, 1.0, None, 5), (None, None, 6, 6),
]


@pytest.mark.parametrize(("backend", "fps", "max_frames", "count"), _LOADED_FRAMES)
def test_videos_load_to_the_frames_vllm_serve_gives_them(backend, fps, max_frames, count) -> None:
    """A video file's frames and metadata are those of vLLM's VideoMediaIO with the model's
    loader, as ``vllm serve`` loads a ``video_url`` with the same ``media_io_kwargs``."""
    from vllm.multimodal.media import ImageMediaIO, VideoMediaIO

    from epd.domain import VideoSampling
    from epd.media.video import VideoLoading, decode_video_file

    data = synthetic_video(48, 32, 40, fps=8.0, seed=3)
    runtime = {"fps": fps} if fps else {"num_frames": max_frames, "max_frames": max_frames} if max_frames else {}
    io_kwargs = VideoMediaIO.merge_kwargs({"video_backend": backend} if backend else {}, runtime)
    frames, metadata = VideoMediaIO(ImageMediaIO(), **io_kwargs).load_bytes(data).media
    decoded = decode_video_file(data, VideoSampling(fps, max_frames), VideoLoading(backend), MediaLimits())
    assert len(frames) == count
    assert decoded.metadata == metadata
    np.testing.assert_array_equal(decoded.frames, frames)


@pytest.mark.parametrize("backend", VIDEO_LOADERS)
def test_caller_frames_sample_as_a_file_of_them_would(backend) -> None:
    """Frames the caller decoded are sampled by the model's loader as the same frames in a file
    at their rate: the same source indices, the same frames."""
    from devkit.media import synthetic_frames_png
    from epd.domain import VideoFrames, VideoSampling
    from epd.media.video import VideoLoading, decode_video_file, decode_video_frames

    loading = VideoLoading(backend)
    from_file = decode_video_file(synthetic_video(48, 32, 40, fps=8.0, seed=3), VideoSampling(), loading, MediaLimits())
    pngs = synthetic_frames_png(48, 32, 40, seed=3)
    from_frames = decode_video_frames(VideoFrames(tuple(MediaFile(p, "image/png") for p in pngs), 8.0), VideoSampling(), loading, MediaLimits())
    assert from_frames.metadata["frames_indices"] == from_file.metadata["frames_indices"]
    for key in ("total_num_frames", "fps", "duration", "do_sample_frames"):
        assert from_frames.metadata[key] == from_file.metadata[key], key
    expected = [np.asarray(decode_image_png(pngs[i])) for i in from_file.metadata["frames_indices"]]
    np.testing.assert_array_equal(from_frames.frames, np.stack(expected))


def decode_image_png(data: bytes):
    from epd.media.image import decode_image

    return decode_image(data, max_pixels=MediaLimits().max_image_pixels)


@pytest.mark.parametrize(("backend", "max_frames", "message"), [
    ("opencv_dynamic", 4, "takes no frame cap"),  # GLM-4.1V's loader samples by duration only
    ("qwen2_vl", 1, "too few for this model's video loader"),  # rounded down to whole temporal patches: none
])
def test_video_frame_cap_a_loader_ignores_is_refused(backend, max_frames, message) -> None:
    """A frame cap the model's loader cannot honour is refused on its field, never served past."""
    from epd.domain import VideoSampling
    from epd.media import MediaError
    from epd.media.video import VideoLoading, decode_video_file

    with pytest.raises(MediaError, match=message) as info:
        decode_video_file(synthetic_video(48, 32, 40, fps=8.0, seed=3), VideoSampling(max_frames=max_frames), VideoLoading(backend), MediaLimits())
    assert info.value.field == "video.sampling.max_frames"

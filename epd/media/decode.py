"""Decoding a request's media into what a tower (or the monolithic oracle's vLLM) takes.

Shared by the encoder and by the monolithic gateway, so that the oracle and the
disaggregated path see the very same frames and samples.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from epd.domain import MediaFile, MediaInput, Modality, PcmAudio, VideoFrames
from epd.errors import FieldViolation, InvalidArgument
from epd.media import MediaError, MediaLimits, check_sizes_and_types, source_field
from epd.media.image import decode_image
from epd.media.video import DecodedVideo, VideoLoading, decode_video_file, decode_video_frames


@dataclasses.dataclass(frozen=True)
class MediaDecoder:
    """Decodes items for one checkpoint, within the limits."""

    limits: MediaLimits
    video_loading: VideoLoading | None  # None: the checkpoint has no video processor
    audio_rate: int | None  # the audio feature extractor's rate; None: no audio
    audio_max_s: float  # min of the configured limit and the feature extractor's window
    audio_min_samples: int  # fewer give no audio token at all

    @classmethod
    def for_model(cls, model_dir: str | pathlib.Path, limits: MediaLimits) -> MediaDecoder:
        """Reads the checkpoint's processor (no weights) for its video loader and audio settings."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
        video_processor = getattr(processor, "video_processor", None)
        extractor = getattr(processor, "feature_extractor", None)
        audio_rate, audio_max_s, audio_min_samples = None, limits.max_audio_s, 0
        if extractor is not None and getattr(extractor, "sampling_rate", None):
            audio_rate = int(extractor.sampling_rate)
            # Longer clips would be cut silently by the feature extractor: refuse them instead.
            chunk_length = getattr(extractor, "chunk_length", None)
            audio_max_s = min(audio_max_s, float(chunk_length)) if chunk_length else audio_max_s
            # Whisper-style towers halve the mel frames twice: under 3 frames leaves no token.
            audio_min_samples = 2 * int(getattr(extractor, "hop_length", 0)) + 1
        video_loading = VideoLoading.for_model(model_dir) if video_processor is not None else None
        return cls(limits, video_loading, audio_rate, audio_max_s, audio_min_samples)

    def decode_all(self, items: list[MediaInput], paths: list[str]) -> list[Any]:
        """Decodes every item, or raises one InvalidArgument naming every bad field.

        ``paths[i]`` is the field path of item i's content part in the caller's request.
        """
        violations = [
            FieldViolation(f"{paths[index]}.{problem.field}" if index >= 0 else "media", str(problem))
            for index, problem in check_sizes_and_types(items, self.limits)
        ]
        decoded = []
        if not violations:
            for path, item in zip(paths, items, strict=True):
                try:
                    decoded.append(self.decode(item))
                except MediaError as exc:
                    violations.append(FieldViolation(f"{path}.{exc.field}", str(exc)))
        if violations:
            raise InvalidArgument("invalid media: " + "; ".join(f"{v.field} {v.description}" for v in violations), violations)
        return decoded

    def decode(self, item: MediaInput) -> Any:
        """An image (vLLM's ``MediaWithBytes`` of a PIL image: :func:`epd.media.image.decode_image`),
        a :class:`DecodedVideo` or a ``DecodedAudio``.

        Raises:
            MediaError: the item cannot be decoded, or breaks a limit.
        """
        source = item.source
        if item.modality is Modality.IMAGE:
            return decode_image(source.data, max_pixels=self.limits.max_image_pixels)
        if item.modality is Modality.VIDEO:
            if self.video_loading is None:
                raise MediaError("video", "this checkpoint has no video processor")
            if isinstance(source, VideoFrames):
                return decode_video_frames(source, item.video_sampling, self.video_loading, self.limits)
            return decode_video_file(source.data, item.video_sampling, self.video_loading, self.limits)
        return self._decode_audio(item)

    def _decode_audio(self, item: MediaInput):
        from epd.media.audio import SUPPORTED_SAMPLE_RATES, decode_audio_file, decode_pcm

        field = source_field(item)
        if self.audio_rate is None:
            raise MediaError("audio", "this checkpoint has no audio feature extractor")
        source = item.source
        low, high = SUPPORTED_SAMPLE_RATES
        if isinstance(source, PcmAudio) and not low <= source.sample_rate_hz <= high:
            raise MediaError(f"{field}.sample_rate_hz", f"is {source.sample_rate_hz} Hz, outside the supported {low}-{high} Hz")
        try:
            if isinstance(source, PcmAudio):
                audio = decode_pcm(source.data, source.sample_rate_hz, source.channels, source.encoding.value, self.audio_rate)
            else:
                assert isinstance(source, MediaFile)
                audio = decode_audio_file(source.data, source.mime_type, self.audio_rate)
        except ValueError as exc:
            raise MediaError(f"{field}.data", str(exc)) from exc
        if audio.duration_s > self.audio_max_s:
            raise MediaError(f"{field}.data", f"lasts {audio.duration_s:.2f} s, over the limit of {self.audio_max_s:g} s")
        if len(audio.samples) < self.audio_min_samples:
            raise MediaError(f"{field}.data", f"holds {len(audio.samples)} samples at {audio.sample_rate} Hz; this model needs at least {self.audio_min_samples}")
        return audio


def vllm_input(modality: Modality, decoded: Any) -> Any:
    """What vLLM's own processor takes for a decoded item (the monolithic oracle)."""
    if modality is Modality.VIDEO:
        assert isinstance(decoded, DecodedVideo)
        return decoded.vllm_input()
    if modality is Modality.AUDIO:
        return decoded.samples, decoded.sample_rate
    return decoded

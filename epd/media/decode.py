"""Decoding a request's media into what a tower (or the monolithic oracle's vLLM) takes.

Shared by the encoder and by the monolithic gateway, so that the oracle and the
disaggregated path see the very same frames and samples.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from epd.domain import MediaFile, MediaInput, Modality, PcmAudio, VideoFrames
from epd.errors import FieldViolation, InvalidArgument
from epd.media import MediaError, MediaLimits, check_sizes_and_types, source_field
from epd.media.image import decode_image
from epd.media.video import DecodedVideo, SamplingDefaults, decode_video_file, decode_video_frames
from epd.models import load_family


@dataclasses.dataclass(frozen=True)
class MediaDecoder:
    """Decodes items for one checkpoint, within the limits."""

    limits: MediaLimits
    video_defaults: SamplingDefaults | None  # None: EPD serves no video for this checkpoint
    audio_rate: int | None  # the audio feature extractor's rate; None: no audio
    audio_max_s: float  # min of the configured limit and the feature extractor's window
    audio_min_samples: int  # fewer give no audio token at all

    @classmethod
    def for_model(cls, model_dir: str | pathlib.Path, limits: MediaLimits) -> MediaDecoder:
        audio_rate, audio_max_s, audio_min_samples = None, limits.max_audio_s, 0
        preprocessor = pathlib.Path(model_dir) / "preprocessor_config.json"
        config = json.loads(preprocessor.read_text()) if preprocessor.exists() else {}
        if "feature_size" in config:  # an audio feature extractor (Whisper's for Qwen2-Audio)
            audio_rate = int(config["sampling_rate"])
            # Longer clips would be cut silently by the feature extractor: refuse them instead.
            audio_max_s = min(audio_max_s, float(config.get("chunk_length", audio_max_s)))
            # The tower halves the mel frames twice: under 3 frames leaves no token.
            audio_min_samples = 2 * int(config["hop_length"]) + 1
        serves_video = Modality.VIDEO in load_family(model_dir).supported_modalities
        video_defaults = SamplingDefaults.from_model_dir(model_dir) if serves_video else None
        return cls(limits, video_defaults, audio_rate, audio_max_s, audio_min_samples)

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
        """A PIL image, a :class:`DecodedVideo` or a ``DecodedAudio``.

        Raises:
            MediaError: the item cannot be decoded, or breaks a limit.
        """
        source = item.source
        if item.modality is Modality.IMAGE:
            return decode_image(source.data, max_pixels=self.limits.max_image_pixels)
        if item.modality is Modality.VIDEO:
            if self.video_defaults is None:
                raise MediaError("video", "video input is not served for this checkpoint")
            if isinstance(source, VideoFrames):
                return decode_video_frames(source, item.video_sampling, self.video_defaults, self.limits)
            return decode_video_file(source.data, item.video_sampling, self.video_defaults, self.limits)
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

"""The Qwen2-Audio family: placeholder layout and audio tower.

Layout rule: the rendered chat prompt holds one ``<|AUDIO|>`` per clip (between
``<|audio_bos|>`` and ``<|audio_eos|>``); the processor repeats it once per row of the clip's
embedding. That count follows from the clip's feature length L, the number of valid 10 ms
mel frames: the tower's stride-2 convolution gives ``(L - 1) // 2 + 1`` frames and its
stride-2 average pool ``(that - 2) // 2 + 1`` rows. Stages after the encoder therefore
rebuild the layout from the token count alone, and vLLM does the same when it is given
``audio_num_tokens`` with precomputed embeddings, or without them on a decode engine that
receives the KV instead.

The Whisper feature extractor pads every clip to a fixed 30 s window and cuts longer ones,
so the tower never sees more than 3000 frames (750 rows); longer clips must be refused
before they get here (:attr:`Qwen2AudioFamily.max_audio_seconds`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epd.domain import EngineRequest, ItemMetadata, Modality
from epd.errors import FieldViolation, InvalidArgument
from epd.models.base import Encoding, ExpandedPrompt, expand_placeholders

if TYPE_CHECKING:
    import numpy as np
    import torch

    from epd.media.audio import DecodedAudio

# On-disk prefixes of the tower: the Whisper-style encoder and the linear projector that
# maps its output to the language model's width. vLLM counts both as the audio tower.
_AUDIO_PREFIXES = ("audio_tower.", "multi_modal_projector.")

# Whisper's front end: 10 ms mel frames, and a convolution stride of 2 before the positions.
_MEL_FRAMES_PER_SECOND = 100
_CONV_STRIDE = 2


@dataclasses.dataclass(frozen=True)
class Qwen2AudioFamily:
    """Layout rules of one Qwen2-Audio checkpoint, read from its config.json."""

    model_type: str
    audio_token_id: int
    embedding_width: int
    max_feature_length: int  # mel frames the tower's position table covers (3000 = 30 s)
    supported_modalities: frozenset[Modality] = frozenset({Modality.AUDIO})
    model_modalities: frozenset[Modality] = frozenset({Modality.AUDIO})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Qwen2AudioFamily:
        """Reads a config.json dict through transformers' config class.

        The released checkpoint's config.json leaves most sizes at their class defaults (its
        ``audio_config`` is just a ``model_type``, its ``text_config`` has no hidden size), so
        the dict alone does not say them.
        """
        from transformers import Qwen2AudioConfig

        model_type = config.get("model_type")
        if model_type != "qwen2_audio":
            raise ValueError(f"unsupported model_type {model_type!r} for Qwen2AudioFamily: expected qwen2_audio")
        resolved = Qwen2AudioConfig.from_dict(config)
        return cls(
            model_type=model_type,
            audio_token_id=int(resolved.audio_token_id),
            embedding_width=int(resolved.text_config.hidden_size),
            max_feature_length=int(resolved.audio_config.max_source_positions) * _CONV_STRIDE,
        )

    @property
    def max_audio_seconds(self) -> float:
        """The longest clip the tower represents whole; the feature extractor cuts the rest."""
        return self.max_feature_length / _MEL_FRAMES_PER_SECOND

    # ---- layout -------------------------------------------------------------------------

    @property
    def placeholder_token_ids(self) -> frozenset[int]:
        return frozenset({self.audio_token_id})

    @staticmethod
    def audio_token_count(feature_length: int) -> int:
        """Embedding rows (and prompt tokens) of a clip with ``feature_length`` valid mel frames.

        The same arithmetic as the tower's ``_get_feat_extract_output_lengths`` (in both
        transformers and vLLM): the stride-2 convolution, then the stride-2 average pool. Clips
        of fewer than 3 frames (20 ms or less at 16 kHz) give 0, which no engine accepts.
        """
        after_conv = (feature_length - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1

    def item_metadata(self, modality: Modality, content_hash: str, encoding: Encoding) -> ItemMetadata:
        if modality is not Modality.AUDIO:
            raise ValueError(f"{self.model_type} encodes audio only, not {modality.value}")
        return ItemMetadata(
            modality=modality,
            content_hash=content_hash,
            placeholder_token_id=self.audio_token_id,
            placeholder_count=encoding.audio_token_count,
            embedding_shape=tuple(encoding.embedding.shape),
            embedding_dtype=str(encoding.embedding.dtype).removeprefix("torch."),
            audio_feature_length=encoding.audio_feature_length,
            audio_token_count=encoding.audio_token_count,
        )

    def expand_prompt(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> ExpandedPrompt:
        """Expands the k-th ``<|AUDIO|>`` of the prompt into item k's run of audio tokens.

        Raises:
            InvalidArgument: the prompt's placeholders do not match the items one to one.
        """
        self.validate_layout(token_ids, items)
        return expand_placeholders(token_ids, items, self.placeholder_token_ids, lambda item: [self.audio_token_id] * item.audio_token_count)

    def validate_layout(self, token_ids: Sequence[int], items: Sequence[ItemMetadata]) -> None:
        """Checks that prompt and metadata agree, before anything reaches an engine.

        The feature length is the item's ground truth: the token counts, the placeholder count
        and the embedding shape must all be the ones it implies.

        Raises:
            InvalidArgument: naming every inconsistent field.
        """
        violations: list[FieldViolation] = []
        found = sum(1 for t in token_ids if t == self.audio_token_id)
        if found != len(items):
            violations.append(FieldViolation("prompt.token_ids", f"holds {found} audio placeholders but the request has {len(items)} items"))
        for index, item in enumerate(items):
            field = f"items[{index}].metadata"
            if item.modality is not Modality.AUDIO:
                violations.append(FieldViolation(f"{field}.modality", f"{item.modality.value} is not supported for {self.model_type}"))
                continue
            length = item.audio_feature_length
            if not 0 < length <= self.max_feature_length:
                violations.append(
                    FieldViolation(f"{field}.audio_feature_length", f"is {length}; this model takes 1 to {self.max_feature_length} mel frames")
                )
                continue
            expected = self.audio_token_count(length)
            if expected == 0:
                violations.append(FieldViolation(f"{field}.audio_feature_length", f"is {length} mel frames, too short to give any audio token"))
                continue
            if item.placeholder_token_id != self.audio_token_id:
                violations.append(
                    FieldViolation(
                        f"{field}.placeholder_token_id", f"is {item.placeholder_token_id} but this model's audio token is {self.audio_token_id}"
                    )
                )
            for name in ("audio_token_count", "placeholder_count"):
                if getattr(item, name) != expected:
                    violations.append(
                        FieldViolation(f"{field}.{name}", f"is {getattr(item, name)} but audio_feature_length {length} implies {expected}")
                    )
            if tuple(item.embedding_shape) != (expected, self.embedding_width):
                violations.append(
                    FieldViolation(
                        f"{field}.embedding_shape",
                        f"is {list(item.embedding_shape)} but this model needs [{expected}, {self.embedding_width}]",
                    )
                )
        if violations:
            raise InvalidArgument("prompt and multimodal metadata disagree", violations)

    # ---- engine inputs ------------------------------------------------------------------

    def engine_prompt(self, request: EngineRequest, embeddings: Sequence[torch.Tensor] | None) -> dict[str, Any]:
        """Builds vLLM's prompt dict from metadata, with or without embeddings.

        vLLM's Qwen2-Audio parser takes ``{"audio_embeds": [one 2-D tensor per clip],
        "audio_num_tokens": 1-D int tensor}``. The counts are the "metadata" role of that input:
        with embeddings (prefill, combined decode) vLLM checks each clip's rows against them;
        without (a decode engine receiving KV, where vLLM lets the tensors be missing) they
        alone size the placeholder runs. The content hashes keep the multimodal cache keys
        identical across stages.

        Raises:
            InvalidArgument: an item is not audio.
        """
        import torch

        prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if not request.items:
            return prompt
        metadata = [item.metadata for item in request.items]
        violations = [
            FieldViolation(f"items[{i}].metadata.modality", f"{m.modality.value} is not supported for {self.model_type}")
            for i, m in enumerate(metadata)
            if m.modality is not Modality.AUDIO
        ]
        if violations:
            raise InvalidArgument("prompt and multimodal metadata disagree", violations)
        data: dict[str, Any] = {"audio_num_tokens": torch.tensor([m.audio_token_count for m in metadata], dtype=torch.int64)}
        if embeddings is not None:
            data["audio_embeds"] = list(embeddings)
        prompt["multi_modal_data"] = {"audio": data}
        prompt["multi_modal_uuids"] = {"audio": [m.content_hash for m in metadata]}
        return prompt


class AudioProcessors:
    """The checkpoint's feature extractor: mel features and layout, no weights. The encoder runs
    it before its tower; the media-forwarding baseline runs it again downstream."""

    def __init__(self, model_dir: str | pathlib.Path, family: Qwen2AudioFamily):
        from transformers import WhisperFeatureExtractor

        self.family = family
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
        self.sampling_rate: int = self.feature_extractor.sampling_rate
        self.max_seconds: float = self.feature_extractor.n_samples / self.sampling_rate

    @property
    def min_samples(self) -> int:
        """Fewest samples that give at least one audio token (3 mel frames: 321 at 16 kHz)."""
        return 2 * self.feature_extractor.hop_length + 1

    def features(self, clips: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(mel features [k, mels, 3000], valid frames per clip, audio tokens per clip).

        Clips longer than :attr:`max_seconds` are cut to it, as the feature extractor (and so
        vLLM) does; callers that must not lose audio refuse them first.

        Raises:
            ValueError: a clip is shorter than :attr:`min_samples`.
        """
        for index, clip in enumerate(clips):
            if len(clip) < self.min_samples:
                raise ValueError(f"clip {index} has {len(clip)} samples; at least {self.min_samples} give an audio token")
        features = self.feature_extractor(
            list(clips),
            sampling_rate=self.sampling_rate,
            # As Qwen2AudioProcessor (and vLLM through it) call it: fixed 30 s window, cut
            # beyond it, and the mask of valid frames.
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        feature_lengths = features["attention_mask"].sum(-1)
        token_counts = [self.family.audio_token_count(int(length)) for length in feature_lengths]
        return features["input_features"], feature_lengths, token_counts

    def checked_samples(self, modality: Modality, clips: Sequence[DecodedAudio]) -> list[np.ndarray]:
        """The samples of decoded clips, checked to be audio at the extractor's rate.

        Raises:
            ValueError: an item is not audio, or not at the feature extractor's rate.
        """
        if modality is not Modality.AUDIO:
            raise ValueError(f"{self.family.model_type} encodes audio only, not {modality.value}")
        for index, clip in enumerate(clips):
            if clip.sample_rate != self.sampling_rate:
                raise ValueError(f"clip {index} is at {clip.sample_rate} Hz; the feature extractor needs {self.sampling_rate} Hz")
        return [clip.samples for clip in clips]

    def layout(self, modality: Modality, clips: Sequence[DecodedAudio]) -> list[Encoding]:
        """What the feature extractor says about each clip's place in the prompt."""
        _, lengths, counts = self.features(self.checked_samples(modality, clips))
        return [Encoding(None, audio_feature_length=int(length), audio_token_count=count) for length, count in zip(lengths, counts, strict=True)]


class AudioEncoder:
    """Runs one Qwen2-Audio checkpoint's feature extractor, audio tower and projector, and
    nothing else. Only those tensors are read from disk (see :mod:`epd.weights`).

    The computation is vLLM's own for raw audio, so the embeddings it hands over equal the
    ones a monolithic engine computes internally: every clip padded to the 30 s window with a
    mask of its valid frames, the padded conv frames masked out of attention with ``-inf``, and
    only the valid rows kept.
    """

    def __init__(self, model_dir: str | pathlib.Path, *, dtype: str = "float32"):
        import torch
        from transformers import AutoConfig
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder, Qwen2AudioMultiModalProjector

        from epd.weights import load_tensors

        self.model_dir = pathlib.Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.family = Qwen2AudioFamily.from_config(config.to_dict())
        self.processors = AudioProcessors(self.model_dir, self.family)
        self.dtype = getattr(torch, dtype)
        # The same classes vLLM instantiates, so the same attention kernel runs.
        self.tower = Qwen2AudioEncoder(config.audio_config).to(self.dtype).eval()
        self.projector = Qwen2AudioMultiModalProjector(config).to(self.dtype).eval()
        state, self.load_report = load_tensors(self.model_dir, _AUDIO_PREFIXES)
        # load_tensors strips either prefix; the projector's names ("linear.*") are its own.
        projector_state = {name: state.pop(name) for name in self.projector.state_dict() if name in state}
        for module, part, weights in ((self.tower, "audio tower", state), (self.projector, "projector", projector_state)):
            missing, unexpected = module.load_state_dict(weights, strict=False)
            if missing or unexpected:
                raise ValueError(f"{part} weights do not fit: missing={missing[:5]} unexpected={unexpected[:5]}")

    def encode(self, modality: Modality, clips: Sequence[DecodedAudio]) -> list[Encoding]:
        """Runs the feature extractor and the tower over a batch of decoded clips, in order.

        Raises:
            ValueError: an item is not audio, not at the feature extractor's rate, or too
                short for one token.
        """
        return self.encode_clips(self.processors.checked_samples(modality, clips))

    def encode_clips(self, clips: Sequence[np.ndarray]) -> list[Encoding]:
        """Runs the feature extractor and the tower over mono float32 clips at the extractor's
        rate; one :class:`Encoding` per clip, in order (see :meth:`AudioProcessors.features`)."""
        import torch

        mel, feature_lengths, token_counts = self.processors.features(clips)
        mel = mel.to(self.dtype)
        conv_lengths = (feature_lengths - 1) // 2 + 1
        conv_frames = (mel.shape[-1] - 2) // 2 + 1
        # Additive mask over keys: 0 for a clip's valid conv frames, -inf for its padding.
        padded = torch.arange(conv_frames)[None, :] >= conv_lengths[:, None]
        mask = torch.zeros(padded.shape, dtype=self.dtype).masked_fill(padded, float("-inf"))
        mask = mask[:, None, None, :].expand(-1, 1, conv_frames, -1)
        with torch.inference_mode():
            hidden = self.tower(mel, attention_mask=mask).last_hidden_state
            embeddings = self.projector(hidden)
        return [
            Encoding(embedding=embeddings[i, :count].contiguous(), audio_feature_length=int(length), audio_token_count=count)
            for i, (length, count) in enumerate(zip(feature_lengths, token_counts, strict=True))
        ]

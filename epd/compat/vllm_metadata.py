"""A model-specific fix: vLLM 0.32 forgets ``second_per_grid_ts`` for the video
of Qwen2.5-VL and Qwen2.5-Omni when the video arrives metadata-only.

Their M-RoPE spaces a video's temporal positions by ``second_per_grid_ts`` (seconds per temporal
patch group, ``temporal_patch_size / sampled fps``), which the processor computes from the
media. On an EC or KV consumer the media is gone, and vLLM's data parsers declare only
``video_grid_thw`` as the video's placeholder metadata, so the producer never publishes the
value and the consumer falls back to 1.0 s. Tokens then differ from a monolithic run for any
video whose sampled rate is not exactly half its patch size (most clips). Both models also parse
metadata-only video with Qwen2-VL's parsing, which drops the field altogether.

This module declares the field as metadata on both parsers, as vLLM does for Qwen3-VL's
``timestamps``, and keeps it in their metadata-only video items, so that an encoder publishes it
and consumers require and keep it. Remove it once vLLM declares the field itself.

It must run in every process where vLLM parses multimodal inputs or publishes their metadata:
our services call :func:`install` before they build an engine, and the EC connector module (which
vLLM imports in its engine processes) calls it on import.
"""

from __future__ import annotations

import functools

_FIELD = "second_per_grid_ts"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import qwen2_5_omni_thinker, qwen2_5_vl
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser, _create_qwen2vl_field_factory
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import DictEmbeddingItems

    def parse_video_data(self, data):
        """Qwen2-VL's parsing, with a place in metadata-only items for every declared field
        Qwen2-VL's lacks (this one; a subclass's own, see :mod:`.vllm_qwen3_omni_vision`)."""
        if not isinstance(data, dict):
            return Qwen2VLMultiModalDataParser._parse_video_data(self, data)
        fields_of = _create_qwen2vl_field_factory(self._spatial_merge_size)
        required, optional = self.embedding_field_sets("video")

        def fields_factory(hf_inputs):
            per_item = {name: MultiModalFieldConfig.batched("video", keep_on_cpu=True) for name in required | optional}
            return {**per_item, **fields_of(hf_inputs)}  # Qwen2-VL's own fields keep their configs

        return DictEmbeddingItems(data, modality="video", required_fields=required, optional_fields=optional, fields_factory=fields_factory)

    def declaring(parser: type) -> dict:
        return {**parser.embedding_fields, "video": {**parser.embedding_fields["video"], _FIELD: "metadata"}}

    # Qwen2.5-VL shares Qwen2-VL's parser: it gets one of its own.
    qwen2_5_vl_parser = type(
        "Qwen2_5_VLDataParser",
        (Qwen2VLMultiModalDataParser,),
        {"embedding_fields": declaring(Qwen2VLMultiModalDataParser), "_parse_video_data": parse_video_data},
    )

    def get_data_parser(self):
        return qwen2_5_vl_parser(
            self.get_hf_config().vision_config.spatial_merge_size,
            video_needs_metadata=True,
            expected_hidden_size=self._get_expected_hidden_size(),
            allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
        )

    qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_data_parser = get_data_parser
    omni_parser = qwen2_5_omni_thinker.Qwen2_5OmniThinkerMultiModalDataParser
    omni_parser.embedding_fields = declaring(omni_parser)
    omni_parser._parse_video_data = parse_video_data

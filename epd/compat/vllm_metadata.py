"""The one model-specific piece of EPD: vLLM 0.32 forgets ``second_per_grid_ts`` for the video
of Qwen2.5-VL and Qwen2.5-Omni when the video arrives metadata-only.

Their M-RoPE spaces a video's temporal positions by ``second_per_grid_ts`` (seconds per temporal
patch group, ``temporal_patch_size / sampled fps``), which the processor computes from the
media. On an EC or KV consumer the media is gone, and vLLM's data parsers declare only
``video_grid_thw`` as the video's placeholder metadata, so the producer never publishes the
value and the consumer falls back to 1.0 s. Tokens then differ from a monolithic run for any
video whose sampled rate is not exactly half its patch size (most clips). Both models also parse
metadata-only video with Qwen2-VL's field factory, which drops the field altogether.

This module declares the field as metadata on both parsers, as vLLM does for Qwen3-VL's
``timestamps``, so that an encoder publishes it and consumers require and keep it. Nothing else
in EPD names a model. Remove it once vLLM declares the field itself.

It must run in every process where vLLM parses multimodal inputs or publishes their metadata:
our services call :func:`install` before they build an engine, and the EC connector module (which
vLLM imports in its engine processes) calls it on import.
"""

from __future__ import annotations

import functools

_FIELD = "second_per_grid_ts"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import qwen2_5_omni_thinker, qwen2_5_vl, qwen2_vl
    from vllm.multimodal.inputs import MultiModalFieldConfig

    # Both models parse metadata-only video through Qwen2-VL's field factory, which drops the
    # field; give it a place there (unused where nothing supplies it).
    base_factory = qwen2_vl._create_qwen2vl_field_factory

    def field_factory(spatial_merge_size: int):
        fields_of = base_factory(spatial_merge_size)
        return lambda hf_inputs: {**fields_of(hf_inputs), _FIELD: MultiModalFieldConfig.batched("video", keep_on_cpu=True)}

    qwen2_vl._create_qwen2vl_field_factory = field_factory

    # Qwen2.5-VL shares Qwen2-VL's parser: declare the field on a parser of its own.
    parser = qwen2_vl.Qwen2VLMultiModalDataParser
    qwen2_5_vl_parser = type(
        "Qwen2_5_VLDataParser", (parser,), {"embedding_fields": {**parser.embedding_fields, "video": {**parser.embedding_fields["video"], _FIELD: "metadata"}}}
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
    omni_parser.embedding_fields = {**omni_parser.embedding_fields, "video": {**omni_parser.embedding_fields["video"], _FIELD: "metadata"}}

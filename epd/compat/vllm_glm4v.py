"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for GLM-4.1V's images
and videos (its processor info builds a plain ``MultiModalDataParser``), so without it prefill
and decode receive every item (EPD's declared fallback).

GLM-4.1V's tower takes Qwen2-VL's patch grids. vLLM's GLM processor lays an image out from its
processed ``image_grid_thw`` alone: declaring that field, with Qwen2-VL's parsing of a
metadata-only image, is all an image needs. A video's placeholder also holds each frame group's
timestamp, which vLLM computes from the video's sampling (``_construct_video_placeholder``: the
source rate, frame count and duration, the sampled frames' indices). Those inputs are published
here as the video's metadata, beside ``video_grid_thw``: the encoder's processor adds them to its
outputs, and a consumer hands them back to vLLM's own placeholder construction, with no frames.

Applies to the models that share GLM-4.1V's processor (GLM-4.5V, GLM-OCR). Remove once vLLM
declares these fields. Installed with the other fixes (:func:`epd.compat.install_vllm_fixes`), in
every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

# The video's sampling, as vLLM's GLM processor reads it from the video's metadata (with the
# dtypes it is published in), under ``video_<key>``; ``video_num_frames``: the frames vLLM was given.
_SAMPLING = {"fps": "float64", "total_num_frames": "int64", "duration": "float64", "do_sample_frames": "bool", "frames_indices": "int64"}
_FIELDS = ("video_num_frames", *(f"video_{key}" for key in _SAMPLING))


@functools.cache
def install() -> None:
    import numpy as np
    import torch
    from vllm.model_executor.models import glm4_1v
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser, _create_qwen2vl_field_factory
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import DictEmbeddingItems, VideoProcessorItems
    from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails

    def sampling_fields() -> dict:
        return {name: MultiModalFieldConfig.batched("video", keep_on_cpu=True) for name in _FIELDS}

    class Glm4vDataParser(Qwen2VLMultiModalDataParser):
        embedding_fields = {
            "image": Qwen2VLMultiModalDataParser.embedding_fields["image"],
            "video": {**Qwen2VLMultiModalDataParser.embedding_fields["video"], **dict.fromkeys(_FIELDS, "metadata")},
        }

        def _parse_video_data(self, data):
            if not isinstance(data, dict):
                return super()._parse_video_data(data)
            required, optional = self.embedding_field_sets("video")
            grids = _create_qwen2vl_field_factory(self._spatial_merge_size)
            return DictEmbeddingItems(
                data, modality="video", required_fields=required, optional_fields=optional, fields_factory=lambda inputs: {**sampling_fields(), **grids(inputs)}
            )

    def get_data_parser(self):
        return Glm4vDataParser(
            self.get_hf_config().vision_config.spatial_merge_size,
            video_needs_metadata=True,
            expected_hidden_size=self._get_expected_hidden_size(),
            allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
        )

    processor_class = glm4_1v.Glm4vMultiModalProcessor
    vllm_apply = processor_class._apply_hf_processor_main
    vllm_fields = processor_class._get_mm_fields_config
    vllm_prompt_updates = processor_class._get_prompt_updates

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        """vLLM's processing, plus each video's sampling as the video's own fields."""
        processed = vllm_apply(self, mm_items, hf_kwargs)
        videos = mm_items.get("video")
        if isinstance(videos, VideoProcessorItems):
            sampled = [videos[index] for index in range(videos.get_count())]
            processed["video_num_frames"] = torch.tensor([len(frames) for frames, _ in sampled])
            for key, dtype_name in _SAMPLING.items():
                values = [metadata.get(key, []) if key == "frames_indices" else metadata[key] for _, metadata in sampled]
                # Exact values: a rate rounded to float32 would move the timestamps vLLM derives.
                dtype = getattr(torch, dtype_name)
                processed[f"video_{key}"] = [torch.tensor(v, dtype=dtype) for v in values] if key == "frames_indices" else torch.tensor(values, dtype=dtype)
        return processed

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        fields = dict(vllm_fields(self, hf_inputs, hf_processor_mm_kwargs))
        if "video_num_frames" in hf_inputs:
            fields |= sampling_fields()
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        """vLLM's replacements; for metadata-only videos, vLLM's own placeholder built from the
        published sampling instead of the frames."""
        updates = vllm_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        if not isinstance(mm_items.get("video"), DictEmbeddingItems):
            return updates
        image_token_id = self.info.get_hf_processor(**hf_processor_mm_kwargs).image_token_id

        def replacement(index: int):
            item = out_mm_kwargs["video"][index]
            metadata = {key: item[f"video_{key}"].data.tolist() for key in _SAMPLING}
            frames = np.empty(int(item["video_num_frames"].data))  # only its length is read
            placeholder = self.info._construct_video_placeholder(frames, metadata, item["video_grid_thw"].data)
            return PromptUpdateDetails.select_token_id(placeholder, embed_token_id=image_token_id)

        video = next(update for update in updates if update.modality == "video")
        return [*(update for update in updates if update.modality != "video"), PromptReplacement(modality="video", target=video.target, replacement=replacement)]

    glm4_1v.Glm4vProcessingInfo.get_data_parser = get_data_parser
    processor_class._apply_hf_processor_main = _apply_hf_processor_main
    processor_class._get_mm_fields_config = _get_mm_fields_config
    processor_class._get_prompt_updates = _get_prompt_updates

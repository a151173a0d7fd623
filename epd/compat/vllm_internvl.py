"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for InternVL's
(transformers-format InternVL 3, served by vLLM's InternS1 model) images and videos, so without it
prefill and decode receive every item (EPD's declared fallback).

An InternVL item's place in the prompt is its tile count alone: an image is ``<img>``, a fixed
number of context tokens per tile (the tiles its aspect ratio gives, plus a thumbnail), then
``</img>``; a video is one such block per frame, each after a "FrameN:" label. vLLM's processor
records the counts as ``image_num_patches`` and ``video_num_patches``; declared here as the items'
metadata, the encoder publishes them and a consumer lays the items out from them. vLLM's video
replacement reads only the count already; its image replacement asks the items for their size,
which a metadata-only image does not have, so for those it is built here from the count, as
vLLM builds it.

Remove once vLLM declares these fields. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), in every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools


@functools.cache
def install() -> None:
    from vllm.model_executor.models import interns1
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import DictEmbeddingItems, MultiModalDataParser
    from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails

    def counted(modality: str):
        def fields(_data):
            return {f"{modality}_embeds": MultiModalFieldConfig.batched(modality), f"{modality}_num_patches": MultiModalFieldConfig.batched(modality, keep_on_cpu=True)}

        return fields

    class InternVLDataParser(MultiModalDataParser):
        embedding_fields = {
            "image": {"image_embeds": "values", "image_num_patches": "metadata"},
            "video": {"video_embeds": "values", "video_num_patches": "metadata"},
        }

        def _items(self, data, modality: str):
            required, optional = self.embedding_field_sets(modality)
            return DictEmbeddingItems(data, modality=modality, required_fields=required, optional_fields=optional, fields_factory=counted(modality))

        def _parse_image_data(self, data):
            return self._items(data, "image") if isinstance(data, dict) else super()._parse_image_data(data)

        def _parse_video_data(self, data):
            return self._items(data, "video") if isinstance(data, dict) else super()._parse_video_data(data)

    def get_data_parser(self):
        return InternVLDataParser(expected_hidden_size=self._get_expected_hidden_size(), allow_missing_mm_embeddings=self.allow_missing_mm_embeddings)

    processor_class = interns1.InternS1MultiModalProcessor
    vllm_prompt_updates = processor_class._get_prompt_updates

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = vllm_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        if not isinstance(mm_items.get("image"), DictEmbeddingItems):
            return updates
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        tokenizer = self.info.get_tokenizer()
        tiles = out_mm_kwargs.get_data()["image_num_patches"].tolist()

        def replacement(index: int):
            context = processor.image_token * (tiles[index] * processor.image_seq_length)
            ids = tokenizer.encode(processor.start_image_token + context + processor.end_image_token, add_special_tokens=False)
            return PromptUpdateDetails.select_token_id(ids, processor.image_token_id)

        image = PromptReplacement(modality="image", target=[processor.image_token_id], replacement=replacement)
        return [image, *(update for update in updates if update.modality != "image")]

    interns1.InternS1ProcessingInfo.get_data_parser = get_data_parser
    processor_class._get_prompt_updates = _get_prompt_updates

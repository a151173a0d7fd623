"""What the declarations of models that lay an image out from its size share (LLaVA-NeXT,
Mistral 3, Idefics3, Gemma 3): the parser that takes metadata-only images with that one field, the
field's configuration, where vLLM's processor does not output the size its recording, and the
prompt update that lays a metadata-only image out from the size with vLLM's own counting."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def metadata_field(name: str) -> dict[str, Any]:
    """The configuration of an image's metadata field: one value per image, kept on the CPU."""
    from vllm.multimodal.inputs import MultiModalFieldConfig

    return {name: MultiModalFieldConfig.batched("image", keep_on_cpu=True)}


def install_image_metadata_parser(info_class: type, field: str, *, subclasses: bool) -> None:
    """Makes ``info_class`` (and its subclasses, where ``subclasses``: those that lay images out
    alike) parse metadata-only images: ``image_embeds`` (optional where an EC connector brings
    them) and ``field``, the item's metadata, which lays the image out."""
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import DictEmbeddingItems, MultiModalDataParser

    def fields(_data) -> dict[str, Any]:
        return {"image_embeds": MultiModalFieldConfig.batched("image"), **metadata_field(field)}

    class ImageMetadataParser(MultiModalDataParser):
        embedding_fields = {"image": {"image_embeds": "values", field: "metadata"}}

        def _parse_image_data(self, data):
            if not isinstance(data, dict):
                return super()._parse_image_data(data)
            required, optional = self.embedding_field_sets("image")
            return DictEmbeddingItems(data, modality="image", required_fields=required, optional_fields=optional, fields_factory=fields)

    vllm_data_parser = info_class.get_data_parser

    def get_data_parser(self):
        if not subclasses and type(self) is not info_class:
            return vllm_data_parser(self)
        return ImageMetadataParser(expected_hidden_size=self._get_expected_hidden_size(), allow_missing_mm_embeddings=self.allow_missing_mm_embeddings)

    info_class.get_data_parser = get_data_parser


def record_original_sizes(processor_class: type, field: str) -> None:
    """Makes vLLM's processing with ``processor_class`` also output each image's original size
    (height, width) as ``field``, one of the image's fields: for models whose layout vLLM derives
    from that size, which its processor otherwise knows only while it holds the pixels."""
    import torch
    from vllm.multimodal.parse import ImageProcessorItems

    vllm_postprocess = processor_class._postprocess_hf_mm_data
    vllm_fields = processor_class._get_mm_fields_config

    def _postprocess_hf_mm_data(self, mm_data, hf_processor_mm_kwargs, processed_data):
        processed = vllm_postprocess(self, mm_data, hf_processor_mm_kwargs, processed_data)
        if mm_data and mm_data.get("images") is not None:
            images = self.info.parse_mm_data({"image": mm_data["images"]}, validate=False).get_items("image", ImageProcessorItems)
            sizes = [images.get_image_size(index) for index in range(len(images))]
            processed[field] = torch.tensor([[size.height, size.width] for size in sizes])
        return processed

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        fields = dict(vllm_fields(self, hf_inputs, hf_processor_mm_kwargs))
        return fields | metadata_field(field) if field in hf_inputs else fields

    processor_class._postprocess_hf_mm_data = _postprocess_hf_mm_data
    processor_class._get_mm_fields_config = _get_mm_fields_config


def install_size_replacement(processor_class: type, field: str, layout: Callable[[Any, Mapping[str, object]], tuple[list[int], Callable[[int, int], Any]]]) -> None:
    """Keeps vLLM's prompt update of ``processor_class`` for images it processed; a metadata-only
    image's ``field`` (height, width) is handed to the model's own layout instead of its pixels.

    ``layout(processor, hf_processor_mm_kwargs)`` gives the target tokens and the replacement for
    an image of a given (width, height), built by vLLM's own counting for the model.
    """
    from vllm.multimodal.parse import DictEmbeddingItems
    from vllm.multimodal.processing import PromptReplacement

    vllm_prompt_updates = processor_class._get_prompt_updates

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        if not isinstance(mm_items.get("image"), DictEmbeddingItems):
            return vllm_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        target, for_size = layout(self, hf_processor_mm_kwargs)

        def replacement(index: int):
            height, width = out_mm_kwargs["image"][index][field].data.tolist()
            return for_size(width, height)

        return [PromptReplacement(modality="image", target=target, replacement=replacement)]

    processor_class._get_prompt_updates = _get_prompt_updates

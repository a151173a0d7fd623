"""What the declarations of models that lay an image out from one metadata field share
(LLaVA-NeXT, Mistral 3, Idefics3): the parser that takes metadata-only images, and the field's
configuration."""

from __future__ import annotations

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

"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for GLM-4.1V's images
(its processor info builds a plain ``MultiModalDataParser``), so without it prefill and decode
receive every image (EPD's declared fallback).

GLM-4.1V's tower takes Qwen2-VL's patch grids, and vLLM's GLM processor already lays an image out
from its processed ``image_grid_thw`` alone: declaring that field as the image's metadata, with
Qwen2-VL's parsing of a metadata-only image, is all a consumer needs. Video is left undeclared:
vLLM builds a GLM video's placeholder from each frame's timestamp, which it computes from the
media (``_construct_video_placeholder``), so a video still takes the fallback.

Applies to the models that share GLM-4.1V's processor info (GLM-4.5V, GLM-OCR). Remove once vLLM
declares the field. Installed with the other fixes (:func:`epd.compat.install_vllm_fixes`), in
every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools


@functools.cache
def install() -> None:
    from vllm.model_executor.models import glm4_1v
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser

    class Glm4vDataParser(Qwen2VLMultiModalDataParser):
        embedding_fields = {"image": Qwen2VLMultiModalDataParser.embedding_fields["image"]}

    def get_data_parser(self):
        return Glm4vDataParser(
            self.get_hf_config().vision_config.spatial_merge_size,
            video_needs_metadata=True,
            expected_hidden_size=self._get_expected_hidden_size(),
            allow_missing_mm_embeddings=self.allow_missing_mm_embeddings,
        )

    glm4_1v.Glm4vProcessingInfo.get_data_parser = get_data_parser

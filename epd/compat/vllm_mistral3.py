"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for Mistral 3's images
(its processor info builds a plain ``MultiModalDataParser``), so without it prefill and decode
receive every image (EPD's declared fallback) and run its processor, though they never run the
tower.

Pixtral's tower takes an image at its own aspect ratio: the processor fits it within the longest
edge and rounds each side up to whole patches, and the prompt holds one ``[IMG]`` per merged
feature, an ``[IMG_BREAK]`` closing each row and ``[IMG_END]`` the last. The layout depends on the
processed size alone, which transformers' processor returns as ``image_sizes`` (height and width
in pixels) and vLLM uses only to crop the padding off each image. Declared here, the encoder
publishes it per item, and a consumer lays the item out from it with vLLM's own grid
(``Mistral3HFEncoderInfo.get_patch_grid_size``, which leaves a size already within the edge
as it is), with no pixels.

Remove once vLLM declares the field. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), in every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

from epd.compat.image_layout import install_image_metadata_parser, install_size_replacement, metadata_field

_SIZES = "image_sizes"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import mistral3
    from vllm.multimodal.processing import PromptUpdateDetails

    install_image_metadata_parser(mistral3.Mistral3ProcessingInfo, _SIZES, subclasses=False)
    processor_class = mistral3.Mistral3MultiModalProcessor
    vllm_fields = processor_class._get_mm_fields_config

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        """vLLM's fields, plus the processed size it otherwise drops once it has cropped."""
        fields = dict(vllm_fields(self, hf_inputs, hf_processor_mm_kwargs))
        return fields | metadata_field(_SIZES) if _SIZES in hf_inputs else fields

    def layout(self, hf_processor_mm_kwargs):
        """vLLM's tokens for the grid of the processed size."""
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        vocab = self.info.get_tokenizer().get_vocab()
        image_token_id = self.info.get_hf_config().image_token_index
        break_id, end_id = vocab[processor.image_break_token], vocab[processor.image_end_token]
        encoder_info = self.info.get_vision_encoder_info(hf_processor_mm_kwargs)

        def for_size(width: int, height: int):
            ncols, nrows = encoder_info.get_patch_grid_size(image_width=width, image_height=height)
            tokens = ([image_token_id] * ncols + [break_id]) * nrows
            tokens[-1] = end_id
            return PromptUpdateDetails.select_token_id(tokens, image_token_id)

        return [image_token_id], for_size

    processor_class._get_mm_fields_config = _get_mm_fields_config
    install_size_replacement(processor_class, _SIZES, layout)

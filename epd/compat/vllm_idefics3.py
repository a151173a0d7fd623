"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for Idefics3's images
(nor SmolVLM's, which shares its processing), so without it prefill and decode receive every
image (EPD's declared fallback) and run its processor, though they never run the tower.

Idefics3 cuts an image into a grid of tiles by its size, and the prompt names every tile's row
and column (``<row_1_col_2>``) before its features, then the whole image's. vLLM builds that text
from the image's original size alone (``Idefics3ProcessingInfo.get_image_repl``), which its
processor knows only while it holds the pixels. So the encoder's processor adds the original
size to its outputs as ``image_sizes`` (height, width), the item's metadata, and a consumer hands
it back to vLLM's own ``get_image_repl``, with no pixels.

Remove once vLLM declares the field. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), in every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

from epd.compat.image_layout import install_image_metadata_parser, install_size_replacement, record_original_sizes

_SIZES = "image_sizes"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import idefics3
    from vllm.multimodal.processing import PromptUpdateDetails, cached_encode

    # SmolVLM's processing info subclasses Idefics3's and lays images out alike.
    install_image_metadata_parser(idefics3.Idefics3ProcessingInfo, _SIZES, subclasses=True)
    processor_class = idefics3.Idefics3MultiModalProcessor
    record_original_sizes(processor_class, _SIZES)

    def layout(self, hf_processor_mm_kwargs):
        """vLLM's own text for an image of the size."""
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        tokenizer = self.info.get_tokenizer()

        def for_size(width: int, height: int):
            text = self.info.get_image_repl(image_width=width, image_height=height, processor=processor, mm_kwargs=hf_processor_mm_kwargs)
            return PromptUpdateDetails.select_token_id(cached_encode(tokenizer, text, add_special_tokens=False), processor.image_token_id)

        return [processor.image_token_id], for_size

    install_size_replacement(processor_class, _SIZES, layout)

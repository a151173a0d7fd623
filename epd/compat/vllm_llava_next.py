"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for LLaVA-NeXT's
images, so without it prefill and decode receive every image (EPD's declared fallback) and run
its processor, though they never run the tower.

Where an image sits in the prompt depends on its size alone: the processor resizes it onto the
best tile grid and counts the tower features that survive unpadding, plus one newline per row
of them. ``image_sizes`` (the original height and width, a processor output) is therefore the
item's metadata. Declared here, the encoder publishes it per item, and a consumer lays the item
out from it with vLLM's own count (``LlavaNextProcessingInfo.get_num_image_tokens``), with no
pixels.

Only LLaVA-NeXT itself gets it: the models built on its classes (LLaVA-OneVision, LLaVA-NeXT-
Video ...) lay their items out differently and keep vLLM's behaviour. Remove once vLLM declares
the field. Installed with the other fixes (:func:`epd.compat.install_vllm_fixes`), in every
process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

from epd.compat.image_layout import install_image_metadata_parser, install_size_replacement

_SIZES = "image_sizes"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import llava_next

    # The models built on LLaVA-NeXT's classes lay their items out otherwise.
    install_image_metadata_parser(llava_next.LlavaNextProcessingInfo, _SIZES, subclasses=False)

    def layout(self, hf_processor_mm_kwargs):
        """As many placeholders as vLLM counts for the size."""
        token = self.info.get_hf_config().image_token_index
        return [token], lambda width, height: [token] * self.info.get_num_image_tokens(image_width=width, image_height=height)

    install_size_replacement(llava_next.LlavaNextMultiModalProcessor, _SIZES, layout)

"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for Gemma 3's images
(its processor info builds a plain ``MultiModalDataParser``), so without it prefill and decode
receive every image (EPD's declared fallback) and run its processor, though they never run the
tower.

A Gemma 3 image is its soft tokens between ``<start_of_image>`` and ``<end_of_image>``, wrapped in
blank lines, and, where pan and scan is on, as many more as the crops vLLM counts from the image's
original size (``Gemma3ProcessingInfo.get_image_repl``). So the encoder's processor adds the
original size to its outputs as ``image_sizes`` (height, width), the item's metadata, and a
consumer hands it back to vLLM's own ``get_image_repl``, with no pixels. vLLM's merging of the
newlines around an image into single tokens runs on the finished prompt, as for pixels.

Remove once vLLM declares the field. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), in every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

from epd.compat.image_layout import install_image_metadata_parser, install_size_replacement, record_original_sizes

_SIZES = "image_sizes"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import gemma3_mm

    install_image_metadata_parser(gemma3_mm.Gemma3ProcessingInfo, _SIZES, subclasses=False)
    processor_class = gemma3_mm.Gemma3MultiModalProcessor
    record_original_sizes(processor_class, _SIZES)

    def layout(self, hf_processor_mm_kwargs):
        """vLLM's own replacement for an image of the size."""
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        boi_token_id = self.info.get_tokenizer().get_vocab()[processor.boi_token]

        def for_size(width: int, height: int):
            return self.info.get_image_repl(image_width=width, image_height=height, processor=processor, mm_kwargs=hf_processor_mm_kwargs)

        return [boi_token_id], for_size

    install_size_replacement(processor_class, _SIZES, layout)

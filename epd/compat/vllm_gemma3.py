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

from epd.compat.image_layout import install_image_metadata_parser, record_original_sizes

_SIZES = "image_sizes"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import gemma3_mm
    from vllm.multimodal.parse import DictEmbeddingItems
    from vllm.multimodal.processing import PromptReplacement

    install_image_metadata_parser(gemma3_mm.Gemma3ProcessingInfo, _SIZES, subclasses=False)
    processor_class = gemma3_mm.Gemma3MultiModalProcessor
    record_original_sizes(processor_class, _SIZES)
    vllm_prompt_updates = processor_class._get_prompt_updates

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        """vLLM's replacement for images it processed; for metadata-only ones, vLLM's own for an
        image of the recorded size."""
        if not isinstance(mm_items.get("image"), DictEmbeddingItems):
            return vllm_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        boi_token_id = self.info.get_tokenizer().get_vocab()[processor.boi_token]

        def replacement(index: int):
            height, width = out_mm_kwargs["image"][index][_SIZES].data.tolist()
            return self.info.get_image_repl(image_width=width, image_height=height, processor=processor, mm_kwargs=hf_processor_mm_kwargs)

        return [PromptReplacement(modality="image", target=[boi_token_id], replacement=replacement)]

    processor_class._get_prompt_updates = _get_prompt_updates

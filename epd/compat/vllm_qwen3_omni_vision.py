"""A model-specific declaration: vLLM 0.32 declares no metadata-only layout for Qwen3-Omni's image
and video ("Keep the existing raw-media fallback for vision inputs", in its thinker), so without
it prefill and decode receive those media (EPD's declared fallback).

Qwen3-Omni's vision path is Qwen2.5-Omni's: the same processor fields lay an item out
(``image_grid_thw``; ``video_grid_thw`` and ``second_per_grid_ts``, which
:mod:`epd.compat.vllm_metadata` declares for Qwen2.5-Omni). Its thinker also reads
``use_audio_in_video`` from every video item, as ``item["use_audio_in_video"]`` (Qwen2.5-Omni's
uses ``.get``), so a metadata-only video must carry it: it is declared as metadata too, the
encoder publishes it per item (False unless a request asks to interleave a video's audio) and a
consumer requires and keeps it.

Remove once vLLM declares these fields for Qwen3-Omni. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), in every process that parses multimodal inputs.
"""

from __future__ import annotations

import functools

_INTERLEAVE = "use_audio_in_video"


@functools.cache
def install() -> None:
    from vllm.model_executor.models import qwen2_5_omni_thinker, qwen3_omni_moe_thinker

    from epd.compat import vllm_metadata

    # Qwen2.5-Omni's video parsing (which Qwen3-Omni's parser inherits) with second_per_grid_ts,
    # and a place for every other declared video field.
    vllm_metadata.install()
    omni = qwen2_5_omni_thinker.Qwen2_5OmniThinkerMultiModalDataParser.embedding_fields
    qwen3_omni_moe_thinker.Qwen3OmniMoeThinkerMultiModalDataParser.embedding_fields = {**omni, "video": {**omni["video"], _INTERLEAVE: "metadata"}}

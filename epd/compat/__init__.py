"""Workarounds for third-party packaging problems, each confined to the install path that needs it."""


def install_vllm_fixes() -> None:
    """vLLM 0.32's omissions EPD fixes (each module says which, and when to remove it). Call it
    before an engine is built, in every process that builds or drives one."""
    from epd.compat import (
        vllm_continued_detokenizer,
        vllm_cpu_thread_warning,
        vllm_gemma3,
        vllm_glm4v,
        vllm_idefics3,
        vllm_internvl,
        vllm_llava_next,
        vllm_metadata,
        vllm_mistral3,
        vllm_qwen3_omni_vision,
        vllm_targeted_lm_names,
        vllm_tower_caches,
    )

    vllm_metadata.install()
    vllm_llava_next.install()
    vllm_glm4v.install()
    vllm_internvl.install()
    vllm_mistral3.install()
    vllm_idefics3.install()
    vllm_gemma3.install()
    vllm_qwen3_omni_vision.install()
    vllm_tower_caches.install()
    vllm_targeted_lm_names.install()
    vllm_cpu_thread_warning.install()
    vllm_continued_detokenizer.install()

"""A fix to vLLM 0.32's encoder-only loading for models that mark their language model by type
(``_mark_composite_model(language_targets=...)``: Idefics3, SmolVLM, and others).

In ``--mm-encoder-only`` mode vLLM replaces each targeted module with a ``StageMissingLayer``
placeholder while the model is built, then looks for the language model's names among the
modules that are still instances of the targets; the placeholders are not, so it records none.
With no names the loader cannot tell language-model shards from the tower's and reads every
safetensors shard (an Idefics3 encoder read 3 of 3 of the tiny checkpoint's shards instead of 2).
Here the names of placeholders standing for a target are recorded too, as they would be had
nothing been replaced.

Remove once vLLM records them itself. Installed with the other fixes
(:func:`epd.compat.install_vllm_fixes`), before any engine builds its model.
"""

from __future__ import annotations

import contextlib
import functools


@functools.cache
def install() -> None:
    from vllm.model_executor.models import utils

    vllm_collect_children = utils.collect_children

    @contextlib.contextmanager
    def collect_children(module, *, targets=None):
        with vllm_collect_children(module, targets=targets) as names:
            yield names
        if targets is not None:
            names.extend(
                name
                for name, child in module.named_modules()
                if isinstance(child, utils.StageMissingLayer) and isinstance(child.__dict__.get("module"), targets) and name not in names
            )

    utils.collect_children = collect_children

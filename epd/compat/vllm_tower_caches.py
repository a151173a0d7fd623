"""Bounds by bytes the per-grid tables that vLLM 0.32's Qwen vision towers cache.

Qwen2.5-VL's tower keeps each image grid's (t, h, w) rotary tables and window index
(``_rope_by_thw_cache``), and Qwen3-VL's its position ids (``_rot_pos_ids_cache``), in an LRU of
1024 grids, whatever their size. A grid's tables grow with its patches and the tower's head
size: the tiny test tower's are too small to show (`bench --only encoder_memory`), but a 7B
tower's are about 0.3 MiB for a 1024-patch image and megabytes for a video grid, so an encoder
seeing many distinct sizes would hold gigabytes before the count bound held. Here the same LRU
is bounded by the bytes of the tensors it holds,
``BUDGET_BYTES`` per tower, so an encoder's memory no longer depends on how many sizes it has
seen; an evicted grid's tables are recomputed (milliseconds, beside the tower's own work).

The caches are created in each tower's ``__init__`` from the name ``LRUCache`` in its model's
module, so :func:`install` rebinds that name; it must run before the model is built, in every
process that builds one (:func:`epd.compat.install_vllm_fixes`). Remove it once vLLM bounds
these caches by size.
"""

from __future__ import annotations

import functools

import torch

# Per tower cache: about 100 grids of a 7B tower's 1024-patch image (its cos and sin tables,
# about 0.3 MiB each), or every grid the tiny test tower sees in the soak.
BUDGET_BYTES = 32 * 2**20


def tensor_bytes(value: object) -> int:
    """Bytes of the tensors in a cached value: a tensor, or a tuple of them."""
    tensors = value if isinstance(value, tuple) else (value,)
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


@functools.cache
def install() -> None:
    from vllm.model_executor.models import qwen2_5_vl, qwen3_vl
    from vllm.utils.cache import LRUCache

    class BytesBoundedLRUCache(LRUCache):
        """vLLM's LRU, holding at most ``BUDGET_BYTES`` of tensors; the tower's grid count is
        ignored."""

        def __init__(self, capacity: float, getsizeof=None) -> None:
            super().__init__(BUDGET_BYTES, getsizeof or tensor_bytes)

        def __setitem__(self, key, value) -> None:
            if self.getsizeof(value) <= self.maxsize:  # a grid past the budget is not kept (cachetools would raise)
                super().__setitem__(key, value)

    for module in (qwen2_5_vl, qwen3_vl):
        module.LRUCache = BytesBoundedLRUCache

"""Lets PyPI's torchvision import beside a CPU-only torch build.

PyPI's torchvision wheels are built against CUDA torch. On ``torch+cpu`` their native
extension fails to load, and the pure-Python part then dies registering fake kernels for
``torchvision::nms`` / ``torchvision::qnms`` ("operator torchvision::nms does not exist").
vLLM's Qwen-VL model files and transformers' video processors import torchvision, so the
engine cannot start without it.

The CPU install (``scripts/install-cpu.sh``) drops a ``.pth`` file into the virtual
environment that calls :func:`install`. That registers an import hook which defines the two
operator schemas right before torchvision is first imported, in every process (vLLM's engine
core subprocesses included). The pure-Python transforms then work; the detection ops stay
unavailable, which nothing here uses. GPU installs never load this module.
"""

from __future__ import annotations

import importlib.abc
import sys

_MISSING_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor qdets, Tensor qscores, float iou_threshold) -> Tensor",
}


class _DefineOpsBeforeTorchvision(importlib.abc.MetaPathFinder):
    """Meta-path hook that runs once, on the first ``import torchvision``, then steps aside."""

    def find_spec(self, fullname, path, target=None):  # noqa: D102 - importlib protocol
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        _define_missing_schemas()
        return None  # let the regular finders locate torchvision itself


def _define_missing_schemas() -> None:
    import torch

    for qualname, schema in _MISSING_SCHEMAS.items():
        try:
            torch.library.define(qualname, schema)
        except RuntimeError:
            pass  # already defined (a working native extension got there first)


def install() -> None:
    """Registers the hook unless torchvision is already imported or the hook is present."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(f, _DefineOpsBeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _DefineOpsBeforeTorchvision())

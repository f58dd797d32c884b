"""sitecustomize.py for the pytest runs of scripts/vllm_scheduler_tests.py and every Python they start.

vLLM's Llava module imports transformers' Pixtral image processor, which imports
``torchvision.transforms.v2.functional`` (plain Python on torch). The torchvision wheels that PyPI
has for x86_64 Linux are CUDA builds: their compiled operators (``torchvision/_C.so``) link
``libtorch_cuda.so`` and ``libc10_cuda.so``, which a CPU build of torch does not have, so they do not
load. torchvision tolerates that (``torchvision.extension._has_ops()`` is False and its ops raise
"Couldn't load custom C++ ops" when called), except that ``torchvision/_meta_registrations.py``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking, and that
fails because the operators were never defined: ``import torchvision`` raises.

This file runs at interpreter start (the runner puts its folder first on PYTHONPATH, for its pytest
runs only; vLLM inspects model classes in a subprocess, which a conftest.py would not reach). It
watches for the import of ``torchvision._meta_registrations``; at that point, and only if
torchvision's compiled operators did not load, it defines those two operators' schemas with no
kernel, so torchvision imports. Nothing runs an operator without a kernel: ``torchvision.ops.nms``
still raises torchvision's own "Couldn't load custom C++ ops" first. Where the operators load (a
CPU build of torchvision), it does nothing. ``DECLARED`` lists what it defined (the conftest shows it).
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any

DECLARED: list[str] = []
# The two operators that torchvision/_meta_registrations.py registers fake kernels for whether or
# not its compiled library loaded; the argument names are those of its fake kernels.
_OPERATORS = ("nms", "qnms")
_SCHEMA = "{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
_LIBRARY: list[Any] = []  # a torch.library.Library drops its definitions when collected


class _DeclareBeforeMetaRegistrations(MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision._meta_registrations" and not _LIBRARY:
            import torch
            import torchvision.extension

            if not torchvision.extension._has_ops():
                lib = torch.library.Library("torchvision", "FRAGMENT")
                for name in _OPERATORS:
                    if not hasattr(torch.ops.torchvision, name):
                        lib.define(_SCHEMA.format(name=name))
                        DECLARED.append(f"torchvision::{name}")
                _LIBRARY.append(lib)
        return None  # the import itself goes on as usual


sys.meta_path.insert(0, _DeclareBeforeMetaRegistrations())

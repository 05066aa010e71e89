"""The kernels this process has loaded, by key, and the constant arguments their calls share.

``picompile.runtime.loader.load_kernels`` fills the table from an artifact's manifest ("kernels"); the
``picompile::tvm_*`` ops (``picompile.ir.ops``), the hybrid scheduler's CUDA partitions and the native C++ ops
look kernels up here with :func:`find_kernel`. Process-global on purpose: a kernel is the same compiled code
whichever artifact named it (its key is the hash of its spec), so two loaded artifacts share it.
"""
from __future__ import annotations

import torch
from torch import Tensor

KERNEL_TABLE: dict[str, object] = {}  # kernel key (KernelSpec.key()) -> loaded kernel (loader.SparseKernel)
_THRESHOLDS: dict[float, Tensor] = {}


def find_kernel(key: str) -> object | None:
    """The loaded kernel ``key``, or None when no loaded artifact named it (or it was skipped: CUDA, no GPU)."""
    return KERNEL_TABLE.get(key)


def add_kernel(key: str, kernel: object) -> None:
    """Make ``kernel`` the loaded kernel ``key`` (the runtime's kernel loader)."""
    KERNEL_TABLE[key] = kernel


def threshold_tensor(value: float) -> Tensor:
    """A predictor threshold as the float32 [1] tensor its kernel reads (one per value, made once)."""
    if value not in _THRESHOLDS:
        _THRESHOLDS[value] = torch.tensor([value], dtype=torch.float32)
    return _THRESHOLDS[value]

"""picompile.kernels: TVM-generated sparse FFN kernels (PowerInfer's operator contract).

Cheap to import: only ``spec`` is loaded eagerly; ``tvm`` (the compiler, 4-6 s) is imported only by
``build_kernel``, and loading/calling a kernel needs just the TVM runtime (see ``loader.py``).

Public API::

    KernelSpec(kind, act, d_model, n_rows, weight_dtype, has_bias, target)   # .key()
    build_kernel(spec, cache_dir) -> Path      # compile or reuse <cache_dir>/<key>.so
    load_kernel(path, spec) -> SparseKernel    # callable; see SparseKernel for the argument order
    aligned_empty(shape, dtype, device="cpu"), as_aligned(t), is_aligned(t)
    aligned_copies({name: t})                 # load time: every weight aligned, on huge pages
    validate_indices(idx, n_rows)              # once at load time, never per call
    dense_ffn(...)                             # torch fallback (prefill / reference)
    KERNEL_TABLE, find_kernel(key), add_kernel(key, k)   # this process's loaded kernels (``table.py``)
    set_num_threads(n), num_threads()          # the TVM runtime's CPU thread pool
"""
from __future__ import annotations

import importlib
from typing import Any

from .spec import KERNEL_ABI_VERSION, SCATTERED_ROW_COST, KernelSpec, KernelSpecError, skips_inactive

_LAZY: dict[str, str] = {
    "build_kernel": "cache",
    "build_count": "cache",
    "load_kernel": "loader",
    "SparseKernel": "loader",
    "aligned_empty": "loader",
    "as_aligned": "loader",
    "aligned_copies": "loader",
    "is_aligned": "loader",
    "validate_indices": "loader",
    "set_num_threads": "loader",
    "ensure_runtime": "loader",
    "physical_cores": "loader",
    "num_threads": "loader",
    "ALIGNMENT": "loader",
    "CALL_ARGS": "loader",
    "call_args": "loader",
    "KernelArgumentError": "loader",
    "IndexValidationError": "loader",
    "KernelLoadError": "loader",
    "dense_ffn": "fallback",
    "KERNEL_TABLE": "table",
    "find_kernel": "table",
    "add_kernel": "table",
    "threshold_tensor": "table",
}

__all__ = ["KERNEL_ABI_VERSION", "SCATTERED_ROW_COST", "KernelSpec", "KernelSpecError", "skips_inactive", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

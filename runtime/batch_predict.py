"""The activation predictors of several sequences' decode tokens in two batched GEMVs instead of one predictor
kernel call per token.

``tvm_predict`` (one token: the ``predict`` kernel, ``mask = fc2 act(fc1 x) + offset > thr``) for B tokens:

    h      = act(fc1 · x_t)          # [B, rank]     (kind ``up``, act relu | none, ``<key>_batch``)
    scores = fc2 · h_t               # [B, n_rows]   (kind ``up``, act none)
    mask   = scores + offset > thr   # [B, n_rows] bool

each predictor row read once for all B. Every (row, token) dot product is computed by itself, in the same order
whatever B is, so a token's mask never depends on the others' (B = 1 in ``serve`` takes this same path). Its
floats are not the fused ``predict`` kernel's (another summation order), so ``serve``'s masks can differ from
``run``'s where a score is within rounding of the threshold, as its GEMVs already do (``runtime/batch.py``).
The two ``up`` kernels are compiled on this machine (or taken from the kernel cache) on first use.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from picompile.kernels.spec import dot_lanes

_DTYPES: dict[torch.dtype, str] = {torch.float16: "float16", torch.float32: "float32"}
_GEMV: dict[tuple[int, int, str, str], Any] = {}  # (n_rows, d, dtype, act) -> the up kernel


def gemv_kernel(n_rows: int, d: int, dtype: torch.dtype, act: str) -> Any:
    """The CPU ``up`` kernel over every row of a [n_rows, d] weight of ``dtype``, with ``act``; compiled or taken
    from the kernel cache on first use. Raises for a dtype the kernels do not take."""
    name = _DTYPES.get(dtype)
    if name is None:
        raise RuntimeError(f"no batched predictor kernel for {dtype} weights")
    key = (n_rows, d, name, act)
    if key not in _GEMV:
        from picompile.config import kernel_cache_dir
        from picompile.kernels import KernelSpec, build_kernel, load_kernel

        spec = KernelSpec(kind="up", act=act, d_model=d, n_rows=n_rows, weight_dtype=name,  # type: ignore[arg-type]
                          has_bias=False, target="llvm")
        _GEMV[key] = load_kernel(build_kernel(spec, kernel_cache_dir()), spec)
    return _GEMV[key]


_MULTI: dict[tuple[int, int, str, str, int], Any] = {}  # (n_rows, d, dtype, kind) -> the kernel, or None (none for it)


def multi_gemv_kernel(n_rows: int, d: int, dtype: torch.dtype, kind: str = "gemv", lanes: int = 0) -> Any:
    """The CPU ``gemv`` kernel (``kernels/batch_gemv.py``: several tokens, each row read once for all) over a
    [n_rows, d] weight of ``dtype``, compiled or taken from the kernel cache on first use; None where it has no
    schedule (quantized weights, d not a multiple of its lanes) or cannot be built here (no TVM compiler).
    ``kind="gemv_down"``: the several-token down kernel over a [n_rows, d] ``w_down_t`` instead. ``lanes``
    (``gemv``): accumulators per dot product (0: the kernel's 32; ``spec.dot_lanes``: a fused kernel's sums)."""
    name = _DTYPES.get(dtype)
    if name is None:
        return None
    lanes = 0 if lanes == 32 else lanes  # the default, under its old key
    key = (n_rows, d, name, kind, lanes)
    if key not in _MULTI:
        from picompile.config import kernel_cache_dir
        from picompile.kernels import KernelSpec, build_kernel, load_kernel

        try:
            spec = KernelSpec(kind=kind, act="none", d_model=d, n_rows=n_rows, weight_dtype=name,  # type: ignore[arg-type]
                              has_bias=False, target="llvm", lanes=lanes)
            _MULTI[key] = load_kernel(build_kernel(spec, kernel_cache_dir()), spec)
        except Exception:  # no compiler, or a shape it does not take: the callers keep their other kernels
            _MULTI[key] = None
    return _MULTI[key]


_ROWS: dict[int, Tensor] = {}


def _rows(n: int) -> Tensor:
    if n not in _ROWS:
        _ROWS[n] = torch.arange(n, dtype=torch.int32)
    return _ROWS[n]


def batched_predict(
    xs: Tensor | Sequence[Tensor],  # [B, ..., d_model] stacked, or B tensors [..., d_model], one token each
    fc1: Tensor,  # [rank, d_model]
    fc2: Tensor,  # [n_neurons, rank]
    threshold: float,
    act: str,  # between fc1 and fc2: "relu" | "none"
    offset: Optional[Tensor] = None,  # [n_neurons] float32
) -> Tensor | list[Tensor]:
    """B tokens' predicted masks (module docstring) → [B, ..., n_neurons] bool (stacked when ``xs`` is, else a
    list of B)."""
    from picompile.kernels import aligned_empty, as_aligned

    rank, d = fc1.shape
    n = fc2.shape[0]
    stacked = isinstance(xs, Tensor)
    b = int(xs.shape[0]) if stacked else len(xs)
    x = as_aligned(xs.reshape(b, d) if stacked else torch.cat([t.reshape(1, d) for t in xs]))  # [B, d_model]
    h = aligned_empty((b, rank))  # [B, rank]
    scores = aligned_empty((b, n))  # [B, n_neurons]
    # the predict kernel's accumulators per dot product (kernels/cpu.py), so each score is its score bit for bit
    k1 = multi_gemv_kernel(rank, d, fc1.dtype, lanes=dot_lanes(d, _DTYPES.get(fc1.dtype, "")))
    k2 = multi_gemv_kernel(n, rank, fc2.dtype, lanes=dot_lanes(rank, _DTYPES.get(fc2.dtype, "")))
    if k1 is not None and k2 is not None:  # each predictor row read once for all B (kernels/batch_gemv.py)
        k1.unchecked(x, fc1, _rows(rank), h)
        if act == "relu":
            h.relu_()
        k2.unchecked(h, fc2, _rows(n), scores)
    else:
        gemv_kernel(rank, d, fc1.dtype, act).unchecked(x, fc1, None, None, _rows(rank), h)
        gemv_kernel(n, rank, fc2.dtype, "none").unchecked(h, fc2, None, None, _rows(n), scores)
    if offset is not None:
        scores += offset
    mask = scores > threshold  # [B, n_neurons]
    if stacked:
        return mask.reshape(*xs.shape[:-1], n)
    return [mask[i].reshape(*xs[i].shape[:-1], n) for i in range(b)]

"""torch fallbacks with the kernels' contract: prefill (many tokens) and a float64 reference.

``dense_ffn`` is the documented prefill path: for a long prompt the union of the tokens' active sets
approaches all rows, so gather + matmul (or plain matmuls with ``idx=None``) is faster than a sparse
kernel. The TVM libraries also hold a batched sparse variant (``<key>_batch``, x ``[t, d_model]``)
for a few tokens; on CUDA only the one-token kernel exists and prefill uses this fallback.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _act(name: str, v: torch.Tensor) -> torch.Tensor:
    if name in ("relu", "drelu"):  # dReLU: relu on the gate here, on the up branch in dense_ffn
        return torch.relu(v)
    if name == "silu":
        return F.silu(v)
    if name == "none":
        return v
    raise ValueError(f"unknown activation {name!r}")


def dense_ffn(
    x: torch.Tensor,  # [t, d_model] or [d_model]
    w_up: torch.Tensor,  # [n_rows, d_model]
    w_gate: torch.Tensor | None,  # [n_rows, d_model] (gated FFN) or None
    b_up: torch.Tensor | None,  # [n_rows] or None
    w_down_t: torch.Tensor,  # [n_rows, d_model]
    idx: torch.Tensor | None,  # int [k] active rows, or None for all rows
    act: str,
    compute_dtype: torch.dtype = torch.float32,
    b_gate: torch.Tensor | None = None,  # [n_rows] or None: the gate bias (gated FFN)
) -> torch.Tensor:  # [t, d_model] / [d_model] in compute_dtype, without b_down
    """``sum_j h[j] * w_down_t[idx[j]]`` with torch gather + matmuls (fp16 weights are upcast)."""
    if idx is not None:
        rows = idx.long()
        w_up = w_up.index_select(0, rows)  # [k, d_model]
        w_down_t = w_down_t.index_select(0, rows)  # [k, d_model]
        w_gate = w_gate.index_select(0, rows) if w_gate is not None else None
        b_up = b_up.index_select(0, rows) if b_up is not None else None
        b_gate = b_gate.index_select(0, rows) if b_gate is not None else None
    f = compute_dtype
    x = x.to(f)
    up = x @ w_up.to(f).t()  # [t, k]
    if b_up is not None:
        up = up + b_up.to(f)
    if w_gate is None:
        return _act(act, up) @ w_down_t.to(f)  # [t, d_model]
    g = x @ w_gate.to(f).t()  # [t, k]
    if b_gate is not None:
        g = g + b_gate.to(f)
    h = _act(act, g) * (torch.relu(up) if act == "drelu" else up)  # [t, k]
    return h @ w_down_t.to(f)  # [t, d_model]

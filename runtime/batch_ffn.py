"""The sparse FFN of several sequences' decode tokens in one pass over the union of their predicted neurons, each
token's output exactly what it is alone.

One FFN partition (hot or cold rows), B tokens, each with its own predicted mask:

    idx  = rows any token's mask selects (ascending)                          # [k] int32
    h    = act(w_gate[idx] · x_t) * (w_up[idx] · x_t + b_up[idx])              # [B, k]  (``<up>_batch``)
    h[t, j] = 0 where token t's mask does not select idx[j]                   # each token's own mask
    y_t  = Σ_j h[t, j] · w_down_t[idx[j]]   over the j where some h[:, j] ≠ 0  # [B, d]  (``<down>_batch``)

Each weight row read once for all B tokens. For float weights the dot products are ``gemv`` calls and the down
sums ``gemv_down`` (``kernels/batch_gemv.py``); a ReLU / dReLU gate is computed first and the up and down rows are
read only where some token that selects the row has a positive gate (``_gated_relu_rows``: the one-token kernel's
``skip_inactive``, for the batch). int8 / int4: the split ``up*`` / ``down`` kernels, two calls. The fused
``ffn_*`` kernel (one call) cannot be used: it has no per-token mask.

Every token's ``y`` is bit for bit what the fused one-token kernel gives it alone (``exact_union`` says where:
float weights, ReLU / dReLU), because each sum is formed as that kernel forms it:
  - a dot product in the fused kernel's accumulators (``spec.dot_lanes``: 32 for float16, 64 for float32), chunks
    in order, then the same halving tree; ``gemv`` takes that lane count;
  - the fused kernel cuts a token's k selected rows into ``parts`` (its build's cores) runs of ceil(k / parts),
    sums each run in ascending row order, then adds the runs' sums in order. ``_down_in_parts`` makes one
    ``gemv_down`` call per run index, each token's ``h`` zero outside its own run: a row of another token's run,
    or of none, adds an exact zero, and ``gemv_down`` adds rows one after the other in ascending order;
  - the activation (a max) and the bias add are the same float operations in torch as in the kernel.
Rows whose ``h`` is 0 for every token (ReLU gates that did not fire) are dropped before the down calls, as the
one-token kernel's ``skip_inactive`` does (``tests/test_serve_batch.py``). A row of two tokens' different runs is
read once per run index (+3.9 % of the down rows in a 4-token 1B step, benchmarks/README.md, serving).

The split kernels are not in the artifact: they are compiled on this machine from the fused kernel's spec
(kind ``up_gated`` / ``up`` and ``down``, same shapes and dtype; ~1 s each, then from the kernel cache), as the
runtime's kernel loader compiles every artifact kernel (``runtime/loader.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from picompile.kernels.spec import dot_lanes

_SPLIT: dict[str, tuple[Any, Any]] = {}  # fused kernel key -> (up kernel, down kernel)


def split_kernels(key: str) -> tuple[Any, Any]:
    """The (``up_gated`` | ``up``, ``down``) CPU kernels of the fused FFN kernel ``key`` (compiled or taken from
    the kernel cache on first use). Raises RuntimeError when ``key`` is not a loaded fused CPU kernel."""
    if key in _SPLIT:
        return _SPLIT[key]
    from picompile.kernels.table import find_kernel
    from picompile.runtime.loader import local_kernel

    fused = find_kernel(key)
    spec = getattr(fused, "spec", None)
    if spec is None or spec.is_cuda or spec.kind not in ("ffn_gated", "ffn_relu"):
        raise RuntimeError(f"kernel {key} is not a loaded fused CPU FFN kernel")
    up_spec = dataclasses.replace(spec, kind="up_gated" if spec.kind == "ffn_gated" else "up")
    down_spec = dataclasses.replace(spec, kind="down", act="none", has_bias=False)
    _SPLIT[key] = (local_kernel(up_spec), local_kernel(down_spec))
    return _SPLIT[key]


def _stack(xs: Tensor | Sequence[Tensor], width: int) -> Tensor:
    """B tokens' vectors as one [B, width] tensor: ``xs`` stacked already ([B, ..., width]) or a list of B."""
    if isinstance(xs, Tensor):
        return xs.reshape(-1, width)
    return torch.cat([t.reshape(1, width) for t in xs])


def _unstack(y: Tensor, xs: Tensor | Sequence[Tensor]) -> Tensor | list[Tensor]:
    """y [B, d] in the form of ``xs``: stacked like it, or a list of B tensors shaped like its items."""
    if isinstance(xs, Tensor):
        return y.reshape(xs.shape)
    return [y[i].reshape(xs[i].shape) for i in range(len(xs))]


def _batch_size(xs: Tensor | Sequence[Tensor]) -> int:
    return int(xs.shape[0]) if isinstance(xs, Tensor) else len(xs)


def batched_part(
    xs: Tensor | Sequence[Tensor],  # [B, ..., d_model] stacked, or B tensors [..., d_model], one token each
    w_up: Optional[Tensor],  # [k, d_model] (int8 / int4: quants); None or k = 0: no rows
    b_up: Optional[Tensor],  # [k]
    w_gate: Optional[Tensor],  # [k, d_model]
    w_down_t: Tensor,  # [k, d_model]
    masks: Tensor | Sequence[Optional[Tensor]],  # [B, ..., k] bool stacked, or B tensors (None: every row)
    kernel: str,  # the part's fused CPU kernel key ("" = no rows)
    s_up: Optional[Tensor] = None,  # [k, d_model / block] float16 scales (quantized weights)
    s_gate: Optional[Tensor] = None,
    s_down: Optional[Tensor] = None,
) -> Tensor | list[Tensor]:
    """One FFN partition for B tokens over the union of their masks, each token masked by its own (module
    docstring) → B outputs [..., d_model] (without b_down: the merge adds it), stacked when ``xs`` is."""
    from picompile.kernels import aligned_empty, as_aligned
    from picompile.runtime.batch_predict import multi_gemv_kernel

    if not kernel or w_up is None or w_up.shape[0] == 0:  # a part with no rows (all on the other device)
        return torch.zeros_like(xs) if isinstance(xs, Tensor) else [torch.zeros_like(x) for x in xs]
    d, n_rows, b = xs[0].shape[-1], w_up.shape[0], _batch_size(xs)
    up, down = split_kernels(kernel)
    x = as_aligned(_stack(xs, d))  # [B, d_model]
    if isinstance(masks, Tensor):
        sel = masks.reshape(b, n_rows)  # [B, n_rows]
    elif any(m is None for m in masks):
        sel = torch.ones((b, n_rows), dtype=torch.bool)
        for i, m in enumerate(masks):
            if m is not None:
                sel[i] = m.reshape(n_rows)
    else:
        sel = torch.cat([m.reshape(1, n_rows) for m in masks])  # type: ignore[union-attr]  # [B, n_rows]
    idx = sel.any(0).nonzero().squeeze(1).to(torch.int32)  # [k_union]
    lanes = dot_lanes(d, str(w_up.dtype).removeprefix("torch."))  # the fused kernel's accumulators per dot product
    gated = _gated_relu_rows(x, w_up, b_up, w_gate, idx, sel, up.spec, lanes) if s_up is None else None
    if gated is not None:  # only the rows whose gate fired for a token that selects them, h masked already
        idx, h = gated
    else:
        maybe = _up_by_gemv(x, w_up, b_up, w_gate, idx, up.spec, lanes) if s_up is None else None  # [B, k_union]
        if maybe is None:
            maybe = aligned_empty((b, idx.numel()))  # [B, k_union]
            if s_up is None:
                up.unchecked(x, w_up, w_gate, b_up, idx, maybe)
            else:
                up.unchecked(x, w_up, s_up, w_gate, s_gate, b_up, idx, maybe)
        h = maybe
        if b > 1:
            h.masked_fill_(~sel.index_select(1, idx), 0.0)  # each token's own neurons only
        live = h.ne(0).any(0)  # [k_union]: rows some token needs
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)  # [k_live]
            idx = idx.index_select(0, keep)
            h = as_aligned(h.index_select(1, keep))
    multi = multi_gemv_kernel(w_down_t.shape[0], d, w_down_t.dtype, "gemv_down") if s_down is None else None
    if multi is not None:  # each row read once for all B tokens (kernels/batch_gemv.py), in the fused kernel's parts
        return _unstack(_down_in_parts(multi, h, w_down_t, idx, sel, fused_parts(kernel)), xs)
    y = aligned_empty((b, d))  # [B, d_model]
    if s_down is None:
        down.unchecked(h, w_down_t, idx, y)
    else:
        down.unchecked(h, w_down_t, s_down, idx, y)
    return _unstack(y, xs)


def exact_union(key: str) -> bool:
    """Whether the union path gives every token of the part with fused CPU kernel ``key`` its one-token kernel's
    output bit for bit: float weights, a ReLU / dReLU FFN (a gated one without a gate bias: the activation is a
    max, computed alike in torch; SiLU's exp is not), and the ``gemv`` / ``gemv_down`` kernels for its shape
    (``kernels/batch_gemv.py``: d_model a multiple of the lanes and of 64). "" (a part with no rows): True."""
    from picompile.kernels.table import find_kernel
    from picompile.runtime.batch_predict import _DTYPES, multi_gemv_kernel

    if key == "":
        return True
    spec = getattr(find_kernel(key), "spec", None)
    if spec is None or spec.is_cuda or spec.quantized or spec.gate_bias:
        return False
    if not (spec.kind == "ffn_gated" and spec.act in ("relu", "drelu") or spec.kind == "ffn_relu" and spec.act == "relu"):
        return False
    dtype = next(t for t, name in _DTYPES.items() if name == spec.weight_dtype)
    lanes = dot_lanes(spec.d_model, spec.weight_dtype)
    return (multi_gemv_kernel(spec.n_rows, spec.d_model, dtype, lanes=lanes) is not None
            and multi_gemv_kernel(spec.n_rows, spec.d_model, dtype, "gemv_down") is not None)


def fused_parts(key: str) -> int:
    """The row parts of the fused one-token kernel ``key`` (recorded when it was built; older builds: this
    machine's cores, which is what they were built with here)."""
    from picompile.kernels.loader import physical_cores
    from picompile.kernels.table import find_kernel

    parts = getattr(find_kernel(key), "partitions", None)
    return parts if isinstance(parts, int) and parts > 0 else physical_cores()


def _down_in_parts(kern: Any, h: Tensor, w_down_t: Tensor, rows: Tensor, sel: Tensor, parts: int) -> Tensor:
    """``y[t] = Σ_j h[t, j] · w_down_t[rows[j]]`` (h [B, k], rows ascending) summed as the fused one-token kernel
    sums token t alone: its own selected rows (``sel`` [B, n_rows]) cut into ``parts`` runs of ceil(k_t / parts),
    each run's sum in ascending row order, then the runs' sums added in order (``compute.describe_partitioned``). One
    ``gemv_down`` call per run index, over the rows some token has in that run, each token's ``h`` zero outside its
    own run (exact zeros: a row of another token's run, or of none, adds nothing) → [B, d_model]. The index work is
    numpy's (a few small arrays; torch's per-op cost was most of the step's added time)."""
    b, d = h.shape[0], w_down_t.shape[1]
    y = _empty((b, d))  # [B, d_model]
    if parts <= 1:
        kern.unchecked(h, w_down_t, rows, y)
        return y
    r, sn, hn = rows.numpy(), sel.numpy(), h.numpy()  # [k] int32, [B, n_rows] bool, [B, k]
    k = r.size
    # token t's run p is the union columns [at[t, p], at[t, p + 1]): rows before its (p · ceil(k_t / parts))-th own
    # selected row are in runs < p (rows ascending, so a run is a range of the union's columns)
    at = np.empty((b, parts + 1), dtype=np.int64)
    at[:, 0], at[:, parts] = 0, k
    for t in range(b):
        own = np.flatnonzero(sn[t])  # [k_t] ascending
        size = max(1, -(-own.size // parts))
        starts = own[size::size][: parts - 1]  # the first row of each later run that has rows
        at[t, 1:1 + starts.size] = np.searchsorted(r, starts)
        at[t, 1 + starts.size:parts] = k  # runs past its rows: empty
    yn = y.numpy()
    first = True
    for p in range(parts):
        lo, hi = int(at[:, p].min()), int(at[:, p + 1].max())
        if hi <= lo:
            continue
        hq = _empty((b, hi - lo))  # [B, k_p]: the columns some token's run p covers, the others' h zeroed
        hqn = hq.numpy()
        hqn[:] = hn[:, lo:hi]
        for t in range(b):
            hqn[t, : at[t, p] - lo] = 0.0
            hqn[t, at[t, p + 1] - lo:] = 0.0
        rq = _empty((hi - lo,), torch.int32)
        rq.numpy()[:] = r[lo:hi]
        yp = y if first else _empty((b, d))
        kern.unchecked(hq, w_down_t, rq, yp)
        if first:
            np.add(yn, np.float32(0.0), out=yn)  # 0 + y_0 (+0 for -0), then + y_1 …: the fused kernel's order
        else:
            np.add(yn, yp.numpy(), out=yn)
        first = False
    if first:
        y.zero_()
    return y


def _empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An uninitialised CPU tensor, 64-byte aligned (torch's allocator already is on x86: ``aligned_empty``'s
    checks cost more than the small buffers here)."""
    from picompile.kernels import aligned_empty

    t = torch.empty(shape, dtype=dtype)
    return t if t.data_ptr() % 64 == 0 else aligned_empty(shape, dtype)


def _gated_relu_rows(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], idx: Tensor,
                     sel: Tensor, spec: Any, lanes: int = 0) -> Optional[tuple[Tensor, Tensor]]:
    """A ReLU / dReLU gated part of float weights as the one-token kernel's ``skip_inactive`` does it: the gate
    rows of the union first (``gemv``), then up rows only where some token that selects the row has a positive
    gate → (rows [k_live] int32, h [B, k_live] with each token's own mask applied). The rows left out have
    ``h = 0`` for every token, so the down sums are those of the full union (exact zeros left out, same order).
    None where this does not apply (another activation, a gate bias, quantized weights, no ``gemv`` kernel)."""
    from picompile.kernels import aligned_empty, as_aligned
    from picompile.runtime.batch_predict import multi_gemv_kernel

    if not spec.gated or spec.gate_bias or spec.act not in ("relu", "drelu") or w_gate is None:
        return None
    kern = multi_gemv_kernel(w_up.shape[0], w_up.shape[1], w_up.dtype, lanes=lanes)
    if kern is None:
        return None
    b, k = x.shape[0], idx.numel()
    g = aligned_empty((b, k))  # [B, k]: gate rows · x
    kern.unchecked(x, w_gate, idx, g)
    keep = g > 0  # [B, k]
    if b > 1:
        keep &= sel.index_select(1, idx)  # each token's own neurons only
    live = keep.any(0).nonzero().squeeze(1)  # [k_live] int64: positions in idx (one nonzero, then index_select)
    rows = idx.index_select(0, live)  # [k_live]
    u = aligned_empty((b, rows.numel()))  # [B, k_live]: up rows · x
    kern.unchecked(x, w_up, rows, u)
    if b_up is not None:
        u += b_up.index_select(0, rows).float()
    if spec.act == "drelu":
        u.relu_()
    h = g.index_select(1, live).relu_().mul_(u)  # [B, k_live]: act(gate) * up, as _up_by_gemv
    if b > 1:
        h.masked_fill_(keep.index_select(1, live).logical_not_(), 0.0)
    return rows, as_aligned(h)


def _up_by_gemv(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], idx: Tensor,
                spec: Any, lanes: int = 0) -> Optional[Tensor]:
    """The up part ``h`` [B, k] of float weights by the ``gemv`` kernel (each selected row read once for all B
    tokens, ``kernels/batch_gemv.py``), the activation in torch; None where that kernel is not to be had (the
    split ``up*`` kernel's batched form then runs)."""
    from picompile.kernels import aligned_empty, as_aligned
    from picompile.runtime.batch_predict import multi_gemv_kernel

    if spec.gate_bias or spec.act not in ("relu", "silu", "drelu", "none"):
        return None
    kern = multi_gemv_kernel(w_up.shape[0], w_up.shape[1], w_up.dtype, lanes=lanes)
    if kern is None:
        return None
    b, k = x.shape[0], idx.numel()
    u = aligned_empty((b, k))  # [B, k]: up rows · x
    kern.unchecked(x, w_up, idx, u)
    if b_up is not None:
        u += b_up.index_select(0, idx).float()
    if spec.gated:
        assert w_gate is not None
        g = aligned_empty((b, k))  # [B, k]: gate rows · x
        kern.unchecked(x, w_gate, idx, g)
        if spec.act == "drelu":
            return as_aligned(g.relu_().mul_(u.relu_()))
        gate = g.relu_() if spec.act == "relu" else torch.nn.functional.silu(g, inplace=True) if spec.act == "silu" else g
        return as_aligned(gate.mul_(u))
    if spec.act == "relu":
        return as_aligned(u.relu_())
    if spec.act == "silu":
        return as_aligned(torch.nn.functional.silu(u, inplace=True))
    return u


def batched_hybrid(
    xs: Tensor | Sequence[Tensor],  # [B, ..., d_model] stacked, or B tensors [..., d_model]
    hot: tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor],  # w_up, b_up, w_gate, w_down_t [k_hot, …]
    masks_h: Tensor | Sequence[Optional[Tensor]],  # [B, ..., k_hot] bool (or a list of B)
    cold: tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor],  # [k_cold, …]
    masks_c: Tensor | Sequence[Optional[Tensor]],  # [B, ..., k_cold] bool (or a list of B)
    bias: Optional[Tensor],  # [d_model] b_down
    hot_kernel: str,
    cold_kernel: str,
) -> Tensor | list[Tensor]:
    """A ``HybridFFN`` layer (runtime/hybrid.py) for B tokens: each part by :func:`batched_part`, then
    ``merge_parts`` (hot + cold (+ b_down), the one-token order, elementwise) → B outputs [..., d_model], stacked
    when ``xs`` is."""
    from picompile.runtime.hybrid import merge_parts

    ys_h = batched_part(xs, *hot, masks_h, hot_kernel)
    ys_c = batched_part(xs, *cold, masks_c, cold_kernel)
    if isinstance(ys_h, Tensor) and isinstance(ys_c, Tensor):
        return merge_parts(ys_h, ys_c, bias)
    return [merge_parts(h, c, bias) for h, c in zip(ys_h, ys_c)]

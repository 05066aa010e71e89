"""Kind ``predict`` with int8 weights by integer dot products, as ``cpu_qdot.py`` does the quantized GEMVs.

before: ``mask = fc2 · act(fc1 · x) + offset > thr`` with every int8 weight widened to float32 (two GEMVs of float
multiply-adds, a 64-lane sum tree per row). after: x, then ``h = act(fc1 · x)``, quantized to int8 blocks of
``QB`` (``d = max|v| / 127``, round half to even), each row's dot product integer (``|w|`` u8 × ``sign(w) · vq``
s8 → i32 lanes, ``cpu_qdot._dot``), one float multiply-add per 16 int32 lanes by the lanes' block scale.

The predictor's int8 rows have no scales (``convert-weights`` folds them into fc2 and the offset), so a row's dot
product is ``Σ_blocks d[b] · Σ_{i in b} w_i · vq_i``. The scores differ from the float kernel's by x's and h's
int8 rounding (~0.8 % of the largest score on random rows), which moves only the neurons within that of the threshold; the
predictor was trained to a recall target, not to that precision. ``qpredict_reference`` is the torch twin.
Applies where ``cpu_qdot.isa_for`` finds integer dot products, ``d_model`` and ``rank`` multiples of 64.
"""
from __future__ import annotations

import torch
from tvm import tirx
from tvm.script import tirx as T

from .cpu_qdot import _dot, _sign_of, int8_scale
from .spec import KernelSpec

QB: int = 32  # elements per quantization block of x and h (8 int32 lanes of 4 bytes)


def _lane_sum(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """The sum of 16 float32 lanes by halving (4 vector adds): llvm's ``reduce.fadd`` without fast-math flags
    is a serial chain of 16 scalar adds, which dominates a 128-element row's dot product."""
    n = 16
    while n > 1:
        n //= 2
        v = (tirx.Shuffle([v], [tirx.const(i, "int32") for i in range(n)])
             + tirx.Shuffle([v], [tirx.const(n + i, "int32") for i in range(n)]))
    return v


def applies(spec: KernelSpec, isa: str | None) -> bool:
    """Whether ``spec`` (kind ``predict``, int8 rows) has this module's kernel on an ``isa`` CPU."""
    return (isa is not None and spec.kind == "predict" and spec.weight_dtype == "int8" and not spec.is_cuda
            and spec.d_model % 64 == 0 and spec.rank % 64 == 0 and spec.act in ("relu", "none"))


def describe(spec: KernelSpec, isa: str) -> tirx.PrimFunc:
    """The one-token predictor, arguments ``(x, fc1, fc2[, offset], thr, mask)`` (``loader._signature``)."""
    if not applies(spec, isa):
        raise ValueError(f"no integer predictor kernel for {spec}")
    d, n, r = spec.d_model, spec.n_rows, spec.rank
    relu, has_bias = spec.act == "relu", spec.has_bias
    zero16 = tirx.Broadcast(tirx.const(0, "int32"), 16)

    def act(v: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.max(v, tirx.const(0.0, "float32")) if relu else v

    @T.macro(hygienic=True)
    def quantize(v, length, vq, vd, m16):  # v [length] → vq [length] int8, vd [length / 4]: each i32 lane's scale
        for b in range(length // QB):
            m16[T.ramp(0, 1, 16)] = T.max(T.fabs(v[T.ramp(b * QB, 1, 16)]), T.fabs(v[T.ramp(b * QB + 16, 1, 16)]))
            dd = T.bind(int8_scale(m16[T.ramp(0, 1, 16)]))
            inv = T.bind(T.Select(dd != T.float32(0), T.float32(1) / dd, T.float32(0)))
            for c in T.unroll(2):
                vq[T.ramp(b * QB + c * 16, 1, 16)] = T.Cast("int8x16", T.round(v[T.ramp(b * QB + c * 16, 1, 16)]
                                                                            * T.Broadcast(inv, 16)))
            vd[T.ramp(b * (QB // 4), 1, QB // 4)] = T.Broadcast(dd, QB // 4)

    @T.macro(hygienic=True)
    def row_dot(w, row, length, vq, vd, acc, out):  # out[0] = Σ_b vd · (w[row] · vq over block b)
        acc[T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
        for c in range(length // 64):
            q = T.bind(w[row, T.ramp(c * 64, 1, 64)])
            iv = T.bind(_dot(isa, zero16, T.reinterpret("uint8x64", T.abs(q)),
                             _sign_of(isa, vq[T.ramp(c * 64, 1, 64)], q)))
            acc[T.ramp(0, 1, 16)] = acc[T.ramp(0, 1, 16)] + T.Cast("float32x16", iv) * vd[T.ramp(c * 16, 1, 16)]
        out[0] = _lane_sum(acc[T.ramp(0, 1, 16)])

    @T.macro(hygienic=True)
    def body(x, fc1, fc2, off, thr, mask):  # off: the offset buffer where has_bias (else unused)
        xq = T.decl_buffer((d,), "int8", align=64)
        xd = T.decl_buffer((d // 4,), "float32", align=64)
        hv = T.decl_buffer((r,), "float32", align=64)
        hq = T.decl_buffer((r,), "int8", align=64)
        hd = T.decl_buffer((r // 4,), "float32", align=64)
        m16 = T.decl_buffer((16,), "float32", align=64)
        quantize(x, d, xq, xd, m16)
        for i in T.parallel(r):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            row_dot(fc1, i, d, xq, xd, acc, res)
            hv[i] = act(res[0])
        quantize(hv, r, hq, hd, m16)
        for j in T.parallel(n):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            row_dot(fc2, j, r, hq, hd, acc, res)
            if has_bias:
                mask[j] = T.Cast("int8", res[0] + off[j] > thr[0])
            else:
                mask[j] = T.Cast("int8", res[0] > thr[0])

    if has_bias:
        @T.prim_func(check_well_formed=False)
        def predict(xh: T.handle, fc1h: T.handle, fc2h: T.handle, offh: T.handle, thrh: T.handle,
                    maskh: T.handle) -> None:
            T.func_attr({"tirx.noalias": True})
            x = T.match_buffer(xh, (d,), "float32")  # [d_model]
            fc1 = T.match_buffer(fc1h, (r, d), "int8")  # [rank, d_model]
            fc2 = T.match_buffer(fc2h, (n, r), "int8")  # [n_rows, rank]
            off = T.match_buffer(offh, (n,), "float32")  # [n_rows]
            thr = T.match_buffer(thrh, (1,), "float32")  # [1]
            mask = T.match_buffer(maskh, (n,), "int8")  # [n_rows]
            body(x, fc1, fc2, off, thr, mask)
        return predict

    @T.prim_func(check_well_formed=False)
    def predict_no_offset(xh: T.handle, fc1h: T.handle, fc2h: T.handle, thrh: T.handle, maskh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        x = T.match_buffer(xh, (d,), "float32")  # [d_model]
        fc1 = T.match_buffer(fc1h, (r, d), "int8")  # [rank, d_model]
        fc2 = T.match_buffer(fc2h, (n, r), "int8")  # [n_rows, rank]
        thr = T.match_buffer(thrh, (1,), "float32")  # [1]
        mask = T.match_buffer(maskh, (n,), "int8")  # [n_rows]
        body(x, fc1, fc2, thr, thr, mask)

    return predict_no_offset


def _quantize_blocks(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [L] (L a multiple of QB) → its int8 quants [L] (float64) and per-element block scales [L] (float64)."""
    blocks = v.double().reshape(-1, QB)  # [L / QB, QB]
    dd = (blocks.abs().amax(dim=1) / 127).float().double()  # the kernel's float32 scale
    inv = torch.where(dd != 0, 1 / dd.float(), torch.zeros_like(dd.float())).double()
    q = torch.round((blocks.float() * inv.float()[:, None]).double())
    return q.reshape(-1), dd.repeat_interleave(QB)


def qpredict_reference(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, act: str,
                       offset: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's scores ``[n_rows]`` (before the threshold) by the same quantized maths, float64 sums."""
    xq, xd = _quantize_blocks(x)
    h = (fc1.double() * (xq * xd)[None, :]).sum(dim=1).float()  # [rank]: Σ_b d_b Σ w·q, as float32 at the end
    if act == "relu":
        h = h.clamp_min(0)
    hq, hd = _quantize_blocks(h)
    s = (fc2.double() * (hq * hd)[None, :]).sum(dim=1)  # [n_rows]
    return s + offset.double() if offset is not None else s

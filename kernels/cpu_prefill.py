"""A ReLU FFN's prompt tokens computed only where their gate fired: kinds ``prefill_up`` and ``prefill_down``.

Prefill of a gated ReLU FFN for ``t`` tokens, after the dense gate GEMM ``g = x · w_gateᵀ`` ([t, n], float32):

    hT[j, tt] = g[tt, j] · (w_up[j] · x[tt])   where g[tt, j] > 0, else 0     # kind prefill_up   [n, t]
    y[tt]     = Σ_{p in row j's run} hT[j, tok[p]] · w_down_t[j]             # kind prefill_down [t, d]

(a non-gated ReLU FFN: ``hT = relu(x · w_upᵀ + b_up)ᵀ`` from the dense up GEMM, then ``prefill_down`` alone).
Rows are symbolic (``n``; the spec's ``n_rows`` is 1, as kind ``dequant``'s): one kernel pair serves every
part of a model. The up and down rows of a neuron are read once for all ``t`` tokens and multiplied only with the tokens whose
gate fired (~10 % of the pairs on a ReLU model), so the prompt's FFN costs its gate GEMM plus about a tenth
of the up and down multiply-adds: exact maths, no predictor (a ReLU output of 0 adds nothing).

* ``prefill_up`` (int8 / int4 weights, the ``cpu_qdot`` ISAs): every token's ``x`` quantized as the one-token
  ``up`` kernel does, then parallel over blocks of ``ROWS`` rows; per token, its quants copied into the thread's
  buffers when one of the block's gates fired for it, then ``row_dot`` (the one-token kernel's sums) for each
  such row. Arguments ``(x [t, d], w, s, g [t, n], hT [n, t])``.
* ``prefill_down`` (int8 / int4): parallel over column chunks of ``d_model`` (each thread owns its
  columns of every token's ``y``; each weight byte is read once), per row with a non-empty run: the row's
  chunk dequantized once into a float buffer, then one float axpy per token of the row's run (``rowptr`` [n+1]
  int32 and ``tok`` [nnz] int32: the (row, token) pairs with ``hT ≠ 0``, sorted by row — ``prefill_runs``).
  Arguments ``(hT [n, t], rowptr, tok, w, s, y [t, d])``.
"""
from __future__ import annotations

import dataclasses

import torch
from tvm import tirx
from tvm.script import tirx as T

from . import cpu_qdot
from .spec import KernelSpec

ROWS: int = 64  # prefill_up: rows per parallel block (64 int4 rows of d 2048: 72 KB, L2-resident for all tokens)
KINDS: tuple[str, ...] = ("prefill_up", "prefill_down")


def chunk_columns(d: int, block: int, parts: int) -> int:
    """prefill_down's columns per parallel task: the widest of 256 / 128 / 64 / 32 that is a whole number of
    blocks, divides ``d`` and leaves at least ``parts`` tasks where it can (0: none, no kernel for this shape).
    (Tried on the 1B int4 at 64 tokens, AMD Zen 2: a chunk per core, 1,024 columns, ran 3.3x slower; tiles of
    64 rows with 128-column sub-chunks 1.5x slower: the tokens' y of a chunk must stay near L1.)"""
    fits = [c for c in (256, 128, 64, 32) if c % block == 0 and d % c == 0]
    wide = [c for c in fits if d // c >= parts]
    return (wide or fits[-1:] or [0])[0]  # too narrow for `parts` tasks: as many as there can be


def applies(spec: KernelSpec, isa: str | None) -> bool:
    """Whether this module has a kernel for ``spec`` on a target with integer dot-product ``isa``."""
    if spec.is_cuda or spec.kind not in KINDS or spec.has_bias:
        return False
    if spec.kind == "prefill_up":
        return cpu_qdot.applies(_up_spec(spec), isa)
    return spec.quantized and chunk_columns(spec.d_model, spec.block, 1) > 0


def _up_spec(spec: KernelSpec) -> KernelSpec:
    """The one-token ``up`` kernel whose dot products ``prefill_up`` repeats."""
    return dataclasses.replace(spec, kind="up")


def describe(spec: KernelSpec, isa: str | None, parts: int) -> tirx.PrimFunc:
    """This module's kernel for ``spec`` (``applies``); ``parts``: the cores it is cut for."""
    return describe_up(spec, isa) if spec.kind == "prefill_up" else describe_down(spec, parts)


def describe_up(spec: KernelSpec, isa: str | None) -> tirx.PrimFunc:
    """``hT[j, tt] = g[tt, j] · (w[j] · x[tt])`` where ``g[tt, j] > 0``, else 0 (module docstring)."""
    if not applies(spec, isa):
        raise ValueError(f"no prefill_up kernel for {spec}")
    assert isa is not None
    up = _up_spec(spec)
    d, B = spec.d_model, spec.block
    sh = cpu_qdot._shape(up)
    nb, RB, NL = sh["nb"], sh["RB"], sh["NL"]
    qdt = "uint8" if spec.weight_dtype == "int4" else "int8"
    prep_x, row_dot = cpu_qdot._macros(up, isa)
    R = ROWS

    @T.prim_func(check_well_formed=False)
    def prefill_up(xh: T.handle, wh: T.handle, sh_: T.handle, gh: T.handle, hh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        n = T.int32()
        x = T.match_buffer(xh, (t, d), "float32", align=64)  # [t, d_model]
        w = T.match_buffer(wh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        s = T.match_buffer(sh_, (n, nb), "float16", align=64)  # [n_rows, blocks]
        g = T.match_buffer(gh, (t, n), "float32")  # [t, n_rows]: the gate GEMM's output
        hT = T.match_buffer(hh, (n, t), "float32")  # [n_rows, t]
        qa = T.decl_buffer((t, RB), "int8", align=64)  # every token's prep_x results
        qb = T.decl_buffer((t, RB), "int8", align=64)
        qc = T.decl_buffer((t, NL), "int32", align=64)
        qd = T.decl_buffer((t, NL), "float32", align=64)
        x1 = T.decl_buffer((d,), "float32", align=64)
        ya = T.decl_buffer((RB,), "int8", align=64)
        yb = T.decl_buffer((RB,), "int8", align=64)
        yc = T.decl_buffer((NL,), "int32", align=64)
        yd = T.decl_buffer((NL,), "float32", align=64)
        dx = T.decl_buffer((nb,), "float32")
        m16 = T.decl_buffer((16,), "float32", align=64)
        for tt in range(t):  # serial, before the parallel region
            for i in range(d // 16):
                x1[T.ramp(i * 16, 1, 16)] = x[tt, T.ramp(i * 16, 1, 16)]
            prep_x(x1, ya, yb, yc, yd, dx, m16)
            for i in range(RB // 16):
                qa[tt, T.ramp(i * 16, 1, 16)] = ya[T.ramp(i * 16, 1, 16)]
                qb[tt, T.ramp(i * 16, 1, 16)] = yb[T.ramp(i * 16, 1, 16)]
            for i in range(NL):
                qc[tt, i] = yc[i]
                qd[tt, i] = yd[i]
        for blk in T.parallel((n + R - 1) // R):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            fired = T.decl_buffer((1,), "int32")
            xa = T.decl_buffer((RB,), "int8", align=64)
            xb = T.decl_buffer((RB,), "int8", align=64)
            xc = T.decl_buffer((NL,), "int32", align=64)
            xd = T.decl_buffer((NL,), "float32", align=64)
            for jj in range(R):
                if blk * R + jj < n:
                    for tt in range(t):
                        hT[blk * R + jj, tt] = T.float32(0)
                if (blk + 1) * R + jj < n:  # the next block's rows (this thread's next, under a static split)
                    for ln in range((RB + 63) // 64):
                        T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                            w[(blk + 1) * R + jj, ln * 64]), 0, 2, 1))
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(
                        s[(blk + 1) * R + jj, 0]), 0, 2, 1))
            for tt in range(t):
                fired[0] = 0
                for jj in range(R):
                    if blk * R + jj < n:
                        if g[tt, blk * R + jj] > T.float32(0):
                            fired[0] = fired[0] + 1
                if fired[0] > 0:
                    for i in range(RB // 16):
                        xa[T.ramp(i * 16, 1, 16)] = qa[tt, T.ramp(i * 16, 1, 16)]
                        xb[T.ramp(i * 16, 1, 16)] = qb[tt, T.ramp(i * 16, 1, 16)]
                    for i in range(NL):
                        xc[i] = qc[tt, i]
                        xd[i] = qd[tt, i]
                    for jj in range(R):
                        if blk * R + jj < n:
                            if g[tt, blk * R + jj] > T.float32(0):
                                row_dot(w, s, xa, xb, xc, xd, blk * R + jj, T.min(blk * R + jj + 1, n - 1), acc, res)
                                hT[blk * R + jj, tt] = g[tt, blk * R + jj] * res[0]

    return prefill_up


def describe_down(spec: KernelSpec, parts: int) -> tirx.PrimFunc:
    """``y[tt] = Σ_j hT[j, tt] · w[j]`` over each row's run of tokens (module docstring), parallel over column
    chunks of ``chunk_columns(d, block, parts)`` (the tokens' ``y`` of a chunk: 64 KB at 64 tokens, 256 columns)."""
    d, wdt, B = spec.d_model, spec.weight_dtype, spec.block
    C = chunk_columns(d, B, parts)
    if not applies(spec, None):
        raise ValueError(f"no prefill_down kernel for {spec}")
    int4 = wdt == "int4"
    RB = d // 2 if int4 else d
    nb = d // B
    HB = B // 2
    qdt = "uint8" if int4 else "int8"
    NC = d // C

    @T.prim_func(check_well_formed=False)
    def prefill_down(hh: T.handle, ph: T.handle, kh: T.handle, wh: T.handle, sh_: T.handle, yh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        n = T.int32()
        nnz = T.int32()
        hT = T.match_buffer(hh, (n, t), "float32")  # [n_rows, t]
        rowptr = T.match_buffer(ph, (n + 1,), "int32")  # [n_rows + 1]
        tok = T.match_buffer(kh, (nnz,), "int32")  # [nnz]
        w = T.match_buffer(wh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        s = T.match_buffer(sh_, (n, nb), "float16", align=64)  # [n_rows, blocks]
        y = T.match_buffer(yh, (t, d), "float32", align=64)  # [t, d_model]
        for c in T.parallel(NC):
            wb = T.decl_buffer((C,), "float32", align=64)
            for tt in range(t):
                for i in range(C // 16):
                    y[tt, T.ramp(c * C + i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for j in range(n):
                if rowptr[j + 1] > rowptr[j]:
                    for b in range(C // B):
                        sv = T.bind(T.Broadcast(T.Cast("float32", s[j, c * (C // B) + b]), 16))
                        if int4:
                            for e in range(HB // 16):
                                q = T.bind(w[j, T.ramp((c * (C // B) + b) * HB + e * 16, 1, 16)])
                                lo = T.bind(T.Cast("float32x16", T.bitwise_and(q, T.Broadcast(T.uint8(15), 16))))
                                hi = T.bind(T.Cast("float32x16", T.shift_right(q, T.Broadcast(T.uint8(4), 16))))
                                wb[T.ramp(b * B + e * 16, 1, 16)] = (lo - T.Broadcast(T.float32(8), 16)) * sv
                                wb[T.ramp(b * B + HB + e * 16, 1, 16)] = (hi - T.Broadcast(T.float32(8), 16)) * sv
                        else:
                            for e in range(B // 16):
                                wb[T.ramp(b * B + e * 16, 1, 16)] = T.Cast(
                                    "float32x16", w[j, T.ramp(c * C + b * B + e * 16, 1, 16)]) * sv
                    for p in range(rowptr[j + 1] - rowptr[j]):
                        tt = T.bind(tok[rowptr[j] + p])
                        hv = T.bind(T.Broadcast(hT[j, tt], 16))
                        for i in range(C // 16):
                            y[tt, T.ramp(c * C + i * 16, 1, 16)] = y[tt, T.ramp(c * C + i * 16, 1, 16)] + hv * wb[
                                T.ramp(i * 16, 1, 16)]

    return prefill_down


def prefill_runs(hT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill_down``'s (row, token) pairs of ``hT`` [n, t] where it is not 0, sorted by row: ``rowptr``
    [n + 1] int32 (row j's pairs are ``rowptr[j] .. rowptr[j+1]``) and ``tok`` [nnz] int32."""
    rows, tok = hT.ne(0).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=hT.shape[0])
    rowptr = torch.zeros(hT.shape[0] + 1, dtype=torch.int32)
    rowptr[1:] = torch.cumsum(counts, 0)
    return rowptr, tok.to(torch.int32)

"""A ReLU FFN's prompt tokens computed only where their gate fired: kinds ``prefill_up`` and ``prefill_down``.

Prefill of a gated ReLU FFN for ``t`` tokens, after the dense gate GEMM ``g = x · w_gateᵀ`` ([t, n], float32):

    h[tt, j] = g[tt, j] · (w_up[j] · x[tt])   where g[tt, j] > 0, else 0          # kind prefill_up   [t, n]
    y[tt]    = Σ_{j: h[tt, j] ≠ 0} h[tt, j] · w_down_t[j]                           # kind prefill_down [t, d]

(a non-gated ReLU FFN: ``h = relu(x · w_upᵀ + b_up)`` from the dense up GEMM, then ``prefill_down`` alone).
Rows are symbolic (``n``; the spec's ``n_rows`` is 1, as kind ``dequant``'s): one kernel pair per weight format
and width serves every part of a model. Each up and down row is read from memory once for all ``t`` tokens and
multiplied only with the tokens whose gate fired (~10 % of the pairs on a ReLU model), so the prompt's FFN costs
its gate GEMM plus about a tenth of the up and down multiply-adds: exact maths, no predictor (a ReLU output of
0 adds nothing).

* ``prefill_up`` (int8 / int4 weights where ``cpu_qdot`` has integer dot products: AVX2 and up): every token's
  ``x`` quantized as the one-token ``up`` kernel does, then parallel over blocks of ``ROWS`` rows (the block's
  rows stay in L2 for all tokens); per token, its quants copied into the thread's buffers when one of the
  block's gates fired for it, then ``row_dot`` (the one-token kernel's sums, so the maths are decode's) for
  each such row. Arguments ``(x [t, d], w, s, g [t, n], h [t, n])``. Float16 / float32 rows (any target):
  the same loops with float32 dot products of 16 lanes, ``(x, w, g, h)``.
* ``prefill_down`` (float16 / float32 / int8 / int4, any LLVM CPU target: float maths): each of the build's cores takes a
  contiguous run of rows and reads it once, ``TILE`` rows at a time; per tile and chunk of ``chunk_columns``
  columns the rows are dequantized into a float tile, then per token its active rows of the tile (``tokptr``
  [t + 1] and ``rows`` [nnz + 1] int32, by token, ascending, a sentinel ``n`` last: ``prefill_runs``) are summed
  into ``LANES`` columns held in registers. Each core writes its own ``y[p]``; the caller adds the parts.
  Arguments ``(h [t, n], tokptr, rows, w, s, y [parts, t, d])`` (float rows: no ``s``).

AMD Zen 2, 2 threads, the 1B int4 (d 2048, 5632 neurons), 64 tokens, ~10.6 % of the pairs active, in a
prefill (weights from DRAM): per layer up 4.4 ms and down 5.1 ms against 11.3 ms for each dense float32 GEMM on
packed copies. Tried and slower in place: a next-block prefetch in ``prefill_up`` (+15 %); ``prefill_down``
parallel over column chunks with one float axpy per (row, token) pair into ``y`` (7.3 ms: each chunk task
re-walks every row; 1,024-column chunks 3.3× slower still).
"""
from __future__ import annotations

import dataclasses

import torch
from tvm import tirx
from tvm.script import tirx as T

from . import cpu_qdot
from .spec import KernelSpec

TILE: int = 128  # prefill_down: rows per tile (128 rows x 128 columns of float32: 64 KB, L2)
LANES: int = 64  # prefill_down: columns a token's sum keeps in registers
ROWS: int = 64  # prefill_up: rows per parallel block (64 int4 rows of d 2048: 72 KB, L2-resident for all tokens)
KINDS: tuple[str, ...] = ("prefill_up", "prefill_down")


# prefill_down: the widest column chunk per tile pass. 128-row tiles of 128 columns against 32 x 256 (Zen 2, 2
# threads, 1B float16 artifact, 64-token prompt, `benchmarks/prefill.py --settings auto --last-only`, 5 alternated
# processes each): 63.1-70.6 tok/s (median 70.2) against 61.4-68.2 (65.1), every pair in its favour: a token's
# running sum is loaded and stored once per ~4x as many active rows; int4 level (medians 69.9 / 70.2 of 7 each).
COLUMNS: int = 128


def chunk_columns(d: int, block: int) -> int:
    """prefill_down's columns per tile pass: the widest of 256 / 128 / 64 / 32, at most ``COLUMNS``, that is a
    whole number of blocks and divides ``d`` (0: none, no kernel for this shape)."""
    return next((c for c in (256, 128, 64, 32) if c <= COLUMNS and c % block == 0 and d % c == 0), 0)


def applies(spec: KernelSpec, isa: str | None) -> bool:
    """Whether this module has a kernel for ``spec`` on a target with integer dot-product ``isa``."""
    if spec.is_cuda or spec.kind not in KINDS or spec.has_bias:
        return False
    if not spec.quantized:  # float16 / float32 rows: float maths, any target
        return spec.weight_dtype in ("float16", "float32") and chunk_columns(spec.d_model, 16) > 0
    if spec.kind == "prefill_up":
        return cpu_qdot.applies(_up_spec(spec), isa)
    return chunk_columns(spec.d_model, spec.block) > 0


def _up_spec(spec: KernelSpec) -> KernelSpec:
    """The one-token ``up`` kernel whose dot products ``prefill_up`` repeats."""
    return dataclasses.replace(spec, kind="up")


def describe(spec: KernelSpec, isa: str | None, parts: int) -> tirx.PrimFunc:
    """This module's kernel for ``spec`` (``applies``); ``parts``: the cores it is cut for."""
    if spec.kind == "prefill_up":
        return describe_up(spec, isa) if spec.quantized else describe_up_float(spec)
    return describe_down(spec, parts)


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
    _, row_dot = cpu_qdot._macros(up, isa)
    prep_tokens, take_token = cpu_qdot.token_macros(up, isa)
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
        hT = T.match_buffer(hh, (t, n), "float32")  # [t, n_rows]
        qa = T.decl_buffer((t, RB), "int8", align=64)  # every token's prep_x results
        qb = T.decl_buffer((t, RB), "int8", align=64)
        qc = T.decl_buffer((t, NL), "int32", align=64)
        qd = T.decl_buffer((t, nb), "float32", align=64)
        prep_tokens(x, qa, qb, qc, qd, t)  # serial, before the parallel region
        for blk in T.parallel((n + R - 1) // R):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            fired = T.decl_buffer((1,), "int32")
            xa = T.decl_buffer((RB,), "int8", align=64)
            xb = T.decl_buffer((RB,), "int8", align=64)
            xc = T.decl_buffer((NL,), "int32", align=64)
            xd = T.decl_buffer((nb,), "float32", align=64)
            for tt in range(t):
                for jj in range(R):
                    if blk * R + jj < n:
                        hT[tt, blk * R + jj] = T.float32(0)
            for tt in range(t):
                fired[0] = 0
                for jj in range(R):
                    if blk * R + jj < n:
                        if g[tt, blk * R + jj] > T.float32(0):
                            fired[0] = fired[0] + 1
                if fired[0] > 0:
                    take_token(qa, qb, qc, qd, tt, xa, xb, xc, xd)
                    for jj in range(R):
                        if blk * R + jj < n:
                            if g[tt, blk * R + jj] > T.float32(0):
                                row_dot(w, s, xa, xb, xc, xd, blk * R + jj, T.min(blk * R + jj + 1, n - 1), acc, res)
                                hT[tt, blk * R + jj] = g[tt, blk * R + jj] * res[0]

    return prefill_up


def describe_up_float(spec: KernelSpec) -> tirx.PrimFunc:
    """``prefill_up`` on float16 / float32 rows: the same loops, each dot product in float32 (16 lanes, the row
    widened in registers; x as it is, no quantization). Arguments ``(x [t, d], w, g [t, n], h [t, n])``."""
    if not applies(spec, None) or spec.quantized:
        raise ValueError(f"no float prefill_up kernel for {spec}")
    d, wdt, R = spec.d_model, spec.weight_dtype, ROWS
    A = 4 if d % 64 == 0 else 1  # independent 16-lane accumulators (one alone is an FMA latency chain)

    @T.prim_func(check_well_formed=False)
    def prefill_up(xh: T.handle, wh: T.handle, gh: T.handle, hh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        n = T.int32()
        x = T.match_buffer(xh, (t, d), "float32", align=64)  # [t, d_model]
        w = T.match_buffer(wh, (n, d), wdt, align=64)  # [n_rows, d_model]
        g = T.match_buffer(gh, (t, n), "float32")  # [t, n_rows]: the gate GEMM's output
        h = T.match_buffer(hh, (t, n), "float32")  # [t, n_rows]
        for blk in T.parallel((n + R - 1) // R):
            acc = T.decl_buffer((16 * A,), "float32", align=64)
            for tt in range(t):
                for jj in range(R):
                    if blk * R + jj < n:
                        h[tt, blk * R + jj] = T.float32(0)
                        if g[tt, blk * R + jj] > T.float32(0):
                            for a in T.unroll(A):
                                acc[T.ramp(a * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
                            for c in range(d // (16 * A)):
                                for a in T.unroll(A):
                                    col = T.bind((c * A + a) * 16)
                                    acc[T.ramp(a * 16, 1, 16)] = acc[T.ramp(a * 16, 1, 16)] + T.Cast(
                                        "float32x16", w[blk * R + jj, T.ramp(col, 1, 16)]) * x[tt, T.ramp(col, 1, 16)]
                            for a in T.unroll(1, A):
                                acc[T.ramp(0, 1, 16)] = acc[T.ramp(0, 1, 16)] + acc[T.ramp(a * 16, 1, 16)]
                            h[tt, blk * R + jj] = g[tt, blk * R + jj] * T.call_llvm_pure_intrin(
                                "float32", "llvm.vector.reduce.fadd", T.float32(0), acc[T.ramp(0, 1, 16)])

    return prefill_up


def describe_down(spec: KernelSpec, parts: int) -> tirx.PrimFunc:
    """``y[p, tt] = Σ_j h[tt, j] · w[j]`` over part ``p``'s rows (module docstring): each of the ``parts`` threads
    reads its contiguous run of rows once, ``TILE`` rows at a time; per tile and chunk of ``chunk_columns``
    columns the rows are dequantized (float16: widened) into a float tile (L1 / L2), then per token its active rows
    of the tile are summed into ``LANES`` columns held in registers (one load and one store of ``y`` per token,
    tile and ``LANES`` columns). Quantized rows take their scales after the quants; float rows none."""
    d, wdt, quant = spec.d_model, spec.weight_dtype, spec.quantized
    if not applies(spec, None):
        raise ValueError(f"no prefill_down kernel for {spec}")
    B = spec.block if quant else 16
    CC = chunk_columns(d, B)  # columns dequantized per tile pass
    CW = min(LANES, CC)
    int4 = wdt == "int4"
    RB = d // 2 if int4 else d
    nb = d // B
    HB = B // 2
    qdt = {"int4": "uint8"}.get(wdt, wdt)
    P, RT = max(parts, 1), TILE

    @T.macro(hygienic=True)
    def fill(w, s, row, jj, cc, wt):  # row's columns cc·CC … +CC as float32 → wt[jj]
        if quant:
            for b in range(CC // B):
                bi = T.bind(cc * (CC // B) + b)  # the block's index in the row
                sv = T.bind(T.Broadcast(T.Cast("float32", s[row, bi]), 16))
                if int4:
                    for e in range(HB // 16):
                        qv = T.bind(w[row, T.ramp(bi * HB + e * 16, 1, 16)])
                        lo4 = T.bind(T.Cast("float32x16", T.bitwise_and(qv, T.Broadcast(T.uint8(15), 16))))
                        hi4 = T.bind(T.Cast("float32x16", T.shift_right(qv, T.Broadcast(T.uint8(4), 16))))
                        wt[jj, T.ramp(b * B + e * 16, 1, 16)] = (lo4 - T.Broadcast(T.float32(8), 16)) * sv
                        wt[jj, T.ramp(b * B + HB + e * 16, 1, 16)] = (hi4 - T.Broadcast(T.float32(8), 16)) * sv
                else:
                    for e in range(B // 16):
                        wt[jj, T.ramp(b * B + e * 16, 1, 16)] = T.Cast(
                            "float32x16", w[row, T.ramp(bi * B + e * 16, 1, 16)]) * sv
        else:
            for e in range(CC // 16):
                wt[jj, T.ramp(e * 16, 1, 16)] = T.Cast("float32x16", w[row, T.ramp(cc * CC + e * 16, 1, 16)])

    @T.macro(hygienic=True)
    def body(h, tokptr, rows, w, s, y, t, n):
        for p in T.parallel(P):
            cur = T.decl_buffer((t,), "int32")
            end = T.decl_buffer((t,), "int32")
            q = T.decl_buffer((1,), "int32")
            wt = T.decl_buffer((RT, CC), "float32", align=64)
            acc = T.decl_buffer((CW,), "float32", align=64)
            per = T.bind((n + P - 1) // P)
            r0 = T.bind(T.min(p * per, n))
            r1 = T.bind(T.min(r0 + per, n))
            for tt in range(t):
                for i in range(d // 16):
                    y[p, tt, T.ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
                q[0] = tokptr[tt]
                while q[0] < tokptr[tt + 1] and rows[q[0]] < r0:
                    q[0] = q[0] + 1
                cur[tt] = q[0]
            for tile in range((per + RT - 1) // RT):
                lo = T.bind(r0 + tile * RT)
                hi = T.bind(T.min(lo + RT, r1))
                if lo < hi:
                    for tt in range(t):
                        q[0] = cur[tt]
                        while q[0] < tokptr[tt + 1] and rows[q[0]] < hi:
                            q[0] = q[0] + 1
                        end[tt] = q[0]
                    for cc in range(d // CC):
                        for jj in range(RT):
                            if lo + jj < hi:
                                fill(w, s, lo + jj, jj, cc, wt)
                        for tt in range(t):
                            if end[tt] > cur[tt]:
                                for cw in range(CC // CW):
                                    col = T.bind(cc * CC + cw * CW)
                                    for v in T.unroll(CW // 16):
                                        acc[T.ramp(v * 16, 1, 16)] = y[p, tt, T.ramp(col + v * 16, 1, 16)]
                                    for k in range(end[tt] - cur[tt]):
                                        j = T.bind(rows[cur[tt] + k])
                                        hv = T.bind(T.Broadcast(h[tt, j], 16))
                                        for v in T.unroll(CW // 16):
                                            acc[T.ramp(v * 16, 1, 16)] = acc[T.ramp(v * 16, 1, 16)] + hv * wt[
                                                j - lo, T.ramp(cw * CW + v * 16, 1, 16)]
                                    for v in T.unroll(CW // 16):
                                        y[p, tt, T.ramp(col + v * 16, 1, 16)] = acc[T.ramp(v * 16, 1, 16)]
                    for tt in range(t):
                        cur[tt] = end[tt]

    if quant:
        @T.prim_func(check_well_formed=False)
        def prefill_down(hh: T.handle, ph: T.handle, rh: T.handle, wh: T.handle, sh_: T.handle, yh: T.handle) -> None:
            T.func_attr({"tirx.noalias": True})
            t = T.int32()
            n = T.int32()
            nr = T.int32()
            h = T.match_buffer(hh, (t, n), "float32")  # [t, n_rows]
            tokptr = T.match_buffer(ph, (t + 1,), "int32")  # [t + 1]
            rows = T.match_buffer(rh, (nr,), "int32")  # [nnz + 1]: each token's rows ascending, then a sentinel n
            w = T.match_buffer(wh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
            s = T.match_buffer(sh_, (n, nb), "float16", align=64)  # [n_rows, blocks]
            y = T.match_buffer(yh, (P, t, d), "float32", align=64)  # [parts, t, d_model]: summed by the caller
            body(h, tokptr, rows, w, s, y, t, n)

        return prefill_down

    @T.prim_func(check_well_formed=False)
    def prefill_down_float(hh: T.handle, ph: T.handle, rh: T.handle, wh: T.handle, yh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        n = T.int32()
        nr = T.int32()
        h = T.match_buffer(hh, (t, n), "float32")  # [t, n_rows]
        tokptr = T.match_buffer(ph, (t + 1,), "int32")  # [t + 1]
        rows = T.match_buffer(rh, (nr,), "int32")  # [nnz + 1]
        w = T.match_buffer(wh, (n, d), qdt, align=64)  # [n_rows, d_model]
        y = T.match_buffer(yh, (P, t, d), "float32", align=64)  # [parts, t, d_model]
        body(h, tokptr, rows, w, w, y, t, n)

    return prefill_down_float


def prefill_runs(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill_down``'s (token, row) pairs of ``h`` [t, n] where it is not 0: ``tokptr`` [t + 1] int32 (token
    tt's rows are ``rows[tokptr[tt] : tokptr[tt+1]]``, ascending) and ``rows`` [nnz + 1] int32, ending with a
    sentinel ``n`` (the kernel's scans read one past a token's last row)."""
    tok, rows = h.ne(0).nonzero(as_tuple=True)
    tokptr = torch.zeros(h.shape[0] + 1, dtype=torch.int32)
    tokptr[1:] = torch.cumsum(torch.bincount(tok, minlength=h.shape[0]), 0)
    out = torch.empty(rows.numel() + 1, dtype=torch.int32)
    out[:-1] = rows
    out[-1] = h.shape[1]
    return tokptr, out

"""Kind ``gemv``: a few tokens' dot products with selected weight rows, each row read once for all of them (CPU).

``y[t, j] = w[idx[j]] · x[t]`` for t < T (symbolic), j < k (symbolic): ``x`` ``[T, d_model]`` float32, ``w``
``[n_rows, d_model]`` float32 / float16, ``idx`` int32 ``[k]``, ``y`` ``[T, k]`` float32, written. A linear layer
for T tokens is ``idx = 0..n_rows-1``; the union FFN's up / gate part and the predictors use it too
(``runtime/batch_ffn.py``, ``batch_predict.py``).

The ``<key>_batch`` form of kind ``up`` computes each (row, token) dot product by itself: the row comes from L1
for every token but is widened and multiplied again, so T tokens cost T times one token's compute, and on two
cores the batched linear layers ran at a third of memory speed at T = 4 (``benchmarks/README.md``, serving).
Here the tokens are taken in tiles of 4 (then 2, then 1 for the rest): per 32-element chunk of a row, the chunk is
loaded and widened once and multiplied into the tile's 4 × 32 float32 accumulators. Threads (``parts`` = the
build's cores) split the selected rows into contiguous ranges. Each chunk step also prefetches (into L1) the same
chunk of the selected row ``ROWS_AHEAD`` on: a tile of 4 tokens spends ~4× one token's instructions per weight
cache line, so the out-of-order window alone keeps too few lines in flight and the hardware prefetchers did not
cover it (at 4 tokens the kernel streamed 0.6× as fast as at 1 on an AMD EPYC Zen 5; with the hint, level with
1 token: ``benchmarks/README.md``, serving). Before a row pair's pass, every cache line of the next pair is also
prefetched into L2 when it does not follow its predecessor (the union FFN's rows are far apart), those calls kept
out of the accumulation loop.

Every (row, token) sum is formed the same way in every tile — 32 lanes accumulated in chunk order, then a fixed
halving tree 32 → 16 → … → 1 — so a token's ``y`` does not depend on T or on its place in the batch (what the
server's exactness relies on, ``runtime/batch.py``).
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .spec import KernelSpec

LANES = 32  # float32 accumulators per token (one float16 cache line per chunk)
LINE_BYTES = 64
COLS = 64  # the down kernel's y columns per register tile (4 float32 vectors per token)
TILES = (4, 2, 1)  # tokens per pass over a row
ROWS_AHEAD = 4  # the chunk loop prefetches the same chunk of the selected row this many rows on


def supports(spec: KernelSpec) -> bool:
    """Whether ``spec`` (kind ``gemv`` / ``gemv_down``) has these schedules: float weights, d_model a multiple of
    the lanes (``gemv``) or of the 64-column tile (``gemv_down``)."""
    return spec.weight_dtype in ("float32", "float16") and spec.d_model % (lanes(spec) if spec.kind == "gemv" else COLS) == 0


def lanes(spec: KernelSpec) -> int:
    """Float32 accumulators of one ``gemv`` dot product: the spec's ``lanes``, by default ``LANES``."""
    return spec.lanes or LANES


def _per_line(wdt: str) -> int:
    """Elements of a ``wdt`` weight per cache line."""
    return LINE_BYTES // (2 if wdt == "float16" else 4)


def describe(spec: KernelSpec, parts: int) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``main(x, w, idx, y)`` for ``spec`` (kind ``gemv``), rows split over ``parts`` tasks."""
    d, n, wdt = spec.d_model, spec.n_rows, spec.weight_dtype
    L = lanes(spec)
    C = d // L  # chunks per row
    pairs = L <= LANES  # two rows per pass of 4 tokens (64 lanes: of 2 tokens; 4 × 64 accumulators fill the registers)
    PT = 4 if pairs else 2  # tokens per two-row pass
    per_line = _per_line(wdt)
    LINES = d // per_line
    parts = max(1, parts)

    @T.macro(hygienic=False)
    def _prefetch_chunk(buf, at):  # a chunk's cache lines (32 lanes: 1 float16, 2 float32) into L1 (a hint)
        for ln in T.unroll(max(1, L // per_line)):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[at + ln * per_line]), 0, 3, 1))

    @T.macro(hygienic=False)
    def tree(a, TS, j, tb):  # y[tb + tt, j] = the halving tree of a[tt, :] (L → L/2 → … → 1), as cpu._rfactor_tree
        for tt in T.unroll(TS):
            if L == 64:
                for e in T.vectorized(32):
                    s32[tt, e] = a[tt, e] + a[tt, e + 32]
            if L >= 64:
                for e in T.vectorized(16):
                    s16[tt, e] = s32[tt, e] + s32[tt, e + 16]
            if L == 32:
                for e in T.vectorized(16):
                    s16[tt, e] = a[tt, e] + a[tt, e + 16]
            if L >= 32:
                for e in T.vectorized(8):
                    s8[tt, e] = s16[tt, e] + s16[tt, e + 8]
            if L == 16:
                for e in T.vectorized(8):
                    s8[tt, e] = a[tt, e] + a[tt, e + 8]
            if L >= 16:
                for e in T.vectorized(4):
                    s4[tt, e] = s8[tt, e] + s8[tt, e + 4]
            if L == 8:
                for e in T.vectorized(4):
                    s4[tt, e] = a[tt, e] + a[tt, e + 4]
            if L >= 8:
                for e in T.vectorized(2):
                    s2[tt, e] = s4[tt, e] + s4[tt, e + 2]
            if L == 4:
                for e in T.vectorized(2):
                    s2[tt, e] = a[tt, e] + a[tt, e + 2]
            if L >= 4:
                y[tb + tt, j] = s2[tt, 0] + s2[tt, 1]
            if L == 2:
                y[tb + tt, j] = a[tt, 0] + a[tt, 1]

    @T.macro(hygienic=False)
    def one(TS, j):  # row idx[j] for the TS tokens from t0
        for tt in T.unroll(TS):
            for e in T.vectorized(L):
                acc[tt, e] = T.float32(0)
        for c in range(C):
            _prefetch_chunk(wf, idx[T.min(j + ROWS_AHEAD, k - 1)] * d + c * L)
            for tt in T.unroll(TS):
                for e in T.vectorized(L):
                    acc[tt, e] = acc[tt, e] + T.Cast("float32", w[idx[j], c * L + e]) * x[t0 + tt, c * L + e]
        tree(acc, TS, j, t0)

    @T.prim_func
    def main(x_h: T.handle, w: T.Buffer((n, d), wdt), idx_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        k = T.int32()
        x = T.match_buffer(x_h, (t, d), "float32")
        idx = T.match_buffer(idx_h, (k,), "int32")
        y = T.match_buffer(y_h, (t, k), "float32")
        wf = T.decl_buffer((n * d,), wdt, data=w.data)
        for p in T.parallel(parts):
            acc = T.alloc_buffer((4, L), "float32")
            acc1 = T.alloc_buffer((4, L), "float32")
            s32 = T.alloc_buffer((4, 32), "float32")
            s16 = T.alloc_buffer((4, 16), "float32")
            s8 = T.alloc_buffer((4, 8), "float32")
            s4 = T.alloc_buffer((4, 4), "float32")
            s2 = T.alloc_buffer((4, 2), "float32")
            lo = p * k // parts
            hi = (p + 1) * k // parts
            for jp in range((hi - lo + 1) // 2):  # rows in pairs (the last alone when the count is odd)
                j0 = lo + 2 * jp
                j1 = T.min(j0 + 1, hi - 1)
                for ahead in range(2):  # the next pair's rows, prefetched whole unless they follow their predecessor
                    ja = T.min(j0 + 2 + ahead, k - 1)
                    if idx[ja] != idx[ja - 1] + 1 or t >= 4:
                        for line in range(LINES):
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                                          T.address_of(wf[idx[ja] * d + line * per_line]), 0, 2, 1))
                for q in range(t // 4 + (t % 4) // 2 + t % 2):
                    # tile q: 4 tokens from 4q while q < t // 4, then one of 2, then one of 1
                    n4 = t // 4
                    t0 = T.if_then_else(q < n4, q * 4, T.if_then_else(q == n4 and t % 4 >= 2, n4 * 4, t - 1))
                    ts = T.if_then_else(q < n4, 4, T.if_then_else(q == n4 and t % 4 >= 2, 2, 1))
                    if j1 != j0 and (ts == 4 or not pairs and ts == 2):
                        # two rows at once: each chunk of x is loaded once for both (4 tokens of a 2048-wide x
                        # are 32 KB, L1's size: read once per row, they came from L2 at half memory speed);
                        # 64 lanes: 2 tokens at a time (4 × 2 × 64 accumulators would fill the registers)
                        for half in range(1 if pairs else ts // 2):
                            tb = t0 + half * 2
                            for tt in T.unroll(PT):
                                for e in T.vectorized(L):
                                    acc[tt, e] = T.float32(0)
                                    acc1[tt, e] = T.float32(0)
                            for c in range(C):
                                _prefetch_chunk(wf, idx[T.min(j0 + ROWS_AHEAD, k - 1)] * d + c * L)
                                _prefetch_chunk(wf, idx[T.min(j1 + ROWS_AHEAD, k - 1)] * d + c * L)
                                for tt in T.unroll(PT):
                                    for e in T.vectorized(L):
                                        acc[tt, e] = acc[tt, e] + T.Cast("float32", w[idx[j0], c * L + e]) * x[tb + tt, c * L + e]
                                        acc1[tt, e] = acc1[tt, e] + T.Cast("float32", w[idx[j1], c * L + e]) * x[tb + tt, c * L + e]
                            tree(acc, PT, j0, tb)
                            tree(acc1, PT, j1, tb)
                    else:
                        for jj in range(j1 - j0 + 1):
                            if ts == 4:
                                one(4, j0 + jj)
                            elif ts == 2:
                                one(2, j0 + jj)
                            else:
                                one(1, j0 + jj)

    return main


GROUP = 8  # rows per step of the down kernel (one load / store of a y tile per GROUP rows' FMAs)


def describe_down(spec: KernelSpec, parts: int) -> tvm.tirx.PrimFunc:
    """Kind ``gemv_down`` for several tokens, ``main(h, w_down_t, idx, y)``: ``y[t] = Σ_j h[t, j] · w_down_t[idx[j]]``
    (``h`` ``[T, k]``, ``y`` ``[T, d_model]`` written). Threads split y's columns (``parts`` contiguous ranges of
    64-column tiles), so each reads one contiguous piece of every selected row (``d_model / parts`` elements) and
    keeps its range of the T tokens' ``y`` in L1. It walks the selected rows ``GROUP`` at a time; per group and
    64-column tile it prefetches the same piece of the next group's rows, then for each tile of 4 (2, 1) tokens
    loads the 4 × 64 sums, adds the group's rows (each 128-byte piece loaded and widened once per token tile) and
    stores them. So every row is read once whatever T is, as ``GROUP`` sequential streams (the loop over columns
    outside the rows it replaced read 128 bytes of every row in turn: 1.4–2.0× slower, ``benchmarks/README.md``,
    serving). Each y element adds its rows one after the other in ascending ``j`` whatever T is, so rows whose
    ``h`` is 0 for a token add exact zeros to its sums (``runtime/batch_ffn.py``)."""
    d, n, wdt = spec.d_model, spec.n_rows, spec.weight_dtype
    n_sub = d // COLS
    parts = max(1, min(parts, n_sub))
    per_line = _per_line(wdt)
    LINES = COLS // per_line  # cache lines of one row's piece of a column tile

    @T.macro(hygienic=False)
    def rows(TS, j0, G):  # y[t0:t0+TS, c0:c0+COLS] += rows j0..j0+G-1 (in order)
        for tt in T.unroll(TS):
            for e in T.vectorized(COLS):
                acc[tt, e] = y[t0 + tt, c0 + e]
        for g in T.unroll(G):
            for tt in T.unroll(TS):
                for e in T.vectorized(COLS):
                    acc[tt, e] = acc[tt, e] + h[t0 + tt, j0 + g] * T.Cast("float32", w[idx[j0 + g], c0 + e])
        for tt in T.unroll(TS):
            for e in T.vectorized(COLS):
                y[t0 + tt, c0 + e] = acc[tt, e]

    @T.macro(hygienic=False)
    def token_tiles(j0, G, step):  # ``step`` (``rows``) for each tile of 4 tokens, then one of 2, then one of 1
        for q in range(n_tiles):
            t0 = T.if_then_else(q < n4, q * 4, T.if_then_else(q == n4 and t % 4 >= 2, n4 * 4, t - 1))
            ts = T.if_then_else(q < n4, 4, T.if_then_else(q == n4 and t % 4 >= 2, 2, 1))
            if ts == 4:
                step(4, j0, G)
            elif ts == 2:
                step(2, j0, G)
            else:
                step(1, j0, G)

    @T.prim_func
    def main(h_h: T.handle, w: T.Buffer((n, d), wdt), idx_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t = T.int32()
        k = T.int32()
        h = T.match_buffer(h_h, (t, k), "float32")
        idx = T.match_buffer(idx_h, (k,), "int32")
        y = T.match_buffer(y_h, (t, d), "float32")
        wf = T.decl_buffer((n * d,), wdt, data=w.data)
        for p in T.parallel(parts):
            acc = T.alloc_buffer((4, COLS), "float32")
            s_lo = p * n_sub // parts
            s_n = (p + 1) * n_sub // parts - s_lo
            n4 = t // 4
            n_tiles = n4 + (t % 4) // 2 + t % 2
            for tt in range(t):
                for sc in range(s_n):
                    for e in T.vectorized(COLS):
                        y[tt, (s_lo + sc) * COLS + e] = T.float32(0)
            for jg in range(k // GROUP):
                for sc in range(s_n):
                    c0 = (s_lo + sc) * COLS
                    for g in range(GROUP):  # the same piece of the next group's rows (a hint: never faults)
                        for ln in range(LINES):
                            T.evaluate(T.call_llvm_intrin(
                                "void", "llvm.prefetch.p0",
                                T.address_of(wf[idx[T.min(jg * GROUP + GROUP + g, k - 1)] * d + c0 + ln * per_line]),
                                0, 3, 1))
                    token_tiles(jg * GROUP, GROUP, rows)
            for sc in range(s_n):
                c0 = (s_lo + sc) * COLS
                for j in range(k - k // GROUP * GROUP):
                    token_tiles(k // GROUP * GROUP + j, 1, rows)

    return main

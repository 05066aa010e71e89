"""Kind ``input_sparse``: one token's input-sparse linear ``y = Σ_{i: mask[i]} x[i] · w_t[i]`` (CPU).

``w_t`` ``[n_rows, d_model]`` is a linear layer's weight input-major (nn.Linear's transposed: one row per input
channel), ``x`` ``[n_rows]`` float32, ``mask`` ``[n_rows]`` int8 (a bool mask viewed as int8: the channels read),
``y`` ``[d_model]`` float32, written. Only the rows of active channels are read.

Schedule (written directly in TIR, not through TE: the active list is data-dependent): ``parts`` parallel tasks
(one per core) split ``y`` (d_model) into contiguous column ranges, never the reduction. Each task

1. compacts the mask itself into a private list of row offsets and their ``x`` values (d_in byte compares: a few
   µs, in parallel in every task; no barrier, no second parallel region, nothing gathered in torch);
2. zeroes its range of ``y`` (it stays in L1: at most d_model/parts float32);
3. walks the active rows eight at a time: for each cache line of its range, ``y += (x0·w0 + … + x3·w3) + (x4·w4 +
   … + x7·w7)`` (float16 widened in registers, float32 FMAs; eight rows per ``y`` load/store: four ran 4–10 %
   slower at 40 % sparsity on an AMD Zen 5, ``benchmarks/README.md``), prefetching (``prefetcht1``) the same line
   of the next eight active rows. The list is padded to a multiple of eight (and the prefetch distance) with the
   last active row at ``x = 0``, which re-reads a cached row.

Without the prefetch a task's reads are short segments of rows far apart (d_model·itemsize / parts bytes each)
and the hardware prefetchers lose each one's start; with it the kernel reads at about the dense GEMV's
bandwidth (``benchmarks/README.md``, "Input-sparse kernel").
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .spec import KernelSpec

ROWS = 8  # active rows per step (one y load/store per eight FMAs; 4 measured 4-10 % slower at 40 %); eight_rows is written for 8
AHEAD = 1  # prefetch distance, in steps of ROWS rows
_LOCALITY = 2  # llvm.prefetch locality 2 = prefetcht1 (into L2), as cpu_rewrite
_LINE_BYTES = 64
ROW_SPLIT_MAX_BYTES = 0  # rows (d_model · itemsize) at most this long: the tasks split the rows, not y


def step_elems(spec: KernelSpec) -> int:
    """Elements of ``y`` per inner iteration: one cache line of ``w_t`` (fewer when d_model is not a multiple)."""
    item = 2 if spec.weight_dtype == "float16" else 4
    for e in (_LINE_BYTES // item, 16, 8, 4, 2, 1):
        if spec.d_model % e == 0:
            return e
    return 1


def row_split(spec: KernelSpec) -> bool:
    """Whether ``spec``'s tasks split the active rows (:func:`describe_rows`) rather than ``y``: rows of at most
    ROW_SPLIT_MAX_BYTES (0: never)."""
    item = 2 if spec.weight_dtype == "float16" else 4
    return spec.d_model * item <= ROW_SPLIT_MAX_BYTES


@T.macro(hygienic=False)
def compact_active(d_in, d_out, pad):
    """The active channels' row offsets ``off[:k[0]]`` (i · d_out) and x values ``h``, then ``pad`` copies of the
    last offset with x = 0 (the unrolled groups of 8 and their prefetches read past the end harmlessly)."""
    k[0] = 0
    for i in range(d_in):
        if mask[i] != T.int8(0):
            off[k[0]] = i * d_out
            h[k[0]] = x[i]
            k[0] = k[0] + 1
    for q in range(pad):
        off[k[0] + q] = T.if_then_else(k[0] > 0, off[T.max(k[0] - 1, 0)], 0)
        h[k[0] + q] = T.float32(0)


@T.macro(hygienic=False)
def eight_rows(dst, a0, c0, j, ahead, n_iter, R, L):
    """``dst[a0 + i] += Σ_{g<8} h[8j + g] · w[off[8j + g] + c0 + i]`` for i < n_iter·L (two sums of four, then
    added to dst), with the same lines of the 8 active rows ``ahead`` groups on prefetched (no Let inside the
    vectorized loop: TVM 0.27's vectorizer drops the store; the indices are inline)."""
    for v in range(n_iter):
        for g in T.unroll(8):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                          T.address_of(w[off[j * R + R * ahead + g] + c0 + v * L]), 0, _LOCALITY, 1))
        for e in T.vectorized(L):
            dst[a0 + v * L + e] = (dst[a0 + v * L + e]
                                   + (h[j * R] * T.Cast("float32", w[off[j * R] + c0 + v * L + e])
                                      + h[j * R + 1] * T.Cast("float32", w[off[j * R + 1] + c0 + v * L + e])
                                      + h[j * R + 2] * T.Cast("float32", w[off[j * R + 2] + c0 + v * L + e])
                                      + h[j * R + 3] * T.Cast("float32", w[off[j * R + 3] + c0 + v * L + e]))
                                   + (h[j * R + 4] * T.Cast("float32", w[off[j * R + 4] + c0 + v * L + e])
                                      + h[j * R + 5] * T.Cast("float32", w[off[j * R + 5] + c0 + v * L + e])
                                      + h[j * R + 6] * T.Cast("float32", w[off[j * R + 6] + c0 + v * L + e])
                                      + h[j * R + 7] * T.Cast("float32", w[off[j * R + 7] + c0 + v * L + e])))


def describe(spec: KernelSpec, parts: int) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``main(x, mask, w_t, y)`` for ``spec`` (kind ``input_sparse``), split over ``parts`` tasks."""
    if row_split(spec):
        return describe_rows(spec, parts)
    d_in, d_out, wdt = spec.n_rows, spec.d_model, spec.weight_dtype
    L = step_elems(spec)
    n_steps = d_out // L  # inner iterations over the whole y, shared out to the parts
    parts = max(1, min(parts, n_steps))
    pad = ROWS * (AHEAD + 1)
    R = ROWS

    @T.prim_func
    def main(x: T.Buffer((d_in,), "float32"), mask: T.Buffer((d_in,), "int8"),
             w_t: T.Buffer((d_in, d_out), wdt), y: T.Buffer((d_out,), "float32")):
        T.func_attr({"tirx.noalias": True})
        w = T.decl_buffer((d_in * d_out,), wdt, data=w_t.data)
        for p in T.parallel(parts):
            off = T.alloc_buffer((d_in + pad,), "int32")  # row offsets (i * d_out) of the active channels
            h = T.alloc_buffer((d_in + pad,), "float32")  # their x values
            k = T.alloc_buffer((16,), "int32")  # k[0]: active count (a buffer: a TIR scalar is immutable)
            compact_active(d_in, d_out, pad)
            c0 = (p * n_steps // parts) * L
            n = ((p + 1) * n_steps // parts) * L - c0
            for v in range(n // L):
                for e in T.vectorized(L):
                    y[c0 + v * L + e] = T.float32(0)
            for j in range((k[0] + R - 1) // R):
                eight_rows(y, c0, c0, j, AHEAD, n // L, R, L)

    return main


def describe_rows(spec: KernelSpec, parts: int, ahead: int = AHEAD) -> tvm.tirx.PrimFunc:
    """As :func:`describe`, the tasks splitting the *active rows* instead of ``y``: each task reads whole rows (one
    contiguous ``d_model·itemsize`` run each, not a ``1/parts`` segment of it) into a private float32 ``y`` (in L1
    up to d_model 8192), then a second parallel loop sums the ``parts`` partial ``y``. For short rows (d_model 2048
    float16: 2 KiB segments per task under the column split)."""
    d_in, d_out, wdt = spec.n_rows, spec.d_model, spec.weight_dtype
    L = step_elems(spec)
    n_lines = d_out // L
    parts = max(1, parts)
    pad = ROWS * (ahead + 1)
    R = ROWS

    @T.prim_func
    def main(x: T.Buffer((d_in,), "float32"), mask: T.Buffer((d_in,), "int8"),
             w_t: T.Buffer((d_in, d_out), wdt), y: T.Buffer((d_out,), "float32")):
        T.func_attr({"tirx.noalias": True})
        w = T.decl_buffer((d_in * d_out,), wdt, data=w_t.data)
        acc = T.alloc_buffer((parts * d_out,), "float32")  # the tasks' partial y
        for p in T.parallel(parts):
            off = T.alloc_buffer((d_in + pad,), "int32")
            h = T.alloc_buffer((d_in + pad,), "float32")
            k = T.alloc_buffer((16,), "int32")
            compact_active(d_in, d_out, pad)
            a0 = p * d_out
            for v in range(n_lines):
                for e in T.vectorized(L):
                    acc[a0 + v * L + e] = T.float32(0)
            ns = (k[0] + R - 1) // R
            for j in range(p * ns // parts, (p + 1) * ns // parts):
                eight_rows(acc, a0, 0, j, ahead, n_lines, R, L)
        for p in T.parallel(parts):
            for v in range(p * n_lines // parts, (p + 1) * n_lines // parts):
                for e in T.vectorized(L):
                    y[v * L + e] = acc[v * L + e]
                for t in range(1, parts):
                    for e in T.vectorized(L):
                        y[v * L + e] = y[v * L + e] + acc[t * d_out + v * L + e]

    return main

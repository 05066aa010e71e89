"""Kind ``dequant``: a stored weight → its bfloat16 values, at memory speed, for prefill's bfloat16 GEMMs (CPU).

``out[r, c] = bf16(w[r, c])``: ``w`` float16 ``[rows, cols]``, or quantized (``qformat.py``: int8 ``[rows, cols]``
/ packed int4 ``[rows, cols / 2]`` quants and float16 scales ``[rows, cols / block]``, ``w = q · s`` in float32),
``out`` bfloat16 ``[rows, cols]``, written; ``rows`` symbolic (one kernel per format, cols and block). The float32
value is rounded to nearest even, as torch's ``.to(torch.bfloat16)`` rounds it, so ``out`` equals
``qformat.dequantize(q, s).to(torch.bfloat16)`` (``w.to(torch.bfloat16)`` for float16) bit for bit.

Prefill without bfloat16 copies (``runtime/prefill_stream.py``) calls it once per weight per prompt chunk into
one reused buffer, then the bfloat16 GEMM reads that buffer: the copies' GEMMs without their memory (a 7B
artifact's copies are 13 GiB). Threads (the build's cores) split the rows into contiguous ranges; each 32-element
piece of a row is two float32 vectors of 16 converted by one ``vcvtne2ps2bf16`` (AVX512-BF16, which every CPU
with a fast bfloat16 GEMM has: AMX CPUs too) and stored as one 64-byte line; elsewhere TVM's own cast (the same
rounding, several instructions per vector). int4's block of 32 is 16 bytes: the low nibbles are the block's
first 16 elements, the high its last 16 (qformat's order), so one 16-byte load feeds both vectors.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .spec import KernelSpec

PIECE = 32  # elements per store: 16 + 16 float32 lanes → 32 bfloat16 (one cache line)


def supports(spec: KernelSpec) -> bool:
    """Whether ``spec`` (kind ``dequant``) has this schedule: float16 / int8 / int4 weights, cols a multiple of 32."""
    return spec.weight_dtype in ("float16", "int8", "int4") and spec.d_model % PIECE == 0


def _has_bf16_convert(target: tvm.target.Target) -> bool:
    from tvm.target import codegen

    return bool(codegen.llvm_cpu_has_features(["avx512bf16", "avx512f"], target))


def describe(spec: KernelSpec, parts: int, target: tvm.target.Target) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``main(w[, s], out)`` for ``spec`` (kind ``dequant``), rows split over ``parts`` tasks."""
    cols, fmt, block = spec.d_model, spec.weight_dtype, spec.block
    nb = cols // block
    hb = block // 2  # int4: bytes per block
    parts = max(1, parts)
    native = _has_bf16_convert(target)

    def bf16x32(lo: tvm.tirx.PrimExpr, hi: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        """bf16(lo ++ hi): two float32x16 → one bfloat16x32."""
        if native:
            v = tvm.tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512bf16.cvtne2ps2bf16.512", hi, lo)
            return tvm.tirx.call_intrin("bfloat16x32", "tirx.reinterpret", v)
        return tvm.tirx.Cast("bfloat16x32", tvm.tirx.Shuffle([lo, hi], list(range(PIECE))))

    if fmt == "float16":
        @T.prim_func
        def main_f16(w_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            r = T.int32()
            w = T.match_buffer(w_h, (r, cols), "float16")
            o = T.match_buffer(o_h, (r, cols), "bfloat16")
            for p in T.parallel(parts):
                for rr in range((p + 1) * r // parts - p * r // parts):
                    for c in range(cols // PIECE):
                        o[p * r // parts + rr, T.ramp(c * PIECE, 1, PIECE)] = bf16x32(
                            T.Cast("float32x16", w[p * r // parts + rr, T.ramp(c * PIECE, 1, 16)]),
                            T.Cast("float32x16", w[p * r // parts + rr, T.ramp(c * PIECE + 16, 1, 16)]))

        return main_f16
    if fmt == "int8":
        @T.prim_func
        def main_i8(q_h: T.handle, s_h: T.handle, o_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            r = T.int32()
            q = T.match_buffer(q_h, (r, cols), "int8")
            s = T.match_buffer(s_h, (r, nb), "float16")
            o = T.match_buffer(o_h, (r, cols), "bfloat16")
            for p in T.parallel(parts):
                for rr in range((p + 1) * r // parts - p * r // parts):
                    for b in range(nb):
                        for c in range(block // PIECE):
                            o[p * r // parts + rr, T.ramp(b * block + c * PIECE, 1, PIECE)] = bf16x32(
                                T.Cast("float32x16", q[p * r // parts + rr, T.ramp(b * block + c * PIECE, 1, 16)])
                                * T.Broadcast(T.Cast("float32", s[p * r // parts + rr, b]), 16),
                                T.Cast("float32x16", q[p * r // parts + rr, T.ramp(b * block + c * PIECE + 16, 1, 16)])
                                * T.Broadcast(T.Cast("float32", s[p * r // parts + rr, b]), 16))

        return main_i8

    # int4: per 16 bytes of block b (piece c of block/32), the low nibbles are elements c·16 + (0..15) of the
    # block, the high nibbles elements block/2 + c·16 + (0..15): block 32 is one piece (lo ++ hi consecutive);
    # larger blocks pair two pieces' low nibbles (and two pieces' high nibbles) into one 32-element store
    def nib(q: tvm.tirx.Buffer, row: tvm.tirx.PrimExpr, byte0: tvm.tirx.PrimExpr, high: bool,
            scale: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        v = tvm.tirx.BufferLoad(q, [row, tvm.tirx.Ramp(byte0, 1, 16)])
        n = (tvm.tirx.shift_right(v, tvm.tirx.Broadcast(tvm.tirx.const(4, "uint8"), 16)) if high
             else tvm.tirx.bitwise_and(v, tvm.tirx.Broadcast(tvm.tirx.const(15, "uint8"), 16)))
        return (tvm.tirx.Cast("float32x16", n) - tvm.tirx.Broadcast(tvm.tirx.const(8.0, "float32"), 16)) \
            * tvm.tirx.Broadcast(scale, 16)

    @T.prim_func
    def main_i4(q_h: T.handle, s_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        r = T.int32()
        q = T.match_buffer(q_h, (r, cols // 2), "uint8")
        s = T.match_buffer(s_h, (r, nb), "float16")
        o = T.match_buffer(o_h, (r, cols), "bfloat16")
        for p in T.parallel(parts):
            for rr in range((p + 1) * r // parts - p * r // parts):
                for b in range(nb):
                    if block == PIECE:  # (a Python constant: one branch is generated)
                        o[p * r // parts + rr, T.ramp(b * block, 1, PIECE)] = bf16x32(
                            nib(q, p * r // parts + rr, b * hb, False, T.Cast("float32", s[p * r // parts + rr, b])),
                            nib(q, p * r // parts + rr, b * hb, True, T.Cast("float32", s[p * r // parts + rr, b])))
                    else:
                        for c in range(hb // PIECE):  # 32 bytes: two pieces' low nibbles, then their high nibbles
                            o[p * r // parts + rr, T.ramp(b * block + c * PIECE, 1, PIECE)] = bf16x32(
                                nib(q, p * r // parts + rr, b * hb + c * PIECE, False, T.Cast("float32", s[p * r // parts + rr, b])),
                                nib(q, p * r // parts + rr, b * hb + c * PIECE + 16, False, T.Cast("float32", s[p * r // parts + rr, b])))
                            o[p * r // parts + rr, T.ramp(b * block + hb + c * PIECE, 1, PIECE)] = bf16x32(
                                nib(q, p * r // parts + rr, b * hb + c * PIECE, True, T.Cast("float32", s[p * r // parts + rr, b])),
                                nib(q, p * r // parts + rr, b * hb + c * PIECE + 16, True, T.Cast("float32", s[p * r // parts + rr, b])))

    return main_i4

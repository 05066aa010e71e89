"""Quantized CPU dot products with integer multiply-adds (llama.cpp's ``vec_dot_q4_0_q8_0`` / ``q8_0_q8_0``).

Kind ``up`` (one token, no bias: the dense GEMV of every quantized linear layer, and the sparse up part), int8 /
int4 weights (``qformat.py``): the kernel first quantizes ``x`` once per call to int8 blocks of the weight's block
size (``dx = max|x| / 127``, ``xq = round_half_even(x / dx)``; ``qx_reference`` below is the torch twin), then each
row's dot product is integer: per 64-byte chunk of quants one (int8) or two (int4: low and high nibbles) u8 × s8
→ i32 multiply-adds of 64 byte pairs, then one float multiply-add per 16 int32 lanes by ``s_w[block] * dx[block]``.

* int4: the nibbles are unsigned (0..15) and are the u8 operand as they are; the ``- 8`` is folded into the int32
  accumulator's start value ``-8 * Σ xq`` over the lane's 8 elements (computed with ``x``'s quantization). ``x``'s
  quants are stored in the byte order of the weight row (``xlo[p]`` / ``xhi[p]``: the elements of the low / high
  nibble of byte ``p``), so a chunk of quants and a chunk of ``x`` pair byte for byte, no shuffle.
* int8: signed × signed, by llama.cpp's sign transfer: ``|w|`` (u8) × ``sign(w) · xq`` (s8).
* lane → block: int32 lane ``l`` of chunk ``c`` sums bytes ``64c + 4l …+3``, all of one block; its scale is the
  block's float16 weight scale times its ``dx`` (16 blocks at once: one ``vcvtph2ps`` and one multiply per 16
  blocks, then one ``vpermps`` per chunk puts each on its lanes).
* ISA (``isa_for``, from the LLVM target's features at build time): ``vnni`` (AVX512-VNNI ``vpdpbusd``; AMD Zen 4,
  Intel Ice Lake and later, AMX machines too), ``avx512bw`` (``vpmaddubsw`` + ``vpmaddwd``: the same sums, int16
  pairs cannot saturate: 2 · 15 · 127 and 2 · 128 · 127 < 32768), else ``None``: the float kernels of
  ``compute.py`` / ``cpu.py`` (AVX2, generic LLVM, odd shapes).
* shape condition: ``d_model`` a multiple of 16 blocks (``16 * block``: 512 at block 32), so the scales of a
  16-block group are one 32-byte load; other shapes take the float kernel.

The maths differ from the float kernels by ``x``'s quantization (as llama.cpp's): compared against
``qx_reference`` (the same quantized maths in torch, float64) to float32 rounding.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from .spec import KernelSpec

ISAS: tuple[str, ...] = ("vnni", "avx512bw", "avx2")


def isa_for(target: tvm.target.Target) -> str | None:
    """The integer dot-product instructions the LLVM ``target`` has: "vnni", "avx512bw", "avx2", or None."""
    from tvm.target import codegen

    if not codegen.llvm_cpu_has_features(["avx512bw", "avx512f"], target):
        return "avx2" if codegen.llvm_cpu_has_features(["avx2", "fma", "f16c"], target) else None
    return "vnni" if codegen.llvm_cpu_has_features(["avx512vnni"], target) else "avx512bw"


def applies(spec: KernelSpec, isa: str | None) -> bool:
    """Whether the one-token kernel of ``spec`` is this module's (else the float kernels of cpu.py)."""
    return (isa is not None and spec.quantized and not spec.is_cuda and spec.kind in KINDS and not spec.has_bias
            and spec.d_model % (16 * spec.block) == 0)


KINDS: tuple[str, ...] = ("up", "ffn_gated", "ffn_relu")  # the kinds with an integer dot-product kernel
AHEAD: int = 2  # fused FFN: the deciding rows prefetched this many rows ahead
# kind up: the row whose lines a row's dot product prefetches, this many rows ahead, by quant dtype. int8 rows
# (2,176 bytes at d 2048) stream from DRAM: 8 ahead decoded the 1B int8 artifact 7 % faster than 1 ahead (Zen 2,
# 3 alternated processes each: 20.5-21.1 against 22.3-22.5 ms a step); int4 rows are compute-bound there (1 and 8
# measured level), so they keep 1.
UP_AHEAD: dict[str, int] = {"int8": 8, "int4": 1}


def describe(spec: KernelSpec, isa: str, partitions: int) -> tirx.PrimFunc:
    """This module's one-token kernel for ``spec`` (``applies``), fused kinds cut into ``partitions`` parts."""
    return describe_up(spec, isa) if spec.kind == "up" else describe_ffn(spec, isa, partitions)


def _lanes(v: tirx.PrimExpr, start: int, n: int) -> tirx.PrimExpr:
    """Lanes ``start .. start+n-1`` of the vector ``v`` (a register half: no instruction once lowered)."""
    return tirx.Shuffle([v], [tirx.const(start + i, "int32") for i in range(n)])


def _concat(a: tirx.PrimExpr, b: tirx.PrimExpr, n: int) -> tirx.PrimExpr:
    """The vectors a and b (n lanes each) side by side."""
    return tirx.Shuffle([a, b], [tirx.const(i, "int32") for i in range(2 * n)])


def _dot(isa: str, acc: tirx.PrimExpr, u8: tirx.PrimExpr, s8: tirx.PrimExpr) -> tirx.PrimExpr:
    """``acc[l] + Σ_{t<4} u8[4l+t] · s8[4l+t]`` over 16 int32 lanes (AVX2: two 32-byte halves, each
    ``vpmaddubsw`` + ``vpmaddwd``; the 512-bit generic operations around it split into 256-bit pairs)."""
    if isa == "vnni":
        return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc, u8, s8)
    if isa == "avx2":
        ones8 = tirx.Broadcast(tirx.const(1, "int16"), 16)
        halves = [tirx.call_llvm_pure_intrin(
            "int32x8", "llvm.x86.avx2.pmadd.wd",
            tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", _lanes(u8, 32 * h, 32),
                                       _lanes(s8, 32 * h, 32)), ones8) for h in range(2)]
        return acc + _concat(halves[0], halves[1], 8)
    pairs = tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", u8, s8)
    ones = tirx.Broadcast(tirx.const(1, "int16"), 32)
    return acc + tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", pairs, ones)


def _dot2(isa: str, acc: tirx.PrimExpr, u8a: tirx.PrimExpr, s8a: tirx.PrimExpr, u8b: tirx.PrimExpr,
          s8b: tirx.PrimExpr) -> tirx.PrimExpr:
    """``_dot(_dot(acc, u8a, s8a), u8b, s8b)`` for ``u8`` operands below 16 (int4 nibbles): without VNNI the two
    ``vpmaddubsw`` pair sums are added as int16 (|2 · 2 · 15 · 128| < 2¹⁵: no saturation) before the one
    ``vpmaddwd`` that widens them (two instructions fewer per 64 bytes of int4 quants)."""
    if isa == "vnni":
        return _dot(isa, _dot(isa, acc, u8a, s8a), u8b, s8b)
    if isa == "avx2":
        ones8 = tirx.Broadcast(tirx.const(1, "int16"), 16)
        halves = []
        for h in range(2):
            pa, pb = (tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", _lanes(u, 32 * h, 32),
                                                 _lanes(v, 32 * h, 32)) for u, v in ((u8a, s8a), (u8b, s8b)))
            halves.append(tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", pa + pb, ones8))
        return acc + _concat(halves[0], halves[1], 8)
    pa, pb = (tirx.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", u, v)
              for u, v in ((u8a, s8a), (u8b, s8b)))
    ones = tirx.Broadcast(tirx.const(1, "int16"), 32)
    return acc + tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.pmaddw.d.512", pa + pb, ones)


def _permute16(isa: str, v: tirx.PrimExpr, idx: tirx.PrimExpr) -> tirx.PrimExpr:
    """``v[idx[l]]`` for 16 float32 lanes (indices < 16): one ``vpermps`` (AVX-512), or on AVX2 each output half
    from the two 8-lane halves of v (``vpermps`` takes an index's low 3 bits) and a blend on ``idx < 8``. The
    indices are constants once the chunk loop is unrolled, so LLVM turns either into fixed shuffles."""
    if isa != "avx2":
        return tirx.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.permvar.sf.512", v, idx)
    lo, hi = _lanes(v, 0, 8), _lanes(v, 8, 8)
    out = []
    for h in range(2):
        i8 = _lanes(idx, 8 * h, 8)
        out.append(tirx.Select(i8 < tirx.Broadcast(tirx.const(8, "int32"), 8),
                               tirx.call_llvm_pure_intrin("float32x8", "llvm.x86.avx2.permps", lo, i8),
                               tirx.call_llvm_pure_intrin("float32x8", "llvm.x86.avx2.permps", hi, i8)))
    return _concat(out[0], out[1], 8)


def _sign_of(isa: str, xv: tirx.PrimExpr, q: tirx.PrimExpr) -> tirx.PrimExpr:
    """int8 sign transfer over 64 lanes: ``-xv`` where ``q < 0``, else ``xv`` (where q = 0 its |q| = 0 zeroes the
    product anyway). AVX2: one ``vpsignb`` per 32-byte half (which also zeroes those lanes); AVX-512 has no
    ``vpsignb``: a compare and a masked negate."""
    if isa == "avx2":
        return _concat(*(tirx.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", _lanes(xv, 32 * h, 32),
                                                    _lanes(q, 32 * h, 32)) for h in range(2)), 32)
    zero = tirx.Broadcast(tirx.const(0, "int8"), 64)
    return tirx.Select(q < zero, zero - xv, xv)


def int8_scale(absmax16: tirx.PrimExpr) -> tirx.PrimExpr:
    """A block's int8 scale ``max|v| / 127`` from 16 lanes of |v| (float32x16, non-negative): the bits of
    non-negative floats order as unsigned integers, and an integer reduction is a shuffle tree (llvm's fmax
    reduction is a serial chain of NaN-checking compares)."""
    bits = tirx.call_llvm_pure_intrin("uint32", "llvm.vector.reduce.umax", tirx.reinterpret("uint32x16", absmax16))
    return tirx.reinterpret("float32", bits) / tirx.const(127.0, "float32")


def _act(act: str, v: tirx.PrimExpr) -> tirx.PrimExpr:
    if act == "relu":
        return tirx.max(v, tirx.const(0.0, "float32"))
    if act == "silu":
        return v * tirx.sigmoid(v)
    return v


def _shape(spec: KernelSpec) -> dict[str, int]:
    d, B = spec.d_model, spec.block
    int4 = spec.weight_dtype == "int4"
    RB = d // 2 if int4 else d  # quant bytes per row
    HB = B // 2 if int4 else B  # quant bytes per block
    return {"nb": d // B, "RB": RB, "HB": HB, "NL": RB // 4, "GB": 16 * HB, "CPG": 16 * HB // 64,
            "NG": d // B // 16, "VX": B // 16}


def _macros(spec: KernelSpec, isa: str):  # -> (prep_x, row_dot): TVMScript macros of the two halves
    """``prep_x``: x → its int8 quants in weight-row byte order, the int4 lane corrections and the blocks' scales;
    ``row_dot(w, s, row, nxt, acc, out)``: ``out[0] = row · x`` (``nxt``: the row whose lines are prefetched)."""
    d, B = spec.d_model, spec.block
    int4 = spec.weight_dtype == "int4"
    sh = _shape(spec)
    nb, HB, NL, GB, CPG, NG, VX = (sh[k] for k in ("nb", "HB", "NL", "GB", "CPG", "NG", "VX"))
    dot = _dot
    zero16 = tirx.Broadcast(tirx.const(0, "int32"), 16)

    @T.macro(hygienic=True)
    def prep_x(x, xa, xb, xc, xd, m16):
        for b in range(nb):  # serial: d_model elements, before the parallel region
            m16[T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for c in T.unroll(VX):
                m16[T.ramp(0, 1, 16)] = T.max(m16[T.ramp(0, 1, 16)], T.fabs(x[T.ramp(b * B + c * 16, 1, 16)]))
            dd = T.bind(int8_scale(m16[T.ramp(0, 1, 16)]))
            xd[b] = dd
            inv = T.bind(T.Select(dd != T.float32(0), T.float32(1) / dd, T.float32(0)))
            for c in T.unroll(VX):
                qv = T.bind(T.Cast("int8x16", T.round(x[T.ramp(b * B + c * 16, 1, 16)] * T.Broadcast(inv, 16))))
                if int4 and c * 16 >= HB:
                    xb[T.ramp(b * HB + c * 16 - HB, 1, 16)] = qv
                else:
                    xa[T.ramp(b * HB + c * 16, 1, 16)] = qv
        for L in range(NL):
            if int4:
                xc[L] = T.int32(-8) * (T.Cast("int32", xa[4 * L]) + T.Cast("int32", xa[4 * L + 1])
                                       + T.Cast("int32", xa[4 * L + 2]) + T.Cast("int32", xa[4 * L + 3])
                                       + T.Cast("int32", xb[4 * L]) + T.Cast("int32", xb[4 * L + 1])
                                       + T.Cast("int32", xb[4 * L + 2]) + T.Cast("int32", xb[4 * L + 3]))

    @T.macro(hygienic=True)
    def row_dot(w, s, xa, xb, xc, xd, row, nxt, acc, out):
        acc[T.ramp(0, 1, 16)] = T.Broadcast(T.float32(0), 16)
        for g in range(NG):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(s[nxt, g * 16]), 0, 2, 1))
            sw = T.bind(T.Cast("float32x16", s[row, T.ramp(g * 16, 1, 16)]) * xd[T.ramp(g * 16, 1, 16)])
            for cc in T.unroll(CPG):
                T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0",
                                              T.address_of(w[nxt, g * GB + cc * 64]), 0, 2, 1))
                q = T.bind(w[row, T.ramp(g * GB + cc * 64, 1, 64)])
                if int4:
                    lo = T.bind(T.bitwise_and(q, T.Broadcast(T.uint8(15), 64)))
                    hi = T.bind(T.shift_right(q, T.Broadcast(T.uint8(4), 64)))
                    iv = T.bind(_dot2(isa, xc[T.ramp(g * GB // 4 + cc * 16, 1, 16)], lo,
                                     xa[T.ramp(g * GB + cc * 64, 1, 64)], hi, xb[T.ramp(g * GB + cc * 64, 1, 64)]))
                else:
                    xv = T.bind(xa[T.ramp(g * GB + cc * 64, 1, 64)])
                    sx = T.bind(_sign_of(isa, xv, q))
                    iv = T.bind(dot(isa, zero16, T.reinterpret("uint8x64", T.abs(q)), sx))
                lane_blk = T.bind(T.floordiv(T.ramp(cc * 64, 4, 16), T.Broadcast(HB, 16)))
                sc = T.bind(_permute16(isa, sw, lane_blk))
                acc[T.ramp(0, 1, 16)] = acc[T.ramp(0, 1, 16)] + T.Cast("float32x16", iv) * sc
        out[0] = T.call_llvm_pure_intrin("float32", "llvm.vector.reduce.fadd", T.float32(0), acc[T.ramp(0, 1, 16)])

    return prep_x, row_dot


def _up_setup(spec: KernelSpec, isa: str) -> tuple:
    """Kind ``up``'s constants: (d_model, n_rows, quant dtype, blocks, quant bytes per row, int32 lanes per row,
    act, (prep_x, row_dot)); refuses a spec this module has no kernel for."""
    if not applies(spec, isa) or spec.kind != "up":
        raise ValueError(f"no integer dot-product kernel for {spec}")
    sh = _shape(spec)
    return (spec.d_model, spec.n_rows, "uint8" if spec.weight_dtype == "int4" else "int8", sh["nb"], sh["RB"],
            sh["NL"], spec.act, _macros(spec, isa))


def describe_up(spec: KernelSpec, isa: str) -> tirx.PrimFunc:
    """The one-token ``up`` kernel ``h[j] = act(w[idx[j]] · x)``, arguments ``(x, w, s, idx, h)``."""
    d, n, qdt, nb, RB, NL, act, (prep_x, row_dot) = _up_setup(spec, isa)
    ahead = UP_AHEAD[spec.weight_dtype]

    @T.prim_func(check_well_formed=False)
    def up(xh: T.handle, wh: T.handle, sh_: T.handle, idxh: T.handle, hh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        k = T.int32()
        x = T.match_buffer(xh, (d,), "float32", align=64)  # [d_model]
        w = T.match_buffer(wh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        s = T.match_buffer(sh_, (n, nb), "float16", align=64)  # [n_rows, blocks]
        idx = T.match_buffer(idxh, (k,), "int32")  # [k]
        h = T.match_buffer(hh, (k,), "float32")  # [k]
        xa = T.decl_buffer((RB,), "int8", align=64)  # int4: x quants of the low nibbles; int8: x quants
        xb = T.decl_buffer((RB,), "int8", align=64)  # int4: x quants of the high nibbles
        xc = T.decl_buffer((NL,), "int32", align=64)  # int4: each lane's -8 * sum of its x quants
        xd = T.decl_buffer((nb,), "float32", align=64)  # each block's x scale
        m16 = T.decl_buffer((16,), "float32", align=64)
        prep_x(x, xa, xb, xc, xd, m16)
        for j in T.parallel(k):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            row_dot(w, s, xa, xb, xc, xd, idx[j], idx[T.min(j + ahead, k - 1)], acc, res)
            h[j] = _act(act, res[0])

    return up


BATCH_ROWS: int = 64  # several-token ``up``: rows per parallel block (64 int4 rows of d 2048: 74 KB, L2-resident)


def token_macros(spec: KernelSpec, isa: str):  # -> (prep_tokens, take_token): TVMScript macros
    """Several tokens' x for ``row_dot``: ``prep_tokens(x, qa, qb, qc, qd, t)`` quantizes each row of ``x`` [t, d]
    as the one-token kernel does (``prep_x``; serial, before a parallel region) into ``qa``/``qb`` [t, RB],
    ``qc`` [t, NL] and ``qd`` [t, blocks]; ``take_token(qa, qb, qc, qd, tt, xa, xb, xc, xd)`` copies token
    ``tt``'s into a thread's one-token buffers."""
    d = spec.d_model
    sh = _shape(spec)
    nb, RB, NL = sh["nb"], sh["RB"], sh["NL"]
    prep_x, _ = _macros(spec, isa)

    @T.macro(hygienic=True)
    def prep_tokens(x, qa, qb, qc, qd, t):
        x1 = T.decl_buffer((d,), "float32", align=64)
        ya = T.decl_buffer((RB,), "int8", align=64)
        yb = T.decl_buffer((RB,), "int8", align=64)
        yc = T.decl_buffer((NL,), "int32", align=64)
        yd = T.decl_buffer((nb,), "float32", align=64)
        m16 = T.decl_buffer((16,), "float32", align=64)
        for tt in range(t):
            for i in range(d // 16):
                x1[T.ramp(i * 16, 1, 16)] = x[tt, T.ramp(i * 16, 1, 16)]
            prep_x(x1, ya, yb, yc, yd, m16)
            for i in range(RB // 16):
                qa[tt, T.ramp(i * 16, 1, 16)] = ya[T.ramp(i * 16, 1, 16)]
                qb[tt, T.ramp(i * 16, 1, 16)] = yb[T.ramp(i * 16, 1, 16)]
            for i in range(NL):
                qc[tt, i] = yc[i]
            for i in range(nb):
                qd[tt, i] = yd[i]

    @T.macro(hygienic=True)
    def take_token(qa, qb, qc, qd, tt, xa, xb, xc, xd):
        for i in range(RB // 16):
            xa[T.ramp(i * 16, 1, 16)] = qa[tt, T.ramp(i * 16, 1, 16)]
            xb[T.ramp(i * 16, 1, 16)] = qb[tt, T.ramp(i * 16, 1, 16)]
        for i in range(NL):
            xc[i] = qc[tt, i]
        for i in range(nb):
            xd[i] = qd[tt, i]

    return prep_tokens, take_token


def describe_up_batched(spec: KernelSpec, isa: str) -> tirx.PrimFunc:
    """The several-token ``up`` kernel ``h[t, j] = act(w[idx[j]] · x[t])``, arguments ``(x [t, d], w, s, idx,
    h [t, k])``: each token's x quantized as the one-token kernel does (``prep_x``, before the parallel region),
    then parallel over blocks of ``BATCH_ROWS`` rows: per token, its quants copied into the thread's own buffers,
    then the block's dot products (``row_dot``: the one-token kernel's sums, so a token's result is the same
    alone or beside others; the block's rows come from memory once and from cache for the other tokens)."""
    d, n, qdt, nb, RB, NL, act, (prep_x, row_dot) = _up_setup(spec, isa)
    prep_tokens, take_token = token_macros(spec, isa)
    R = BATCH_ROWS

    @T.prim_func(check_well_formed=False)
    def up_batch(xh: T.handle, wh: T.handle, sh_: T.handle, idxh: T.handle, hh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        k = T.int32()
        t = T.int32()
        x = T.match_buffer(xh, (t, d), "float32", align=64)  # [t, d_model]
        w = T.match_buffer(wh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        s = T.match_buffer(sh_, (n, nb), "float16", align=64)  # [n_rows, blocks]
        idx = T.match_buffer(idxh, (k,), "int32")  # [k]
        h = T.match_buffer(hh, (t, k), "float32")  # [t, k]
        qa = T.decl_buffer((t, RB), "int8", align=64)  # [t, quant bytes]: every token's prep_x results
        qb = T.decl_buffer((t, RB), "int8", align=64)
        qc = T.decl_buffer((t, NL), "int32", align=64)
        qd = T.decl_buffer((t, nb), "float32", align=64)
        prep_tokens(x, qa, qb, qc, qd, t)  # serial, before the parallel region
        for blk in T.parallel((k + R - 1) // R):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            xa = T.decl_buffer((RB,), "int8", align=64)
            xb = T.decl_buffer((RB,), "int8", align=64)
            xc = T.decl_buffer((NL,), "int32", align=64)
            xd = T.decl_buffer((nb,), "float32", align=64)
            for tt in range(t):
                take_token(qa, qb, qc, qd, tt, xa, xb, xc, xd)
                for jj in range(R):
                    if blk * R + jj < k:
                        row_dot(w, s, xa, xb, xc, xd, idx[blk * R + jj], idx[T.min(blk * R + jj + 1, k - 1)], acc, res)
                        h[tt, blk * R + jj] = _act(act, res[0])

    return up_batch


GROUP: int = 4  # gated FFN: active rows per step of the down part (one y_part load/store per GROUP rows)
LEAD: int = 1  # gated FFN: the next rows' up and down lines are prefetched this many groups ahead


def _prefetch4_macro(spec: KernelSpec):  # -> TVMScript macro
    """``prefetch4(wd, sd, n0..n3, c)``: line ``c`` of the down rows ``n0..n3``' quants, and of their scales while
    ``c`` is below the scales' line count (the group after the current one, in the down macros' loops)."""
    scale_lines = max(1, _shape(spec)["nb"] * 2 // 64)  # float16 scales: 64-byte lines per row

    def pf(buf, row, col):
        return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[row, col]), 0, 2, 1))

    @T.macro(hygienic=True)
    def prefetch4(wd, sd, n0, n1, n2, n3, c):
        pf(wd, n0, c * 64)
        pf(wd, n1, c * 64)
        pf(wd, n2, c * 64)
        pf(wd, n3, c * 64)
        if c < scale_lines:
            pf(sd, n0, c * 32)
            pf(sd, n1, c * 32)
            pf(sd, n2, c * 32)
            pf(sd, n3, c * 32)

    return prefetch4


def _down4_macro(spec: KernelSpec):  # -> TVMScript macro
    """``axpy4(wd, sd, r0..r3, h0..h3, yp, p, n0..n3)``: ``yp[p] += Σ_i h_i · dequant(wd[r_i])`` (float32, per 16
    elements one ``y_part`` load and store for the four rows: ``q * (h * s)`` each), prefetching the same line of
    the rows ``n0..n3`` (and their scales' lines)."""
    B = spec.block
    int4 = spec.weight_dtype == "int4"
    sh = _shape(spec)
    RB, HB = sh["RB"], sh["HB"]
    prefetch4 = _prefetch4_macro(spec)

    def lo(qb):
        return T.Cast("float32x16", T.Cast("int8x16", T.bitwise_and(qb, T.Broadcast(T.uint8(15), 16)))
                      - T.Broadcast(T.int8(8), 16))

    def hi(qb):
        return T.Cast("float32x16", T.Cast("int8x16", T.shift_right(qb, T.Broadcast(T.uint8(4), 16)))
                      - T.Broadcast(T.int8(8), 16))

    @T.macro(hygienic=True)
    def axpy4(wd, sd, r0, r1, r2, r3, h0, h1, h2, h3, yp, p, n0, n1, n2, n3):
        for c in range(RB // 64):
            prefetch4(wd, sd, n0, n1, n2, n3, c)
            for t in T.unroll(4):
                s0 = T.bind(T.Broadcast(h0 * T.Cast("float32", sd[r0, (c * 64 + t * 16) // HB]), 16))
                s1 = T.bind(T.Broadcast(h1 * T.Cast("float32", sd[r1, (c * 64 + t * 16) // HB]), 16))
                s2 = T.bind(T.Broadcast(h2 * T.Cast("float32", sd[r2, (c * 64 + t * 16) // HB]), 16))
                s3 = T.bind(T.Broadcast(h3 * T.Cast("float32", sd[r3, (c * 64 + t * 16) // HB]), 16))
                q0 = T.bind(wd[r0, T.ramp(c * 64 + t * 16, 1, 16)])
                q1 = T.bind(wd[r1, T.ramp(c * 64 + t * 16, 1, 16)])
                q2 = T.bind(wd[r2, T.ramp(c * 64 + t * 16, 1, 16)])
                q3 = T.bind(wd[r3, T.ramp(c * 64 + t * 16, 1, 16)])
                if int4:
                    e = T.bind(((c * 64 + t * 16) // HB) * B + (c * 64 + t * 16) % HB)
                    yp[p, T.ramp(e, 1, 16)] = yp[p, T.ramp(e, 1, 16)] + (
                        lo(q0) * s0 + lo(q1) * s1 + (lo(q2) * s2 + lo(q3) * s3))
                    yp[p, T.ramp(e + HB, 1, 16)] = yp[p, T.ramp(e + HB, 1, 16)] + (
                        hi(q0) * s0 + hi(q1) * s1 + (hi(q2) * s2 + hi(q3) * s3))
                else:
                    yp[p, T.ramp(c * 64 + t * 16, 1, 16)] = yp[p, T.ramp(c * 64 + t * 16, 1, 16)] + (
                        T.Cast("float32x16", q0) * s0 + T.Cast("float32x16", q1) * s1
                        + (T.Cast("float32x16", q2) * s2 + T.Cast("float32x16", q3) * s3))

    return axpy4


INT_DOWN: bool = True  # gated FFN: the down rows by integer multiply-adds over 4 rows (``_down_int_macro``)


def int_down(spec: KernelSpec, isa: str) -> bool:
    """Whether the gated FFN's down rows take ``_down_int_macro`` (int8 on AVX512-BW alone keeps the float axpy:
    ``vpmaddubsw``'s int16 pair sums of 255 · 127 would saturate)."""
    return INT_DOWN and (isa == "vnni" or spec.weight_dtype == "int4")


PAIRED_DOWN: bool = True  # AVX2 int4: the integer down rows as two pairs (``paired_down``); False for A/Bs


def paired_down(spec: KernelSpec, isa: str) -> bool:
    """Whether the integer down rows take the AVX2 form of ``_down_int_macro``: the 4 rows as two interleaved
    pairs, their ``vpmaddubsw`` sums added as int16 (|Σ| ≤ 4 · 15 · 127 + 8 · 4 · 127 < 2¹⁵) and widened by
    shifts, where the 4-row form spends a ``vpmaddwd`` per 16 outputs and twice the byte shuffles. The same
    integers, so the same floats; ``y_part`` holds each 16 outputs as their 8 even then their 8 odd ones
    (``unpair`` puts them back). Zen 2, one thread, 768 rows of the 1B's FFN with ~half active (L3): 112.8
    against 118.0 µs a call, best of 5 alternated processes."""
    return PAIRED_DOWN and int_down(spec, isa) and isa == "avx2" and spec.weight_dtype == "int4"


UNPAIR: tuple[int, ...] = tuple(m // 2 + 8 * (m % 2) for m in range(16))  # output m of 16 ← y_part lane UNPAIR[m]


def unpair(v: tirx.PrimExpr, paired: bool) -> tirx.PrimExpr:
    """16 ``y_part`` lanes in output order (``paired_down``: from evens-then-odds; else as they are)."""
    return tirx.Shuffle([v], [tirx.const(i, "int32") for i in UNPAIR]) if paired else v


def _down_int_macro(spec: KernelSpec, isa: str):  # -> (scales4, axpy_int): TVMScript macros
    """The down rows of a group of 4 active rows as integer dot products across the rows (llama.cpp's
    ``vec_dot_q4_0_q8_0`` with the roles turned: the reduction runs over the 4 rows, not along a row).

    ``scales4``: per block ``b`` the 4 rows' ``c_i = h_i · s_i[b]`` quantized together (``dc = max_i |c_i| / 127``,
    ``cq_i = round_half_even(c_i / dc)``): ``cw[b]`` the 4 int8 ``cq_i`` packed in one int32, ``cr[b]`` the offset
    term (int4: ``-8 · Σ cq_i``; int8: ``-128 · Σ cq_i``), ``cd[b] = dc``.
    ``axpy_int``: per 16 quant bytes of each row (int4: one block of 32 at block 32; int8: 16 elements) the 4 rows'
    bytes interleaved into 16 int32 lanes (``vpermb``: lane ``e`` = byte ``e`` of rows 0..3), int4 nibbles as they are
    / int8 quants ``+ 128`` (``^ 0x80``) the u8 operand, ``cw[b]`` the s8 one: one ``vpdpbusd`` (``_dot``) per 16
    outputs from ``cr[b]``, then ``y_part += dc · float(acc)``: one int → float conversion and one FMA per 16 outputs
    for the 4 rows, where the float axpy (``_down4_macro``) converts and multiplies each row's elements. The next
    rows' lines (quants and scales) are prefetched as there.
    ``paired_down`` (AVX2 int4): ``scales4`` writes ``cw[b]`` / ``cw[nb + b]`` the (cq_0, cq_1) / (cq_2, cq_3) byte
    pairs and ``cr[b]`` the int16 offset, each twice per int32; the axpy is ``axpy_pairs`` (``paired_down``)."""
    B = spec.block
    int4 = spec.weight_dtype == "int4"
    sh = _shape(spec)
    RB, HB, nb = sh["RB"], sh["HB"], sh["nb"]
    off = -8 if int4 else -128
    perm = [tirx.const(16 * i + e, "int32") for e in range(16) for i in range(4)]  # byte 4e + i ← row i, byte e
    dot = _dot

    def pack(q0, q1, q2, q3):
        m = T.Broadcast(T.int32(255), 16)
        return (T.bitwise_and(q0, m) | T.shift_left(T.bitwise_and(q1, m), T.Broadcast(T.int32(8), 16))
                | T.shift_left(T.bitwise_and(q2, m), T.Broadcast(T.int32(16), 16))
                | T.shift_left(q3, T.Broadcast(T.int32(24), 16)))

    prefetch4 = _prefetch4_macro(spec)

    paired = paired_down(spec, isa)

    def pack2(qa, qb):  # two rows' int8 cq as the int16 (qa, qb) byte pair
        m = T.Broadcast(T.int32(255), 16)
        return T.bitwise_and(qa, m) | T.shift_left(T.bitwise_and(qb, m), T.Broadcast(T.int32(8), 16))

    @T.macro(hygienic=True)
    def scales4(sd, r0, r1, r2, r3, h0, h1, h2, h3, cw, cr, cd):
        for g in range(nb // 16):
            c0 = T.bind(T.Broadcast(h0, 16) * T.Cast("float32x16", sd[r0, T.ramp(g * 16, 1, 16)]))
            c1 = T.bind(T.Broadcast(h1, 16) * T.Cast("float32x16", sd[r1, T.ramp(g * 16, 1, 16)]))
            c2 = T.bind(T.Broadcast(h2, 16) * T.Cast("float32x16", sd[r2, T.ramp(g * 16, 1, 16)]))
            c3 = T.bind(T.Broadcast(h3, 16) * T.Cast("float32x16", sd[r3, T.ramp(g * 16, 1, 16)]))
            dd = T.bind(T.max(T.max(T.fabs(c0), T.fabs(c1)), T.max(T.fabs(c2), T.fabs(c3)))
                        / T.Broadcast(T.float32(127), 16))
            inv = T.bind(T.Select(dd != T.Broadcast(T.float32(0), 16), T.Broadcast(T.float32(1), 16) / dd,
                                  T.Broadcast(T.float32(0), 16)))
            q0 = T.bind(T.Cast("int32x16", T.round(c0 * inv)))
            q1 = T.bind(T.Cast("int32x16", T.round(c1 * inv)))
            q2 = T.bind(T.Cast("int32x16", T.round(c2 * inv)))
            q3 = T.bind(T.Cast("int32x16", T.round(c3 * inv)))
            if paired:  # two int16 (cq_a, cq_b) byte pairs and the int16 offset, each replicated in both halves
                p01 = T.bind(pack2(q0, q1))
                p23 = T.bind(pack2(q2, q3))
                o16 = T.bind(T.bitwise_and(T.Broadcast(T.int32(off), 16) * (q0 + q1 + (q2 + q3)),
                                           T.Broadcast(T.int32(0xFFFF), 16)))
                cw[T.ramp(g * 16, 1, 16)] = p01 | T.shift_left(p01, T.Broadcast(T.int32(16), 16))
                cw[T.ramp(nb + g * 16, 1, 16)] = p23 | T.shift_left(p23, T.Broadcast(T.int32(16), 16))
                cr[T.ramp(g * 16, 1, 16)] = o16 | T.shift_left(o16, T.Broadcast(T.int32(16), 16))
            else:
                cw[T.ramp(g * 16, 1, 16)] = pack(q0, q1, q2, q3)
                cr[T.ramp(g * 16, 1, 16)] = T.Broadcast(T.int32(off), 16) * (q0 + q1 + (q2 + q3))
            cd[T.ramp(g * 16, 1, 16)] = dd

    @T.macro(hygienic=True)
    def axpy_int(wd, sd, r0, r1, r2, r3, cw, cr, cd, yp, p, n0, n1, n2, n3):
        for c in range(RB // 64):
            prefetch4(wd, sd, n0, n1, n2, n3, c)
            for t in T.unroll(4):
                il = T.bind(T.Shuffle([wd[r0, T.ramp(c * 64 + t * 16, 1, 16)], wd[r1, T.ramp(c * 64 + t * 16, 1, 16)],
                                       wd[r2, T.ramp(c * 64 + t * 16, 1, 16)], wd[r3, T.ramp(c * 64 + t * 16, 1, 16)]],
                                      perm))
                cv = T.bind(T.reinterpret("int8x64", T.Broadcast(cw[(c * 64 + t * 16) // HB], 16)))
                a0 = T.bind(T.Broadcast(cr[(c * 64 + t * 16) // HB], 16))
                dv = T.bind(T.Broadcast(cd[(c * 64 + t * 16) // HB], 16))
                if int4:
                    e = T.bind(((c * 64 + t * 16) // HB) * B + (c * 64 + t * 16) % HB)
                    yp[p, T.ramp(e, 1, 16)] = yp[p, T.ramp(e, 1, 16)] + T.Cast("float32x16", dot(
                        isa, a0, T.bitwise_and(il, T.Broadcast(T.uint8(15), 64)), cv)) * dv
                    yp[p, T.ramp(e + HB, 1, 16)] = yp[p, T.ramp(e + HB, 1, 16)] + T.Cast("float32x16", dot(
                        isa, a0, T.shift_right(il, T.Broadcast(T.uint8(4), 64)), cv)) * dv
                else:
                    yp[p, T.ramp(c * 64 + t * 16, 1, 16)] = yp[p, T.ramp(c * 64 + t * 16, 1, 16)] + T.Cast(
                        "float32x16", dot(isa, a0, T.bitwise_xor(T.reinterpret("uint8x64", il),
                                                                 T.Broadcast(T.uint8(128), 64)), cv)) * dv

    if not paired:
        return scales4, axpy_int
    perm2 = [tirx.const(16 * i + e, "int32") for e in range(16) for i in range(2)]  # byte 2e + i ← row i, byte e

    def maddubs(u8: tirx.PrimExpr, s8: tirx.PrimExpr) -> tirx.PrimExpr:  # 32 u8 × s8 → 16 int16 pair sums
        return tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", u8, s8)

    sixteen = T.Broadcast(T.int32(16), 8)

    def evens(v: tirx.PrimExpr) -> tirx.PrimExpr:  # int16x16 → its even lanes as int32 (sign-extended)
        return T.shift_right(T.shift_left(T.reinterpret("int32x8", v), sixteen), sixteen)

    def odds(v: tirx.PrimExpr) -> tirx.PrimExpr:  # int16x16 → its odd lanes as int32
        return T.shift_right(T.reinterpret("int32x8", v), sixteen)

    @T.macro(hygienic=True)
    def axpy_pairs(wd, sd, r0, r1, r2, r3, cw, cr, cd, yp, p, n0, n1, n2, n3):
        for c in range(RB // 64):
            prefetch4(wd, sd, n0, n1, n2, n3, c)
            for t in T.unroll(4):
                il01 = T.bind(T.Shuffle([wd[r0, T.ramp(c * 64 + t * 16, 1, 16)],
                                         wd[r1, T.ramp(c * 64 + t * 16, 1, 16)]], perm2))
                il23 = T.bind(T.Shuffle([wd[r2, T.ramp(c * 64 + t * 16, 1, 16)],
                                         wd[r3, T.ramp(c * 64 + t * 16, 1, 16)]], perm2))
                c01 = T.bind(T.reinterpret("int8x32", T.Broadcast(cw[(c * 64 + t * 16) // HB], 8)))
                c23 = T.bind(T.reinterpret("int8x32", T.Broadcast(cw[nb + (c * 64 + t * 16) // HB], 8)))
                a0 = T.bind(T.reinterpret("int16x16", T.Broadcast(cr[(c * 64 + t * 16) // HB], 8)))
                dv = T.bind(T.Broadcast(cd[(c * 64 + t * 16) // HB], 8))
                e = T.bind(((c * 64 + t * 16) // HB) * B + (c * 64 + t * 16) % HB)
                slo = T.bind(a0 + maddubs(T.bitwise_and(il01, T.Broadcast(T.uint8(15), 32)), c01)
                             + maddubs(T.bitwise_and(il23, T.Broadcast(T.uint8(15), 32)), c23))
                shi = T.bind(a0 + maddubs(T.shift_right(il01, T.Broadcast(T.uint8(4), 32)), c01)
                             + maddubs(T.shift_right(il23, T.Broadcast(T.uint8(4), 32)), c23))
                yp[p, T.ramp(e, 1, 8)] = yp[p, T.ramp(e, 1, 8)] + T.Cast("float32x8", evens(slo)) * dv
                yp[p, T.ramp(e + 8, 1, 8)] = yp[p, T.ramp(e + 8, 1, 8)] + T.Cast("float32x8", odds(slo)) * dv
                yp[p, T.ramp(e + HB, 1, 8)] = yp[p, T.ramp(e + HB, 1, 8)] + T.Cast("float32x8", evens(shi)) * dv
                yp[p, T.ramp(e + HB + 8, 1, 8)] = yp[p, T.ramp(e + HB + 8, 1, 8)] + T.Cast("float32x8", odds(shi)) * dv

    return scales4, axpy_pairs


def describe_ffn(spec: KernelSpec, isa: str, partitions: int) -> tirx.PrimFunc:
    """The one-token fused FFN (``ffn_gated``: arguments ``(x, w_up, s_up, w_gate, s_gate, w_down_t, s_down, idx,
    y)``; ``ffn_relu``: without the gate), the rows cut into ``partitions`` contiguous parts (one per core, as
    ``compute.describe_partitioned``): per part, first the deciding dot products (gate; ffn_relu: up and h) of
    all its rows, then the active rows (ReLU: decider > 0; SiLU: all) compacted and taken 4 at a time
    (``_describe_gated`` / ``_describe_relu_grouped``): the up dot products (gated) and the 4 down rows into the part's ``y_part``, the next
    group's lines prefetched; ``y = Σ_p y_part[p]``. (``INT_DOWN = False`` and no integer down for the format:
    the float down rows, 4 per ``y_part`` load/store.)"""
    if not applies(spec, isa) or spec.kind not in ("ffn_gated", "ffn_relu"):
        raise ValueError(f"no integer dot-product kernel for {spec}")
    return (_describe_gated if spec.gated else _describe_relu_grouped)(spec, isa, partitions)


def _describe_gated(spec: KernelSpec, isa: str, partitions: int) -> tirx.PrimFunc:
    """``ffn_gated`` (``describe_ffn``): per part (one per core, contiguous rows of ``idx``)

    1. the gate dot products of all its rows (integer), prefetched ``AHEAD`` rows ahead;
    2. the active rows (ReLU: gate > 0; SiLU: all) compacted into a private list with ``act(gate)``, padded to
       whole groups (and ``LEAD`` more) with the last active row at h = 0 (which re-reads a cached row);
    3. per group of ``GROUP`` active rows: their up dot products (integer; ``h = act(gate) · up``), then their
       down rows into the part's ``y_part``, four rows per ``y_part`` load/store (``_down4_macro``); the up rows
       and the down rows of the group ``LEAD`` ahead are prefetched meanwhile, so every scattered row a part reads
       after its gates has its lines requested a group ahead (the deciding phase's inactive rows no longer break
       the prefetch chain);
    ``y = Σ_p y_part[p]``."""
    d, n, P = spec.d_model, spec.n_rows, partitions
    qdt = "uint8" if spec.weight_dtype == "int4" else "int8"
    sh = _shape(spec)
    nb, RB, NL = sh["nb"], sh["RB"], sh["NL"]
    act = spec.act
    relu = act == "relu"
    prep_x, row_dot = _macros(spec, isa)
    axpy4 = _down4_macro(spec)
    integer_down = int_down(spec, isa)
    paired = paired_down(spec, isa)
    scales4, axpy_int = _down_int_macro(spec, isa)
    G = GROUP
    pad = G * (LEAD + 1)

    def active(v: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.Not(v <= tirx.const(0.0, "float32")) if relu else tirx.const(True, "bool")

    @T.prim_func(check_well_formed=False)
    def ffn(xh: T.handle, wuh: T.handle, suh: T.handle, wgh: T.handle, sgh: T.handle, wdh: T.handle,
            sdh: T.handle, idxh: T.handle, yh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        k = T.int32()
        x = T.match_buffer(xh, (d,), "float32", align=64)  # [d_model]
        wu = T.match_buffer(wuh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        su = T.match_buffer(suh, (n, nb), "float16", align=64)  # [n_rows, blocks]
        wg = T.match_buffer(wgh, (n, RB), qdt, align=64)
        sg = T.match_buffer(sgh, (n, nb), "float16", align=64)
        wd = T.match_buffer(wdh, (n, RB), qdt, align=64)
        sd = T.match_buffer(sdh, (n, nb), "float16", align=64)
        idx = T.match_buffer(idxh, (k,), "int32")  # [k]
        y = T.match_buffer(yh, (d,), "float32", align=64)  # [d_model]
        xa = T.decl_buffer((RB,), "int8", align=64)
        xb = T.decl_buffer((RB,), "int8", align=64)
        xc = T.decl_buffer((NL,), "int32", align=64)
        xd = T.decl_buffer((nb,), "float32", align=64)
        m16 = T.decl_buffer((16,), "float32", align=64)
        yp = T.decl_buffer((P, d), "float32", align=64)  # [parts, d_model]
        gv = T.decl_buffer((k + 1,), "float32")  # [k] the gates
        rows = T.decl_buffer((P, (k + P - 1) // P + pad), "int32")  # [parts, active rows + pad]
        hh = T.decl_buffer((P, (k + P - 1) // P + pad), "float32")  # act(gate), then h
        cnt = T.decl_buffer((P * 16,), "int32", align=64)  # cnt[16 p]: the part's active rows (own line)
        prep_x(x, xa, xb, xc, xd, m16)
        for p in T.parallel(P):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            cw = T.decl_buffer((2 * nb,), "int32", align=64)  # integer down: the group's packed int8 h·s per block
            cr = T.decl_buffer((nb,), "int32", align=64)  # its offset term per block
            cd = T.decl_buffer((nb,), "float32", align=64)  # its scale per block
            for i in range(d // 16):
                yp[p, T.ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for jj in range((k + P - 1) // P):
                if p * ((k + P - 1) // P) + jj < k:
                    row_dot(wg, sg, xa, xb, xc, xd, idx[p * ((k + P - 1) // P) + jj],
                            idx[T.min(p * ((k + P - 1) // P) + jj + AHEAD, k - 1)], acc, res)
                    gv[p * ((k + P - 1) // P) + jj] = res[0]
            cnt[p * 16] = 0
            for jj in range((k + P - 1) // P):
                if p * ((k + P - 1) // P) + jj < k:
                    if active(gv[p * ((k + P - 1) // P) + jj]):
                        rows[p, cnt[p * 16]] = idx[p * ((k + P - 1) // P) + jj]
                        hh[p, cnt[p * 16]] = _act(act, gv[p * ((k + P - 1) // P) + jj])
                        cnt[p * 16] = cnt[p * 16] + 1
            if cnt[p * 16] > 0:
                for q in range(pad):
                    rows[p, cnt[p * 16] + q] = rows[p, cnt[p * 16] - 1]
                    hh[p, cnt[p * 16] + q] = T.float32(0)
                for g in range((cnt[p * 16] + G - 1) // G):
                    for i in range(G):
                        row_dot(wu, su, xa, xb, xc, xd, rows[p, g * G + i], rows[p, (g + LEAD) * G + i], acc, res)
                        hh[p, g * G + i] = hh[p, g * G + i] * res[0]
                    if integer_down:
                        scales4(sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                                hh[p, g * G], hh[p, g * G + 1], hh[p, g * G + 2], hh[p, g * G + 3], cw, cr, cd)
                        axpy_int(wd, sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                                 cw, cr, cd, yp, p, rows[p, (g + LEAD) * G], rows[p, (g + LEAD) * G + 1],
                                 rows[p, (g + LEAD) * G + 2], rows[p, (g + LEAD) * G + 3])
                    else:
                        axpy4(wd, sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                              hh[p, g * G], hh[p, g * G + 1], hh[p, g * G + 2], hh[p, g * G + 3], yp, p,
                              rows[p, (g + LEAD) * G], rows[p, (g + LEAD) * G + 1], rows[p, (g + LEAD) * G + 2],
                              rows[p, (g + LEAD) * G + 3])
        for i in range(d // 16):
            y[T.ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for p in range(P):
                y[T.ramp(i * 16, 1, 16)] = y[T.ramp(i * 16, 1, 16)] + unpair(yp[p, T.ramp(i * 16, 1, 16)], paired)

    return ffn


def _describe_relu_grouped(spec: KernelSpec, isa: str, partitions: int) -> tirx.PrimFunc:
    """``ffn_relu`` (arguments ``(x, w_up, s_up, w_down_t, s_down, idx, y)``) as ``_describe_gated``: per part the
    up dot products of all its rows (``h = act(up)``, prefetched ``AHEAD`` rows ahead), the rows with ``h != 0``
    compacted, then per group of 4 their down rows (integer where ``int_down``), the next group's lines
    prefetched; ``y = Σ_p y_part[p]``."""
    d, n, P = spec.d_model, spec.n_rows, partitions
    qdt = "uint8" if spec.weight_dtype == "int4" else "int8"
    sh = _shape(spec)
    nb, RB, NL = sh["nb"], sh["RB"], sh["NL"]
    act = spec.act
    prep_x, row_dot = _macros(spec, isa)
    axpy4 = _down4_macro(spec)
    integer_down = int_down(spec, isa)
    paired = paired_down(spec, isa)
    scales4, axpy_int = _down_int_macro(spec, isa)
    G = GROUP
    pad = G * (LEAD + 1)

    @T.prim_func(check_well_formed=False)
    def ffn_relu(xh: T.handle, wuh: T.handle, suh: T.handle, wdh: T.handle, sdh: T.handle, idxh: T.handle,
                 yh: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        k = T.int32()
        x = T.match_buffer(xh, (d,), "float32", align=64)  # [d_model]
        wu = T.match_buffer(wuh, (n, RB), qdt, align=64)  # [n_rows, quant bytes]
        su = T.match_buffer(suh, (n, nb), "float16", align=64)  # [n_rows, blocks]
        wd = T.match_buffer(wdh, (n, RB), qdt, align=64)
        sd = T.match_buffer(sdh, (n, nb), "float16", align=64)
        idx = T.match_buffer(idxh, (k,), "int32")  # [k]
        y = T.match_buffer(yh, (d,), "float32", align=64)  # [d_model]
        xa = T.decl_buffer((RB,), "int8", align=64)
        xb = T.decl_buffer((RB,), "int8", align=64)
        xc = T.decl_buffer((NL,), "int32", align=64)
        xd = T.decl_buffer((nb,), "float32", align=64)
        m16 = T.decl_buffer((16,), "float32", align=64)
        yp = T.decl_buffer((P, d), "float32", align=64)  # [parts, d_model]
        hv = T.decl_buffer((k + 1,), "float32")  # [k] h
        rows = T.decl_buffer((P, (k + P - 1) // P + pad), "int32")  # [parts, active rows + pad]
        hh = T.decl_buffer((P, (k + P - 1) // P + pad), "float32")  # their h
        cnt = T.decl_buffer((P * 16,), "int32", align=64)  # cnt[16 p]: the part's active rows (own line)
        prep_x(x, xa, xb, xc, xd, m16)
        for p in T.parallel(P):
            acc = T.decl_buffer((16,), "float32", align=64)
            res = T.decl_buffer((1,), "float32")
            cw = T.decl_buffer((2 * nb,), "int32", align=64)
            cr = T.decl_buffer((nb,), "int32", align=64)
            cd = T.decl_buffer((nb,), "float32", align=64)
            for i in range(d // 16):
                yp[p, T.ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for jj in range((k + P - 1) // P):
                if p * ((k + P - 1) // P) + jj < k:
                    row_dot(wu, su, xa, xb, xc, xd, idx[p * ((k + P - 1) // P) + jj],
                            idx[T.min(p * ((k + P - 1) // P) + jj + AHEAD, k - 1)], acc, res)
                    hv[p * ((k + P - 1) // P) + jj] = _act(act, res[0])
            cnt[p * 16] = 0
            for jj in range((k + P - 1) // P):
                if p * ((k + P - 1) // P) + jj < k:
                    if hv[p * ((k + P - 1) // P) + jj] != T.float32(0):
                        rows[p, cnt[p * 16]] = idx[p * ((k + P - 1) // P) + jj]
                        hh[p, cnt[p * 16]] = hv[p * ((k + P - 1) // P) + jj]
                        cnt[p * 16] = cnt[p * 16] + 1
            if cnt[p * 16] > 0:
                for q in range(pad):
                    rows[p, cnt[p * 16] + q] = rows[p, cnt[p * 16] - 1]
                    hh[p, cnt[p * 16] + q] = T.float32(0)
                for g in range((cnt[p * 16] + G - 1) // G):
                    if integer_down:
                        scales4(sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                                hh[p, g * G], hh[p, g * G + 1], hh[p, g * G + 2], hh[p, g * G + 3], cw, cr, cd)
                        axpy_int(wd, sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                                 cw, cr, cd, yp, p, rows[p, (g + LEAD) * G], rows[p, (g + LEAD) * G + 1],
                                 rows[p, (g + LEAD) * G + 2], rows[p, (g + LEAD) * G + 3])
                    else:
                        axpy4(wd, sd, rows[p, g * G], rows[p, g * G + 1], rows[p, g * G + 2], rows[p, g * G + 3],
                              hh[p, g * G], hh[p, g * G + 1], hh[p, g * G + 2], hh[p, g * G + 3], yp, p,
                              rows[p, (g + LEAD) * G], rows[p, (g + LEAD) * G + 1], rows[p, (g + LEAD) * G + 2],
                              rows[p, (g + LEAD) * G + 3])
        for i in range(d // 16):
            y[T.ramp(i * 16, 1, 16)] = T.Broadcast(T.float32(0), 16)
            for p in range(P):
                y[T.ramp(i * 16, 1, 16)] = y[T.ramp(i * 16, 1, 16)] + unpair(yp[p, T.ramp(i * 16, 1, 16)], paired)

    return ffn_relu

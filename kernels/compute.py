"""Target-independent kernel descriptions (TVM TE), turned into schedulable TensorIR PrimFuncs.

Every kernel is described once here; ``cpu.py`` and ``cuda.py`` schedule the same PrimFunc.
Imports TVM, so only the build path (``cache.build_kernel``) imports this module.

Blocks (names the schedules rely on):

* ``up`` / ``gate``: ``[t?, k]`` float32 dot products of the selected rows with ``x`` (reduction over d)
* ``h``:             ``[t?, k]`` activation (and gate product, bias) — the sparse hidden vector
* ``y``:             ``[t?, d]`` row-axpy over the k selected rows of ``w_down_t`` (reduction over k)

``batched=True`` adds a symbolic leading token axis ``t`` to ``x``/``h``/``y`` (one ``idx`` for all
tokens, i.e. the union of their active sets); ``k`` and ``t`` are symbolic in every kernel.

``describe_partitioned`` is the fused FFN in the form the CPU schedule uses: the k active rows are cut
into ``P`` contiguous parts (one per core); part ``p`` computes ``h`` for its rows and its own partial
``y_part[p] = sum over its rows h[j] * w_down_t[idx[j]]``; ``y = sum_p y_part[p]``. Each core thus
reads whole rows of w_up (w_gate) and w_down_t, needs no other core's ``h`` (one parallel region
per call instead of two) and writes no shared output. Blocks: ``up``/``gate``/``h`` ``[P, S, t?]``
(S = ceil(k / P)), ``y_part`` ``[P, t?, d]``, ``y`` ``[t?, d]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import te, tirx

from .spec import KernelSpec


@dataclass
class KernelDesc:
    """An unscheduled kernel: the PrimFunc and the argument names in call order."""

    func: tirx.PrimFunc
    arg_names: list[str]
    batched: bool
    partitions: int | None = None  # set for the row-partitioned fused form (``describe_partitioned``)


def arg_names(spec: KernelSpec) -> list[str]:
    """PrimFunc argument order for a spec (``None``-able Python arguments are simply absent)."""
    if spec.kind == "predict":
        return ["x", "fc1", "fc2", *(["offset"] if spec.has_bias else []), "thr", "mask"]
    q = spec.quantized  # each quantized weight is followed by its scales
    names: list[str] = []
    if spec.has_up:
        names += ["x", "w_up", *(["s_up"] if q else [])]
        if spec.gated:
            names += ["w_gate", *(["s_gate"] if q else [])]
        if spec.has_bias:
            names.append("b_up")
    else:
        names.append("h")
    if spec.has_down:
        names += ["w_down_t", *(["s_down"] if q else [])]
    names.append("idx")
    names.append("y" if spec.has_down else "h")
    return names


SCALE_NAMES: dict[str, str] = {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"}  # quantized weights' scales

WeightReader = Callable[..., "tirx.PrimExpr"]  # (row, col) -> float32 value


def weight(spec: KernelSpec, name: str, tensors: dict[str, te.Tensor], rows: int | None = None) -> WeightReader:
    """Placeholder(s) of weight ``name`` ``[rows, d_model]`` (added to ``tensors``) and its reader
    ``(row, col) -> float32 value``: a float weight widened; a quantized one (``qformat.py``) dequantized,
    ``q * s`` (int8) or ``(nibble - 8) * s`` (int4: element ``c`` of block ``b`` is the low nibble of byte
    ``b*B/2 + c%(B/2)`` for ``c%B < B/2``, else its high nibble)."""
    n, d, f32 = rows or spec.n_rows, spec.d_model, "float32"
    if not spec.quantized:
        w = te.placeholder((n, d), spec.weight_dtype, name=name)  # [rows, d_model]
        tensors[name] = w
        return lambda row, col: w[row, col].astype(f32)
    bl = spec.block
    s = te.placeholder((n, d // bl), "float16", name=SCALE_NAMES[name])  # [rows, d_model / block]
    tensors[SCALE_NAMES[name]] = s
    if spec.weight_dtype == "int8":
        q = te.placeholder((n, d), "int8", name=name)  # [rows, d_model]
        tensors[name] = q
        return lambda row, col: q[row, col].astype(f32) * s[row, col // bl].astype(f32)
    half = bl // 2
    q4 = te.placeholder((n, d // 2), "uint8", name=name)  # [rows, d_model / 2]: two nibbles a byte
    tensors[name] = q4

    def read4(row: tirx.PrimExpr, col: tirx.PrimExpr) -> tirx.PrimExpr:
        byte = q4[row, (col // bl) * half + col % half]
        shift = ((col % bl) // half * 4).astype("uint8")
        nib = tirx.bitwise_and(tirx.shift_right(byte, shift), tirx.const(15, "uint8"))
        return (nib.astype(f32) - tirx.const(8.0, f32)) * s[row, col // bl].astype(f32)

    return read4


def bias_dtype(spec: KernelSpec) -> str:
    """``b_up``'s dtype: the weight dtype, float32 for quantized weights."""
    return "float32" if spec.quantized else spec.weight_dtype


def _activation(act: str, v: tirx.PrimExpr) -> tirx.PrimExpr:
    if act == "relu":
        return tirx.max(v, tirx.const(0.0, "float32"))
    if act == "silu":
        return v * tirx.sigmoid(v)
    return v


def _gate_and_bias(
    spec: KernelSpec, tensors: dict[str, te.Tensor], dot: Callable[[WeightReader, str], te.Tensor]
) -> tuple[te.Tensor | None, te.Tensor | None]:
    """The optional inputs of the up part: gate rows (→ their dot products) and the up bias."""
    n = spec.n_rows
    gate = b_up = None
    if spec.gated:
        gate = dot(weight(spec, "w_gate", tensors), "gate")
    if spec.has_bias:
        b_up = te.placeholder((n,), bias_dtype(spec), name="b_up")  # [n_rows]
        tensors["b_up"] = b_up
    return gate, b_up


def describe(spec: KernelSpec, batched: bool = False) -> KernelDesc:
    """TE description of ``spec`` → PrimFunc with symbolic ``k`` (and ``t`` when batched)."""
    d, f32 = spec.d_model, "float32"
    k = te.var("k")
    t = te.var("t") if batched else None
    tok = (t,) if batched else ()

    tensors: dict[str, te.Tensor] = {}
    idx = te.placeholder((k,), "int32", name="idx")  # [k]
    tensors["idx"] = idx

    h: te.Tensor | None = None
    if spec.has_up:
        x = te.placeholder((*tok, d), f32, name="x")  # [t?, d_model]
        tensors["x"] = x
        w_up = weight(spec, "w_up", tensors)

        def _dot(w: WeightReader, name: str) -> te.Tensor:
            r = te.reduce_axis((0, d), name="r")
            return te.compute(
                (*tok, k),
                lambda *ij: te.sum(w(idx[ij[-1]], r) * x[(*ij[:-1], r)], axis=r),
                name=name,
            )  # [t?, k]

        up = _dot(w_up, "up")
        gate, b_up = _gate_and_bias(spec, tensors, _dot)

        def _h(*ij: tirx.Var) -> tirx.PrimExpr:
            j = ij[-1]
            u = up[ij]
            if b_up is not None:
                u = u + b_up[idx[j]].astype(f32)
            if gate is not None:
                return _activation(spec.act, gate[ij]) * u
            return _activation(spec.act, u)

        h = te.compute((*tok, k), _h, name="h")  # [t?, k]
    else:
        h = te.placeholder((*tok, k), f32, name="h")  # [t?, k]
        tensors["h"] = h

    if spec.has_down:
        w_down_t = weight(spec, "w_down_t", tensors)
        rj = te.reduce_axis((0, k), name="rj")
        y = te.compute(
            (*tok, d),
            lambda *ti: te.sum(h[(*ti[:-1], rj)] * w_down_t(idx[rj], ti[-1]), axis=rj),
            name="y",
        )  # [t?, d_model]
        out = y
    else:
        out = h

    names = arg_names(spec)  # the output is always last
    func = te.create_prim_func([tensors[nm] for nm in names[:-1]] + [out])
    return KernelDesc(func=func, arg_names=names, batched=batched)


def describe_partitioned(spec: KernelSpec, partitions: int, batched: bool = False) -> KernelDesc:
    """Fused FFN (``ffn_relu`` / ``ffn_gated``) with the active rows split into ``partitions`` parts."""
    if spec.kind not in ("ffn_relu", "ffn_gated"):
        raise ValueError(f"describe_partitioned is for fused FFN kinds, not {spec.kind!r}")
    d, f32, P = spec.d_model, "float32", partitions
    k = te.var("k")
    t = te.var("t") if batched else None
    tok = (t,) if batched else ()
    S = (k + P - 1) // P  # rows per part (the last part may be short)
    idx = te.placeholder((k,), "int32", name="idx")  # [k]
    x = te.placeholder((*tok, d), f32, name="x")  # [t?, d_model]
    tensors: dict[str, te.Tensor] = {"idx": idx, "x": x}
    w_up = weight(spec, "w_up", tensors)  # [n_rows, d_model]
    w_down_t = weight(spec, "w_down_t", tensors)  # [n_rows, d_model]

    def row(p: tirx.PrimExpr, jj: tirx.PrimExpr) -> tirx.PrimExpr:
        # Slots past k (the short last part) re-read row idx[k-1] and get h = 0 below. TE's
        # ``te.sum(..., where=...)`` would be the natural guard, but create_prim_func drops it
        # (TVM 0.27), so the index is clamped instead: every load stays in bounds.
        return idx[tirx.min(p * S + jj, k - 1)]

    def _dot(w: WeightReader, name: str) -> te.Tensor:
        r = te.reduce_axis((0, d), name="r")
        return te.compute(
            (P, S, *tok),
            lambda p, jj, *tt: te.sum(w(row(p, jj), r) * x[(*tt, r)], axis=r),
            name=name,
        )  # [P, S, t?]

    up = _dot(w_up, "up")
    gate, b_up = _gate_and_bias(spec, tensors, _dot)
    zero = tirx.const(0.0, f32)

    def _h(p: tirx.Var, jj: tirx.Var, *tt: tirx.Var) -> tirx.PrimExpr:
        u = up[(p, jj, *tt)]
        if b_up is not None:
            u = u + b_up[row(p, jj)].astype(f32)
        v = _activation(spec.act, gate[(p, jj, *tt)]) * u if gate is not None else _activation(spec.act, u)
        return tirx.if_then_else(p * S + jj < k, v, zero)

    h = te.compute((P, S, *tok), _h, name="h")  # [P, S, t?]
    rj = te.reduce_axis((0, S), name="rj")
    y_part = te.compute(
        (P, *tok, d),
        lambda p, *ti: te.sum(h[(p, rj, *ti[:-1])] * w_down_t(row(p, rj), ti[-1]), axis=rj),
        name="y_part",
    )  # [P, t?, d_model]
    rp = te.reduce_axis((0, P), name="rp")
    y = te.compute((*tok, d), lambda *ti: te.sum(y_part[(rp, *ti)], axis=rp), name="y")  # [t?, d_model]
    names = arg_names(spec)
    func = te.create_prim_func([tensors[nm] for nm in names[:-1]] + [y])
    return KernelDesc(func=func, arg_names=names, batched=batched, partitions=P)


def describe_predict(spec: KernelSpec) -> KernelDesc:
    """Kind ``predict`` (one token): ``a = act(fc1 x)`` ``[rank]``, ``s = fc2 a (+ offset)`` ``[n_rows]``,
    ``mask = s > thr[0]`` (int8). Blocks: ``up``/``h`` (fc1, then the activation), ``score``/``mask``."""
    if spec.kind != "predict":
        raise ValueError(f"describe_predict is for kind 'predict', not {spec.kind!r}")
    d, n, rank, wdt, f32 = spec.d_model, spec.n_rows, spec.rank, spec.weight_dtype, "float32"
    x = te.placeholder((d,), f32, name="x")  # [d_model]
    fc1 = te.placeholder((rank, d), wdt, name="fc1")  # [rank, d_model]
    fc2 = te.placeholder((n, rank), wdt, name="fc2")  # [n_rows, rank]
    thr = te.placeholder((1,), f32, name="thr")  # [1]
    tensors: dict[str, te.Tensor] = {"x": x, "fc1": fc1, "fc2": fc2, "thr": thr}
    r = te.reduce_axis((0, d), name="r")
    up = te.compute((rank,), lambda i: te.sum(fc1[i, r].astype(f32) * x[r], axis=r), name="up")  # [rank]
    h = te.compute((rank,), lambda i: _activation(spec.act, up[i]), name="h")  # [rank]
    q = te.reduce_axis((0, rank), name="q")
    score = te.compute((n,), lambda j: te.sum(fc2[j, q].astype(f32) * h[q], axis=q), name="score")  # [n_rows]
    if spec.has_bias:
        offset = te.placeholder((n,), f32, name="offset")  # [n_rows]
        tensors["offset"] = offset
        mask = te.compute((n,), lambda j: (score[j] + offset[j] > thr[0]).astype("int8"), name="mask")
    else:
        mask = te.compute((n,), lambda j: (score[j] > thr[0]).astype("int8"), name="mask")  # [n_rows]
    names = arg_names(spec)
    func = te.create_prim_func([tensors[nm] for nm in names[:-1]] + [mask])
    return KernelDesc(func=func, arg_names=names, batched=False)

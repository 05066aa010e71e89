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
        if spec.gate_bias:
            names.append("b_gate")
    else:
        names.append("h")
    if spec.has_down:
        names += ["w_down_t", *(["s_down"] if q else [])]
    names.append("idx")
    names.append("y" if spec.has_down else "h")
    return names


SCALE_NAMES: dict[str, str] = {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"}  # quantized weights' scales

CHUNK: int = 16  # quantized CPU dot products: elements of a half-block one vector holds (16 float32 = 512 bits)


def dot_extent(spec: KernelSpec) -> int:
    """Extent of the dot products' reduction axis ``r``: ``d_model``; quantized on the CPU ``d_model / (B / 16)``
    (``r = 16 b + l``: lane ``l`` of block ``b``, the block's ``B / 16`` chunks summed in the term, see ``Weight``)."""
    if spec.quantized and not spec.is_cuda:
        return spec.d_model // (spec.block // CHUNK)
    return spec.d_model


@dataclass
class Weight:
    """A weight ``[rows, d_model]`` as the descriptions read it: float (widened) or quantized (``qformat.py``:
    ``q * s`` for int8, ``(nibble - 8) * s`` for int4, where element ``c`` of block ``b`` is the low nibble of
    byte ``b*B/2 + c%(B/2)`` for ``c%B < B/2``, else its high nibble)."""

    spec: KernelSpec
    q: te.Tensor  # the float weight, or the quants
    s: te.Tensor | None  # float16 scales [rows, d_model / block], quantized only

    def _int(self, row: tirx.PrimExpr, col: tirx.PrimExpr) -> tirx.PrimExpr:
        """The quant of element ``col`` as float32 (int4: the nibble minus 8)."""
        f32 = "float32"
        if self.spec.weight_dtype == "int8":
            return self.q[row, col].astype(f32)
        bl = self.spec.block
        half = bl // 2
        byte = self.q[row, (col // bl) * half + col % half]
        if self.spec.is_cuda:  # TVM 0.27's CUDA codegen rejects vectors of uint8 shifts: decode in int32
            shift = (col % bl) // half * 4
            nib = tirx.bitwise_and(tirx.shift_right(byte.astype("int32"), shift), tirx.const(15, "int32"))
            return (nib - tirx.const(8, "int32")).astype(f32)
        # CPU: in the byte lanes of one 16-byte load (a mask or a shift, the - 8 as int8), then widened
        shift = ((col % bl) // half * 4).astype("uint8")
        nib = tirx.bitwise_and(tirx.shift_right(byte, shift), tirx.const(15, "uint8"))
        return (nib.astype("int8") - tirx.const(8, "int8")).astype(f32)

    def value(self, row: tirx.PrimExpr, col: tirx.PrimExpr, mult: tirx.PrimExpr | None = None) -> tirx.PrimExpr:
        """Element ``[row, col]`` as float32, times ``mult`` (quantized: ``q * (s * mult)``: the scale product is
        one broadcast per vector)."""
        if self.s is None:
            v = self.q[row, col].astype("float32")
            return v if mult is None else mult * v
        sc = self.s[row, col // self.spec.block].astype("float32")
        return self._int(row, col) * (sc if mult is None else mult * sc)

    def dot_term(self, row: tirx.PrimExpr, r: tirx.PrimExpr, xv: Callable[[tirx.PrimExpr], tirx.PrimExpr]) -> tirx.PrimExpr:
        """Term ``r`` of ``row · x`` (``xv(col)`` reads x), ``r`` over ``dot_extent``. Quantized CPU: lane ``l = r % 16``
        of block ``b = r // 16``, its ``B / 16`` chunks' products summed, then scaled once:
        ``s[b] * sum_c q[b*B + 16c + l] * x[b*B + 16c + l]`` (one multiply by the scale per B/16 elements)."""
        if self.s is None or self.spec.is_cuda:
            return self.value(row, r) * xv(r)
        bl = self.spec.block
        b, lane = r // CHUNK, r % CHUNK
        cols = [b * bl + c * CHUNK + lane for c in range(bl // CHUNK)]
        acc = self._int(row, cols[0]) * xv(cols[0])
        for col in cols[1:]:
            acc = acc + self._int(row, col) * xv(col)
        return self.s[row, b].astype("float32") * acc


def weight(spec: KernelSpec, name: str, tensors: dict[str, te.Tensor], rows: int | None = None) -> Weight:
    """Placeholder(s) of weight ``name`` ``[rows, d_model]`` (added to ``tensors``: quants then scales)."""
    n, d = rows or spec.n_rows, spec.d_model
    if not spec.quantized:
        w = te.placeholder((n, d), spec.weight_dtype, name=name)  # [rows, d_model]
        tensors[name] = w
        return Weight(spec, w, None)
    if spec.weight_dtype == "int8":
        q = te.placeholder((n, d), "int8", name=name)  # [rows, d_model]
    else:
        q = te.placeholder((n, d // 2), "uint8", name=name)  # [rows, d_model / 2]: two nibbles a byte
    s = te.placeholder((n, d // spec.block), "float16", name=SCALE_NAMES[name])  # [rows, d_model / block]
    tensors[name] = q
    tensors[SCALE_NAMES[name]] = s
    return Weight(spec, q, s)


def bias_dtype(spec: KernelSpec) -> str:
    """``b_up``'s dtype: the weight dtype, float32 for quantized weights."""
    return "float32" if spec.quantized else spec.weight_dtype


def _activation(act: str, v: tirx.PrimExpr) -> tirx.PrimExpr:
    if act in ("relu", "drelu"):  # dReLU: relu on the gate here, on the up branch in _gated_h
        return tirx.max(v, tirx.const(0.0, "float32"))
    if act == "silu":
        return v * tirx.sigmoid(v)
    return v


def _gate_and_bias(
    spec: KernelSpec, tensors: dict[str, te.Tensor], dot: Callable[[Weight, str], te.Tensor]
) -> tuple[te.Tensor | None, te.Tensor | None, te.Tensor | None]:
    """The optional inputs of the up part: gate rows (→ their dot products), the up bias and the gate bias."""
    n = spec.n_rows
    gate = b_up = b_gate = None
    if spec.gated:
        gate = dot(weight(spec, "w_gate", tensors), "gate")
    if spec.has_bias:
        b_up = te.placeholder((n,), bias_dtype(spec), name="b_up")  # [n_rows]
        tensors["b_up"] = b_up
    if spec.gate_bias:
        b_gate = te.placeholder((n,), bias_dtype(spec), name="b_gate")  # [n_rows]
        tensors["b_gate"] = b_gate
    return gate, b_up, b_gate


def _gated_h(spec: KernelSpec, g: tirx.PrimExpr, u: tirx.PrimExpr, b_gate: te.Tensor | None,
             row: tirx.PrimExpr) -> tirx.PrimExpr:
    """``act(g + b_gate[row]) * u`` (dReLU: ``* relu(u)``), g and u the row's gate and up values (u biased)."""
    if b_gate is not None:
        g = g + b_gate[row].astype("float32")
    if spec.act == "drelu":
        u = _activation("relu", u)
    return _activation(spec.act, g) * u


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

        def _dot(w: Weight, name: str) -> te.Tensor:
            r = te.reduce_axis((0, dot_extent(spec)), name="r")
            return te.compute(
                (*tok, k),
                lambda *ij: te.sum(w.dot_term(idx[ij[-1]], r, lambda c: x[(*ij[:-1], c)]), axis=r),
                name=name,
            )  # [t?, k]

        up = _dot(w_up, "up")
        gate, b_up, b_gate = _gate_and_bias(spec, tensors, _dot)

        def _h(*ij: tirx.Var) -> tirx.PrimExpr:
            j = ij[-1]
            u = up[ij]
            if b_up is not None:
                u = u + b_up[idx[j]].astype(f32)
            if gate is not None:
                return _gated_h(spec, gate[ij], u, b_gate, idx[j])
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
            lambda *ti: te.sum(w_down_t.value(idx[rj], ti[-1], h[(*ti[:-1], rj)]), axis=rj),
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

    def _dot(w: Weight, name: str) -> te.Tensor:
        r = te.reduce_axis((0, dot_extent(spec)), name="r")
        return te.compute(
            (P, S, *tok),
            lambda p, jj, *tt: te.sum(w.dot_term(row(p, jj), r, lambda c: x[(*tt, c)]), axis=r),
            name=name,
        )  # [P, S, t?]

    up = _dot(w_up, "up")
    gate, b_up, b_gate = _gate_and_bias(spec, tensors, _dot)
    zero = tirx.const(0.0, f32)

    def _h(p: tirx.Var, jj: tirx.Var, *tt: tirx.Var) -> tirx.PrimExpr:
        u = up[(p, jj, *tt)]
        if b_up is not None:
            u = u + b_up[row(p, jj)].astype(f32)
        v = (_gated_h(spec, gate[(p, jj, *tt)], u, b_gate, row(p, jj)) if gate is not None
             else _activation(spec.act, u))
        return tirx.if_then_else(p * S + jj < k, v, zero)

    h = te.compute((P, S, *tok), _h, name="h")  # [P, S, t?]
    rj = te.reduce_axis((0, S), name="rj")
    y_part = te.compute(
        (P, *tok, d),
        lambda p, *ti: te.sum(w_down_t.value(row(p, rj), ti[-1], h[(p, rj, *ti[:-1])]), axis=rj),
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

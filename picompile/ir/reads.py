"""The weight bytes one decode token reads through a graph, in total and by storage format.

Every tensor read in full, one embedding row, and of each FFN the rows of the neurons computed (per layer, the
fraction its masks select). Shared by the build (``package`` records bytes per token by format in the manifest,
for ``picompile inspect``) and ``picompile bench`` (``tools/traffic``, with fractions measured by running the
graph). A quantized weight's quants and scales count under its format (``int8`` / ``int4``); every other
tensor under its dtype. FFN nodes are read by argument name (:mod:`picompile.ir.schema`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, fx

from picompile.ir import schema
from picompile.ir.patterns import SCALE_ARGS

FFN_OPS: tuple[str, ...] = ("ffn", "sparse_ffn", "tvm_sparse_ffn")  # the ops that compute FFN neurons
# the weights each FFN op reads, in call order; ffn's down projection is [d_model, n_neurons]: a column per neuron
FFN_WEIGHTS: dict[str, tuple[str, ...]] = {
    "ffn": ("w_up", "b_up", "w_gate", "w_down", "b_down", "s_up", "s_gate", "s_down", "b_gate"),
    "sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t", "s_up", "s_gate", "s_down", "b_gate"),
    "tvm_sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t", "s_up", "s_gate", "s_down", "b_gate"),
}


def ffn_op(target: object) -> str | None:
    """The FFN op a call target stands for (one of :data:`FFN_OPS`), or None."""
    op = schema.op_name(target)
    return op if op in FFN_OPS else None


def attr(gm: fx.GraphModule, node: Any) -> Tensor | None:
    """The tensor a get_attr node reads, else None."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, Tensor) else None
    return None


def skips_inactive(op: str | None, args: Mapping[str, Any]) -> bool:
    """Whether an FFN call (its arguments by name) runs, for one token, a CPU kernel (``kernel``, its key) that
    reads only the deciding rows (gate; no gate: up, b_up) of a selected neuron whose ReLU is 0
    (``kernels.skips_inactive``)."""
    from picompile.kernels import skips_inactive as kernel_skips

    if op != "tvm_sparse_ffn" or not args.get("kernel"):
        return False
    return kernel_skips("ffn_gated" if args["w_gate"] is not None else "ffn_relu", str(args["act"]),
                        args.get("b_gate") is not None)


def _row_sparse(op: str, name: str, t: Tensor, n_rows: int) -> bool:
    """Whether an FFN weight is read a row (``ffn``'s w_down: a column) per computed neuron."""
    if op == "ffn" and name == "w_down":  # [d_model, n_neurons]
        return t.dim() == 2 and t.shape[1] == n_rows
    if op == "ffn" and name in ("b_down", "s_down"):  # read in full
        return False
    return t.dim() >= 1 and t.shape[0] == n_rows  # w_up, b_up, w_gate, w_down_t and their scales: a row per neuron


def tensor_format(t: Tensor) -> str:
    """The storage format of a tensor that is not part of a quantized weight: its dtype's name."""
    return str(t.dtype).removeprefix("torch.")


def quant_formats(gm: fx.GraphModule, node: fx.Node) -> dict[str, str]:
    """{argument name: "int8" | "int4"} for the quants and scales arguments of a node's quantized weights."""
    op = schema.node_op(node)
    if op not in SCALE_ARGS:
        return {}
    a = schema.args_of(node)
    out: dict[str, str] = {}
    for w, s in SCALE_ARGS[op].items():
        q = attr(gm, a[w])
        if a[s] is not None and q is not None:
            out[w] = out[s] = "int8" if q.dtype == torch.int8 else "int4"
    return out


class _Reads:
    """Bytes read per tensor (max over its uses, keyed by start address), which tensors are FFN weights, and
    each tensor's format."""

    def __init__(self) -> None:
        self.uses: dict[int, float] = {}
        self.ffn_ptrs: set[int] = set()
        self.formats: dict[int, str] = {}
        self.ffn_full = 0.0

    def use(self, t: Tensor, nbytes: float, ffn: bool = False, fmt: str | None = None) -> None:
        key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        self.uses[key] = max(self.uses.get(key, 0.0), float(nbytes))
        self.formats[key] = fmt or self.formats.get(key) or tensor_format(t)
        if ffn:
            self.ffn_ptrs.add(key)

    def totals(self) -> dict[str, Any]:
        total = sum(self.uses.values())
        ffn = sum(v for k, v in self.uses.items() if k in self.ffn_ptrs)
        by_format: dict[str, float] = {}
        for k, v in self.uses.items():
            by_format[self.formats[k]] = by_format.get(self.formats[k], 0.0) + v
        return {"total": total, "ffn": ffn, "ffn_full": self.ffn_full, "other": total - ffn,
                "by_format": dict(sorted(by_format.items()))}


def _ffn_reads(reads: _Reads, gm: fx.GraphModule, node: fx.Node, op: str, args: Mapping[str, Any],
               active: Mapping[int, float] | None, fired: Mapping[int, float] | None) -> None:
    """The weight bytes one token reads through one FFN node (``args``: its arguments by name)."""
    layer = int(args["layer"])
    has_mask = args["mask"] is not None
    frac = (active or {}).get(layer, 1.0) if has_mask else 1.0
    w_up = attr(gm, args["w_up"])
    n_rows = int(w_up.shape[0]) if w_up is not None else 0
    later: tuple[str, ...] = ()  # weights read only for the selected rows that fire
    if has_mask and fired and layer in fired and skips_inactive(op, args):
        later = ("w_up", "b_up", "w_down_t", "s_up", "s_down") if args["w_gate"] is not None else ("w_down_t", "s_down")
    fmts = quant_formats(gm, node)
    for name in FFN_WEIGHTS[op]:
        t = attr(gm, args.get(name))
        if t is None:
            continue
        nbytes = t.numel() * t.element_size()
        reads.ffn_full += nbytes
        f = (fired or {}).get(layer, frac) if name in later else frac
        reads.use(t, nbytes * f if _row_sparse(op, name, t, n_rows) else nbytes, ffn=True, fmt=fmts.get(name))


def weight_bytes(gm: fx.GraphModule, active: Mapping[int, float] | None,
                 fired: Mapping[int, float] | None = None,
                 input_active: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Weight bytes one decode token reads through ``gm``.

    ``active``: per FFN layer, the fraction of neurons computed (``None``, or a layer missing: all of
    them, as in a graph without masks). ``fired``: per layer, the fraction of neurons selected *and*
    firing (ReLU output non-zero); where a kernel skips the rest of a selected row that does not fire
    (:func:`skips_inactive`), only its deciding rows count at ``active``, the others at ``fired``.
    ``input_active``: per input-sparse linear (node name), the fraction of its input channels read (its weight
    ``w_t`` rows; missing: all of them).
    Returns {"total", "ffn", "ffn_full", "other", "by_format": {format: bytes}} in bytes.
    """
    reads = _Reads()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if input_active and node.name in input_active and schema.node_op(node) == "input_sparse_linear":
            named = schema.args_of(node)
            t = attr(gm, named["w_t"])
            if t is not None:
                reads.use(t, t.numel() * t.element_size() * float(input_active[node.name]))
            for k in ("x", "b"):
                b = attr(gm, named[k])
                if b is not None:
                    reads.use(b, b.numel() * b.element_size())
            continue
        op = ffn_op(node.target)
        if op is not None:
            _ffn_reads(reads, gm, node, op, schema.args_of(node), active, fired)
            continue
        if node.target is torch.ops.aten.embedding.default:
            t = attr(gm, node.args[0])
            if t is not None:
                reads.use(t, t.shape[-1] * t.element_size())  # one row per token
            continue
        named = schema.args_of(node) if schema.node_op(node) in SCALE_ARGS else {}
        fmts = {id(named[k]): f for k, f in quant_formats(gm, node).items()}
        for arg in list(node.args) + list(node.kwargs.values()):
            t = attr(gm, arg)
            if t is not None:
                reads.use(t, t.numel() * t.element_size(), fmt=fmts.get(id(arg)))
    return reads.totals()

"""convert-weights: aten.linear(x, W) → picompile.linear(x, W', b[, s]), and the rows of sparse_ffn / ffn /
oracle_mask → --weight-dtype; predict's fc1/fc2 → --predictor-dtype (int8: fc1, fc2 int8 with their per-row
scales folded into the offset, threshold 0, ``sparsity.predictor.fold_int8``). float16: W' = W.half(). int8 / int4:
W' the block quants and s their float16 scales (``picompile.kernels.qformat``; blocks of --quant-block along each
stored row: a linear's input dimension, the neuron-major FFN rows' d_model, ffn's down projection's neurons);
a weight whose rows are not whole blocks is stored float16 instead (``convert_weights.fallback`` names it);
weights already quantized (split-ffn makes the FFN rows so) are counted, not quantized again.
Activations, norms, biases (b_up too when quantized; float16 builds narrow it with its rows), embeddings,
predictor offsets and the KV cache stay float32. All float32 leaves the graph as it is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.formats.tensorfile import release_pages
from picompile.ir.graph import drop_unused_weights, get_tensor
from picompile.ir.patterns import QUANT_WEIGHT_DTYPES, QUANTIZED_FROM, SCALE_ARGS, add_buffer, add_quantized
from picompile.ir.patterns import WEIGHT_DTYPES as DTYPES
from picompile.ir.schema import args_of, call_args, node_op, set_args
from picompile.kernels.qformat import QFormat
from picompile.passes.registry import register_pass
from picompile.sparsity.predictor import fold_int8

aten = torch.ops.aten
# picompile op -> the weight tensors it reads in the artifact's weight dtype, by argument name
# (b_up and b_gate go with their rows in float16: the float kernels take it in the weight dtype; quantized ones in float32)
WEIGHT_ARGS: dict[str, tuple[str, ...]] = {
    "ffn": ("w_up", "b_up", "w_gate", "w_down", "b_gate"),
    "sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t", "b_gate"),
    "oracle_mask": ("w", "b", "w_mul", "b_mul"),
}
PREDICTOR_ARGS: tuple[str, ...] = ("fc1", "fc2")  # predict's: in the predictor dtype
# quantized builds: the oracle's deciding rows (a full copy of gate / up, read only by --predictor oracle) in float16
FLOAT_IN_QUANT: tuple[str, ...] = ("oracle_mask",)


class _Converter:
    """One narrowed copy per weight tensor (a weight shared by several nodes stays shared)."""

    def __init__(self, gm: fx.GraphModule, dtype: torch.dtype) -> None:
        self.gm, self.dtype = gm, dtype
        self.done: dict[fx.Node, fx.Node] = {}
        self.count = 0
        self.bytes_before = self.bytes_after = 0

    def __call__(self, arg: object) -> object:
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return arg
        if arg not in self.done:
            t = get_tensor(self.gm, arg)
            if not t.is_floating_point() or t.dtype == self.dtype:
                return arg
            name = f"{str(arg.target).replace('.', '_')}_{str(self.dtype).removeprefix('torch.')}"
            self.done[arg] = add_buffer(self.gm, name, t.to(self.dtype), arg)  # beside the original: before its users
            release_pages([t])  # a mapped checkpoint tensor's pages leave this process's memory (no-op otherwise)
            self.count += 1
            self.bytes_before += t.numel() * t.element_size()
            self.bytes_after += t.numel() * self.dtype.itemsize
        return self.done[arg]


class _Quantizer:
    """One (quants, scales) pair per 2-D weight tensor, quantized from its float32 values as they are (a weight
    that is already whole llama.cpp blocks, e.g. from a Q8_0 / Q4_0 GGUF, gets exactly its blocks back);
    a weight whose rows are not whole blocks goes to ``fallback`` (float16) and is named in ``kept``."""

    def __init__(self, gm: fx.GraphModule, fmt: QFormat, fallback: _Converter) -> None:
        self.gm, self.fmt, self.fallback = gm, fmt, fallback
        self.done: dict[fx.Node, tuple[fx.Node, fx.Node | None]] = {}
        self.count = 0
        self.bytes_before = self.bytes_after = 0
        self.kept: list[dict[str, Any]] = []

    def __call__(self, arg: object) -> tuple[object, object]:
        """``arg`` (a weight node) → (its quants node, its scales node), or (its float16 copy, None)."""
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return arg, None
        if arg not in self.done:
            t = get_tensor(self.gm, arg)
            if t.dim() != 2 or not t.is_floating_point():
                return arg, None
            if t.shape[1] % self.fmt.block:
                self.kept.append({"tensor": str(arg.target), "shape": list(t.shape),
                                  "reason": f"rows of {t.shape[1]} are not whole {self.fmt.block}-element blocks"})
                self.done[arg] = (self.fallback(arg), None)  # type: ignore[assignment]
            else:  # [rows, cols or cols/2], [rows, cols/block]; a few rows at a time
                self.done[arg] = add_quantized(self.gm, str(arg.target).replace(".", "_"), t, self.fmt, arg)
                self.counted(*self.done[arg])
                release_pages([t])  # a mapped checkpoint tensor's pages leave this process's memory (no-op otherwise)
        return self.done[arg]

    def counted(self, q_node: fx.Node, s_node: fx.Node) -> None:
        """Count one quantized weight (its quants node's meta: the bytes it was made from)."""
        q, s = get_tensor(self.gm, q_node), get_tensor(self.gm, s_node)
        self.count += 1
        self.bytes_before += int(q_node.meta.pop(QUANTIZED_FROM, 0))
        self.bytes_after += q.numel() * q.element_size() + s.numel() * s.element_size()


def _dtype(name: str, flag: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise PassError(f"unknown {flag} {name!r}; known: {', '.join(DTYPES)}")
    return dtype


def _narrow_linear(gm: fx.GraphModule, node: fx.Node, conv: _Converter | _Quantizer) -> str | None:
    """aten.linear(x, W, b) → picompile.linear(x, W narrowed, b[, s]); why not, when its weight is computed."""
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return f"{node.name}: its weight is computed ({getattr(w, 'target', w)}), not a stored tensor"
    if isinstance(conv, _Quantizer):
        q, s = conv(w)
        values = dict(x=x, w=q, b=b, s=s)
    else:
        values = dict(x=x, w=conv(w), b=b)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.picompile.linear.default, call_args("linear", values))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return None


def _fold_predictor(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int]:
    """predict(x, fc1, fc2, threshold, offset) rounded to int8 rows (train-predictors) → predict(x, q1, q2, 0,
    offset'): int8 weights, no scales (``fold_int8``); returns (fc1 and fc2 bytes before, after)."""
    a = args_of(node)
    fc1, fc2 = get_tensor(gm, a["fc1"]), get_tensor(gm, a["fc2"])
    offset = None if a["offset"] is None else get_tensor(gm, a["offset"])
    try:
        q1, q2, shifted, thr = fold_int8(fc1, fc2, offset, float(a["threshold"]))
    except ValueError as e:
        raise PassError(f"convert-weights: layer {a['layer']} predictor: {e}") from None
    name = f"predictor{a['layer']}"
    set_args(node, fc1=add_buffer(gm, f"{name}_fc1_int8", q1, node), fc2=add_buffer(gm, f"{name}_fc2_int8", q2, node),
             offset=add_buffer(gm, f"{name}_offset_folded", shifted, node), threshold=thr)
    return (fc1.numel() + fc2.numel()) * fc1.element_size(), fc1.numel() + fc2.numel()


def _narrow_args(node: fx.Node, names: tuple[str, ...], convert: _Converter) -> None:
    """The weight arguments ``names`` of a picompile op node, each read through its narrowed copy."""
    args = args_of(node)
    set_args(node, **{name: convert(args[name]) for name in names})


def _quantize_args(node: fx.Node, op: str, quant: _Quantizer) -> None:
    """The 2-D weights of an ffn / sparse_ffn node → quants + scales (``SCALE_ARGS``); b_up stays float32."""
    args = args_of(node)
    values: dict[str, object] = {}
    for w, s in SCALE_ARGS[op].items():
        if args[s] is not None:  # quantized already (split-ffn's rows)
            if isinstance(args[w], fx.Node) and QUANTIZED_FROM in args[w].meta:
                quant.counted(args[w], args[s])
            continue
        values[w], values[s] = quant(args[w])
    set_args(node, **values)


@register_pass("convert-weights")
def convert_weights(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    name = ctx.config.weight_dtype
    quantized = name in QUANT_WEIGHT_DTYPES
    if quantized:
        try:
            fmt = QFormat(name, ctx.config.quant_block)
        except ValueError as e:
            raise PassError(f"--weight-dtype {name}: {e}") from None
    dtype = torch.float16 if quantized else _dtype(name, "weight dtype")
    conv = _Converter(gm, dtype)  # a no-op for float32 tensors when dtype is float32
    quant = _Quantizer(gm, fmt, conv) if quantized else None
    pname = ctx.config.predictor_storage()
    fold = pname == "int8"
    pconv = _Converter(gm, torch.float32 if fold else _dtype(pname, "predictor dtype"))
    linears = folded = 0
    why_kept: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default and dtype != torch.float32:
            why = _narrow_linear(gm, node, quant or conv)
            if why is None:
                linears += 1
            else:
                why_kept.append(why)
        elif (op := node_op(node)) == "predict" and fold:
            folded += 1
            before, after = _fold_predictor(gm, node)
            pconv.bytes_before += before
            pconv.bytes_after += after
        elif op == "predict":
            _narrow_args(node, PREDICTOR_ARGS, pconv)
        elif op in WEIGHT_ARGS:
            if quant is not None and op not in FLOAT_IN_QUANT:
                _quantize_args(node, op, quant)
            else:
                _narrow_args(node, WEIGHT_ARGS[op], conv)
    if conv.count or pconv.count or folded or linears or (quant is not None and quant.count):
        drop_unused_weights(gm)  # the float32 originals no longer read (an embedding keeps its own)
        gm.recompile()
    q_count, q_before, q_after = (quant.count, quant.bytes_before, quant.bytes_after) if quant else (0, 0, 0)
    info: dict[str, Any] = {
        "dtype": name, "predictor_dtype": pname,
        "converted": conv.count + pconv.count + 2 * folded + q_count, "linear_nodes": linears,
        "bytes_before": conv.bytes_before + pconv.bytes_before + q_before,
        "bytes_after": conv.bytes_after + pconv.bytes_after + q_after,
        "kept": why_kept,
    }
    if quant is not None:
        info.update(block=fmt.block, quantized=quant.count, fallback=quant.kept)
    ctx.manifest_extra["convert_weights"] = info
    return gm

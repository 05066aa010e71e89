"""convert-weights: aten.linear(x, W) → picompile.linear(x, W.half(), b), and the rows of sparse_ffn / ffn /
oracle_mask → --weight-dtype (float16); predict's fc1/fc2 → --predictor-dtype. Activations, norms, biases (but b_up),
embeddings, predictor offsets and the KV cache stay float32. All float32 leaves the graph as it is.
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.formats.tensorfile import release_pages
from picompile.ir.graph import drop_unused_weights, get_tensor
from picompile.ir.patterns import WEIGHT_DTYPES as DTYPES
from picompile.ir.patterns import add_buffer
from picompile.ir.schema import args_of, call_args, node_op, set_args
from picompile.passes.registry import register_pass

aten = torch.ops.aten
# picompile op -> the weight tensors it reads in the artifact's weight dtype, by argument name
# (b_up goes with its rows: the kernels take it in the weight dtype)
WEIGHT_ARGS: dict[str, tuple[str, ...]] = {
    "ffn": ("w_up", "b_up", "w_gate", "w_down"),
    "sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t"),
    "oracle_mask": ("w", "b", "w_mul"),
}
PREDICTOR_ARGS: tuple[str, ...] = ("fc1", "fc2")  # predict's: in the predictor dtype


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


def _dtype(name: str, flag: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise PassError(f"unknown {flag} {name!r}; known: {', '.join(DTYPES)}")
    return dtype


def _narrow_linear(gm: fx.GraphModule, node: fx.Node, conv: _Converter) -> str | None:
    """aten.linear(x, W, b) → picompile.linear(x, W narrowed, b); why not, when its weight is computed."""
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        return f"{node.name}: its weight is computed ({getattr(w, 'target', w)}), not a stored tensor"
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.picompile.linear.default, call_args("linear", dict(x=x, w=conv(w), b=b)))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return None


def _narrow_args(node: fx.Node, names: tuple[str, ...], convert: _Converter) -> None:
    """The weight arguments ``names`` of a picompile op node, each read through its narrowed copy."""
    args = args_of(node)
    set_args(node, **{name: convert(args[name]) for name in names})


@register_pass("convert-weights")
def convert_weights(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    dtype = _dtype(ctx.config.weight_dtype, "weight dtype")
    conv = _Converter(gm, dtype)  # a no-op for float32 tensors when dtype is float32
    pconv = _Converter(gm, _dtype(ctx.config.predictor_dtype, "predictor dtype"))
    ops = {**{op: (names, conv) for op, names in WEIGHT_ARGS.items()}, "predict": (PREDICTOR_ARGS, pconv)}
    linears = 0
    why_kept: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default and dtype != torch.float32:
            why = _narrow_linear(gm, node, conv)
            if why is None:
                linears += 1
            else:
                why_kept.append(why)
        elif (op := node_op(node)) is not None and op in ops:
            _narrow_args(node, *ops[op])
    if conv.count or pconv.count or linears:
        drop_unused_weights(gm)  # the float32 originals no longer read (an embedding keeps its own)
        gm.recompile()
    ctx.manifest_extra["convert_weights"] = {
        "dtype": ctx.config.weight_dtype, "predictor_dtype": ctx.config.predictor_dtype,
        "converted": conv.count + pconv.count, "linear_nodes": linears,
        "bytes_before": conv.bytes_before + pconv.bytes_before, "bytes_after": conv.bytes_after + pconv.bytes_after,
        "kept": why_kept,
    }
    return gm

"""fuse-projections: linear(x, Wq), linear(x, Wk), linear(x, Wv) → slices of linear(x, [Wq; Wk; Wv]):
linear layers reading the same input (q/k/v) become one GEMV over the stacked rows (one kernel call, one
stream, instead of three; small k/v projections pay a call's fixed cost for 1 MB of weights). Quantized
linears (int8 / int4 blocks along each row) stack their quants and their scales alike. Biases (Llama
``attention_bias``, Qwen2's q/k/v) stack with their rows; in a group where only some linears have one, the others
get zeros (the stacked linear adds exactly what each did).
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.ir.graph import drop_unused_weights, get_tensor
from picompile.ir.patterns import add_buffer, linear_parts, scale_of
from picompile.ir.schema import call_args, op_name
from picompile.passes.registry import register_pass

aten = torch.ops.aten


def _linear_args(target: object, x: fx.Node, w: fx.Node, b: fx.Node | None,
                 s: fx.Node | None = None) -> tuple[object, ...]:
    """The arguments of a call of ``target`` (aten.linear, or picompile.linear by name) on x, w, b (and the
    scales s of a quantized w)."""
    op = op_name(target)
    return (x, w, b) if op is None else call_args(op, dict(x=x, w=w, b=b, s=s))


@register_pass("fuse-projections")
def fuse_projections(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    groups: dict[tuple[object, ...], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        parts = linear_parts(node)
        if parts is None:
            continue
        x, w, b = parts
        t = get_tensor(gm, w)  # [d_out, d_in] (int4: [d_out, d_in / 2])
        s = scale_of(node, "w")
        blocks = None if s is None else get_tensor(gm, s).shape[1]  # quantized: the same blocks per row
        groups.setdefault((node.target, x, t.dtype, t.shape[1], blocks), []).append(node)
    fused: list[dict[str, object]] = []
    for (target, x, _, _, blocks), nodes in groups.items():
        if len(nodes) < 2:
            continue
        parts = [linear_parts(n) for n in nodes]
        ws = [get_tensor(gm, w) for _, w, _ in parts]  # type: ignore[misc]  # each [d_out_i, d_in]
        first = nodes[0]
        w_node = add_buffer(gm, f"fused_{first.name}_w", torch.cat(ws), first)  # [sum d_out_i, d_in]
        biases = [None if b is None else get_tensor(gm, b) for _, _, b in parts]  # type: ignore[misc]  # each [d_out_i]
        have = [bt for bt in biases if bt is not None]
        b_node = None if not have else add_buffer(gm, f"fused_{first.name}_b", torch.cat([
            bt if bt is not None else have[0].new_zeros(w.shape[0]) for bt, w in zip(biases, ws)]), first)  # [sum d_out_i]
        s_node = None if blocks is None else add_buffer(
            gm, f"fused_{first.name}_s", torch.cat([get_tensor(gm, scale_of(n, "w")) for n in nodes]), first)  # type: ignore[arg-type]
        with gm.graph.inserting_before(first):
            out = gm.graph.call_function(target, _linear_args(target, x, w_node, b_node, s_node))  # [..., sum d_out_i]
            start = 0
            for n, w in zip(nodes, ws):
                part = gm.graph.call_function(aten.slice.Tensor, (out, -1, start, start + w.shape[0]))
                part.meta.update(n.meta)
                n.replace_all_uses_with(part)
                start += w.shape[0]
        for n in nodes:
            gm.graph.erase_node(n)
        fused.append({"input": str(getattr(x, "name", x)), "linears": [n.name for n in nodes],
                      "rows": [int(w.shape[0]) for w in ws]})
        del ws, biases, have, parts, w
        drop_unused_weights(gm)  # this group's separate weights, no longer read: gone before the next is stacked
    gm.recompile()
    ctx.manifest_extra["fuse_projections"] = {"groups": len(fused), "fused": fused}
    return gm

"""fold-kv-repeat: sdpa(q, reshape(expand(unsqueeze(k, 2), [b, kv, rep, T, hd]), [b, kv·rep, T, hd]), …same for v)
→ sdpa(q, k, v, …, enable_gqa=True): grouped-query attention reads the KV cache once instead of copying it
rep times per layer and step (HF's repeat_kv, traced). A layer whose attention does not match says why.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.passes.registry import register_pass

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def _repeated_source(node: Any) -> tuple[fx.Node | None, str]:
    """The KV tensor ``node`` repeats (b, kv, T, hd), or None and why it is not a repeat_kv."""
    if not isinstance(node, fx.Node) or node.target not in (aten.reshape.default, aten.view.default,
                                                             aten._unsafe_view.default):
        return None, f"{getattr(node, 'name', node)} is not a reshape"
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None, f"{node.name} does not reshape an expand"
    unsq = expand.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target is not aten.unsqueeze.default or unsq.args[1] != 2:
        return None, f"{expand.name} does not expand an unsqueeze(·, 2)"
    if len(expand.users) != 1 or len(node.users) != 1:
        return None, f"{node.name} is used elsewhere"
    return unsq.args[0], ""


@register_pass("fold-kv-repeat")
def fold_kv_repeat(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    folded, reasons = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        if node.kwargs.get("enable_gqa"):
            continue
        (k, why_k), (v, why_v) = _repeated_source(node.args[1]), _repeated_source(node.args[2])
        if k is None or v is None:
            reasons.append(f"{node.name}: {why_k or why_v}")
            continue
        old_k, old_v = node.args[1], node.args[2]
        node.args = (node.args[0], k, v, *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for dead in (old_k, old_v):  # reshape → expand → unsqueeze, now unused
            while isinstance(dead, fx.Node) and not dead.users:
                src = dead.args[0]
                gm.graph.erase_node(dead)
                dead = src
        folded += 1
    gm.graph.lint()
    gm.recompile()
    ctx.manifest_extra["fold_kv_repeat"] = {"folded": folded, "left": reasons}
    return gm

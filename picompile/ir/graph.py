"""Graph helpers shared by passes and the runtime: flat calling convention, lint, printing."""
from __future__ import annotations

import torch
from torch import fx

from picompile.errors import PassError


def flatten_codegen(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop torch.export's pytree wrapper: forward(input_ids, past_0, …) -> (logits, present_0, …).

    Also drops the shape-guard call ``ep.module()`` inserts: the runtime checks lengths itself.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm._forward_pre_hooks.clear()  # torch.export's input checks assume the pytree signature we drop
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    return gm


def shared_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module with a copy of ``gm``'s graph (to rewrite) and ``gm``'s buffers (the same tensors)."""
    import copy

    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def drop_unused_weights(gm: fx.GraphModule) -> None:
    """Erase the get_attr nodes nothing reads, then forget the flat buffers no get_attr node names (weights a
    pass replaced: permuted, converted or stacked copies), so the build stops holding them."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [n for n, _ in gm.named_buffers(recurse=False) if n not in used]:
        delattr(gm, name)


def drop_metadata_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove torch.export's ``aten._assert_tensor_metadata`` checks (no outputs; ~2 per layer per step)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _val_dtype(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def drop_noop_ops(gm: fx.GraphModule) -> dict[str, int]:
    """Remove calls that do nothing but cost a Python call each per step (in place):

    ``aten.to.dtype(x, d)`` where x is already d (HF's norms cast float32 to float32) → x;
    ``aten.detach_(aten.lift_fresh_copy(c))`` whose result nothing reads (torch.export's copies of constant
    tensors, e.g. an FFN part's empty rows) → gone. Returns how many of each went."""
    aten = torch.ops.aten
    counts = {"casts": 0, "constant_copies": 0}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            src, dtype = node.args
            if isinstance(dtype, torch.dtype) and _val_dtype(src) == dtype == _val_dtype(node):
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
                counts["casts"] += 1
        elif node.target is aten.detach_.default and not node.users:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.target is aten.lift_fresh_copy.default and len(src.users) == 1:
                gm.graph.erase_node(node)
                gm.graph.erase_node(src)
                counts["constant_copies"] += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return counts


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an operator returning a view of its first argument (slice, view, transpose, …), by its
    schema: one aliasing, non-written return."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def lint(gm: fx.GraphModule, pass_name: str) -> None:
    """Structural checks run after every pass; a failure names the pass."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise PassError(f"graph is malformed after pass {pass_name}: {e}") from None
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                _resolve(gm, str(node.target))
            except AttributeError:
                raise PassError(f"after pass {pass_name}: node {node.name} reads missing attribute {node.target}") from None
    if sum(1 for n in gm.graph.nodes if n.op == "output") != 1:
        raise PassError(f"after pass {pass_name}: the graph must have exactly one output")


def _resolve(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def get_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """The tensor a get_attr node reads."""
    assert node.op == "get_attr", node
    return _resolve(gm, str(node.target))


def format_graph(gm: fx.GraphModule) -> str:
    """Readable text of a graph: fx's Python form with shapes, one line per node."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def count_ops(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            key = n.target.name() if hasattr(n.target, "name") else getattr(n.target, "__name__", str(n.target))
            counts[key] = counts.get(key, 0) + 1
    return counts

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

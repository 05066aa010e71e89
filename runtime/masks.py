"""Every neuron computed: the FFN ops' neuron masks dropped (``load(dense=True)``, and dense prefill).

ffn / sparse_ffn / tvm_sparse_ffn(…, mask=m, …) → the same op with mask=None, a hybrid scheduler's two
partition masks likewise; the predictors feeding the masks become dead code and go. With the placement
kept, this is the artifact's exact dense reference (same weights, same split).
"""
from __future__ import annotations

from typing import Any

from torch import fx

from picompile.ir.graph import shared_copy
from picompile.ir.schema import args_of, node_op, set_args

MASKED_OPS: tuple[str, ...] = ("ffn", "sparse_ffn", "tvm_sparse_ffn", "input_sparse_linear")  # ops taking a mask "mask"


def masks_of(node: fx.Node) -> dict[str, Any]:
    """``node``'s neuron mask arguments by name (empty unless it is an FFN op or a hybrid scheduler)."""
    from picompile.runtime.hybrid import HYBRID_MASKS, HybridFFN, hybrid_args

    if node.op != "call_function":
        return {}
    if isinstance(node.target, HybridFFN):
        args = hybrid_args(node)
        return {name: args[name] for name in HYBRID_MASKS}
    if node_op(node) in MASKED_OPS:
        return {"mask": args_of(node)["mask"]}
    return {}


def _unmask(node: fx.Node, names: list[str]) -> None:
    from picompile.runtime.hybrid import HybridFFN, set_hybrid_args

    values = dict.fromkeys(names)
    if isinstance(node.target, HybridFFN):
        set_hybrid_args(node, **values)
    else:
        set_args(node, **values)


def drop_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """Compute every neuron (in place): the FFN ops lose their masks (predictors become dead code and go).

    Hybrid-scheduled graphs (``runtime/hybrid.py``) lose the masks of both partitions alike.
    """
    for node in gm.graph.nodes:
        masked = [name for name, value in masks_of(node).items() if value is not None]
        if masked:
            _unmask(node, masked)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def without_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its weights whose FFN ops compute every neuron (:func:`drop_masks`), or ``gm``
    itself when none of its FFN ops has a mask."""
    if not any(value is not None for node in gm.graph.nodes for value in masks_of(node).values()):
        return gm
    return drop_masks(shared_copy(gm))

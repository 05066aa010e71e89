"""A one-token decode graph's glue as fewer calls: each per-layer pattern of aten ops between the kernels → one
``picompile_native`` C++ op running the same aten ops (``native_ops.cpp``: the same floats, bit for bit).

    pow, mean, add eps, rsqrt, mul, mul weight            → rms_norm(x, w, eps)
    mul cos, slice, slice, neg, cat, mul sin, add          → rotary(x, cos, sin, half)
    grouped_attention (Python: 11 aten calls)             → grouped_attention (C++)
    an FFN part without rows and its merge               → the other part (+ the down bias)
    input_mask (a Python op: |x| > threshold)             → aten abs and gt
    the same unsqueeze / sym_size of the same input       → the first one, shared

An eager decode step is a Python call per node: at one token each aten call costs a few µs of dispatch for
nanoseconds of work, and a 22-layer step ran ~1,500 of them. Patterns that differ from these (other casts,
another rotary layout) stay as they are; the step is the same computation either way.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx

from picompile.ir.graph import get_tensor
from picompile.ir.schema import args_of, node_op

aten = torch.ops.aten


@dataclass
class GlueCounts:
    """How many of each pattern a graph had rewritten."""

    rms_norms: int = 0
    rotaries: int = 0
    attentions: int = 0
    empty_parts: int = 0
    input_masks: int = 0
    shared: int = 0

    def total(self) -> int:
        return sum(asdict(self).values())


def _is(node: Any, target: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _float_val(node: Any) -> torch.Tensor | None:
    """The fake float32 tensor a node computes, or None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) and val.dtype == torch.float32 else None


def _rms_norm(node: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, w, eps) when ``node`` is ``mul(w, mul(x, rsqrt(add(mean(pow(x, 2), [-1], True), eps))))`` (either
    operand order of each mul), each inner node read only by the next, x and w float32, w a weight."""
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for inner, w in (node.args, node.args[::-1]):
        if not (_is(inner, aten.mul.Tensor) and isinstance(w, fx.Node) and w.op == "get_attr"
                and _only_user(inner, node)):
            continue
        for x, r in (inner.args, inner.args[::-1]):
            if not (_is(r, aten.rsqrt.default) and _only_user(r, inner)):
                continue
            add = r.args[0]
            if not (_is(add, aten.add.Tensor) and _only_user(add, r) and isinstance(add.args[1], float)):
                continue
            mean = add.args[0]
            if not (_is(mean, aten.mean.dim) and _only_user(mean, add) and list(mean.args[1:]) == [[-1], True]
                    and not mean.kwargs):
                continue
            sq = mean.args[0]
            if (_is(sq, aten.pow.Tensor_Scalar) and _only_user(sq, mean) and sq.args == (x, 2)
                    and _float_val(x) is not None and _float_val(w) is not None):
                return x, w, float(add.args[1])
    return None


def _rotated_half(cat: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, half) when ``cat`` is ``cat([neg(x[..., half:]), x[..., :half]], -1)`` on x's last dimension, half of it."""
    if not _is(cat, aten.cat.default) or len(cat.args) != 2 or len(cat.args[0]) != 2:
        return None
    neg, low = cat.args[0]
    if not (_is(neg, aten.neg.default) and _is(low, aten.slice.Tensor) and _is(neg.args[0], aten.slice.Tensor)):
        return None
    high = neg.args[0]
    if len(high.args) != 4 or len(low.args) != 4 or high.kwargs or low.kwargs:
        return None
    x, d, half, stop = high.args
    val = _float_val(x)
    if val is None or not isinstance(half, int) or not isinstance(stop, int):
        return None
    n, last = val.shape[-1], val.dim() - 1
    same_dim = all(isinstance(i, int) and i % val.dim() == last for i in (d, low.args[1], cat.args[1]))
    if same_dim and low.args[0] is x and low.args[2:] == (0, half) and 2 * half == n and stop >= n:
        return x, half
    return None


def _rotary(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int] | None:
    """(x, cos, sin, half) when ``node`` is ``add(mul(x, cos), mul(rotate_half(x), sin))`` (any operand order)."""
    if not _is(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    for a, b in (node.args, node.args[::-1]):
        if not (_is(a, aten.mul.Tensor) and _is(b, aten.mul.Tensor)):
            continue
        for cat, sin in (b.args, b.args[::-1]):
            found = _rotated_half(cat) if isinstance(cat, fx.Node) else None
            if found is None or not isinstance(sin, fx.Node):
                continue
            x, half = found
            for xx, cos in (a.args, a.args[::-1]):
                if xx is x and isinstance(cos, fx.Node) and _float_val(cos) is not None \
                        and _float_val(sin) is not None:
                    return x, cos, sin, half
    return None


def _replace(gm: fx.GraphModule, node: fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _empty_part(gm: fx.GraphModule, node: Any) -> bool:
    """Whether ``node`` is an FFN part with no rows (zeros: every neuron is in the other part)."""
    return isinstance(node, fx.Node) and node_op(node) in ("tvm_sparse_ffn", "sparse_ffn") \
        and get_tensor(gm, args_of(node)["w_up"]).shape[0] == 0


def fold_empty_parts(gm: fx.GraphModule) -> int:
    """``merge(hot, cold, bias)`` where one part has no rows → the other (+ bias); how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node_op(node) != "merge":
            continue
        a = args_of(node)
        hot_empty, cold_empty = _empty_part(gm, a["hot"]), _empty_part(gm, a["cold"])
        if hot_empty == cold_empty:
            continue
        other = a["cold"] if hot_empty else a["hot"]
        if a["bias"] is None:
            node.replace_all_uses_with(other)
            gm.graph.erase_node(node)
        else:
            _replace(gm, node, aten.add.Tensor, (other, a["bias"]))
        count += 1
    return count


def inline_input_masks(gm: fx.GraphModule) -> int:
    """``input_mask(x, threshold, …, thresholds)`` → ``abs(x) > thresholds`` (or ``> threshold``): the op's own
    computation as two aten calls, which a C++ program runs (``graph_exec.py``); how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node_op(node) != "input_mask":
            continue
        a = args_of(node)
        with gm.graph.inserting_before(node):
            mag = gm.graph.call_function(aten.abs.default, (a["x"],))
        if a.get("thresholds") is not None:
            _replace(gm, node, aten.gt.Tensor, (mag, a["thresholds"]))
        else:
            _replace(gm, node, aten.gt.Scalar, (mag, float(a["threshold"])))
        count += 1
    return count


SHARED = (aten.unsqueeze.default, aten.sym_size.int)  # pure, cheap to keep, repeated per layer on the same input


def share_repeats(gm: fx.GraphModule) -> int:
    """Later calls of a ``SHARED`` op with the same arguments as an earlier one → that one; how many."""
    seen: dict[tuple[Any, ...], fx.Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SHARED or node.kwargs:
            continue
        key = (node.target, *node.args)
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            count += 1
    return count


def fuse_glue(gm: fx.GraphModule) -> GlueCounts:
    """Rewrite ``gm`` (a one-token decode graph whose library ``picompile_native`` is loaded) in place: the
    patterns of the module docstring as their C++ ops. Returns how many of each."""
    from picompile.runtime.decode_attention import grouped_attention

    native = torch.ops.picompile_native
    counts = GlueCounts()
    counts.empty_parts = fold_empty_parts(gm)
    counts.input_masks = inline_input_masks(gm)
    counts.shared = share_repeats(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is grouped_attention:
            _replace(gm, node, native.grouped_attention.default, tuple(node.args))
            counts.attentions += 1
        elif (norm := _rms_norm(node)) is not None:
            _replace(gm, node, native.rms_norm.default, norm)
            counts.rms_norms += 1
        elif (rot := _rotary(node)) is not None:
            _replace(gm, node, native.rotary.default, rot)
            counts.rotaries += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return counts


__all__ = ["GlueCounts", "fold_empty_parts", "fuse_glue", "inline_input_masks", "share_repeats"]

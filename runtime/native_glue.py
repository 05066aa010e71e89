"""A one-token decode graph's glue as fewer calls: each per-layer pattern of aten ops between the kernels → one
``picompile_native`` C++ op running the same aten ops (``native_ops.cpp``: the same floats, bit for bit).

    pow, mean, add eps, rsqrt, mul, mul weight            → rms_norm(x, w, eps)
    mul cos, slice, slice, neg, cat, mul sin, add          → rotary(x, cos, sin, half)
    grouped_attention (Python: 11 aten calls)             → grouped_attention (C++)
    slice, view, transpose (and rotary) of a fused q/k/v   → heads(qkv, offset, n, e, cos, sin, half)
    the KV cache writes, its views, grouped_attention and  → cached_attention(q, k, v, k_cache, v_cache, …)
      the reshape / transpose / reshape after it
    an FFN part without rows and its merge               → the other part (+ the down bias)
    input_mask (a Python op: |x| > threshold)             → aten abs and gt
    the same unsqueeze / sym_size of the same input       → the first one, shared
    x[..., 0:] (a mask's slice past zero hot rows)         → x

An eager decode step is a Python call per node: at one token each aten call costs a few µs of dispatch for
nanoseconds of work, and a 22-layer step ran ~1,500 of them. Patterns that differ from these (other casts,
another rotary layout) stay as they are; the step is the same computation either way.
"""
from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx

from picompile.ir.graph import get_tensor, is_view
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
    heads: int = 0
    cached_attentions: int = 0
    whole_slices: int = 0

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


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` may write ``node`` (or what it views) in place: a schema argument marked written, or a
    call that is not an operator (whose writes cannot be read off)."""
    target = user.target
    if user.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return user.op != "output"
    args = target._schema.arguments
    for i, a in enumerate(user.args):
        if a is node and i < len(args) and args[i].alias_info is not None and args[i].alias_info.is_write:
            return True
    if any(v is node and a.alias_info is not None and a.alias_info.is_write
           for a in args for k, v in user.kwargs.items() if k == a.name):
        return True
    # a view of node: its writes are node's too
    return is_view(user) and user.args[0] is node and any(_writes(u, user) for u in user.users)


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or symbols) are known equal."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _slice_args(node: fx.Node) -> tuple[Any, Any, Any, Any, Any]:
    """``aten.slice.Tensor``'s (x, dim, start, end, step), its defaults where the node leaves them out."""
    return (*node.args, *(0, None, None, 1)[len(node.args) - 1:])[:5]


def _swaps_1_2(t: Any) -> bool:
    """Whether ``t`` is ``transpose(x, 1, 2)`` of a 4-D x (either order, negative dims too)."""
    return (_is(t, aten.transpose.int) and len(t.args) == 3 and not t.kwargs
            and sorted(d % 4 for d in t.args[1:] if isinstance(d, int)) == [1, 2])


def _split_heads(t: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(x, offset, n, e) when ``t`` is ``transpose(view(x[..., offset : offset + n * e], [b, s, n, e]), 1, 2)``
    on a float32 x [b, s, d] (each inner node read only by the next)."""
    if not _swaps_1_2(t):
        return None
    view = t.args[0]
    if not (_is(view, aten.view.default) and _only_user(view, t)):
        return None
    sl = view.args[0]
    if not (_is(sl, aten.slice.Tensor) and _only_user(sl, view) and not sl.kwargs and 3 <= len(sl.args) <= 5):
        return None
    x, dim, start, end, step = _slice_args(sl)
    xv, vv = _float_val(x), _float_val(view)
    if xv is None or vv is None or xv.dim() != 3 or vv.dim() != 4 or dim not in (2, -1) or step != 1:
        return None
    start = 0 if start is None else start
    if not (isinstance(start, int) and isinstance(end, int) and isinstance(vv.shape[2], int)
            and isinstance(vv.shape[3], int) and isinstance(xv.shape[2], int)):
        return None
    n, e = int(vv.shape[2]), int(vv.shape[3])
    if not (0 <= start and end <= xv.shape[2] and end - start == n * e and n > 0 and e > 0
            and _same(vv.shape[0], xv.shape[0]) and _same(vv.shape[1], xv.shape[1])):
        return None
    return x, start, n, e


def fuse_heads(gm: fx.GraphModule) -> int:
    """``rotary(transpose(view(slice(qkv))), cos, sin, half)`` → ``heads(qkv, offset, n, e, cos, sin, half)``, and
    ``transpose(view(slice(qkv)))`` (v: a view) → ``heads(qkv, offset, n, e)`` (a copy) where no reader writes
    it, directly or through a view; none where qkv itself is written in place; how many."""
    native = torch.ops.picompile_native
    count = 0
    for node in list(gm.graph.nodes):
        found = _split_heads(node) if node.op == "call_function" else None
        if found is None:
            continue
        users = list(node.users)
        if any(_writes(u, found[0]) for u in found[0].users):  # qkv written in place: its views would see it
            continue
        if len(users) == 1 and _is(users[0], native.rotary.default) and users[0].args[0] is node:
            rot = users[0]
            _replace(gm, rot, native.heads.default, (*found, *rot.args[1:4]))
        elif users and not any(_writes(u, node) for u in users):
            _replace(gm, node, native.heads.default, (*found, None, None, 0))
        else:
            continue
        count += 1
    gm.graph.eliminate_dead_code()
    return count


def _cache_write(view: Any) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """(cache, new, start, write slice, copy) when ``view`` is ``cache[:, :, :end]`` (read only by the attention),
    ``cache`` a buffer otherwise only written by ``copy_(cache[:, :, start:end], new)``, with ``end = start +
    new.size(2)`` (``kv_cache.arena_step``'s form)."""
    if not (_is(view, aten.slice.Tensor) and len(view.args) == 4 and not view.kwargs and len(view.users) == 1):
        return None
    cache, dim, zero, end = view.args
    if not (isinstance(cache, fx.Node) and cache.op == "get_attr" and dim in (2, -2) and zero == 0):
        return None
    writes = [u for u in cache.users if u is not view]
    if len(writes) != 1:
        return None
    w = writes[0]
    if not (_is(w, aten.slice.Tensor) and len(w.args) == 4 and w.args[0] is cache and w.args[1] == dim
            and w.args[3] is end and len(w.users) == 1):
        return None
    copy = next(iter(w.users))
    if not (_is(copy, aten.copy_.default) and copy.args[0] is w and len(copy.args) == 2 and not copy.users):
        return None
    start, new = w.args[2], copy.args[1]
    if not (isinstance(end, fx.Node) and end.op == "call_function" and end.target is operator.add
            and len(end.args) == 2 and end.args[0] is start and _is(end.args[1], aten.sym_size.int)
            and end.args[1].args[0] is new and end.args[1].args[1] in (2, -2)):
        return None
    return cache, new, start, w, copy


def fuse_cached_attention(gm: fx.GraphModule) -> int:
    """The KV cache writes and views (``kv_cache.arena_step``), ``grouped_attention`` over them and the
    ``reshape / transpose(1, 2) / reshape`` to ``[b, s, hq * e]`` after it → ``cached_attention``; how many."""
    native = torch.ops.picompile_native
    count = 0
    for node in list(gm.graph.nodes):
        if not _is(node, native.grouped_attention.default) or len(node.args) != 5:
            continue
        q, kview, vview, mask, scale = node.args
        k, v = _cache_write(kview), _cache_write(vview)
        if k is None or v is None or len(node.users) != 1:
            continue
        r1 = next(iter(node.users))
        t = next(iter(r1.users)) if len(r1.users) == 1 else None
        r2 = next(iter(t.users)) if t is not None and len(t.users) == 1 else None
        av, v1, v2 = _float_val(node), _float_val(r1), _float_val(r2)
        if not (_is(r1, aten.reshape.default) and _swaps_1_2(t) and _is(r2, aten.reshape.default)
                and t.args[0] is r1 and r2.args[0] is t
                and av is not None and v1 is not None and v2 is not None and av.dim() == v1.dim() == 4
                and v2.dim() == 3 and all(_same(a, b) for a, b in zip(av.shape, v1.shape))
                and _same(v2.shape[0], av.shape[0]) and _same(v2.shape[1], av.shape[2])
                and _same(v2.shape[2], av.shape[1] * av.shape[3])):
            continue
        (kc, knew, kstart, kw, kcopy), (vc, vnew, vstart, vw, vcopy) = k, v
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(native.cached_attention.default,
                                         (q, knew, vnew, kc, vc, kstart, vstart, mask, scale))
        new.meta.update(r2.meta)
        r2.replace_all_uses_with(new)
        for dead in (r2, t, r1, node, kview, vview, kcopy, vcopy, kw, vw):
            gm.graph.erase_node(dead)
        count += 1
    gm.graph.eliminate_dead_code()
    return count


def drop_whole_slices(gm: fx.GraphModule) -> int:
    """``slice(x, dim, 0[, end ≥ size])`` (step 1: all of x, as a view) → x where no reader writes it; how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _is(node, aten.slice.Tensor) or node.kwargs or not isinstance(node.args[0], fx.Node):
            continue
        x, dim, start, end, step = _slice_args(node)
        val = x.meta.get("val")
        if not (isinstance(val, torch.Tensor) and isinstance(dim, int) and -val.dim() <= dim < val.dim()):
            continue
        size = val.shape[dim]
        whole = start in (0, None) and step == 1 and (end is None or isinstance(end, int) and isinstance(size, int)
                                                      and end >= size)
        if whole and not any(_writes(u, node) for u in node.users):
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
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
    counts.whole_slices = drop_whole_slices(gm)
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
    counts.cached_attentions = fuse_cached_attention(gm)
    counts.heads = fuse_heads(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return counts


__all__ = ["GlueCounts", "drop_whole_slices", "fold_empty_parts", "fuse_cached_attention", "fuse_glue", "fuse_heads",
           "inline_input_masks", "share_repeats"]

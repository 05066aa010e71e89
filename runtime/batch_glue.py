"""Which aten nodes of the B-sequence decode graph (``runtime/batch.py``) run once on the B tokens stacked.

A decode step's per-token work besides the weight-streaming kernels is ~70 small aten calls per layer (norms,
head views, rotary, residual adds), a few microseconds each: run B times they cost more than the weights'
bytes on a 2-core CPU. Every tensor of the decode graph whose leading dimension is the (size-1) batch of the
export is instead computed once on the B sequences' values stacked along that dimension ("batched"), where the
op is **dim-0-pointwise**: ``f(cat(x_0..x_B-1)) == cat(f(x_0)..f(x_B-1))`` for inputs of leading size 1. An op
qualifies when

* it is in :data:`POINTWISE` (elementwise, broadcasting), :data:`DIM_OPS` (a dimension argument that must not be
  0), :data:`SHAPE_OPS` (a size list whose first entry, a literal 1 or -1, becomes B) or ``embedding``;
* its output and every stacked input have a static leading size 1 and the same rank, and no shape mentions a
  past length (the symbols of the past inputs' shapes: those differ between sequences);
* inputs that are not stacked are shared by all sequences (weights, constants; they broadcast over B).

Everything else (attention over each sequence's own KV arena, the arena writes, the causal mask, positions)
runs once per sequence, as before; a per-sequence value enters the batched part by one ``cat`` and leaves it
by a ``narrow`` view. Stacking changes no float: each op computes each row as it does alone (elementwise, or a
reduction along a dimension other than 0, on one torch thread in decode), so a sequence's result is bit for bit
the one it gets alone (``tests/test_serve_batch.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten

POINTWISE: frozenset[Any] = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default, aten.exp.default, aten.tanh.default,
    aten.cos.default, aten.sin.default, aten.abs.default, aten.relu.default, aten.silu.default,
    aten.sigmoid.default, aten.gelu.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout,
    aten._to_copy.default, aten.type_as.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.where.self, aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor,
    aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.eq.Tensor, aten.ne.Tensor,
    aten.minimum.default, aten.maximum.default, aten.clamp.default, aten.masked_fill.Scalar,
})
# op -> its dimension arguments (by schema name) and whether they index the output (unsqueeze) or the input
DIM_OPS: dict[Any, tuple[tuple[str, ...], bool]] = {
    aten.mean.dim: (("dim",), False), aten.sum.dim_IntList: (("dim",), False), aten.amax.default: (("dim",), False),
    aten.slice.Tensor: (("dim",), False), aten.select.int: (("dim",), False), aten.narrow.default: (("dim",), False),
    aten.transpose.int: (("dim0", "dim1"), False), aten.unsqueeze.default: (("dim",), True),
    aten.squeeze.dim: (("dim",), False), aten.cat.default: (("dim",), False), aten._softmax.default: (("dim",), False),
    aten.softmax.int: (("dim",), False), aten._log_softmax.default: (("dim",), False),
}
SHAPE_OPS: frozenset[Any] = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                                       aten.expand.default})


def varying_symbols(graph: fx.Graph, past: list[fx.Node]) -> set[Any]:
    """The shape symbols that differ between sequences: those of the past inputs' shapes (their lengths)."""
    syms: set[Any] = set()
    for n in past:
        val = n.meta.get("val")
        for d in getattr(val, "shape", ()):
            syms |= _free(d)
    return syms


def _free(value: Any) -> set[Any]:
    node = getattr(value, "node", None)  # a SymInt
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ())) if expr is not None else set()


def varies(val: Any, syms: set[Any]) -> bool:
    """Whether a node's value (tensor, SymInt, …) has a shape or value that names a varying symbol."""
    if isinstance(val, torch.Tensor):
        return any(_free(d) & syms for d in val.shape)
    if isinstance(val, (list, tuple)):
        return any(varies(v, syms) for v in val)
    return bool(_free(val) & syms)


def stackable(val: Any, syms: set[Any]) -> bool:
    """A per-sequence tensor that stacks along dim 0: rank >= 2, static leading size 1, no varying shape."""
    return (isinstance(val, torch.Tensor) and val.dim() >= 2 and isinstance(val.shape[0], int)
            and val.shape[0] == 1 and not varies(val, syms))


def schema_kwargs(node: fx.Node) -> Optional[dict[str, Any]]:
    """An aten node's arguments by their schema names (defaults filled in), or None when they do not bind."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            return None
    return out


def _norm(d: Any, ndim: int) -> Optional[int]:
    return d % ndim if isinstance(d, int) and ndim > 0 else None


def batched_kwargs(node: fx.Node, batch: int, stacked: set[fx.Node], syms: set[Any]) -> Optional[dict[str, Any]]:
    """The keyword arguments (by schema name) of ``node``'s batched form, whose inputs in ``stacked`` are the
    B sequences' values stacked along dim 0 and the other nodes shared; None when it is not dim-0-pointwise."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or not isinstance(out.shape[0], int) \
            or out.shape[0] != 1 or varies(out, syms):
        return None
    target = node.target
    if target not in POINTWISE and target not in DIM_OPS and target not in SHAPE_OPS \
            and target is not aten.embedding.default:
        return None
    kwargs = schema_kwargs(node)
    if kwargs is None:
        return None
    inputs: list[fx.Node] = []
    fx.node.map_arg(list(kwargs.values()), inputs.append)
    if not any(a in stacked for a in inputs):
        return None
    for a in inputs:
        if a in stacked and getattr(a.meta.get("val"), "dim", lambda: -1)() != out.dim() and target not in (
                *SHAPE_OPS, aten.unsqueeze.default, aten.squeeze.dim, aten.mean.dim, aten.sum.dim_IntList,
                aten.amax.default, aten.select.int, aten.embedding.default):
            return None  # a stacked input of another rank would broadcast against the batch dimension
    if target in DIM_OPS:
        names, on_output = DIM_OPS[target]
        if target is aten.cat.default:
            if not all(t in stacked for t in kwargs["tensors"]):
                return None  # a shared tensor has leading size 1, not B
            ndim = out.dim()
        else:
            src = kwargs.get("self")
            ndim = out.dim() if on_output else getattr(getattr(src, "meta", {}).get("val"), "dim", lambda: 0)()
        for name in names:
            dims = kwargs.get(name)
            for d in dims if isinstance(dims, (list, tuple)) else [dims]:
                if d is None or _norm(d, ndim) in (None, 0):
                    return None
    if target in SHAPE_OPS:
        src = kwargs.get("self")
        sval = getattr(src, "meta", {}).get("val")
        key = "shape" if "shape" in kwargs else "size"  # reshape's name for it
        size = list(kwargs.get(key, []))
        if src not in stacked or not isinstance(sval, torch.Tensor) or sval.dim() == 0 or sval.shape[0] != 1 \
                or not size or size[0] not in (1, -1):
            return None
        size[0] = -1 if target is aten.expand.default else batch
        kwargs[key] = size
    if target is aten.embedding.default and kwargs.get("weight") in stacked:
        return None
    return kwargs

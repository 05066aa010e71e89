"""Shape and indexing ONNX ops: ``Shape`` / ``Size``, ``Gather`` / ``GatherND`` / ``Slice``, ``Concat`` /
``Split``, ``Squeeze`` / ``Unsqueeze`` / ``Reshape`` / ``Flatten`` / ``Transpose`` / ``Expand``, ``Range``,
``ConstantOfShape``, ``Identity``.

``Shape`` yields a :class:`Known` of ints / SymInts, and the ops that index, cut or join such values
keep them Known, so torch.export can reshape by symbolic ``seq`` / ``past``. Every op is
``fn(inputs, attrs, opset) -> outputs``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from picompile.errors import UnsupportedArchitectureError
from picompile.frontend.onnx.values import (
    INT64_MAX, KNOWN_MAX_ELEMS, Known, Value, as_tensor, axes_of, cast_scalar, ints, is_float_dtype, np_dtype,
)


def op_shape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    dims = list(x.shape)
    start, end = int(attrs.get("start", 0)), attrs.get("end")
    dims = dims[start:] if end is None else dims[start:int(end)]
    return [Known(dims, (len(dims),), torch.int64)]


def op_size(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    n: Any = 1
    for d in x.shape:
        n = n * d
    return [Known([n], (), torch.int64)]


def op_gather(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    data, idx = ins
    axis = int(attrs.get("axis", 0))
    if isinstance(data, Known) and isinstance(idx, Known) and data.rank == 1:
        n = len(data.vals)
        return [Known([data.vals[int(i) + (n if int(i) < 0 else 0)] for i in idx.vals], idx.shape, data.dtype)]
    data = as_tensor(data)
    axis = axis % data.dim()
    if isinstance(idx, Known):
        if idx.rank == 0:
            return [data.select(axis, idx.scalar())]
        idx = as_tensor(idx)
    if axis == 0 and data.dim() == 2 and is_float_dtype(data.dtype):
        return [F.embedding(idx, data)]  # a token / position embedding lookup
    flat = torch.index_select(data, axis, idx.reshape(-1))
    return [flat.reshape(*data.shape[:axis], *idx.shape, *data.shape[axis + 1:])]


def op_gather_nd(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    data, idx = as_tensor(ins[0]), as_tensor(ins[1])
    if int(attrs.get("batch_dims", 0)):
        raise UnsupportedArchitectureError("GatherND with batch_dims > 0 is not supported")
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise UnsupportedArchitectureError("GatherND with a symbolic index depth is not supported")
    return [data[tuple(idx[..., i] for i in range(k))]]


def _slice_bounds(ins: list[Value], attrs: dict[str, Any]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """(starts, ends, axes, steps) of a ``Slice``: attributes before opset 10, inputs since."""
    if "starts" in attrs:  # opset < 10
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs.get("axes", range(len(starts))))
        return starts, ends, axes, [1] * len(starts)
    starts, ends = ints(ins[1], "Slice starts"), ints(ins[2], "Slice ends")
    axes = ints(ins[3], "Slice axes") if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = ints(ins[4], "Slice steps") if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    return starts, ends, axes, steps


def op_slice(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    starts, ends, axes, steps = _slice_bounds(ins, attrs)
    if isinstance(x, Known):
        if x.rank != 1 or [int(a) for a in axes] not in ([0], [-1]):
            raise UnsupportedArchitectureError(f"Slice of a {x.rank}-d shape value is not supported")
        vals = x.vals[slice(starts[0], ends[0], steps[0])]
        return [Known(vals, (len(vals),), x.dtype)]
    rank = x.dim()
    index: list[Any] = [slice(None)] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        if isinstance(st, int) and st < 0:
            raise UnsupportedArchitectureError("Slice with a negative step is not supported")
        e = INT64_MAX if isinstance(e, int) and e >= INT64_MAX else e
        index[int(a) % rank] = slice(s, e, st)
    return [x[tuple(index)]]


def op_concat(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    axis = int(attrs["axis"])
    parts = [v for v in ins if v is not None]
    if all(isinstance(v, Known) for v in parts) and all(v.rank == 1 for v in parts):  # type: ignore[union-attr]
        vals = [x for v in parts for x in v.vals]  # type: ignore[union-attr]
        return [Known(vals, (len(vals),), parts[0].dtype)]  # type: ignore[union-attr]
    tensors = [as_tensor(v) for v in parts]
    tensors = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0 and tensors[0].dim() > 1)]
    return [torch.cat(tensors, dim=axis)]


def op_split(ins: list[Value], attrs: dict[str, Any], opset: int, n_out: int = 0) -> list[Value]:
    """``Split`` into ``split`` sizes, else ``num_outputs`` (or ``n_out``, the node's outputs) equal parts."""
    x = as_tensor(ins[0])
    axis = int(attrs.get("axis", 0))
    if "split" in attrs:
        sizes: Any = [int(s) for s in attrs["split"]]
    elif len(ins) > 1 and ins[1] is not None:
        sizes = ints(ins[1], "Split sizes")
    else:
        n = int(attrs.get("num_outputs", n_out))
        size = x.shape[axis]
        sizes = -(-size // n)  # ceil, as ONNX does
    return list(torch.split(x, sizes, dim=axis))


def op_squeeze(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, axes = ins[0], axes_of(ins, attrs)
    if isinstance(x, Known):
        return [Known(x.vals, tuple(d for d in x.shape if d != 1) if axes is None else
                      tuple(d for i, d in enumerate(x.shape) if i not in [a % max(x.rank, 1) for a in axes]), x.dtype)]
    return [x.squeeze() if axes is None else x.squeeze(tuple(axes))]


def op_unsqueeze(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, axes = ins[0], axes_of(ins, attrs)
    assert axes is not None
    out_rank = (x.rank if isinstance(x, Known) else x.dim()) + len(axes)
    norm = sorted(a % out_rank for a in axes)
    if isinstance(x, Known):
        shape = list(x.shape)
        for a in norm:
            shape.insert(a, 1)
        return [Known(x.vals, shape, x.dtype)]
    for a in norm:
        x = x.unsqueeze(a)
    return [x]


def op_reshape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, shape = ins[0], ints(ins[1], "Reshape shape")
    allowzero = int(attrs.get("allowzero", 0))
    if isinstance(x, Known):
        n = len(x.vals)
        dims = [int(d) for d in shape]
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = n // max(known, 1)
        return [Known(x.vals, dims, x.dtype)]
    dims = [x.shape[i] if (not allowzero and isinstance(d, int) and d == 0) else d for i, d in enumerate(shape)]
    return [x.reshape(dims)]


def op_flatten(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = as_tensor(ins[0])
    axis = int(attrs.get("axis", 1)) % max(x.dim(), 1)
    return [x.reshape(math.prod(x.shape[:axis]) if axis else 1, -1)]


def op_transpose(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = as_tensor(ins[0])
    perm = attrs.get("perm") or list(reversed(range(x.dim())))
    return [x.permute([int(p) for p in perm])]


def _expand_dims(x: torch.Tensor, shape: list[Any]) -> torch.Tensor:
    xs = list(x.shape)
    r = max(len(xs), len(shape))
    xs, shape = [1] * (r - len(xs)) + xs, [1] * (r - len(shape)) + list(shape)
    out = [a if (isinstance(b, int) and b == 1) else b for a, b in zip(xs, shape)]
    return x.reshape(xs).expand(out)


def op_expand(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [_expand_dims(as_tensor(ins[0]), ints(ins[1], "Expand shape"))]


def op_range(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    start, limit, delta = ins
    dtype = start.dtype
    s, e, d = (v.scalar() if isinstance(v, Known) else v for v in (start, limit, delta))
    return [torch.arange(s, e, d, dtype=dtype)]


def op_constant_of_shape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    shape = ints(ins[0], "ConstantOfShape shape")
    value = attrs.get("value")
    fill, dtype = (0.0, torch.float32) if value is None else (value.reshape(-1)[0].item(), np_dtype(value))
    if not is_float_dtype(dtype) and all(isinstance(s, int) for s in shape) and len(shape) <= 1 \
            and math.prod(shape) <= KNOWN_MAX_ELEMS:
        return [Known([cast_scalar(fill, dtype)] * math.prod(shape), shape, dtype)]
    return [torch.full(shape, fill, dtype=dtype)]


def op_identity(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [ins[0]]

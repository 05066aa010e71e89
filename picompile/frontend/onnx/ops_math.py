"""Elementwise and math ONNX ops: binary / unary / variadic arithmetic, comparisons and logic,
reductions, ``Where``, ``Cast`` / ``CastLike``, ``Clip``, ``CumSum``.

Every op is ``fn(inputs, attrs, opset) -> outputs``. On :class:`Known` operands (shape arithmetic) the
op is evaluated in Python, elementwise with broadcasting of one element; otherwise in torch, with a
one-element Known turned into a Python number (``x * 0.5``, as torch writes it).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from picompile.errors import UnsupportedArchitectureError
from picompile.frontend.onnx.values import (
    TORCH_DTYPES, Known, Value, as_tensor, axes_of, cast_scalar, ints, is_float_dtype,
)


def _bcast(a: Known, b: Known) -> tuple[list[Any], list[Any], tuple[int, ...]]:
    n = max(len(a.vals), len(b.vals))
    if len(a.vals) not in (1, n) or len(b.vals) not in (1, n) or max(a.rank, b.rank) > 1:
        raise UnsupportedArchitectureError(f"shape arithmetic on {a} and {b} is not supported")
    av = a.vals * n if len(a.vals) == 1 else a.vals
    bv = b.vals * n if len(b.vals) == 1 else b.vals
    shape = (n,) if max(a.rank, b.rank) == 1 else ()
    return av, bv, shape


def idiv(a: Any, b: Any) -> Any:
    """ONNX integer ``Div`` on Python ints / SymInts: truncation toward zero."""
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return a // b  # symbolic sizes are non-negative: floor = truncation


def _int_div(a: Any, b: Any) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    return torch.div(a, b, rounding_mode="trunc")


def _scalar_operands(a: Value, b: Value, scalars: bool) -> tuple[Any, Any]:
    """The torch operands: a one-element Known becomes a Python number when ``scalars``, else a tensor."""
    if not scalars:
        return as_tensor(a), as_tensor(b)
    if isinstance(a, Known) and len(a.vals) == 1 and (a.rank == 0 or b.dim() >= 1):  # type: ignore[union-attr]
        return cast_scalar(a.scalar(), b.dtype), b  # type: ignore[union-attr]
    if isinstance(b, Known) and len(b.vals) == 1 and (b.rank == 0 or a.dim() >= 1):  # type: ignore[union-attr]
        return a, cast_scalar(b.scalar(), a.dtype)  # type: ignore[union-attr]
    return as_tensor(a), as_tensor(b)


def binary(torch_fn: Callable[[Any, Any], Any], py_fn: Callable[[Any, Any], Any], *,
           int_fn: Optional[Callable[[Any, Any], Any]] = None, out_bool: bool = False,
           scalars: bool = True) -> Callable[..., list[Value]]:
    """An elementwise op; ``torch_fn`` takes a Python number on either side when ``scalars``."""
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        a, b = ins
        if isinstance(a, Known) and isinstance(b, Known):
            av, bv, shape = _bcast(a, b)
            fn = int_fn if (int_fn is not None and not is_float_dtype(a.dtype)) else py_fn
            return [Known([fn(x, y) for x, y in zip(av, bv)], shape, torch.bool if out_bool else a.dtype)]
        a, b = _scalar_operands(a, b, scalars)
        if int_fn is not None:
            dt = a.dtype if isinstance(a, torch.Tensor) else b.dtype  # type: ignore[union-attr]
            if not is_float_dtype(dt):
                return [_int_div(a, b)]
        return [torch_fn(a, b)]
    return run


def unary(torch_fn: Callable[[torch.Tensor], torch.Tensor], py_fn: Optional[Callable[[Any], Any]] = None
          ) -> Callable[..., list[Value]]:
    """An elementwise one-operand op; evaluated in Python on a Known when ``py_fn`` is given."""
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        (x,) = ins[:1]
        if isinstance(x, Known) and py_fn is not None:
            return [Known([py_fn(v) for v in x.vals], x.shape, x.dtype)]
        return [torch_fn(as_tensor(x))]
    return run


def variadic(fn: Callable[[Any, Any], Any], py: Callable[[Any, Any], Any], scalars: bool = False
             ) -> Callable[..., list[Value]]:
    """``Max`` / ``Min`` / ``Sum`` of any number of operands, folded left with the binary op."""
    two = binary(fn, py, scalars=scalars)

    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        acc = ins[0]
        for v in ins[1:]:
            acc = two([acc, v], attrs, opset)[0]
        return [acc]
    return run


def logical_not(x: Any) -> Any:
    return not x


def reduce(fn: Callable[..., torch.Tensor]) -> Callable[..., list[Value]]:
    """A ``Reduce*`` op: ``fn(x, axes, keepdim)``; no axes reduces over all (unless noop_with_empty_axes)."""
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        x = as_tensor(ins[0])
        axes = axes_of(ins, attrs)
        keep = bool(int(attrs.get("keepdims", 1)))
        if not axes:
            if int(attrs.get("noop_with_empty_axes", 0)):
                return [x]
            axes = list(range(x.dim()))
        return [fn(x, axes, keep)]
    return run


def reduce_max(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amax(x, dim=axes, keepdim=keep)


def reduce_min(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amin(x, dim=axes, keepdim=keep)


def op_where(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    c, a, b = ins
    if all(isinstance(v, Known) for v in ins):
        n = max(len(c.vals), len(a.vals), len(b.vals))  # type: ignore[union-attr]
        pick = [a.vals[i % len(a.vals)] if bool(c.vals[i % len(c.vals)]) else b.vals[i % len(b.vals)]  # type: ignore[union-attr]
                for i in range(n)]
        return [Known(pick, (n,) if max(c.rank, a.rank, b.rank) else (), a.dtype)]  # type: ignore[union-attr]
    cond = as_tensor(c).to(torch.bool)

    def operand(v: Value, other: Value) -> Any:
        if isinstance(v, Known) and len(v.vals) == 1 and v.rank <= cond.dim():
            return cast_scalar(v.scalar(), v.dtype)
        return as_tensor(v)

    x, y = operand(a, b), operand(b, a)
    dtype = a.dtype if isinstance(a, (Known, torch.Tensor)) else None
    out = torch.where(cond, x, y)
    return [out.to(dtype) if dtype is not None and out.dtype != dtype else out]


def _cast_to(x: Value, dtype: torch.dtype) -> Value:
    if isinstance(x, Known):
        return Known([cast_scalar(v, dtype) for v in x.vals], x.shape, dtype)
    return x.to(dtype)


def op_cast(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    to = int(attrs["to"])
    if to not in TORCH_DTYPES:
        raise UnsupportedArchitectureError(f"Cast to ONNX type {to} is not supported")
    return [_cast_to(ins[0], TORCH_DTYPES[to])]


def op_castlike(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [_cast_to(ins[0], ins[1].dtype)]


def op_clip(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = as_tensor(ins[0])
    lo = attrs.get("min") if "min" in attrs else (ins[1] if len(ins) > 1 else None)
    hi = attrs.get("max") if "max" in attrs else (ins[2] if len(ins) > 2 else None)
    lo = lo.scalar() if isinstance(lo, Known) else lo
    hi = hi.scalar() if isinstance(hi, Known) else hi
    return [torch.clamp(x, lo, hi)]


def op_cumsum(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = as_tensor(ins[0])
    axis = int(ints(ins[1], "CumSum axis")[0])
    if int(attrs.get("exclusive", 0)) or int(attrs.get("reverse", 0)):
        raise UnsupportedArchitectureError("CumSum with exclusive / reverse is not supported")
    return [torch.cumsum(x, axis)]

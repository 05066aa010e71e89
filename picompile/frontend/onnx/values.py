"""Values the ONNX interpreter passes between nodes: :class:`Known` (shape arithmetic kept out of the
graph as Python numbers / SymInts) and tensors; the ONNX → torch dtype tables; reading initializers,
``Constant`` attributes and shape-like operands."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from picompile.errors import UnsupportedArchitectureError

KNOWN_MAX_ELEMS: int = 64  # integer constants up to this size are shape arithmetic, not tensors
INT64_MAX: int = 2**63 - 1

FLOAT_TYPES = {1, 10, 11, 16}  # float, float16, double, bfloat16: all imported as float32
TORCH_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 10: torch.float32, 11: torch.float32, 16: torch.float32,
    2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64, 9: torch.bool,
}
INT_TYPES = {2, 3, 5, 6, 7}


class Known:
    """A small tensor whose elements are Python numbers or SymInts: shape arithmetic, kept out of the graph."""

    __slots__ = ("vals", "shape", "dtype")

    def __init__(self, vals: Sequence[Any], shape: Sequence[int], dtype: torch.dtype) -> None:
        self.vals = list(vals)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def scalar(self) -> Any:
        return self.vals[0]

    def __repr__(self) -> str:
        return f"Known({self.vals}, shape={self.shape}, {self.dtype})"


Value = Union[torch.Tensor, Known]


def is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def cast_scalar(v: Any, dtype: torch.dtype) -> Any:
    """One element (number or SymInt / SymFloat / SymBool) as ``dtype`` would hold it."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if dtype == torch.bool:
            return v != 0 if not isinstance(v, torch.SymBool) else v
        if is_float_dtype(dtype):
            return torch.sym_float(v)
        return v if isinstance(v, torch.SymInt) else torch.sym_int(v)
    if dtype == torch.bool:
        return bool(v)
    if is_float_dtype(dtype):
        return float(v)
    return int(v)


def as_tensor(v: Value) -> torch.Tensor:
    """A Known as a tensor (in the graph); tensors pass through."""
    if isinstance(v, torch.Tensor):
        return v
    if all(isinstance(x, (bool, int, float)) for x in v.vals):
        return torch.tensor(v.vals, dtype=v.dtype).reshape(v.shape)
    parts = [torch.full((), x, dtype=v.dtype) for x in v.vals]
    return torch.stack(parts).reshape(v.shape) if parts else torch.empty(v.shape, dtype=v.dtype)


def ints(v: Value, what: str) -> list[Any]:
    """The elements of a shape-like operand (ints / SymInts)."""
    if isinstance(v, Known):
        return list(v.vals)
    if v.numel() <= KNOWN_MAX_ELEMS and not v.requires_grad:
        try:
            return [int(x) for x in v.reshape(-1).tolist()]
        except Exception:
            pass
    raise UnsupportedArchitectureError(
        f"the {what} is computed by tensor ops the ONNX importer cannot follow while tracing")


def axes_of(ins: list[Value], attrs: dict[str, Any], pos: int = 1) -> Optional[list[int]]:
    """An op's ``axes``: the attribute (older opsets), else input ``pos``; None when neither is given."""
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(ins) > pos and ins[pos] is not None:
        return [int(a) for a in ints(ins[pos], "axes")]
    return None


def np_dtype(arr: np.ndarray) -> torch.dtype:
    """The torch dtype an initializer / constant array is imported as (floats as float32)."""
    if arr.dtype.kind == "f" or str(arr.dtype) == "bfloat16":
        return torch.float32
    if arr.dtype == np.bool_:
        return torch.bool
    return torch.from_numpy(np.zeros(0, dtype=arr.dtype)).dtype


def to_numpy(t: Any) -> np.ndarray:
    """An ONNX TensorProto as a writeable numpy array (floats as float32)."""
    from onnx import numpy_helper

    arr = numpy_helper.to_array(t)
    if arr.dtype.kind == "f" or str(arr.dtype) == "bfloat16":
        arr = arr.astype(np.float32)
    return np.array(arr, copy=True) if not arr.flags.writeable else arr


def attr_value(a: Any) -> Any:
    """An ONNX node attribute as a Python value (tensors as numpy; graphs left as protos)."""
    from onnx import helper

    if a.type == a.TENSOR:
        return to_numpy(a.t)
    if a.type in (a.GRAPH, a.GRAPHS):
        return a  # control flow: refused by the op check
    v = helper.get_attribute_value(a)
    return v.decode() if isinstance(v, bytes) else v


def constant_value(attrs: dict[str, Any]) -> np.ndarray:
    """The array a ``Constant`` node holds."""
    if "value" in attrs:
        return attrs["value"]
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise UnsupportedArchitectureError(f"Constant with attributes {sorted(attrs)} is not supported")

"""ONNX frontend: ``picompile build model.onnx`` — an ONNX decoder step brought into the same
``torch.export`` graph the passes work on.

What it takes
=============
An ONNX model of one decoder step, as ``torch.onnx.export`` writes it from a causal LM wrapped in
the flat KV-cache convention of :class:`picompile.frontend.decoder.FlatDecoder` (what
:mod:`picompile.tools.ort_reference` exports), or without a cache:

- inputs: token ids (int64/int32 ``[1, seq]``: the input named ``input_ids``, else the only integer
  input); optionally ``attention_mask`` ``[1, past + seq]`` (fed all ones) and ``position_ids``
  ``[1, seq]`` (fed ``past … past + seq - 1``); the KV cache: every rank-4 float input,
  ``[1, kv_heads, past, head_dim]`` with ``kv_heads`` and ``head_dim`` fixed, in layer order (key,
  value of layer 0, then layer 1, …; any names), ``past`` symbolic (0 at prefill);
- outputs: logits ``[1, seq, vocab]`` (the output named ``logits``, else the first) and one
  present ``[1, kv_heads, past + seq, head_dim]`` per past input, in the same order. Other outputs
  are ignored.

Without KV-cache inputs (a logits-only export) the artifact still decodes, by re-running the whole
sequence every step: the importer gives the model a *token-history cache* — each of the
``2 · n_layers`` cache tensors is ``[1, 1, past, 1]`` and holds the tokens seen so far (as float32,
exact below 2**24) — so the artifact keeps the one calling convention the runtime knows
(``forward(input_ids, past_0 …) -> (logits, present_0 …)``); a step costs a full forward over
``past + seq`` tokens (quadratic in the length; fine for checks, slow for long generations). The
manifest's ``kv_shape`` is then ``[1, 1, past, 1]`` and ``model.extra.onnx.kv_cache`` says
``"token-history"``.

Refused, each with a one-line :class:`~picompile.errors.UnsupportedArchitectureError` naming what
is wrong: no integer token-id input; batch fixed above 1; a fixed sequence or past length (exported
without dynamic axes); an input that is none of the above (e.g. ``inputs_embeds``, encoder states);
KV inputs with symbolic heads / head_dim, an odd number of them, or a different number of present
outputs; logits not ``[batch, seq, vocab]``; ops outside the
supported set (:data:`SUPPORTED_OPS`; e.g. ``If`` / ``Loop`` control flow, opset-23 ``Attention`` /
``RotaryEmbedding``, ``com.microsoft`` contrib ops) — all listed at once. FFNs that are not
linear → act → linear (or gated) fail later in canonicalize-ffn, which says why per layer.
A truncated or corrupt file, missing external data, or a graph reading undefined values is a
:class:`~picompile.errors.ModelLoadError`.

Model facts (:class:`~picompile.frontend.base.ModelInfo`)
=========================================================
Read from the graph: ``n_layers`` = past inputs / 2; ``n_kv_heads``, ``head_dim`` from the past
inputs' fixed dims; ``vocab`` from the logits' last dim (else the token embedding's rows);
``d_model`` from the token embedding (the ``Gather`` of a 2-D initializer by the token ids).
A ``config.json`` beside the ``.onnx`` (an HF config), when present, names the architecture and
gives ``max_position_embeddings``; its ``num_hidden_layers`` / ``hidden_size`` / ``vocab_size`` must
agree with the graph (else a clear error) and fill in what the graph does not say (``n_layers`` of
a logits-only export). ``max_seq_len`` comes from, in order: config.json, ONNX metadata
``max_position_embeddings`` / ``max_seq_len``, a learned position table (rows − 2, OPT's offset,
a safe bound for any learned table), else :data:`DEFAULT_MAX_SEQ_LEN`. A ``tokenizer.json`` beside
the file is the artifact's tokenizer.

Why a small interpreter (and not onnx2torch)
============================================
The graph becomes :class:`OnnxDecoder`, an ``nn.Module`` whose forward walks the ONNX nodes in
order and calls one torch function per node; ``capture`` wraps it in ``FlatDecoder`` (it answers
the HF calling convention FlatDecoder uses) and ``torch.export`` traces it like an HF model, so
every pass runs unchanged on the usual aten graph with weights as parameters. onnx2torch 1.5.15
was tried: it imports torchvision at import time (not a dependency here, and pinned to torch
builds), has no converter for opset-19+ ``Shape`` (torch.onnx writes opset 20), and turns shape
arithmetic into tensor ops, which torch.export cannot reshape by with symbolic ``seq`` / ``past``.
Here:

- Shape arithmetic (``Shape``, ``Gather`` / ``Slice`` / ``Concat`` / ``Squeeze`` / ``Unsqueeze``
  of shapes, arithmetic, comparisons, ``Where``, ``Cast`` on them, small integer constants) is
  evaluated in Python on ints and torch.export SymInts (:class:`Known`), so ``seq`` and ``past``
  stay symbolic.
- Each node runs inside a module named after its source module (torch.onnx's ``namespace``
  metadata, else the ``/a/b/Op`` node-name convention), so ``nn_module_stack`` reads e.g.
  ``…layers.3.mlp.up_proj`` as in a captured HF model and canonicalize-ffn finds the layer.
- Initializers become parameters under those module paths; anonymous ones (``val_12``) are named
  after the module that uses them (``…mlp.up_proj.weight``). A 2-D initializer used only as the
  right operand of ``MatMul`` (``x @ W``, ``W [d_in, d_out]``: how torch.onnx writes nn.Linear) is
  stored transposed, in nn.Linear layout, and read as ``W.t()``: canonicalize-ffn then uses the
  parameter itself (no copy) and placement's accounting sees the FFN weights by name.
- One-element constants in elementwise ops are Python numbers (``x * 0.5``, as torch writes it),
  which is what canonicalize-ffn's decomposed-GELU match expects.
- Floating-point tensors of any precision are imported as float32 (picompile's weight dtype).
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.base import ModelInfo

DEFAULT_MAX_SEQ_LEN: int = 2048  # when neither config.json, metadata nor a position table says
KNOWN_MAX_ELEMS: int = 64  # integer constants up to this size are shape arithmetic, not tensors
INT64_MAX: int = 2**63 - 1

_FLOAT_TYPES = {1, 10, 11, 16}  # float, float16, double, bfloat16: all imported as float32
_TORCH_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32, 10: torch.float32, 11: torch.float32, 16: torch.float32,
    2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64, 9: torch.bool,
}
_INT_TYPES = {2, 3, 5, 6, 7}


# --------------------------------------------------------------------------------------------
# values known while tracing (shape arithmetic)

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


def _is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def _cast_scalar(v: Any, dtype: torch.dtype) -> Any:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if dtype == torch.bool:
            return v != 0 if not isinstance(v, torch.SymBool) else v
        if _is_float_dtype(dtype):
            return torch.sym_float(v)
        return v if isinstance(v, torch.SymInt) else torch.sym_int(v)
    if dtype == torch.bool:
        return bool(v)
    if _is_float_dtype(dtype):
        return float(v)
    return int(v)


def _tensor(v: Value) -> torch.Tensor:
    """A Known as a tensor (in the graph); tensors pass through."""
    if isinstance(v, torch.Tensor):
        return v
    if all(isinstance(x, (bool, int, float)) for x in v.vals):
        return torch.tensor(v.vals, dtype=v.dtype).reshape(v.shape)
    parts = [torch.full((), x, dtype=v.dtype) for x in v.vals]
    return torch.stack(parts).reshape(v.shape) if parts else torch.empty(v.shape, dtype=v.dtype)


def _ints(v: Value, what: str) -> list[Any]:
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


def _bcast(a: Known, b: Known) -> tuple[list[Any], list[Any], tuple[int, ...]]:
    n = max(len(a.vals), len(b.vals))
    if len(a.vals) not in (1, n) or len(b.vals) not in (1, n) or max(a.rank, b.rank) > 1:
        raise UnsupportedArchitectureError(f"shape arithmetic on {a} and {b} is not supported")
    av = a.vals * n if len(a.vals) == 1 else a.vals
    bv = b.vals * n if len(b.vals) == 1 else b.vals
    shape = (n,) if max(a.rank, b.rank) == 1 else ()
    return av, bv, shape


def _idiv(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return a // b  # symbolic sizes are non-negative: floor = truncation


# --------------------------------------------------------------------------------------------
# op implementations: fn(inputs, attrs, opset) -> list of outputs

@dataclass
class _Node:
    op: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    scope: str


def _binary(torch_fn: Callable[[Any, Any], Any], py_fn: Callable[[Any, Any], Any], *,
            int_fn: Optional[Callable[[Any, Any], Any]] = None, out_bool: bool = False,
            scalars: bool = True) -> Callable[..., list[Value]]:
    """An elementwise op; ``torch_fn`` takes a Python number on either side when ``scalars``."""
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        a, b = ins
        if isinstance(a, Known) and isinstance(b, Known):
            av, bv, shape = _bcast(a, b)
            fn = int_fn if (int_fn is not None and not _is_float_dtype(a.dtype)) else py_fn
            return [Known([fn(x, y) for x, y in zip(av, bv)], shape, torch.bool if out_bool else a.dtype)]
        if not scalars:
            a, b = _tensor(a), _tensor(b)
        elif isinstance(a, Known) and len(a.vals) == 1 and (a.rank == 0 or b.dim() >= 1):  # type: ignore[union-attr]
            a = _cast_scalar(a.scalar(), b.dtype)  # type: ignore[union-attr]
        elif isinstance(b, Known) and len(b.vals) == 1 and (b.rank == 0 or a.dim() >= 1):  # type: ignore[union-attr]
            b = _cast_scalar(b.scalar(), a.dtype)  # type: ignore[union-attr]
        else:
            a, b = _tensor(a), _tensor(b)
        if int_fn is not None:
            dt = a.dtype if isinstance(a, torch.Tensor) else b.dtype  # type: ignore[union-attr]
            if not _is_float_dtype(dt):
                return [_int_div(a, b)]
        return [torch_fn(a, b)]
    return run


def _int_div(a: Any, b: Any) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    return torch.div(a, b, rounding_mode="trunc")


def _unary(torch_fn: Callable[[torch.Tensor], torch.Tensor], py_fn: Optional[Callable[[Any], Any]] = None
           ) -> Callable[..., list[Value]]:
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        (x,) = ins[:1]
        if isinstance(x, Known) and py_fn is not None:
            return [Known([py_fn(v) for v in x.vals], x.shape, x.dtype)]
        return [torch_fn(_tensor(x))]
    return run


def _axes(ins: list[Value], attrs: dict[str, Any], pos: int = 1) -> Optional[list[int]]:
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(ins) > pos and ins[pos] is not None:
        return [int(a) for a in _ints(ins[pos], "axes")]
    return None


def _op_shape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    dims = list(x.shape)
    start, end = int(attrs.get("start", 0)), attrs.get("end")
    dims = dims[start:] if end is None else dims[start:int(end)]
    return [Known(dims, (len(dims),), torch.int64)]


def _op_size(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    n: Any = 1
    for d in x.shape:
        n = n * d
    return [Known([n], (), torch.int64)]


def _op_gather(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    data, idx = ins
    axis = int(attrs.get("axis", 0))
    if isinstance(data, Known) and isinstance(idx, Known) and data.rank == 1:
        n = len(data.vals)
        return [Known([data.vals[int(i) + (n if int(i) < 0 else 0)] for i in idx.vals], idx.shape, data.dtype)]
    data = _tensor(data)
    axis = axis % data.dim()
    if isinstance(idx, Known):
        if idx.rank == 0:
            return [data.select(axis, idx.scalar())]
        idx = _tensor(idx)
    if axis == 0 and data.dim() == 2 and _is_float_dtype(data.dtype):
        return [F.embedding(idx, data)]
    flat = torch.index_select(data, axis, idx.reshape(-1))
    return [flat.reshape(*data.shape[:axis], *idx.shape, *data.shape[axis + 1:])]


def _op_gather_nd(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    data, idx = _tensor(ins[0]), _tensor(ins[1])
    if int(attrs.get("batch_dims", 0)):
        raise UnsupportedArchitectureError("GatherND with batch_dims > 0 is not supported")
    k = idx.shape[-1]
    if not isinstance(k, int):
        raise UnsupportedArchitectureError("GatherND with a symbolic index depth is not supported")
    return [data[tuple(idx[..., i] for i in range(k))]]


def _op_slice(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    if "starts" in attrs:  # opset < 10
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes = list(attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(ins[1], "Slice starts"), _ints(ins[2], "Slice ends")
        axes = _ints(ins[3], "Slice axes") if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = _ints(ins[4], "Slice steps") if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
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


def _op_concat(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    axis = int(attrs["axis"])
    parts = [v for v in ins if v is not None]
    if all(isinstance(v, Known) for v in parts) and all(v.rank == 1 for v in parts):  # type: ignore[union-attr]
        vals = [x for v in parts for x in v.vals]  # type: ignore[union-attr]
        return [Known(vals, (len(vals),), parts[0].dtype)]  # type: ignore[union-attr]
    tensors = [_tensor(v) for v in parts]
    tensors = [t for t in tensors if not (t.dim() == 1 and t.shape[0] == 0 and tensors[0].dim() > 1)]
    return [torch.cat(tensors, dim=axis)]


def _op_squeeze(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, axes = ins[0], _axes(ins, attrs)
    if isinstance(x, Known):
        return [Known(x.vals, tuple(d for d in x.shape if d != 1) if axes is None else
                      tuple(d for i, d in enumerate(x.shape) if i not in [a % max(x.rank, 1) for a in axes]), x.dtype)]
    return [x.squeeze() if axes is None else x.squeeze(tuple(axes))]


def _op_unsqueeze(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, axes = ins[0], _axes(ins, attrs)
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


def _op_reshape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, shape = ins[0], _ints(ins[1], "Reshape shape")
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


def _op_flatten(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = _tensor(ins[0])
    axis = int(attrs.get("axis", 1)) % max(x.dim(), 1)
    return [x.reshape(math.prod(x.shape[:axis]) if axis else 1, -1)]


def _op_transpose(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = _tensor(ins[0])
    perm = attrs.get("perm") or list(reversed(range(x.dim())))
    return [x.permute([int(p) for p in perm])]


def _op_matmul(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [torch.matmul(_tensor(ins[0]), _tensor(ins[1]))]


def _op_gemm(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    a, b = _tensor(ins[0]), _tensor(ins[1])
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if int(attrs.get("transA", 0)):
        a = a.t()
    bias = _tensor(c) if c is not None else None
    if int(attrs.get("transB", 0)):
        if alpha == 1.0 and beta == 1.0 and (bias is None or bias.dim() == 1):
            return [F.linear(a, b, bias)]  # Gemm with transB is nn.Linear: y = a @ bᵀ + c
        y = F.linear(a, b)
    else:
        y = torch.matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if bias is not None:
        y = y + (bias * beta if beta != 1.0 else bias)
    return [y]


def _op_where(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    c, a, b = ins
    if all(isinstance(v, Known) for v in ins):
        n = max(len(c.vals), len(a.vals), len(b.vals))  # type: ignore[union-attr]
        pick = [a.vals[i % len(a.vals)] if bool(c.vals[i % len(c.vals)]) else b.vals[i % len(b.vals)]  # type: ignore[union-attr]
                for i in range(n)]
        return [Known(pick, (n,) if max(c.rank, a.rank, b.rank) else (), a.dtype)]  # type: ignore[union-attr]
    cond = _tensor(c).to(torch.bool)

    def operand(v: Value, other: Value) -> Any:
        if isinstance(v, Known) and len(v.vals) == 1 and v.rank <= cond.dim():
            return _cast_scalar(v.scalar(), v.dtype)
        return _tensor(v)

    x, y = operand(a, b), operand(b, a)
    dtype = a.dtype if isinstance(a, (Known, torch.Tensor)) else None
    out = torch.where(cond, x, y)
    return [out.to(dtype) if dtype is not None and out.dtype != dtype else out]


def _op_cast(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    to = int(attrs["to"])
    if to not in _TORCH_DTYPES:
        raise UnsupportedArchitectureError(f"Cast to ONNX type {to} is not supported")
    dtype = _TORCH_DTYPES[to]
    x = ins[0]
    if isinstance(x, Known):
        return [Known([_cast_scalar(v, dtype) for v in x.vals], x.shape, dtype)]
    return [x.to(dtype)]


def _op_castlike(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    like = ins[1]
    dtype = like.dtype
    x = ins[0]
    if isinstance(x, Known):
        return [Known([_cast_scalar(v, dtype) for v in x.vals], x.shape, dtype)]
    return [x.to(dtype)]


def _expand_dims(x: torch.Tensor, shape: list[Any]) -> torch.Tensor:
    xs = list(x.shape)
    r = max(len(xs), len(shape))
    xs, shape = [1] * (r - len(xs)) + xs, [1] * (r - len(shape)) + list(shape)
    out = [a if (isinstance(b, int) and b == 1) else b for a, b in zip(xs, shape)]
    return x.reshape(xs).expand(out)


def _op_expand(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [_expand_dims(_tensor(ins[0]), _ints(ins[1], "Expand shape"))]


def _op_range(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    start, limit, delta = ins
    dtype = start.dtype
    s, e, d = (v.scalar() if isinstance(v, Known) else v for v in (start, limit, delta))
    return [torch.arange(s, e, d, dtype=dtype)]


def _op_constant_of_shape(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    shape = _ints(ins[0], "ConstantOfShape shape")
    value = attrs.get("value")
    fill, dtype = (0.0, torch.float32) if value is None else (value.reshape(-1)[0].item(), _np_dtype(value))
    if not _is_float_dtype(dtype) and all(isinstance(s, int) for s in shape) and len(shape) <= 1 \
            and math.prod(shape) <= KNOWN_MAX_ELEMS:
        return [Known([_cast_scalar(fill, dtype)] * math.prod(shape), shape, dtype)]
    return [torch.full(shape, fill, dtype=dtype)]


def _op_identity(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [ins[0]]


def _op_dropout(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    return [x, torch.ones_like(_tensor(x), dtype=torch.bool)]


def _op_softmax(ins: list[Value], attrs: dict[str, Any], opset: int, log: bool = False) -> list[Value]:
    x = _tensor(ins[0])
    axis = int(attrs.get("axis", -1 if opset >= 13 else 1))
    if opset < 13 and axis % x.dim() != x.dim() - 1:
        raise UnsupportedArchitectureError(f"Softmax over axis {axis} before opset 13 (flattening semantics) is not supported")
    return [torch.log_softmax(x, axis) if log else torch.softmax(x, axis)]


def _reduce(fn: Callable[..., torch.Tensor]) -> Callable[..., list[Value]]:
    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        x = _tensor(ins[0])
        axes = _axes(ins, attrs)
        keep = bool(int(attrs.get("keepdims", 1)))
        if not axes:
            if int(attrs.get("noop_with_empty_axes", 0)):
                return [x]
            axes = list(range(x.dim()))
        return [fn(x, axes, keep)]
    return run


def _reduce_max(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amax(x, dim=axes, keepdim=keep)


def _reduce_min(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amin(x, dim=axes, keepdim=keep)


def _op_layer_norm(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, w = _tensor(ins[0]), _tensor(ins[1])
    b = _tensor(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    axis = int(attrs.get("axis", -1)) % x.dim()
    return [F.layer_norm(x, tuple(x.shape[axis:]), w, b, float(attrs.get("epsilon", 1e-5)))]


def _op_gelu(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    approx = attrs.get("approximate", "none")
    return [F.gelu(_tensor(ins[0]), approximate=approx.decode() if isinstance(approx, bytes) else approx)]


def _op_trilu(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = _tensor(ins[0])
    k = int(_ints(ins[1], "Trilu k")[0]) if len(ins) > 1 and ins[1] is not None else 0
    return [torch.triu(x, k) if int(attrs.get("upper", 1)) else torch.tril(x, k)]


def _op_variadic(fn: Callable[[Any, Any], Any], py: Callable[[Any, Any], Any], scalars: bool = False
                 ) -> Callable[..., list[Value]]:
    two = _binary(fn, py, scalars=scalars)

    def run(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
        acc = ins[0]
        for v in ins[1:]:
            acc = two([acc, v], attrs, opset)[0]
        return [acc]
    return run


def _op_clip(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = _tensor(ins[0])
    lo = attrs.get("min") if "min" in attrs else (ins[1] if len(ins) > 1 else None)
    hi = attrs.get("max") if "max" in attrs else (ins[2] if len(ins) > 2 else None)
    lo = lo.scalar() if isinstance(lo, Known) else lo
    hi = hi.scalar() if isinstance(hi, Known) else hi
    return [torch.clamp(x, lo, hi)]


def _op_split(ins: list[Value], attrs: dict[str, Any], opset: int, n_out: int = 0) -> list[Value]:
    x = _tensor(ins[0])
    axis = int(attrs.get("axis", 0))
    if "split" in attrs:
        sizes: Any = [int(s) for s in attrs["split"]]
    elif len(ins) > 1 and ins[1] is not None:
        sizes = _ints(ins[1], "Split sizes")
    else:
        n = int(attrs.get("num_outputs", n_out))
        size = x.shape[axis]
        sizes = -(-size // n)  # ceil, as ONNX does
    return list(torch.split(x, sizes, dim=axis))


def _op_cumsum(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = _tensor(ins[0])
    axis = int(_ints(ins[1], "CumSum axis")[0])
    if int(attrs.get("exclusive", 0)) or int(attrs.get("reverse", 0)):
        raise UnsupportedArchitectureError("CumSum with exclusive / reverse is not supported")
    return [torch.cumsum(x, axis)]


def _leaky(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [F.leaky_relu(_tensor(ins[0]), float(attrs.get("alpha", 0.01)))]


def _not(x: Any) -> Any:
    return not x


OpFn = Callable[[list[Value], dict[str, Any], int], list[Value]]
_OPS: dict[str, OpFn] = {
    "Add": _binary(operator.add, operator.add),
    "Sub": _binary(operator.sub, operator.sub),
    "Mul": _binary(operator.mul, operator.mul),
    "Div": _binary(operator.truediv, operator.truediv, int_fn=_idiv),
    "Pow": _binary(operator.pow, operator.pow),
    "Mod": _binary(operator.mod, operator.mod),
    "Equal": _binary(operator.eq, operator.eq, out_bool=True),
    "Less": _binary(operator.lt, operator.lt, out_bool=True),
    "LessOrEqual": _binary(operator.le, operator.le, out_bool=True),
    "Greater": _binary(operator.gt, operator.gt, out_bool=True),
    "GreaterOrEqual": _binary(operator.ge, operator.ge, out_bool=True),
    "And": _binary(torch.logical_and, lambda a, b: a and b, out_bool=True, scalars=False),
    "Or": _binary(torch.logical_or, lambda a, b: a or b, out_bool=True, scalars=False),
    "Xor": _binary(torch.logical_xor, lambda a, b: bool(a) != bool(b), out_bool=True, scalars=False),
    "Max": _op_variadic(torch.maximum, lambda a, b: torch.sym_max(a, b)),
    "Min": _op_variadic(torch.minimum, lambda a, b: torch.sym_min(a, b)),
    "Sum": _op_variadic(operator.add, operator.add, scalars=True),
    "Not": _unary(torch.logical_not, _not),
    "Neg": _unary(torch.neg, lambda a: -a),
    "Abs": _unary(torch.abs, abs),
    "Sqrt": _unary(torch.sqrt),
    "Reciprocal": _unary(torch.reciprocal),
    "Exp": _unary(torch.exp),
    "Log": _unary(torch.log),
    "Tanh": _unary(torch.tanh),
    "Erf": _unary(torch.erf),
    "Sigmoid": _unary(torch.sigmoid),
    "Relu": _unary(torch.relu),
    "Softplus": _unary(F.softplus),
    "Cos": _unary(torch.cos),
    "Sin": _unary(torch.sin),
    "Floor": _unary(torch.floor),
    "Ceil": _unary(torch.ceil),
    "IsNaN": _unary(torch.isnan),
    "IsInf": _unary(torch.isinf),
    "LeakyRelu": _leaky,
    "Gelu": _op_gelu,
    "Softmax": _op_softmax,
    "LogSoftmax": lambda ins, attrs, opset: _op_softmax(ins, attrs, opset, log=True),
    "ReduceMean": _reduce(lambda x, axes, keep: torch.mean(x, dim=axes, keepdim=keep)),
    "ReduceSum": _reduce(lambda x, axes, keep: torch.sum(x, dim=axes, keepdim=keep)),
    "ReduceMax": _reduce(_reduce_max),
    "ReduceMin": _reduce(_reduce_min),
    "LayerNormalization": _op_layer_norm,
    "MatMul": _op_matmul,
    "Gemm": _op_gemm,
    "Shape": _op_shape,
    "Size": _op_size,
    "Gather": _op_gather,
    "GatherND": _op_gather_nd,
    "Slice": _op_slice,
    "Concat": _op_concat,
    "Squeeze": _op_squeeze,
    "Unsqueeze": _op_unsqueeze,
    "Reshape": _op_reshape,
    "Flatten": _op_flatten,
    "Transpose": _op_transpose,
    "Where": _op_where,
    "Cast": _op_cast,
    "CastLike": _op_castlike,
    "Expand": _op_expand,
    "Range": _op_range,
    "ConstantOfShape": _op_constant_of_shape,
    "Identity": _op_identity,
    "Dropout": _op_dropout,
    "Trilu": _op_trilu,
    "Clip": _op_clip,
    "Split": _op_split,
    "CumSum": _op_cumsum,
}
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted([*_OPS, "Constant"]))


# --------------------------------------------------------------------------------------------
# reading the model

def _np_dtype(arr: np.ndarray) -> torch.dtype:
    if arr.dtype.kind == "f" or str(arr.dtype) == "bfloat16":
        return torch.float32
    if arr.dtype == np.bool_:
        return torch.bool
    return torch.from_numpy(np.zeros(0, dtype=arr.dtype)).dtype


def _to_numpy(t: Any) -> np.ndarray:
    from onnx import numpy_helper

    arr = numpy_helper.to_array(t)
    if arr.dtype.kind == "f" or str(arr.dtype) == "bfloat16":
        arr = arr.astype(np.float32)
    return np.array(arr, copy=True) if not arr.flags.writeable else arr


def _attr_value(a: Any) -> Any:
    from onnx import helper

    if a.type == a.TENSOR:
        return _to_numpy(a.t)
    if a.type in (a.GRAPH, a.GRAPHS):
        return a  # control flow: refused by the op check
    v = helper.get_attribute_value(a)
    return v.decode() if isinstance(v, bytes) else v


def _scope_of(node: Any) -> str:
    """Source-module path of an ONNX node: torch.onnx's ``namespace`` metadata, else ``/a/b/Op`` names."""
    meta = {p.key: p.value for p in node.metadata_props}
    ns = meta.get("namespace")
    if ns:
        segments = [seg.split(": ")[0].strip() for seg in ns.split("/")]
        mods = [s for s in segments[:-1] if s and not s.startswith("_empty_nn_module_stack")]
        return mods[-1] if mods else ""
    if node.name.startswith("/"):
        return ".".join(p for p in node.name.strip("/").split("/")[:-1] if p)
    return ""


_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)+$")


def _sanitize(part: str) -> str:
    s = re.sub(r"\W", "_", part) or "_"
    return s


@dataclass
class Signature:
    ids: str
    ids_dtype: torch.dtype
    attention_mask: Optional[str]
    position_ids: Optional[str]
    past: list[str]
    logits: str
    presents: list[str]
    kv_heads: int = 1
    head_dim: int = 1


def _dims(vi: Any) -> list[Any]:
    shape = vi.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def _desc(vi: Any) -> str:
    from onnx import TensorProto

    t = vi.type.tensor_type.elem_type
    name = TensorProto.DataType.Name(t).lower() if t else "?"
    return f"{name} {_dims(vi)}"


def _signature(graph: Any, where: str) -> Signature:
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    ids: Any = None
    mask = pos = None
    past: list[Any] = []
    ints = [i for i in inputs if i.type.tensor_type.elem_type in _INT_TYPES]
    for vi in inputs:
        t, dims = vi.type.tensor_type.elem_type, _dims(vi)
        lname = vi.name.lower()
        if t in _INT_TYPES and len(dims) == 2 and "attention_mask" in lname:
            mask = vi.name
        elif t in _INT_TYPES and len(dims) == 2 and "position" in lname:
            pos = vi.name
        elif t in _INT_TYPES and len(dims) == 2 and (lname == "input_ids" or ids is None and
                                                      not any(i.name.lower() == "input_ids" for i in ints)):
            if ids is not None:
                raise UnsupportedArchitectureError(
                    f"{where}: two integer inputs ({ids.name}, {vi.name}) could be the token ids; name one input_ids")
            ids = vi
        elif t in _FLOAT_TYPES and len(dims) == 4:
            past.append(vi)
        else:
            raise UnsupportedArchitectureError(
                f"{where}: input {vi.name!r} ({_desc(vi)}) is not token ids [1, seq], attention_mask, position_ids "
                f"or a KV-cache tensor [1, kv_heads, past, head_dim]; picompile builds decoder-only causal LMs")
    if ids is None:
        raise UnsupportedArchitectureError(
            f"{where}: no integer token-id input [1, seq] (inputs: "
            f"{', '.join(f'{i.name} ({_desc(i)})' for i in inputs) or 'none'}); picompile builds decoder-only causal LMs")
    batch, seq = _dims(ids)
    if isinstance(batch, int) and batch not in (0, 1):
        raise UnsupportedArchitectureError(f"{where}: token ids {ids.name} have a fixed batch of {batch}; picompile runs batch 1")
    if isinstance(seq, int):
        raise UnsupportedArchitectureError(
            f"{where}: token ids {ids.name} have a fixed length {seq}; export the model with a dynamic sequence axis")
    outputs = list(graph.output)
    logits = next((o for o in outputs if o.name == "logits"), outputs[0] if outputs else None)
    if logits is None or len(_dims(logits)) != 3 or logits.type.tensor_type.elem_type not in _FLOAT_TYPES:
        raise UnsupportedArchitectureError(
            f"{where}: the logits output ({logits.name + ' ' + _desc(logits) if logits is not None else 'none'}) "
            f"is not a float [1, seq, vocab] tensor")
    presents = [o for o in outputs if o is not logits and o.type.tensor_type.elem_type in _FLOAT_TYPES
                and len(_dims(o)) == 4]
    sig = Signature(ids.name, _TORCH_DTYPES[ids.type.tensor_type.elem_type], mask, pos, [p.name for p in past],
                    logits.name, [])
    if not past:
        return sig
    if len(past) % 2:
        raise UnsupportedArchitectureError(f"{where}: {len(past)} KV-cache inputs; expected a key and a value per layer")
    if len(presents) != len(past):
        raise UnsupportedArchitectureError(
            f"{where}: {len(past)} KV-cache inputs but {len(presents)} present outputs; each past needs its present")
    shapes = set()
    for p, q in zip(past, presents):
        pd, qd = _dims(p), _dims(q)
        if isinstance(pd[2], int):
            raise UnsupportedArchitectureError(
                f"{where}: KV-cache input {p.name} ({_desc(p)}) has a fixed past length; export it with a dynamic past axis")
        if not (isinstance(pd[1], int) and isinstance(pd[3], int)):
            raise UnsupportedArchitectureError(
                f"{where}: KV-cache input {p.name} ({_desc(p)}) must have fixed kv_heads and head_dim")
        if (isinstance(qd[1], int) and qd[1] != pd[1]) or (isinstance(qd[3], int) and qd[3] != pd[3]):
            raise UnsupportedArchitectureError(
                f"{where}: present {q.name} ({_desc(q)}) does not match its past {p.name} ({_desc(p)})")
        shapes.add((pd[1], pd[3]))
    if len(shapes) != 1:
        raise UnsupportedArchitectureError(f"{where}: KV-cache inputs differ in shape ({sorted(shapes)})")
    sig.kv_heads, sig.head_dim = shapes.pop()
    sig.presents = [q.name for q in presents]
    return sig


# --------------------------------------------------------------------------------------------
# the module

class _Scope(torch.nn.Module):
    """A module of the source model's hierarchy: holds its parameters and runs the ONNX nodes that
    belonged to it, so torch.export records the module path in ``nn_module_stack``."""

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


@dataclass
class _Param:
    module: torch.nn.Module
    attr: str
    transposed: bool  # stored as Wᵀ (nn.Linear layout); the ONNX value is param.t()


class OnnxDecoder(torch.nn.Module):
    """An ONNX decoder step as a torch module.

    ``flat(input_ids, *past) -> (logits, *presents)`` is the picompile calling convention;
    ``forward(input_ids=…, cache=…, position_ids=…)`` answers the HF calling convention
    :class:`~picompile.frontend.decoder.FlatDecoder` uses (past read from and presents written to
    the ``DynamicCache`` layers). Without KV inputs the cache is the token history (module doc).
    """

    def __init__(self, graph: Any, sig: Signature, n_layers: int, opset: int) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(num_hidden_layers=n_layers)
        self.sig = sig
        self.n_layers = n_layers
        self.opset = opset
        self.token_history = not sig.past
        self._scopes: dict[str, torch.nn.Module] = {"": self}
        self._params: dict[str, _Param] = {}
        self._known: dict[str, Known] = {}
        self._nodes: list[_Node] = []
        self._node_scope: list[torch.nn.Module] = []

        consts: dict[str, np.ndarray] = {t.name: _to_numpy(t) for t in graph.initializer}
        nodes = []
        for n in graph.node:
            attrs = {a.name: _attr_value(a) for a in n.attribute}
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                consts[n.output[0]] = _constant_value(attrs)
                continue
            nodes.append(_Node(n.op_type, n.name, list(n.input), list(n.output), attrs, _scope_of(n)))
        # a root every module path shares (the export wrapper's attribute, e.g. FlatDecoder's "model")
        # is dropped, so paths read as in the source model: model.layers.0.mlp.up_proj.weight
        self._root = _shared_root([n.scope for n in nodes if n.scope] + [k for k in consts if _DOTTED.match(k)])
        for n in nodes:
            n.scope = self._strip(n.scope)
        uses: dict[str, list[tuple[_Node, int]]] = {}
        for n in nodes:
            for i, name in enumerate(n.inputs):
                uses.setdefault(name, []).append((n, i))
        for name, arr in consts.items():
            self._add_const(name, arr, uses.get(name, []))
        self._nodes = nodes
        self._node_scope = [self._scope(n.scope) for n in nodes]
        # free each value after its last use (graph outputs are kept)
        outs = {sig.logits, *sig.presents}
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for name in n.inputs:
                last[name] = i
        self._free: list[list[str]] = [[] for _ in nodes]
        for name, i in last.items():
            if name not in outs and name not in self._params and name not in self._known:
                self._free[i].append(name)

    # -- construction helpers
    def _scope(self, path: str) -> torch.nn.Module:
        if path in self._scopes:
            return self._scopes[path]
        parent_path, _, last = path.rpartition(".")
        parent = self._scope(parent_path)
        name = _sanitize(last)
        while name in parent._parameters or name in parent._buffers or (
                hasattr(parent, name) and name not in parent._modules):
            name += "_"
        if name not in parent._modules:
            parent.add_module(name, _Scope())
        self._scopes[path] = parent._modules[name]  # type: ignore[assignment]
        return self._scopes[path]

    def _add_const(self, name: str, arr: np.ndarray, uses: list[tuple[_Node, int]]) -> None:
        dtype = _np_dtype(arr)
        small = arr.size <= KNOWN_MAX_ELEMS and arr.ndim <= 1
        if small and (not _is_float_dtype(dtype) or arr.size == 1):
            self._known[name] = Known([_cast_scalar(v, dtype) for v in arr.reshape(-1).tolist()], arr.shape, dtype)
            return
        tensor = torch.from_numpy(arr).to(dtype)
        transposed = (_is_float_dtype(dtype) and arr.ndim == 2 and bool(uses) and all(
            i == 1 and (n.op == "MatMul" or (n.op == "Gemm" and not int(n.attrs.get("transB", 0))))
            for n, i in uses))
        if transposed:
            tensor = tensor.t().contiguous()  # nn.Linear layout [d_out, d_in]
        path = self._param_path(name, uses)
        mod_path, _, attr = path.rpartition(".")
        module = self._scope(mod_path)
        attr = _sanitize(attr)
        base, k = attr, 0
        while attr in module._parameters or attr in module._buffers or hasattr(module, attr):
            k += 1
            attr = f"{base}_{k}"
        if _is_float_dtype(dtype):
            module.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            module.register_buffer(attr, tensor)
        self._params[name] = _Param(module, attr, transposed)

    def _strip(self, path: str) -> str:
        if not self._root:
            return path
        return "" if path == self._root else path[len(self._root) + 1:] if path.startswith(self._root + ".") else path

    def _param_path(self, name: str, uses: list[tuple[_Node, int]]) -> str:
        if _DOTTED.match(name) and not name.startswith("onnx::"):
            return self._strip(name)
        scopes = {n.scope for n, _ in uses}
        if len(scopes) == 1 and "" not in scopes:
            (scope,) = scopes
            if all((n.op in ("MatMul", "Gemm") and i == 1) for n, i in uses):
                return f"{scope}.weight"
            if all((n.op == "Add" or (n.op == "Gemm" and i == 2)) for n, i in uses):
                return f"{scope}.bias"
            return f"{scope}.{_sanitize(name)}"
        return f"onnx_constants.{_sanitize(name)}"

    # -- running
    def _value(self, name: str, env: dict[str, Value]) -> Optional[Value]:
        if not name:
            return None
        if name in env:
            return env[name]
        if name in self._known:
            return self._known[name]
        p = self._params.get(name)
        if p is None:
            raise ModelLoadError(f"ONNX graph reads undefined value {name!r}")
        t = getattr(p.module, p.attr)
        return t.t() if p.transposed else t

    def _exec(self, i: int, env: dict[str, Value]) -> None:
        node = self._nodes[i]
        ins = [self._value(n, env) for n in node.inputs]
        fn = _OPS[node.op]
        if node.op == "Split":
            outs = _op_split(ins, node.attrs, self.opset, n_out=len(node.outputs))
        else:
            outs = fn(ins, node.attrs, self.opset)
        for name, v in zip(node.outputs, outs):
            if name:
                env[name] = v

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, Value]:
        """Evaluate the graph on ``feeds``; returns the environment holding the graph outputs."""
        env: dict[str, Value] = dict(feeds)
        for i, scope in enumerate(self._node_scope):
            if scope is self:
                self._exec(i, env)
            else:
                scope(self._exec, i, env)
            for name in self._free[i]:
                env.pop(name, None)
        return env

    def flat(self, input_ids: torch.Tensor, *past: torch.Tensor,
             position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """(logits [1, seq, vocab], presents…) for ``input_ids`` [1, seq] after ``past``."""
        sig = self.sig
        seq = input_ids.shape[1]
        if self.token_history:
            hist = past[0]
            n_past = hist.shape[2]
            ids = torch.cat([hist.reshape(1, -1).to(input_ids.dtype), input_ids], dim=1)
            positions = torch.arange(0, n_past + seq).unsqueeze(0)
        else:
            n_past = past[0].shape[2] if past else 0
            ids = input_ids
            positions = position_ids if position_ids is not None else torch.arange(n_past, n_past + seq).unsqueeze(0)
        feeds: dict[str, torch.Tensor] = {sig.ids: ids.to(sig.ids_dtype)}
        if sig.attention_mask is not None:
            feeds[sig.attention_mask] = torch.ones(1, ids.shape[1] + (0 if self.token_history else n_past), dtype=torch.int64)
        if sig.position_ids is not None:
            feeds[sig.position_ids] = positions.to(torch.int64)
        if not self.token_history:
            feeds.update(zip(sig.past, past))
        env = self.run(feeds)
        logits = _tensor(env[sig.logits]).to(torch.float32)
        if self.token_history:
            new = input_ids.to(torch.float32).reshape(1, 1, seq, 1)
            return (logits[:, n_past:], *(torch.cat([p, new], dim=2) for p in past))
        return (logits, *(_tensor(env[name]) for name in sig.presents))

    def forward(self, input_ids: torch.Tensor, cache: Any = None, position_ids: Optional[torch.Tensor] = None,
                use_cache: bool = True, **unused: Any) -> Any:
        past: list[torch.Tensor] = []
        layers = list(cache.layers) if cache is not None else []
        for layer in layers:
            past += [layer.keys, layer.values]
        if len(past) != 2 * self.n_layers:
            raise ModelLoadError(f"the ONNX model needs {2 * self.n_layers} cache tensors, got {len(past)}")
        out = self.flat(input_ids, *past, position_ids=position_ids)
        for i, layer in enumerate(layers):
            layer.keys, layer.values = out[1 + 2 * i], out[2 + 2 * i]
        return SimpleNamespace(logits=out[0], cache=cache)


def _shared_root(paths: list[str]) -> str:
    """The first path component when every path is it or starts with it (and some path goes deeper)."""
    if not paths:
        return ""
    root = paths[0].split(".", 1)[0]
    if all(p == root or p.startswith(root + ".") for p in paths) and any(p != root for p in paths):
        return root
    return ""


def _constant_value(attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return attrs["value"]
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise UnsupportedArchitectureError(f"Constant with attributes {sorted(attrs)} is not supported")


# --------------------------------------------------------------------------------------------
# facts and entry point

@dataclass
class _Facts:
    n_layers: int
    d_model: int
    vocab: int
    max_seq_len: int
    sources: dict[str, str] = field(default_factory=dict)


def _read_model(path: Path) -> Any:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as e:  # protobuf DecodeError, missing external data, …
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ModelLoadError(f"corrupt or truncated ONNX file {path}: {type(e).__name__}: {msg}") from None
    if not model.graph.node:
        raise ModelLoadError(f"corrupt or truncated ONNX file {path}: it holds no graph")
    return model


def _check_graph(graph: Any, where: str, opset: int) -> None:
    bad: dict[str, int] = {}
    for n in graph.node:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        if key not in SUPPORTED_OPS:
            bad[key] = bad.get(key, 0) + 1
    if bad:
        raise UnsupportedArchitectureError(
            f"{where}: ONNX op(s) {', '.join(f'{k} (×{v})' for k, v in sorted(bad.items()))} are not supported by "
            f"picompile's ONNX importer; it supports {', '.join(SUPPORTED_OPS)}")
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for n in graph.node:
        for name in n.input:
            if name not in defined:
                raise ModelLoadError(
                    f"{where}: node {n.name or n.op_type} reads {name!r}, which nothing before it defines "
                    f"(a truncated or corrupt file, or nodes out of order)")
        defined.update(n.output)
    missing = [o.name for o in graph.output if o.name not in defined]
    if missing:
        raise ModelLoadError(f"{where}: graph output(s) {', '.join(missing)} are never computed (truncated or corrupt file?)")


def _trace_to(graph: Any, name: str, target: str) -> bool:
    """Whether ``name`` is ``target`` through single-input reshaping ops."""
    producers = {o: n for n in graph.node for o in n.output}
    for _ in range(8):
        if name == target:
            return True
        n = producers.get(name)
        if n is None or n.op_type not in ("Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten", "Expand"):
            return False
        name = n.input[0]
    return False


def _read_config(path: Path) -> tuple[dict[str, Any], Optional[Path]]:
    from picompile.frontend.hf import read_config

    cfg = path.parent / "config.json"
    if not cfg.is_file():
        return {}, None
    return read_config(cfg), cfg


def _facts(model: Any, sig: Signature, cfg: dict[str, Any], cfg_file: Optional[Path], where: str) -> _Facts:
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    table_gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
                     and len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].data_type in _FLOAT_TYPES]
    emb = next((inits[n.input[0]] for n in table_gathers if _trace_to(graph, n.input[1], sig.ids)), None)
    pos_table = next((inits[n.input[0]] for n in table_gathers
                      if emb is None or n.input[0] != emb.name), None)
    sources: dict[str, str] = {}

    def pick(key: str, graph_value: Optional[int], graph_src: str) -> Optional[int]:
        c = cfg.get(key)
        if graph_value is not None:
            if isinstance(c, int) and c != graph_value:
                raise ModelLoadError(f"{cfg_file} does not describe {where}: its {key} is {c}, the graph's is {graph_value}")
            sources[key] = graph_src
            return graph_value
        if isinstance(c, int):
            sources[key] = "config.json"
            return c
        return None

    logits_dims = next(_dims(o) for o in graph.output if o.name == sig.logits)
    vocab_graph = logits_dims[2] if isinstance(logits_dims[2], int) and logits_dims[2] > 0 else (
        int(emb.dims[0]) if emb is not None else None)
    vocab = pick("vocab_size", vocab_graph, "logits shape")
    d_model = pick("hidden_size", int(emb.dims[1]) if emb is not None else None, "token embedding")
    n_layers_graph: Optional[int] = len(sig.past) // 2 if sig.past else None
    src = "KV-cache inputs"
    if n_layers_graph is None and "num_hidden_layers" not in cfg:  # logits-only: count layers.N / h.N names
        found = set()
        for n in graph.node:
            for text in (_scope_of(n), *n.input):
                m = re.search(r"\blayers[./](\d+)\b|\bh[./](\d+)\b", text)
                if m:
                    found.add(int(m.group(1) or m.group(2)))
        if found and found == set(range(len(found))):
            n_layers_graph, src = len(found), "layer names"
    n_layers = pick("num_hidden_layers", n_layers_graph, src)
    for key, value in (("vocab_size", vocab), ("hidden_size", d_model), ("num_hidden_layers", n_layers)):
        if value is None:
            raise UnsupportedArchitectureError(
                f"{where}: cannot tell the model's {key} from the graph; put its config.json beside the .onnx file")
    meta = {p.key: p.value for p in model.metadata_props}
    if isinstance(cfg.get("max_position_embeddings"), int):
        max_seq, sources["max_seq_len"] = int(cfg["max_position_embeddings"]), "config.json"
    elif any(k in meta for k in ("max_position_embeddings", "max_seq_len")):
        max_seq = int(meta.get("max_position_embeddings") or meta["max_seq_len"])
        sources["max_seq_len"] = "ONNX metadata"
    elif pos_table is not None and int(pos_table.dims[0]) > 2:
        max_seq, sources["max_seq_len"] = int(pos_table.dims[0]) - 2, "position table rows - 2"
    else:
        max_seq, sources["max_seq_len"] = DEFAULT_MAX_SEQ_LEN, "default"
    return _Facts(int(n_layers), int(d_model), int(vocab), max_seq, sources)  # type: ignore[arg-type]


def load_onnx(path: str | Path) -> tuple[OnnxDecoder, ModelInfo]:
    """Import an ONNX decoder step (see the module doc): (module for capture, ModelInfo)."""
    from picompile.frontend.hf import SUPPORTED_ARCHITECTURES

    path = Path(path)
    where = str(path)
    model = _read_model(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    _check_graph(model.graph, where, opset)
    sig = _signature(model.graph, where)
    cfg, cfg_file = _read_config(path)
    facts = _facts(model, sig, cfg, cfg_file, where)
    if sig.past and len(sig.past) != 2 * facts.n_layers:
        raise ModelLoadError(f"{where}: {len(sig.past)} KV-cache inputs for {facts.n_layers} layers")
    module = OnnxDecoder(model.graph, sig, facts.n_layers, opset).eval()
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if archs else "OnnxDecoder"
    tok = path.parent / "tokenizer.json"
    extra = {"onnx": {
        "file": path.name, "opset": opset, "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "kv_cache": "token-history" if not sig.past else "inputs",
        "inputs": [sig.ids, *([sig.attention_mask] if sig.attention_mask else []),
                   *([sig.position_ids] if sig.position_ids else []), *sig.past],
        "outputs": [sig.logits, *sig.presents], "facts_from": facts.sources,
        "config_json": cfg_file is not None,
    }}
    del model
    info = ModelInfo(
        architecture=arch,
        family=SUPPORTED_ARCHITECTURES.get(arch, "onnx"),
        source=where,
        source_format="onnx",
        config=cfg,
        n_layers=facts.n_layers,
        d_model=facts.d_model,
        vocab_size=facts.vocab,
        max_seq_len=facts.max_seq_len,
        n_kv_heads=sig.kv_heads,
        head_dim=sig.head_dim,
        tokenizer={"kind": "hf", "path": str(path.parent)} if tok.is_file() else None,
        extra=extra,
    )
    return module, info


__all__ = ["DEFAULT_MAX_SEQ_LEN", "Known", "OnnxDecoder", "SUPPORTED_OPS", "load_onnx"]

"""Neural-network ONNX ops: ``MatMul`` / ``Gemm`` (nn.Linear as torch.onnx writes it), ``Softmax`` /
``LogSoftmax``, ``LayerNormalization``, ``Gelu`` / ``LeakyRelu``, ``Dropout`` (inference: identity),
``Trilu`` (causal masks). Every op is ``fn(inputs, attrs, opset) -> outputs``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from picompile.errors import UnsupportedArchitectureError
from picompile.frontend.onnx.values import Value, as_tensor, ints


def op_matmul(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [torch.matmul(as_tensor(ins[0]), as_tensor(ins[1]))]


def op_gemm(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    a, b = as_tensor(ins[0]), as_tensor(ins[1])
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
    if int(attrs.get("transA", 0)):
        a = a.t()
    bias = as_tensor(c) if c is not None else None
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


def op_softmax(ins: list[Value], attrs: dict[str, Any], opset: int, log: bool = False) -> list[Value]:
    x = as_tensor(ins[0])
    axis = int(attrs.get("axis", -1 if opset >= 13 else 1))
    if opset < 13 and axis % x.dim() != x.dim() - 1:
        raise UnsupportedArchitectureError(f"Softmax over axis {axis} before opset 13 (flattening semantics) is not supported")
    return [torch.log_softmax(x, axis) if log else torch.softmax(x, axis)]


def op_log_softmax(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return op_softmax(ins, attrs, opset, log=True)


def op_layer_norm(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x, w = as_tensor(ins[0]), as_tensor(ins[1])
    b = as_tensor(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    axis = int(attrs.get("axis", -1)) % x.dim()
    return [F.layer_norm(x, tuple(x.shape[axis:]), w, b, float(attrs.get("epsilon", 1e-5)))]


def op_gelu(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    approx = attrs.get("approximate", "none")
    return [F.gelu(as_tensor(ins[0]), approximate=approx.decode() if isinstance(approx, bytes) else approx)]


def op_leaky_relu(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    return [F.leaky_relu(as_tensor(ins[0]), float(attrs.get("alpha", 0.01)))]


def op_dropout(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = ins[0]
    return [x, torch.ones_like(as_tensor(x), dtype=torch.bool)]


def op_trilu(ins: list[Value], attrs: dict[str, Any], opset: int) -> list[Value]:
    x = as_tensor(ins[0])
    k = int(ints(ins[1], "Trilu k")[0]) if len(ins) > 1 and ins[1] is not None else 0
    return [torch.triu(x, k) if int(attrs.get("upper", 1)) else torch.tril(x, k)]

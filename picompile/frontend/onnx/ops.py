"""The table of supported ONNX ops: op type (default domain) → ``fn(inputs, attrs, opset) -> outputs``."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F

from picompile.frontend.onnx import ops_math as m
from picompile.frontend.onnx import ops_nn as nn
from picompile.frontend.onnx import ops_shape as s
from picompile.frontend.onnx.values import Value

OpFn = Callable[[list[Value], dict[str, Any], int], list[Value]]

OPS: dict[str, OpFn] = {
    "Add": m.binary(operator.add, operator.add),
    "Sub": m.binary(operator.sub, operator.sub),
    "Mul": m.binary(operator.mul, operator.mul),
    "Div": m.binary(operator.truediv, operator.truediv, int_fn=m.idiv),
    "Pow": m.binary(operator.pow, operator.pow),
    "Mod": m.binary(operator.mod, operator.mod),
    "Equal": m.binary(operator.eq, operator.eq, out_bool=True),
    "Less": m.binary(operator.lt, operator.lt, out_bool=True),
    "LessOrEqual": m.binary(operator.le, operator.le, out_bool=True),
    "Greater": m.binary(operator.gt, operator.gt, out_bool=True),
    "GreaterOrEqual": m.binary(operator.ge, operator.ge, out_bool=True),
    "And": m.binary(torch.logical_and, lambda a, b: a and b, out_bool=True, scalars=False),
    "Or": m.binary(torch.logical_or, lambda a, b: a or b, out_bool=True, scalars=False),
    "Xor": m.binary(torch.logical_xor, lambda a, b: bool(a) != bool(b), out_bool=True, scalars=False),
    "Max": m.variadic(torch.maximum, lambda a, b: torch.sym_max(a, b)),
    "Min": m.variadic(torch.minimum, lambda a, b: torch.sym_min(a, b)),
    "Sum": m.variadic(operator.add, operator.add, scalars=True),
    "Not": m.unary(torch.logical_not, m.logical_not),
    "Neg": m.unary(torch.neg, lambda a: -a),
    "Abs": m.unary(torch.abs, abs),
    "Sqrt": m.unary(torch.sqrt),
    "Reciprocal": m.unary(torch.reciprocal),
    "Exp": m.unary(torch.exp),
    "Log": m.unary(torch.log),
    "Tanh": m.unary(torch.tanh),
    "Erf": m.unary(torch.erf),
    "Sigmoid": m.unary(torch.sigmoid),
    "Relu": m.unary(torch.relu),
    "Softplus": m.unary(F.softplus),
    "Cos": m.unary(torch.cos),
    "Sin": m.unary(torch.sin),
    "Floor": m.unary(torch.floor),
    "Ceil": m.unary(torch.ceil),
    "IsNaN": m.unary(torch.isnan),
    "IsInf": m.unary(torch.isinf),
    "LeakyRelu": nn.op_leaky_relu,
    "Gelu": nn.op_gelu,
    "Softmax": nn.op_softmax,
    "LogSoftmax": nn.op_log_softmax,
    "ReduceMean": m.reduce(lambda x, axes, keep: torch.mean(x, dim=axes, keepdim=keep)),
    "ReduceSum": m.reduce(lambda x, axes, keep: torch.sum(x, dim=axes, keepdim=keep)),
    "ReduceMax": m.reduce(m.reduce_max),
    "ReduceMin": m.reduce(m.reduce_min),
    "LayerNormalization": nn.op_layer_norm,
    "MatMul": nn.op_matmul,
    "Gemm": nn.op_gemm,
    "Shape": s.op_shape,
    "Size": s.op_size,
    "Gather": s.op_gather,
    "GatherND": s.op_gather_nd,
    "Slice": s.op_slice,
    "Concat": s.op_concat,
    "Squeeze": s.op_squeeze,
    "Unsqueeze": s.op_unsqueeze,
    "Reshape": s.op_reshape,
    "Flatten": s.op_flatten,
    "Transpose": s.op_transpose,
    "Where": m.op_where,
    "Cast": m.op_cast,
    "CastLike": m.op_castlike,
    "Expand": s.op_expand,
    "Range": s.op_range,
    "ConstantOfShape": s.op_constant_of_shape,
    "Identity": s.op_identity,
    "Dropout": nn.op_dropout,
    "Trilu": nn.op_trilu,
    "Clip": m.op_clip,
    "Split": s.op_split,  # the interpreter passes n_out (the node's output count) too
    "CumSum": m.op_cumsum,
}
SUPPORTED_OPS: tuple[str, ...] = tuple(sorted([*OPS, "Constant"]))  # Constant nodes are folded at import

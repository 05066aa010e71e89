"""The prefill graph's GEMMs in another dtype: ``with_compute_dtype(gm, torch.bfloat16)``.

linear / FFN ops reading float16 (or float32) weights → the same ops reading bfloat16 copies of them, which
``picompile.ir.ops.lin`` computes in bfloat16 (activations rounded to bfloat16, float32 accumulation, result
widened back). On a CPU with AMX, torch's bfloat16 GEMM (oneDNN) runs 2.4× its float32 / float16 GEMM
(measured here: 24 against 59 ms for [512, 2048] × [2048, 5632]); float16 GEMMs get no such unit, so a
float16 artifact's prefill runs at float32 speed. Costs: a bfloat16 copy of every weight it converts (the
size of the float16 weights again), and the rounding — ~3e-3 relative error per GEMM output against
~3e-4 for float16 activations. Only the several-token (prefill) graph is rewritten; decode reads the
artifact's own weights through its kernels. Quantized weights (int8 / int4 artifacts) get dequantized copies in
``dtype`` (their scales dropped from the prefill nodes): the memory of a bfloat16 model besides the quantized one.
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.errors import InputError
from picompile.ir.graph import shared_copy
from picompile.ir.ops import call_directly, deq
from picompile.ir.patterns import SCALE_ARGS
from picompile.ir.schema import arg_names, args_of, call_args, node_op

aten = torch.ops.aten
_OPS = torch.ops.picompile

# op name → (the op the rewritten node calls, its weight arguments); the lowered forms become their reference
# ops (their arguments shared by name; the kernel keys go), which take the torch GEMM path for any token count
# (their kernels read float16)
_WEIGHTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear": ("linear", ("w",)),
    "tvm_linear": ("linear", ("w",)),
    "ffn": ("ffn", ("w_up", "w_gate", "w_down")),
    "sparse_ffn": ("sparse_ffn", ("w_up", "w_gate", "w_down_t")),
    "tvm_sparse_ffn": ("sparse_ffn", ("w_up", "w_gate", "w_down_t")),
}
_ATEN_LINEAR = {"input": "x", "weight": "w", "bias": "b"}  # aten.linear's argument names → picompile::linear's

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16}


def resolve(name: str | None) -> torch.dtype | None:
    """``prefill_dtype`` → a torch dtype (None: the weights' own), failing with the reason where this CPU
    has no fast path for it."""
    if name is None:
        return None
    dtype = COMPUTE_DTYPES.get(name)
    if dtype is None:
        raise InputError(f"prefill_dtype must be one of {', '.join(COMPUTE_DTYPES)} (or None: the weights' "
                         f"dtype), got {name!r}")
    if not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()):
        raise InputError("prefill_dtype='bfloat16' needs a CPU with AMX or AVX512-BF16 (this one has neither: "
                         "its bfloat16 GEMMs would be slower than float32 ones)")
    return dtype


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return "linear"
    op = node_op(node)
    return op if op in _WEIGHTS else None


def _named_args(node: fx.Node) -> dict[str, object]:
    """The arguments of a linear / FFN node by name: a picompile op's (``ir.schema``), or aten.linear's as
    picompile::linear names them."""
    if node.target is not aten.linear.default:
        return args_of(node)
    names = [a.name for a in aten.linear.default._schema.arguments]  # input, weight, bias
    given = dict(zip(names, node.args), **node.kwargs)
    return {"b": None, **{_ATEN_LINEAR[k]: v for k, v in given.items()}}


def with_compute_dtype(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A copy of ``gm`` sharing its other tensors whose linear and FFN GEMMs read ``dtype`` copies of their
    weights (``aten.linear`` and the TVM-lowered ops become picompile's reference ops, which compute in the
    weights' dtype). Every weight is converted once, however many nodes read it."""
    out = shared_copy(gm)
    converted: dict[str, fx.Node] = {}

    def convert(arg: object) -> object:
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return arg
        name = str(arg.target)
        if name not in converted:
            w = getattr(out, name)
            if not w.is_floating_point() or w.dtype == dtype:
                return arg
            attr = f"{name}_{str(dtype).removeprefix('torch.')}"
            out.register_buffer(attr, w.to(dtype), persistent=False)
            with out.graph.inserting_after(arg):
                converted[name] = out.graph.get_attr(attr)
        return converted[name]

    def dequantized(q: fx.Node, s: fx.Node) -> fx.Node:
        """A quantized weight (int8 / int4 quants + scales) as a dense ``dtype`` copy (option (b) of the
        quantized prefill: the memory of a bfloat16 model for bfloat16 GEMMs)."""
        name = f"{q.target}_dequantized"
        if name not in converted:
            attr = f"{str(q.target)}_{str(dtype).removeprefix('torch.')}"
            out.register_buffer(attr, deq(getattr(out, str(q.target)), getattr(out, str(s.target))).to(dtype),
                                persistent=False)
            with out.graph.inserting_after(q):
                converted[name] = out.graph.get_attr(attr)
        return converted[name]

    for node in list(out.graph.nodes):
        op = _op_name(node)
        if op is None:
            continue
        target, weights = _WEIGHTS[op]
        args = _named_args(node)
        values = {k: v for k, v in args.items() if k in arg_names(target)}
        quant = {w: (args[w], args[s]) for w, s in SCALE_ARGS.get(op, {}).items() if args.get(s) is not None}
        values.update({w: dequantized(*quant[w]) if w in quant else convert(args[w]) for w in weights})
        values.update({s: None for s in SCALE_ARGS.get(op, {}).values()})
        node.target, node.args, node.kwargs = getattr(_OPS, target).default, call_args(target, values), {}
    out.graph.eliminate_dead_code()
    return call_directly(out)

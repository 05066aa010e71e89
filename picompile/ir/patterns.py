"""Graph patterns the passes share: the FFN nodes by layer, what decides a neuron fires, stored linears, buffers.

Passes never import each other; what two of them need to find in a graph lives here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from picompile.ir.graph import get_tensor
from picompile.kernels.qformat import QFormat, quantize
from picompile.ir.ops import activation_score, is_picompile_op, lin
from picompile.ir.schema import arg, args_of, node_op

aten = torch.ops.aten

# --weight-dtype / --predictor-dtype names -> the dtype a weight is stored in
WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
# --predictor-dtype names (after ``auto``) → the dtype fc1/fc2 are stored in (int8: per-row scales folded away)
PREDICTOR_DTYPES: dict[str, torch.dtype] = {**WEIGHT_DTYPES, "int8": torch.int8}
# --weight-dtype names of the block-quantized formats (picompile.kernels.qformat): quants + float16 scales
QUANT_WEIGHT_DTYPES: tuple[str, ...] = ("int8", "int4")
# bytes per stored element of each --weight-dtype, before a quantized format's scales (2 bytes per block)
_ELEMENT_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}


def weight_itemsize(name: str, block: int = 32) -> float:
    """Bytes one weight element of --weight-dtype ``name`` costs in the artifact, its share of the float16
    scales included (int4, block 32: 0.5625; what a decode step reads per element of a row)."""
    return _ELEMENT_BYTES[name] + (2.0 / block if name in QUANT_WEIGHT_DTYPES else 0.0)


# picompile op -> {weight argument: the argument holding its float16 scales when it is quantized}
SCALE_ARGS: dict[str, dict[str, str]] = {
    "ffn": {"w_up": "s_up", "w_gate": "s_gate", "w_down": "s_down"},
    "sparse_ffn": {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"},
    "tvm_sparse_ffn": {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"},
    "linear": {"w": "s"},
    "tvm_linear": {"w": "s"},
}


def scale_of(node: fx.Node, weight: str) -> fx.Node | None:
    """The scales node of weight argument ``weight`` of a picompile op node when that weight is quantized, else None."""
    op = node_op(node)
    s_name = SCALE_ARGS.get(op or "", {}).get(weight)
    return None if s_name is None else arg(node, s_name)


def quantized_weights(node: fx.Node) -> dict[str, tuple[fx.Node, fx.Node]]:
    """{weight argument: (quants node, scales node)} of a picompile op node's quantized weights."""
    op = node_op(node)
    if op not in SCALE_ARGS:
        return {}
    a = args_of(node)
    return {w: (a[w], a[s]) for w, s in SCALE_ARGS[op].items() if a[s] is not None and a[w] is not None}


def ffn_nodes(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Every picompile.ffn node by its layer index."""
    return {int(arg(n, "layer")): n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "ffn")}


@dataclass
class Decider:
    """What decides if a neuron of one FFN fires: ``activation_score(x, w, b, act, w_mul, b_mul) > threshold``."""

    w: torch.Tensor  # [n_neurons, d_model] gate rows for gated FFNs, else up rows
    b: torch.Tensor | None  # [n_neurons] the bias of w's rows (gate bias, or a plain MLP's up bias)
    act: str
    w_mul: torch.Tensor | None  # [n_neurons, d_model] up rows: the product criterion (gated, non-ReLU; dReLU), else None
    b_mul: torch.Tensor | None = None  # [n_neurons] the up bias with w_mul

    def score(self, x: torch.Tensor) -> torch.Tensor:  # [N, d_model] -> [N, n_neurons]
        return activation_score(x, self.w, self.b, self.act, self.w_mul, self.b_mul)

    @torch.no_grad()
    def margin(self, x: torch.Tensor, threshold: float) -> torch.Tensor:  # [N, d_model] -> [N, n_neurons]
        """How far each neuron is above firing (> 0: fires): ReLU's pre-activation ``w x + b``; dReLU's smaller
        pre-activation ``min(gate x + b, up x + b_mul)`` (it fires when both are positive); else
        ``score - threshold``."""
        if self.act == "relu" and self.w_mul is None:
            return lin(x, self.w, self.b).float() - threshold
        if self.act == "drelu" and self.w_mul is not None:
            return torch.minimum(lin(x, self.w, self.b).float(), lin(x, self.w_mul, self.b_mul).float()) - threshold
        return self.score(x).float() - threshold


def decider_nodes(node: fx.Node, criterion: str = "gate") -> tuple[fx.Node, fx.Node | None, fx.Node | None,
                                                                 fx.Node | None]:
    """The weight nodes (w, b, w_mul, b_mul) of a picompile.ffn ``node`` that decide if a neuron fires: gate rows
    and bias for gated FFNs (times the up rows and bias for non-ReLU ones under the "product" criterion, and
    always for dReLU, whose neuron is zero when either branch is), else the up rows and bias."""
    a = args_of(node)
    if a["w_gate"] is not None:
        mul = a["act"] == "drelu" or (criterion == "product" and a["act"] != "relu")
        return a["w_gate"], a["b_gate"], a["w_up"] if mul else None, a["b_up"] if mul else None
    return a["w_up"], a["b_up"], None, None


def decider_of(gm: fx.GraphModule, node: fx.Node, criterion: str = "gate") -> Decider:
    """The :class:`Decider` of a picompile.ffn ``node`` (its :func:`decider_nodes` as tensors)."""
    w, b, w_mul, b_mul = (None if n is None else get_tensor(gm, n) for n in decider_nodes(node, criterion))
    assert w is not None
    return Decider(w, b, str(arg(node, "act")), w_mul, b_mul)


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(x, w, b) of a linear node (aten's or picompile's) whose weight (and bias) are stored tensors, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, w, *rest = node.args
        b = rest[0] if rest else node.kwargs.get("bias")
    elif is_picompile_op(node.target, "linear"):
        x, w, b = (arg(node, k) for k in ("x", "w", "b"))
    else:
        return None
    stored = all(isinstance(t, fx.Node) and t.op == "get_attr" for t in (w, *([b] if b is not None else [])))
    return (x, w, b) if isinstance(x, fx.Node) and stored else None  # type: ignore[return-value]


def add_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
    """Register ``tensor`` on the graph module and return a get_attr node for it."""
    gm.register_buffer(name, tensor.detach().contiguous())
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(name)


QUANT_CHUNK_ELEMENTS: int = 1 << 22  # elements of a weight quantized at a time (16 MiB in float32)
QUANTIZED_FROM: str = "quantized_from_bytes"  # a quants node's meta: bytes of the weight it was made from


def quantize_rows(w: torch.Tensor, fmt: QFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``qformat.quantize(w, fmt)`` of ``w`` [rows, cols] a few rows at a time: the same quants and scales (a
    block lies within a row), with one chunk's float32 temporaries (~4x its size) instead of the whole weight's
    (an lm_head [32000, 2048] quantized at once peaked 1 GiB above its own size at int8)."""
    rows, cols = w.shape
    step = max(1, QUANT_CHUNK_ELEMENTS // max(cols, 1))
    if rows <= step:
        return quantize(w, fmt)
    q0, s0 = quantize(w[:step], fmt)
    q = q0.new_empty((rows, q0.shape[1]))  # [rows, cols or cols / 2]
    s = s0.new_empty((rows, s0.shape[1]))  # [rows, cols / block]
    q[:step], s[:step] = q0, s0
    for lo in range(step, rows, step):
        q[lo:lo + step], s[lo:lo + step] = quantize(w[lo:lo + step], fmt)
    return q, s


def add_quantized(gm: fx.GraphModule, name: str, w: torch.Tensor, fmt: QFormat,
                  before: fx.Node) -> tuple[fx.Node, fx.Node]:
    """``w`` [rows, cols] quantized (:func:`quantize_rows`) as the buffers ``{name}_{fmt.name}_q`` and ``_s``
    (convert-weights' names for a weight ``name``); the quants node's meta records ``w``'s bytes."""
    q, s = quantize_rows(w, fmt)
    base = f"{name}_{fmt.name}"
    q_node, s_node = add_buffer(gm, f"{base}_q", q, before), add_buffer(gm, f"{base}_s", s, before)
    q_node.meta[QUANTIZED_FROM] = w.numel() * w.element_size()
    return q_node, s_node

"""Prefill's FFN as two GEMMs on packed copies: ``PrefillFFN`` and ``pack_ffn``.

A split FFN layer (hot and cold parts; a hybrid-scheduled one, ``runtime/hybrid.py``, is one node) (``runtime/hybrid.py``: hot part, cold part, merge; dense in prefill) costs prefill
four or six GEMMs in its stored layout: up and gate per part, then the down rows neuron-major (a transposed
weight). Packed for prefill, the layer is one GEMM over ``[up_hot; up_cold; gate_hot; gate_cold]``
(``[2·n_ff, d_model]``: up and gate fused, both parts in one) and one over the down projection in nn.Linear
layout (``[d_model, n_ff]``, contiguous): the layout torch's (oneDNN's) GEMM reads fastest, every call with
the full N of the layer. The copies are in the prefill dtype (bfloat16), so they cost the bytes of the
converted weights once (decode keeps reading the artifact's own float16 rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, fx

from picompile.ir.graph import get_tensor
from picompile.ir.ops import apply_act, gemm
from picompile.ir.schema import args_of, node_op


class PrefillFFN:
    """One FFN layer for several tokens: ``down(act(gate x) · (up x + b_up)) + b_down`` on packed weights,
    computed in the weights' dtype (x rounded to it, float32 accumulation inside the GEMM), returned in x's."""

    def __init__(self, layer: int, act: str, n_ff: int, gated: bool) -> None:
        self.layer = layer
        self.act = act
        self.n_ff = n_ff
        self.gated = gated
        self.__name__ = f"prefill_ffn_{layer}"  # fx's code generation names the call after it

    def __call__(
        self,
        x: Tensor,  # [..., d_model] float32
        w_in: Tensor,  # [2·n_ff, d_model] (gated: up rows, then gate rows) or [n_ff, d_model]
        b_in: Optional[Tensor],  # [n_ff] float32: the up bias
        w_out: Tensor,  # [d_model, n_ff]: the down projection, nn.Linear layout
        bias: Optional[Tensor],  # [d_model] float32: the down bias
    ) -> Tensor:
        h = gemm(x.to(w_in.dtype), w_in)  # [..., 2·n_ff | n_ff]
        up = h[..., : self.n_ff]
        if b_in is not None:
            up = up + b_in.to(h.dtype)
        a = apply_act(up, self.act) if not self.gated else apply_act(h[..., self.n_ff:], self.act) * up  # [..., n_ff]
        y = gemm(a, w_out).to(x.dtype)  # [..., d_model]
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"PrefillFFN(layer={self.layer}, act={self.act}, n_ff={self.n_ff}, gated={self.gated})"


@dataclass
class Packed:
    """An FFN node's prefill form: a ``PrefillFFN`` and its packed weights (``w_in``, ``b_in``, ``w_out``) per
    part with rows, and the graph inputs it keeps (``x``, the down bias ``bias``)."""

    parts: list[tuple[PrefillFFN, dict[str, Optional[Tensor]]]]
    x: fx.Node
    bias: Optional[fx.Node]


def node_parts(node: fx.Node) -> Optional[tuple[list[dict[str, Any]], Any, Optional[fx.Node], str, int]]:
    """The mask-free FFN parts with rows a node computes (HybridFFN: hot, then cold), as dicts of weight nodes
    (w_up, b_up, w_gate, and w_down_t [k, d_model] or w_down [d_model, k]), with its x, down bias, activation
    and layer; None for any other node."""
    from picompile.runtime.hybrid import HybridFFN, hybrid_args
    from picompile.runtime.partitions import EmptyPartition, InlinePartition, ThreadPartition

    target = node.target
    if isinstance(target, HybridFFN):
        a = hybrid_args(node)
        if a["mask_h"] is not None or a["mask_c"] is not None:
            return None
        live = [(p, s) for p, s in ((target.hot, "_h"), (target.cold, "_c")) if not isinstance(p, EmptyPartition)]
        if not live or not all(isinstance(p, (InlinePartition, ThreadPartition)) for p, _ in live):
            return None  # a part on the GPU (CudaPartition) keeps its scheduler: its weights live there
        acts = {str(p.part.consts["act"]) for p, _ in live}  # type: ignore[attr-defined]
        if len(acts) != 1 or "drelu" in acts:  # dReLU: PrefillFFN has no relu on the up branch
            return None
        parts = [{k: a[f"{k}{s}"] for k in ("w_up", "b_up", "w_gate", "w_down_t")} for _, s in live]
        return parts, a["x"], a["bias"], acts.pop(), target.layer
    op = node_op(node) if node.op == "call_function" else None
    if op not in ("ffn", "sparse_ffn", "tvm_sparse_ffn"):
        return None
    a = args_of(node)
    if a["mask"] is not None or a.get("b_gate") is not None or a["act"] == "drelu":  # PrefillFFN: no gate bias, no dReLU
        return None
    scales = {k: a.get(k) for k in ("s_up", "s_gate", "s_down")}  # int8 / int4 weights: their float16 scales
    if op == "ffn":
        part = {**{k: a[k] for k in ("w_up", "b_up", "w_gate", "w_down")}, **scales}
        return [part], a["x"], a["b_down"], str(a["act"]), int(a["layer"])
    part = {**{k: a[k] for k in ("w_up", "b_up", "w_gate", "w_down_t")}, **scales}
    return [part], a["x"], None, str(a["act"]), int(a["layer"])


def _pack_part(gm: fx.GraphModule, part: dict[str, Any], act: str, layer: int,
               dtype: torch.dtype, onednn: bool = True) -> Optional[tuple[PrefillFFN, dict[str, Optional[Tensor]]]]:
    from picompile.ir.ops import deq

    def weight(name: str, scales: str) -> Tensor:
        """A stored weight as float maths reads it (int8 / int4 quants dequantized with their scales)."""
        s = part.get(scales)
        return deq(get_tensor(gm, part[name]), None if s is None else get_tensor(gm, s))

    up = weight("w_up", "s_up")  # [k, d_model]
    if up.shape[0] == 0:
        return None
    n_ff = int(up.shape[0])
    gated = part["w_gate"] is not None
    w_in = torch.cat([up, weight("w_gate", "s_gate")]) if gated else up  # [2k | k, d_model]
    b_in = None if part["b_up"] is None else get_tensor(gm, part["b_up"]).float()  # [k]
    if "w_down" in part:
        w_out = weight("w_down", "s_down")  # [d_model, k] already
    else:
        w_out = weight("w_down_t", "s_down").t()  # [k, d_model] → [d_model, k]
    weights = {"w_in": gemm_layout(w_in, dtype, onednn), "b_in": b_in, "w_out": gemm_layout(w_out, dtype, onednn)}
    return PrefillFFN(layer, act, n_ff, gated), weights


def gemm_layout(w: Tensor, dtype: torch.dtype, onednn: bool = True) -> Tensor:
    """``w`` [d_out, d_in] as a ``dtype`` copy in the layout torch's GEMM reads fastest for ``x @ w.T``
    (``ops.gemm`` computes with any of them): bfloat16, nn.Linear's own, contiguous; float32, oneDNN's packed
    (blocked) layout where torch has oneDNN, else input-major storage for MKL (``w`` a transposed view of a
    contiguous [d_in, d_out]; ``onednn=False``: for a graph torch.compile will trace, which cannot read the opaque
    packed tensors). AMD Zen 2, 2 threads, GFLOPS at 64 / 16 rows: [5632, 2048] packed 128 / 72,
    input-major 91 / 40, nn.Linear's 56 / —; [2560, 2048] 140 / 108, 94 / 34; [2048, 5632] 130 / 73, 87 / 41."""
    if dtype != torch.float32:
        return w.to(dtype).contiguous()
    packed = _onednn_packed(w) if onednn else None
    return packed if packed is not None else w.t().to(dtype).contiguous().t()


def _onednn_packed(w: Tensor) -> Optional[Tensor]:
    """oneDNN's packed float32 copy of ``w`` [d_out, d_in] (an opaque ``torch._mkldnn`` tensor that
    ``torch.ops.mkldnn._linear_pointwise`` reads), or None where this torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous())
    except (RuntimeError, AttributeError):  # a build without the op: the input-major copy instead
        return None


def pack_ffn(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype, onednn: bool = True) -> Optional[Packed]:
    """A mask-free FFN node of ``gm`` (a HybridFFN; a sparse_ffn / tvm_sparse_ffn part; an ffn) as one
    ``PrefillFFN`` per part with rows, on weights packed in ``dtype``; None where it is not one (a mask left, a
    part on the GPU, no rows). Parts stay apart, summed as ``merge`` does (hot + cold, then the bias), so a
    layer computes the same whatever its hybrid mode."""
    found = node_parts(node)
    if found is None:
        return None
    parts, x, bias, act, layer = found
    packed = [p for p in (_pack_part(gm, part, act, layer, dtype, onednn) for part in parts) if p is not None]
    if not packed:
        return None
    return Packed(packed, x, bias)

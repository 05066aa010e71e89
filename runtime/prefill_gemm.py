"""Prefill's FFN as two GEMMs on packed copies: ``PrefillFFN`` and ``pack_ffn``.

A hybrid-scheduled FFN layer (``runtime/hybrid.py``: hot part, cold part, merge; dense in prefill) costs prefill
four or six GEMMs in its stored layout: up and gate per part, then the down rows neuron-major (a transposed
weight). Packed for prefill, the layer is one GEMM over ``[up_hot; up_cold; gate_hot; gate_cold]``
(``[2·n_ff, d_model]``: up and gate fused, both parts in one) and one over the down projection in nn.Linear
layout (``[d_model, n_ff]``, contiguous): the layout torch's (oneDNN's) GEMM reads fastest, every call with
the full N of the layer. The copies are in the prefill dtype (bfloat16), so they cost the bytes of the
converted weights once (decode keeps reading the artifact's own float16 rows).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, fx

from picompile.ir.graph import get_tensor
from picompile.ir.ops import apply_act


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
        h = torch.nn.functional.linear(x.to(w_in.dtype), w_in)  # [..., 2·n_ff | n_ff]
        up = h[..., : self.n_ff]
        if b_in is not None:
            up = up + b_in.to(h.dtype)
        a = apply_act(up, self.act) if not self.gated else apply_act(h[..., self.n_ff:], self.act) * up  # [..., n_ff]
        y = torch.nn.functional.linear(a, w_out).to(x.dtype)  # [..., d_model]
        return y if bias is None else y + bias

    def __repr__(self) -> str:
        return f"PrefillFFN(layer={self.layer}, act={self.act}, n_ff={self.n_ff}, gated={self.gated})"


def _cat(gm: fx.GraphModule, nodes: list[object]) -> Optional[Tensor]:
    parts = [get_tensor(gm, n) for n in nodes if n is not None]  # type: ignore[arg-type]
    return torch.cat(parts) if parts else None


def pack_ffn(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> Optional[tuple[PrefillFFN, dict[str, Optional[Tensor]]]]:
    """A dense HybridFFN node (no masks) as a ``PrefillFFN`` and its packed weights in ``dtype``
    (``w_in``, ``b_in``, ``w_out``; the down bias stays the node's own ``bias`` input), or None where the node is not that (a mask left, a part
    without a partition op)."""
    from picompile.runtime.hybrid import HybridFFN, hybrid_args
    from picompile.runtime.partitions import EmptyPartition, InlinePartition, ThreadPartition

    target = node.target
    if not isinstance(target, HybridFFN):
        return None
    a = hybrid_args(node)
    if a["mask_h"] is not None or a["mask_c"] is not None:
        return None
    parts = [(p, s) for p, s in ((target.hot, "_h"), (target.cold, "_c")) if not isinstance(p, EmptyPartition)]
    if not parts or not all(isinstance(p, (InlinePartition, ThreadPartition)) for p, _ in parts):
        return None  # a part on the GPU (CudaPartition) keeps its scheduler: its weights live there
    ops = [p.part for p, _ in parts]  # type: ignore[attr-defined]
    act = str(ops[0].consts["act"])  # type: ignore[union-attr]
    gated = [a[f"w_gate{s}"] is not None for _, s in parts]
    if len(set(gated)) != 1 or any(op.consts["act"] != act for op in ops):  # type: ignore[union-attr]
        return None
    sfx = [s for _, s in parts]
    up = _cat(gm, [a[f"w_up{s}"] for s in sfx])  # [n_ff, d_model]
    assert up is not None
    n_ff = int(up.shape[0])
    w_in = torch.cat([up, _cat(gm, [a[f"w_gate{s}"] for s in sfx])]) if gated[0] else up  # type: ignore[list-item]
    b_up = [a[f"b_up{s}"] for s in sfx]
    b_in = _cat(gm, b_up) if all(b is not None for b in b_up) else None
    if b_in is None and any(b is not None for b in b_up):
        return None  # one part with an up bias, one without: not one GEMM's bias
    w_out = _cat(gm, [a[f"w_down_t{s}"] for s in sfx])  # [n_ff, d_model] neuron-major
    assert w_out is not None
    weights = {"w_in": w_in.to(dtype).contiguous(),  # [2·n_ff | n_ff, d_model]
               "b_in": None if b_in is None else b_in.float(),  # [n_ff]
               "w_out": w_out.t().to(dtype).contiguous()}  # [d_model, n_ff]
    return PrefillFFN(target.layer, act, n_ff, gated[0]), weights

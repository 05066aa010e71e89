"""What one decode step reads, for ``picompile bench``'s bytes per token and its bandwidth bound.

:func:`weight_bytes` (``picompile.ir.reads``) walks a loaded graph: every tensor read in full, one embedding row,
and of each FFN the rows of the neurons computed (the fraction its masks select, :func:`measured_active`, counted
by running the graph; fallback: the manifest's, :func:`manifest_active`), in total and by format. :func:`kv_bytes` is the KV cache
read and :func:`copy_bandwidth` the memory bandwidth the bound divides by. FFN nodes are read by argument
name (:mod:`picompile.ir.schema`).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, fx

from picompile.ir import schema
from picompile.ir.ops import deq
from picompile.ir.reads import FFN_OPS, FFN_WEIGHTS, attr, ffn_op, skips_inactive, weight_bytes
from picompile.tools.engines import greedy_token

# the graph walk is picompile.ir.reads' (the build records bytes per token by format with it too)
_attr = attr
__all__ = ["FFN_OPS", "FFN_WEIGHTS", "ffn_op", "skips_inactive", "weight_bytes", "measured_active", "measured_input_active", "manifest_active",
           "kv_bytes", "copy_bandwidth"]


def _fired_rows(args: Mapping[str, Any], mask: Tensor) -> int:
    """Selected rows whose deciding value is > 0, formed as the skipping kernel forms it (one token)."""
    rows = mask.reshape(-1).nonzero().squeeze(1)  # [k]
    x = args["x"].reshape(-1).float()  # one token  # [d_model]
    w_gate, w_up, b_up = args["w_gate"], args["w_up"], args["b_up"]
    w, s = (w_gate, args.get("s_gate")) if w_gate is not None else (w_up, args.get("s_up"))
    z = deq(w[rows], None if s is None else s[rows]).float() @ x  # [k] (a quantized weight: its rows dequantized)
    if w_gate is None and b_up is not None:
        z = z + b_up[rows].float()
    if w_gate is not None and args.get("b_gate") is not None:
        z = z + args["b_gate"][rows].float()
    return int((z > 0).sum())


class _MaskCounter(fx.Interpreter):
    """Runs a graph and counts, per FFN layer, the neurons its masks select (decode tokens)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.selected: dict[int, int] = {}
        self.fired: dict[int, int] = {}  # selected rows whose ReLU output is not 0 (kernels that skip the rest)
        self.rows: dict[int, int] = {}
        self.inputs_read: dict[str, int] = {}  # input-sparse linear (node name) -> active input channels counted
        self.inputs_rows: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        if schema.node_op(n) == "input_sparse_linear":  # input sparsity: the channels (w_t rows) it reads
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            mask = schema.bind("input_sparse_linear", args, kwargs)["mask"]
            if isinstance(mask, Tensor):
                self.inputs_read[n.name] = self.inputs_read.get(n.name, 0) + int(mask.sum())
                self.inputs_rows[n.name] = self.inputs_rows.get(n.name, 0) + int(mask.numel())
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        op = ffn_op(target)
        if op is not None:
            named = schema.bind(op, args, kwargs)
            if isinstance(named["mask"], Tensor):
                self._count(op, named)
        return super().call_function(target, args, kwargs)

    def _count(self, op: str, args: Mapping[str, Any]) -> None:
        layer, mask = int(args["layer"]), args["mask"]
        self.selected[layer] = self.selected.get(layer, 0) + int(mask.sum())
        self.rows[layer] = self.rows.get(layer, 0) + int(mask.numel())
        n_fired = _fired_rows(args, mask) if skips_inactive(op, args) else int(mask.sum())
        self.fired[layer] = self.fired.get(layer, 0) + n_fired


def _count_decode(session: Any, prompt: list[int], n: int) -> _MaskCounter:
    """A mask counter that has seen ``n`` greedy decode steps after ``prompt`` (the prompt's prefill not counted)."""
    logits, past = session.step(torch.tensor([prompt]), session.empty_past())
    tok = greedy_token(logits)
    counter = _MaskCounter(session.graph)
    with torch.inference_mode():
        for _ in range(n):
            out = counter.run(torch.tensor([[tok]]), *past)
            tok, past = greedy_token(out[0][0]), tuple(out[1:])
    return counter


def measured_active(session: Any, prompt: list[int], n: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per FFN layer, the fraction of neurons the masks select over ``n`` greedy decode steps after ``prompt``,
    and the fraction selected and firing (see :func:`weight_bytes`)."""
    counter = _count_decode(session, prompt, n)
    layers = [layer for layer in counter.rows if counter.rows[layer]]
    return ({layer: counter.selected[layer] / counter.rows[layer] for layer in layers},
            {layer: counter.fired[layer] / counter.rows[layer] for layer in layers})


def measured_input_active(session: Any, prompt: list[int], n: int) -> dict[str, float]:
    """Per input-sparse linear (node name), the fraction of its input channels its mask reads over ``n`` greedy
    decode steps after ``prompt`` (empty for a graph without input sparsity)."""
    if not any(schema.node_op(node) == "input_sparse_linear" for node in session.graph.graph.nodes):
        return {}
    counter = _count_decode(session, prompt, n)
    return {name: counter.inputs_read[name] / rows for name, rows in counter.inputs_rows.items() if rows}


def manifest_active(manifest: Any) -> dict[int, float] | None:
    """Per FFN layer, the manifest's active fraction (``predicted_active``, else ``true_active``); None if none."""
    out = {}
    for layer in manifest.layers:
        for key in ("predicted_active", "true_active"):
            if layer.get(key) is not None:
                out[int(layer["index"])] = float(layer[key])
                break
    return out or None


def kv_bytes(session: Any, context: float) -> float:
    """KV-cache bytes one decode step reads at ``context`` past tokens (float32)."""
    return float(session.n_past * session.kv_heads * session.head_dim * 4 * context)


def copy_bandwidth(src: Tensor, dst: Tensor, tries: int = 3) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting read + write: the best of ``tries`` back-to-back
    copies. (The first copy after the engines ran is often 3-5x slower on this machine kind: threads
    other libraries leave spinning, cores woken from idle; a decode step is continuous work, so the
    bound it is compared with is the warm figure.)"""
    best = 0.0
    for _ in range(max(1, tries)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * src.element_size() / (time.perf_counter() - t0))
    return best

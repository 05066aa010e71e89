"""What one decode step reads, for ``picompile bench``'s bytes per token and its bandwidth bound.

:func:`weight_bytes` walks a loaded graph: every tensor read in full, one embedding row, and of each FFN
the rows of the neurons computed (the fraction its masks select, :func:`measured_active`, counted by
running the graph; fallback: the manifest's, :func:`manifest_active`). :func:`kv_bytes` is the KV cache
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
from picompile.tools.engines import greedy_token

FFN_OPS: tuple[str, ...] = ("ffn", "sparse_ffn", "tvm_sparse_ffn")  # the ops that compute FFN neurons
# the weights each FFN op reads, in call order; ffn's down projection is [d_model, n_neurons]: a column per neuron
FFN_WEIGHTS: dict[str, tuple[str, ...]] = {
    "ffn": ("w_up", "b_up", "w_gate", "w_down", "b_down"),
    "sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t"),
    "tvm_sparse_ffn": ("w_up", "b_up", "w_gate", "w_down_t"),
}


def ffn_op(target: object) -> str | None:
    """The FFN op a call target stands for (one of :data:`FFN_OPS`), or None."""
    op = schema.op_name(target)
    return op if op in FFN_OPS else None


def _attr(gm: fx.GraphModule, node: Any) -> Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, Tensor) else None
    return None


def skips_inactive(op: str | None, args: Mapping[str, Any]) -> bool:
    """Whether an FFN call (its arguments by name) runs, for one token, a CPU kernel (``kernel``, its key) that
    reads only the deciding rows (gate; no gate: up, b_up) of a selected neuron whose ReLU is 0
    (``kernels.skips_inactive``)."""
    from picompile.kernels import skips_inactive as kernel_skips

    if op != "tvm_sparse_ffn" or not args.get("kernel"):
        return False
    return kernel_skips("ffn_gated" if args["w_gate"] is not None else "ffn_relu", str(args["act"]))


def _row_sparse(op: str, name: str, t: Tensor, n_rows: int) -> bool:
    """Whether an FFN weight is read a row (``ffn``'s w_down: a column) per computed neuron."""
    if op == "ffn" and name == "w_down":  # [d_model, n_neurons]
        return t.dim() == 2 and t.shape[1] == n_rows
    if op == "ffn" and name == "b_down":  # read in full
        return False
    return t.shape[0] == n_rows  # w_up, b_up, w_gate, w_down_t: a row per neuron


class _Reads:
    """Bytes read per tensor (max over its uses, keyed by start address), and which tensors are FFN weights."""

    def __init__(self) -> None:
        self.uses: dict[int, float] = {}
        self.ffn_ptrs: set[int] = set()
        self.ffn_full = 0.0

    def use(self, t: Tensor, nbytes: float, ffn: bool = False) -> None:
        key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        self.uses[key] = max(self.uses.get(key, 0.0), float(nbytes))
        if ffn:
            self.ffn_ptrs.add(key)

    def totals(self) -> dict[str, Any]:
        total = sum(self.uses.values())
        ffn = sum(v for k, v in self.uses.items() if k in self.ffn_ptrs)
        return {"total": total, "ffn": ffn, "ffn_full": self.ffn_full, "other": total - ffn}


def _ffn_reads(reads: _Reads, gm: fx.GraphModule, op: str, args: Mapping[str, Any],
               active: dict[int, float] | None, fired: dict[int, float] | None) -> None:
    """The weight bytes one token reads through one FFN node (``args``: its arguments by name)."""
    layer = int(args["layer"])
    has_mask = args["mask"] is not None
    frac = (active or {}).get(layer, 1.0) if has_mask else 1.0
    w_up = _attr(gm, args["w_up"])
    n_rows = int(w_up.shape[0]) if w_up is not None else 0
    later: tuple[str, ...] = ()  # weights read only for the selected rows that fire
    if has_mask and fired and layer in fired and skips_inactive(op, args):
        later = ("w_up", "b_up", "w_down_t") if args["w_gate"] is not None else ("w_down_t",)
    for name in FFN_WEIGHTS[op]:
        t = _attr(gm, args[name])
        if t is None:
            continue
        nbytes = t.numel() * t.element_size()
        reads.ffn_full += nbytes
        f = (fired or {}).get(layer, frac) if name in later else frac
        reads.use(t, nbytes * f if _row_sparse(op, name, t, n_rows) else nbytes, ffn=True)


def weight_bytes(gm: fx.GraphModule, active: dict[int, float] | None,
                 fired: dict[int, float] | None = None) -> dict[str, Any]:
    """Weight bytes one decode token reads through ``gm``.

    ``active``: per FFN layer, the fraction of neurons computed (``None``, or a layer missing: all of
    them, as in a graph without masks). ``fired``: per layer, the fraction of neurons selected *and*
    firing (ReLU output non-zero); where a kernel skips the rest of a selected row that does not fire
    (:func:`skips_inactive`), only its deciding rows count at ``active``, the others at ``fired``.
    Returns {"total", "ffn", "ffn_full", "other"} in bytes.
    """
    reads = _Reads()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = ffn_op(node.target)
        if op is not None:
            _ffn_reads(reads, gm, op, schema.args_of(node), active, fired)
            continue
        if node.target is torch.ops.aten.embedding.default:
            t = _attr(gm, node.args[0])
            if t is not None:
                reads.use(t, t.shape[-1] * t.element_size())  # one row per token
            continue
        for arg in list(node.args) + list(node.kwargs.values()):
            t = _attr(gm, arg)
            if t is not None:
                reads.use(t, t.numel() * t.element_size())
    return reads.totals()


def _fired_rows(args: Mapping[str, Any], mask: Tensor) -> int:
    """Selected rows whose deciding value is > 0, formed as the skipping kernel forms it (one token)."""
    rows = mask.reshape(-1).nonzero().squeeze(1)  # [k]
    x = args["x"].reshape(-1).float()  # one token  # [d_model]
    w_gate, w_up, b_up = args["w_gate"], args["w_up"], args["b_up"]
    z = (w_gate if w_gate is not None else w_up)[rows].float() @ x  # [k]
    if w_gate is None and b_up is not None:
        z = z + b_up[rows].float()
    return int((z > 0).sum())


class _MaskCounter(fx.Interpreter):
    """Runs a graph and counts, per FFN layer, the neurons its masks select (decode tokens)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.selected: dict[int, int] = {}
        self.fired: dict[int, int] = {}  # selected rows whose ReLU output is not 0 (kernels that skip the rest)
        self.rows: dict[int, int] = {}

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


def measured_active(session: Any, prompt: list[int], n: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per FFN layer, the fraction of neurons the masks select over ``n`` greedy decode steps after ``prompt``,
    and the fraction selected and firing (see :func:`weight_bytes`)."""
    logits, past = session.step(torch.tensor([prompt]), session.empty_past())
    tok = greedy_token(logits)
    counter = _MaskCounter(session.graph)
    with torch.inference_mode():
        for _ in range(n):
            out = counter.run(torch.tensor([[tok]]), *past)
            tok, past = greedy_token(out[0][0]), tuple(out[1:])
    layers = [layer for layer in counter.rows if counter.rows[layer]]
    return ({layer: counter.selected[layer] / counter.rows[layer] for layer in layers},
            {layer: counter.fired[layer] / counter.rows[layer] for layer in layers})


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

"""Analytic decode-speed model: tokens/s of a model on a target, for several ways of running it.

Decode at batch 1 is memory-bound, so the time of one token is, to first order, the bytes each device
reads divided by its bandwidth. This module counts those bytes from a model's *shape* alone (no
weights), places hot neurons with :mod:`picompile.sparsity.placement`, and predicts tokens/s for

* ``hybrid`` — PowerInfer: dense parts (attention, predictors, norms, lm_head, KV cache) on the GPU
  in :data:`picompile.sparsity.placement.FIXED_PART_PRIORITY` order, hot FFN neurons on the GPU, cold ones on
  the CPU, where only the neurons the predictor marks active are read. Per layer::

      t_l = t_dense_gpu + max(t_hot_gpu, t_cold_cpu) + t_sync

  the FFN halves overlap (GPU and CPU work at once), the attention before them cannot (the FFN needs
  its output); ``t_sync`` is two PCIe transfers (FFN input + mask to the host, partial output back)
  with their latency, paid only by layers that have cold neurons. The GPU reads *all* its hot neurons
  (they fire often; PowerInfer's issue #50: no gain once a model fits) unless ``gpu_sparse`` is set.
  ``balance`` trims each split layer's hot set to where its GPU half stops being the longer one (with
  a dense GPU half, rarely active neurons cost less on the CPU). When not even the dense parts fit,
  PowerInfer falls back to llama.cpp-style offload of the dense parts of the first layers; the other
  layers run wholly (sparse) on the CPU.
* ``layer_offload`` — llama.cpp ``-ngl``: as many whole layers (all weights + their KV cache) as fit
  in VRAM, the lm_head too if everything else fits, the rest dense on the CPU. ``layer_offload_sparse``
  is the same split with predictors and sparse FFN operators (PowerInfer's ablation "+PO").
* ``cpu`` — everything dense on the CPU (llama.cpp CPU-only); ``cpu_sparse`` — PowerInfer CPU-only
  (predictors + sparse FFN on the CPU).

Without a measured profile every layer gets the same synthetic power-law activation profile
(:func:`synthetic_frequencies`): ``f_i = min(1, c·(i+1)^-α)``, with ``c`` and ``α`` solved so the mean
activity is ``1 - sparsity`` and a fraction ``locality`` of the neurons carries 80 % of all
activations. Defaults (:func:`default_activity`): ReLU models 90 % inactive per token; locality 0.26
(OPT-30B in the PowerInfer paper) for plain FFNs, 0.43 (LLaMA-ReGLU-70B) for gated ones; non-ReLU
models 50 % (the build's ``--act-sparsity`` default) and locality 0.5 (assumed). The predictor marks
``f_i·(recall + overhead)`` of each neuron's tokens active (:class:`Assumptions`). The profiles,
predictor sizes and assumptions are :mod:`picompile.tools.plan_inputs`; the shapes
:mod:`picompile.tools.model_shapes`.

CPU rates: the dense parts stream at the target's CPU bandwidth, the sparse FFN's scattered rows at
``Assumptions.cpu_sparse_ffn_share`` of it, and each CPU layer costs ``cpu_layer_overhead_s`` besides its bytes;
``plan --cpu-bandwidth kernel`` measures the first two with picompile's own kernels on the model's shape and dtype
(:func:`measure_kernel_rates`), ``plan --glue ART`` the third on a built artifact's decode step
(``tools/kernel_calls.glue_per_layer``). Without them every kernel is taken to run at the bandwidth, with a 5 µs
barrier per layer: the bound, not the decode.

Not modelled: compute limits (beyond what those measured rates include), prefill, batch > 1,
caches, dequantisation cost of int4, the accuracy side of the predictor (recall < 1 only loses
quality here, never time), multi-GPU and the host memory capacity.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from picompile.errors import BudgetError, PicompileError
from picompile.sparsity.placement import Placement, PlacementProblem, ffn_budget, greedy_placement, solve_placement
from picompile.targets import Target
from picompile.tools.plan_inputs import Assumptions, ModelInputs

GB: float = 1e9
GiB: int = 1 << 30

#: bytes per weight. int4 is llama.cpp's q4_0: 32 weights in 16 bytes + one fp16 scale = 18 bytes.
# bytes per weight; int8 / int4: blocks of 32 quants and one float16 scale (kernels/qformat.py's default block)
DTYPE_BYTES: dict[str, float] = {"float16": 2.0, "float32": 4.0, "int8": 34.0 / 32.0, "int4": 18.0 / 32.0}

#: CPU read bandwidth measured on the development machine (2 shared cores, 2 threads, torch; medians
#: of 15 rounds over 256 MiB buffers, several runs). Used by ``--cpu-bandwidth host``; the presets keep
#: their desktop figures (rtx4090 = an i9-13900K with dual-channel DDR5). See benchmarks/README.md.
MEASURED_HOST_CPU_GBS: float = 11.0

# --------------------------------------------------------------------------------------------------
# the cost model


@dataclass
class StrategyCost:
    """Predicted per-token cost of one strategy; times in seconds, bytes per token."""

    name: str
    description: str
    sparse: bool
    total_s: float  # critical path of one decode step
    gpu_s: float  # time the GPU spends reading
    cpu_s: float  # time the CPU spends reading
    sync_s: float  # host<->GPU transfers and their latency
    overhead_s: float  # kernel launches / barriers
    gpu_bytes: float
    cpu_bytes: float
    vram_bytes: int  # resident on the GPU
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.total_s if self.total_s > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "ms_per_token": self.total_s * 1e3,
            "gpu_ms": self.gpu_s * 1e3,
            "cpu_ms": self.cpu_s * 1e3,
            "sync_ms": self.sync_s * 1e3,
            "overhead_ms": self.overhead_s * 1e3,
            "gpu_bytes_per_token": self.gpu_bytes,
            "cpu_bytes_per_token": self.cpu_bytes,
            "vram_bytes": self.vram_bytes,
            "sparse": self.sparse,
            "description": self.description,
            **self.details,
        }


class CostModel:
    """Bytes and seconds of one decode step of ``inputs`` on ``target`` with weights of ``dtype``."""

    def __init__(self, inputs: ModelInputs, target: Target, dtype: str, assumptions: Assumptions) -> None:
        if dtype not in DTYPE_BYTES:
            raise PicompileError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        self.inputs, self.shape, self.target, self.dtype, self.a = inputs, inputs.shape, target, dtype, assumptions
        s = self.shape
        e = DTYPE_BYTES[dtype]
        self.elem = e
        self.act_elem = 4.0 if dtype == "float32" else 2.0  # KV cache, predictors, norms
        self.has_gpu = target.has_gpu and target.gpu_bandwidth_gbs > 0
        self.bw_gpu = target.gpu_bandwidth_gbs * GB
        self.bw_cpu = target.cpu_bandwidth_gbs * GB
        if self.bw_cpu <= 0:
            raise PicompileError(f"target {target.name} has no CPU bandwidth; give --cpu-bandwidth")
        self.bw_cpu_ffn = self.bw_cpu * assumptions.cpu_sparse_ffn_share  # the sparse FFN's scattered rows
        self.bw_link = max(target.link_bandwidth_gbs, 1e-9) * GB
        # bytes of the parts of one layer
        self.attn_b = s.attention_params * e
        self.norm_b = s.norm_params * 4.0  # norms stay float32 (ggml does)
        self.neuron_b = [int(math.ceil(s.ffn_matrices * s.d_model * e + (e if s.bias else 0)))] * s.n_layers
        self.ffn_b = [la.freq.size * nb for la, nb in zip(inputs.layers, self.neuron_b)]
        self.pred_b = [la.predictor_params * self.act_elem for la in inputs.layers]
        self.kv_b = 2.0 * s.n_kv_heads * s.head_dim * assumptions.context * self.act_elem  # per layer
        self.head_b = s.lm_head_params * e + s.d_model * 4.0  # lm_head + final norm
        # per-layer FFN bytes actually read when sparse (predicted-active neurons only)
        self.pred_ffn_b = [float(la.predicted.sum()) * nb for la, nb in zip(inputs.layers, self.neuron_b)]

    # -- helpers ------------------------------------------------------------------------------------
    def _xfer(self, nbytes: float) -> float:
        return self.a.link_latency_s + nbytes / self.bw_link

    def weight_bytes(self) -> float:
        """Bytes of all weights as stored (the embedding, which decode only looks up, included)."""
        s = self.shape
        embed = 0.0 if s.tied else s.lm_head_params * self.elem
        return s.n_layers * (self.attn_b + self.norm_b) + sum(self.ffn_b) + self.head_b + embed

    # -- all on the CPU -----------------------------------------------------------------------------
    def cpu(self, sparse: bool) -> StrategyCost:
        s = self.shape
        ffn = sum(self.pred_b) if sparse else sum(self.ffn_b)
        nbytes = s.n_layers * (self.attn_b + self.norm_b + self.kv_b) + ffn + self.head_b
        read = nbytes / self.bw_cpu + (sum(self.pred_ffn_b) / self.bw_cpu_ffn if sparse else 0.0)
        nbytes += sum(self.pred_ffn_b) if sparse else 0.0
        over = s.n_layers * self.a.cpu_layer_overhead_s
        name = "cpu_sparse" if sparse else "cpu"
        desc = ("all on the CPU, predictors + sparse FFN (PowerInfer CPU-only)" if sparse
                else "all on the CPU, dense (llama.cpp CPU-only)")
        return StrategyCost(name, desc, sparse, read + over, 0.0, read, 0.0, over, 0.0, nbytes, 0,
                            {"gpu_layers": 0})

    # -- llama.cpp -ngl -----------------------------------------------------------------------------
    def layer_offload(self, sparse: bool) -> StrategyCost:
        s, a = self.shape, self.a
        name = "layer_offload_sparse" if sparse else "layer_offload"
        desc = (f"llama.cpp -ngl whole layers on the GPU, predictors + sparse FFN on "
                f"{'both sides' if a.gpu_sparse else 'the CPU'} (PowerInfer ablation +PO)" if sparse
                else "llama.cpp -ngl: whole layers on the GPU as fit, the rest dense on the CPU")
        if not self.has_gpu:
            c = self.cpu(sparse)
            return dataclasses.replace(c, name=name, description=desc + " (no GPU: all on the CPU)")
        vram = int(self.target.vram_bytes)
        per_layer_res = [self.attn_b + self.norm_b + fb + (pb if sparse else 0.0) + self.kv_b
                         for fb, pb in zip(self.ffn_b, self.pred_b)]
        k, used = 0, 0.0
        for r in per_layer_res:
            if used + r > vram:
                break
            used += r
            k += 1
        head_on_gpu = k == s.n_layers and used + self.head_b <= vram
        used += self.head_b if head_on_gpu else 0.0

        def layer_read(i: int, gpu: bool) -> float:
            sparse_here = sparse and (not gpu or a.gpu_sparse)
            ffn = self.pred_ffn_b[i] + self.pred_b[i] if sparse_here else self.ffn_b[i]
            return self.attn_b + self.norm_b + self.kv_b + ffn

        gpu_bytes = sum(layer_read(i, True) for i in range(k)) + (self.head_b if head_on_gpu else 0.0)
        cpu_bytes = sum(layer_read(i, False) for i in range(k, s.n_layers)) + (0.0 if head_on_gpu else self.head_b)
        cpu_ffn = sum(self.pred_ffn_b[i] for i in range(k, s.n_layers)) if sparse else 0.0  # its scattered rows
        gpu_s = gpu_bytes / self.bw_gpu
        cpu_s = (cpu_bytes - cpu_ffn) / self.bw_cpu + cpu_ffn / self.bw_cpu_ffn
        over = k * a.gpu_layer_overhead_s + (s.n_layers - k) * a.cpu_layer_overhead_s
        # the embedding row goes to the GPU; the hidden state comes back where the GPU part ends
        crossings = (1 + (1 if k < s.n_layers or not head_on_gpu else 0)) if k > 0 else 0
        sync = crossings * self._xfer(s.d_model * 4.0)
        total = gpu_s + cpu_s + sync + over
        return StrategyCost(name, desc, sparse, total, gpu_s, cpu_s, sync, over, gpu_bytes, cpu_bytes, int(used),
                            {"gpu_layers": k, "n_layers": s.n_layers, "lm_head_on_gpu": head_on_gpu})

    # -- PowerInfer hybrid --------------------------------------------------------------------------
    def fixed_parts(self, layers: Sequence[int] | None = None) -> list[tuple[str, int]]:
        """(name, bytes) of the non-FFN parts, in the names ffn_budget orders by priority."""
        idx = range(self.shape.n_layers) if layers is None else layers
        n = len(idx)
        return [
            ("attention", int(math.ceil(n * self.attn_b))),
            ("predictors", int(math.ceil(sum(self.pred_b[i] for i in idx)))),
            ("norms", int(math.ceil(n * self.norm_b + self.shape.d_model * 4.0))),
            ("lm_head", int(math.ceil(self.shape.lm_head_params * self.elem))),
            ("kv_cache", int(math.ceil(n * self.kv_b))),
        ]

    def _place(self, layers: Sequence[int], budget: int) -> Placement:
        a = self.a
        problem = PlacementProblem(
            freqs=[self.inputs.layers[i].freq for i in layers],
            neuron_bytes=[self.neuron_b[i] for i in layers],
            budget_bytes=budget, batch_size=a.placement_batch, min_neurons=a.min_layer_neurons,
        )
        uniform = len(set(problem.neuron_bytes.tolist())) == 1 and all(
            f.size % a.placement_batch == 0 for f in problem.freqs)
        if a.placement == "greedy" or (a.placement == "auto" and uniform and a.min_layer_neurons == 0
                                       and problem.total_bytes > budget):
            p = greedy_placement(problem)
            if a.placement == "auto":
                p.status = "greedy (exact: equal batch sizes and no per-layer minimum)"
            return p
        return solve_placement(problem)

    def _balance(self, i: int, hot: np.ndarray, order: np.ndarray) -> np.ndarray:
        """Trim layer ``i``'s hot set to where its GPU half stops being the longer one.

        With a dense GPU part every hot neuron costs its bytes on every token, while on the CPU it costs
        only when predicted active; the two halves overlap, so past the point where the GPU half is the
        longer, each further neuron on the GPU slows the layer down. ``order`` is the hot neurons by
        frequency, descending (what the placement returns); the kept set is a prefix of it.
        """
        nb = self.neuron_b[i]
        q = self.inputs.layers[i].predicted
        k = np.arange(order.size + 1, dtype=np.float64)  # candidate hot counts
        cold_rest = float(q[~hot].sum())
        q_hot = np.concatenate([[0.0], np.cumsum(q[order])])  # [n_hot + 1]
        t = np.maximum(k * nb / self.bw_gpu, (cold_rest + q_hot[-1] - q_hot) * nb / self.bw_cpu_ffn)
        best = int(np.flatnonzero(t <= t.min() * (1 + 1e-12))[-1])  # ties: keep more on the GPU
        if best == order.size:
            return hot
        out = np.zeros_like(hot)
        out[order[:best]] = True
        return out

    def hybrid(self) -> tuple[StrategyCost, dict[str, Any]]:
        """PowerInfer's split (see the module doc): the cost, and the placement as ``plan`` reports it."""
        desc = "PowerInfer hybrid: dense parts + hot neurons on the GPU, predicted-active cold neurons on the CPU"
        if not self.has_gpu:
            c = self.cpu(True)
            return (dataclasses.replace(c, name="hybrid", description=desc + " (no GPU: all on the CPU, sparse)"),
                    {"gpu": False, "note": "no GPU: every neuron is cold"})
        split = self._hybrid_split()
        placement, hot_mask, n_placed = self._hot_neurons(split)
        tally = _Tally()
        for i in range(self.shape.n_layers):
            if i in hot_mask:
                self._split_layer(tally, i, hot_mask[i], "kv_cache" in split.placed)
            else:
                self._cpu_layer(tally, i, split.gpu_layers)
        self._head(tally, "lm_head" in split.placed)
        vram_used = int(sum(b for n, b in split.parts if n in split.placed)
                        + sum(int(m.sum()) * self.neuron_b[i] for i, m in hot_mask.items()))
        cost = StrategyCost("hybrid", desc, True, tally.total, tally.gpu_s, tally.cpu_s, tally.sync_s, tally.over_s,
                            tally.gpu_b, tally.cpu_b, vram_used, self._hybrid_details(split, hot_mask))
        return cost, self._hybrid_info(split, placement, hot_mask, n_placed)

    def _hybrid_split(self) -> "_Split":
        """Which layers' dense parts go on the GPU, and the FFN budget left there for hot neurons."""
        s, vram = self.shape, int(self.target.vram_bytes)
        parts = self.fixed_parts()
        try:
            budget, placed = ffn_budget(vram, parts)
            return _Split(list(range(s.n_layers)), parts, budget, placed, None)
        except BudgetError:
            pass
        # PowerInfer then offloads the dense parts layer by layer (llama.cpp -ngl); the FFNs of those
        # layers are split hot/cold with what is left, every other layer runs wholly on the CPU.
        def mandatory(k: int) -> int:
            return sum(b for n, b in self.fixed_parts(range(k)) if n not in ("lm_head", "kv_cache"))

        k = 0
        while k < s.n_layers and mandatory(k + 1) <= vram:
            k += 1
        gpu_layers = list(range(k))
        parts = [(n, b) for n, b in self.fixed_parts(gpu_layers) if n != "lm_head"]
        budget, placed = ffn_budget(vram, parts)
        dense = sum(b for n, b in self.fixed_parts() if n != "kv_cache")
        fallback = (f"the dense parts ({dense / GiB:.1f} GiB) exceed the GPU budget: dense parts of {k} of "
                    f"{s.n_layers} layers on the GPU, the other layers wholly on the CPU")
        return _Split(gpu_layers, parts, budget, placed, fallback)

    def _hot_neurons(self, split: "_Split") -> tuple[Placement | None, dict[int, np.ndarray], int]:
        """(the placement, per GPU layer its hot-neuron mask ``[d_ffn]`` (balanced with ``balance``), the number
        of neurons the placement put on the GPU)."""
        gpu_layers = split.gpu_layers
        placement = self._place(gpu_layers, split.budget) if gpu_layers else None
        hot_mask: dict[int, np.ndarray] = {}
        if placement is not None:
            for j, i in enumerate(gpu_layers):
                m = np.zeros(self.inputs.layers[i].freq.size, dtype=bool)
                m[placement.hot[j]] = True
                hot_mask[i] = m
        n_placed = int(sum(m.sum() for m in hot_mask.values()))
        if self.a.balance and not self.a.gpu_sparse:
            for i, m in hot_mask.items():
                if not m.all():
                    hot_mask[i] = self._balance(i, m, placement.hot[gpu_layers.index(i)])
        return placement, hot_mask, n_placed

    def _cpu_layer(self, tally: "_Tally", i: int, gpu_layers: list[int]) -> None:
        """Layer ``i`` wholly on the CPU, sparse (the hidden state leaves the GPU at the first of them)."""
        a = self.a
        b = self.attn_b + self.norm_b + self.kv_b + self.pred_b[i] + self.pred_ffn_b[i]
        t = (b - self.pred_ffn_b[i]) / self.bw_cpu + self.pred_ffn_b[i] / self.bw_cpu_ffn
        if i == len(gpu_layers) and gpu_layers:  # the hidden state leaves the GPU here
            x = self._xfer(self.shape.d_model * 4.0)
            tally.sync_s += x
            tally.total += x
        tally.cpu_b += b
        tally.cpu_s += t
        tally.total += t + a.cpu_layer_overhead_s
        tally.over_s += a.cpu_layer_overhead_s

    def _split_layer(self, tally: "_Tally", i: int, hot: np.ndarray, kv_gpu: bool) -> None:
        """Layer ``i`` with its dense parts and ``hot`` neurons on the GPU, the other neurons on the CPU: the FFN
        halves overlap, the dense part before them does not."""
        s, a = self.shape, self.a
        q, nb = self.inputs.layers[i].predicted, self.neuron_b[i]
        n_cold = int((~hot).sum())
        dense_b = self.attn_b + self.norm_b + (self.pred_b[i] if n_cold else 0.0)
        kv_t = self.kv_b / (self.bw_gpu if kv_gpu else self.bw_cpu)
        hot_b = float((q[hot].sum() if a.gpu_sparse else hot.sum())) * nb
        cold_b = float(q[~hot].sum()) * nb
        t_dense = dense_b / self.bw_gpu + kv_t
        t_hot, t_cold = hot_b / self.bw_gpu, cold_b / self.bw_cpu_ffn
        sync = 0.0
        if n_cold:
            sync = self._xfer(s.d_model * 4.0 + s.d_ffn / 8.0) + self._xfer(s.d_model * 4.0)
        if not kv_gpu:
            sync += 2 * self._xfer(s.n_heads * s.head_dim * 4.0)
        over = a.gpu_layer_overhead_s + (a.cpu_layer_overhead_s if n_cold else 0.0)
        tally.total += t_dense + max(t_hot, t_cold + (a.cpu_layer_overhead_s if n_cold else 0.0)) + sync + a.gpu_layer_overhead_s
        tally.gpu_s += (dense_b / self.bw_gpu + (kv_t if kv_gpu else 0.0)) + t_hot
        tally.cpu_s += t_cold + (0.0 if kv_gpu else kv_t)
        tally.gpu_b += dense_b + hot_b + (self.kv_b if kv_gpu else 0.0)
        tally.cpu_b += cold_b + (0.0 if kv_gpu else self.kv_b)
        tally.sync_s += sync
        tally.over_s += over

    def _head(self, tally: "_Tally", head_gpu: bool) -> None:
        """The lm_head (+ final norm) where it was placed, and the embedding row sent to the GPU."""
        head_t = self.head_b / (self.bw_gpu if head_gpu else self.bw_cpu)
        tally.total += head_t + self._xfer(self.shape.d_model * 4.0)  # + the embedding row to the GPU
        tally.sync_s += self._xfer(self.shape.d_model * 4.0)
        if head_gpu:
            tally.gpu_s, tally.gpu_b = tally.gpu_s + head_t, tally.gpu_b + self.head_b
        else:
            tally.cpu_s, tally.cpu_b = tally.cpu_s + head_t, tally.cpu_b + self.head_b

    def _hybrid_details(self, split: "_Split", hot_mask: dict[int, np.ndarray]) -> dict[str, Any]:
        """The hybrid strategy's own columns: GPU layers, hot share, activation coverage, what sits on the GPU."""
        n_hot = int(sum(m.sum() for m in hot_mask.values()))
        n_all = int(sum(la.freq.size for la in self.inputs.layers))
        # activation share served by the GPU, over all layers
        served = sum(float(self.inputs.layers[i].freq[hot_mask[i]].sum()) for i in hot_mask)
        all_f = sum(float(la.freq.sum()) for la in self.inputs.layers)
        return {
            "gpu_layers": len(split.gpu_layers),
            "n_layers": self.shape.n_layers,
            "hot_neuron_fraction": n_hot / n_all,
            "activation_coverage": served / all_f if all_f else 0.0,
            "kv_cache_on_gpu": "kv_cache" in split.placed,
            "lm_head_on_gpu": "lm_head" in split.placed,
        }

    def _hybrid_info(self, split: "_Split", placement: Placement | None, hot_mask: dict[int, np.ndarray],
                     n_placed: int) -> dict[str, Any]:
        """The placement as ``plan`` reports it: budget, fixed parts, hot neurons per layer, the solver's figures."""
        info: dict[str, Any] = {
            "gpu": True,
            "ffn_budget_bytes": int(split.budget),
            "fixed_parts": dict(split.parts),
            "fixed_parts_on_gpu": split.placed,
            "n_hot": [int(hot_mask[i].sum()) if i in hot_mask else 0 for i in range(self.shape.n_layers)],
            "n_hot_placed": n_placed,
            "n_hot_used": int(sum(m.sum() for m in hot_mask.values())),
            "n_neurons": [int(la.freq.size) for la in self.inputs.layers],
        }
        if placement is not None:
            pj = placement.to_json()
            info.update({k: pj[k] for k in ("method", "status", "coverage", "gpu_bytes", "solve_time_s")})
        if split.fallback:
            info["fallback"] = split.fallback
        return info


@dataclass
class _Split:
    """How the hybrid strategy splits the GPU: layers whose dense parts are there, the FFN budget left."""

    gpu_layers: list[int]
    parts: list[tuple[str, int]]  # (name, bytes) of the fixed parts considered
    budget: int  # bytes left for hot neurons
    placed: list[str]  # the fixed parts that fit on the GPU
    fallback: str | None  # why only some layers' dense parts are on the GPU


@dataclass
class _Tally:
    """Running sums of one decode step: seconds on the critical path and per side, bytes per side."""

    total: float = 0.0
    gpu_s: float = 0.0
    cpu_s: float = 0.0
    sync_s: float = 0.0
    over_s: float = 0.0
    gpu_b: float = 0.0
    cpu_b: float = 0.0


def measure_cpu_bandwidth(threads: int = 2, mib: int = 1024, repeats: int = 9) -> dict[str, float]:
    """Median host memory bandwidth in GB/s: a read-only reduction and a copy (read + write bytes).

    Uses torch with ``threads`` intra-op threads (numpy, single-threaded, when torch is missing).
    A decode step reads weights, so :data:`MEASURED_HOST_CPU_GBS` is taken from ``read``.
    """
    import statistics
    import time

    n = (mib << 20) // 4
    try:
        import torch

        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            src = torch.rand(n)
            dst = torch.empty_like(src)
            copy_fn, read_fn = (lambda: dst.copy_(src)), (lambda: src.sum())
            reads, copies = _bench(copy_fn, read_fn, n * 4, repeats, time.perf_counter)
        finally:
            torch.set_num_threads(old)
    except ImportError:  # pragma: no cover - torch is a dependency
        src = np.random.rand(n).astype(np.float32)
        dst = np.empty_like(src)
        reads, copies = _bench(lambda: np.copyto(dst, src), lambda: src.sum(), n * 4, repeats, time.perf_counter)
    return {"read_gbs": statistics.median(reads), "copy_gbs": statistics.median(copies), "threads": float(threads)}


def _weights(spec: Any, name: str, gen: Any) -> dict[str, Any]:
    """Random stored weights for one kernel argument ``name`` of ``spec`` (float, or quants + float16 scales)."""
    import torch

    from picompile.kernels import as_aligned
    from picompile.kernels.qformat import QFormat, quantize

    w = torch.randn(spec.n_rows, spec.d_model, generator=gen) * 0.05  # [n_rows, d_model]
    scales = {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"}[name]
    if spec.quantized:
        q, sc = quantize(w, QFormat(spec.weight_dtype, spec.block))
        return {name: as_aligned(q), scales: as_aligned(sc)}
    return {name: as_aligned(w.to(getattr(torch, spec.weight_dtype)))}


def measure_kernel_rates(shape: Any, dtype: str, active_fraction: float, threads: int = 2, mib: int = 1024,
                         repeats: int = 7) -> dict[str, float]:
    """What picompile's own one-token CPU kernels stream on this machine for ``shape`` in ``dtype`` (medians of
    ``repeats`` rounds, each reading from DRAM: weights rotated over copies totalling ``mib`` MiB, ``threads``
    threads), beside the read bandwidth (a sum) in the same rounds:

    * ``gemv_gbs``: the GEMV (kind ``up``) over a [d_model, d_model] weight, as q/k/v/o and lm_head run;
    * ``ffn_gbs``: the fused sparse FFN (``ffn_gated`` / ``ffn_relu``, the shape's activation) over
      [d_ffn, d_model] rows with ``active_fraction`` of them selected at random, counted as the cost model counts
      them (every matrix's row of each selected neuron; with ReLU the kernel reads only the gate row of a neuron
      that does not fire, so this rate can exceed the read bandwidth's share).

    A decode step's kernels run at these rates between the glue, so a plan at them predicts what picompile decodes
    here; at the read bandwidth it gives the bound."""
    import statistics
    import time

    import torch

    from picompile.config import kernel_cache_dir
    from picompile.kernels import (KernelSpec, aligned_empty, build_kernel, call_args, load_kernel, num_threads,
                                   set_num_threads)

    gen = torch.Generator().manual_seed(0)
    block = {"block": 32} if dtype in ("int8", "int4") else {}
    d, n = shape.d_model, shape.d_ffn
    act = shape.act if shape.act in ("relu", "silu") else "relu"
    kind = "ffn_gated" if shape.gated else "ffn_relu"
    gspec = KernelSpec("up", "none", d, d, dtype, False, "llvm", **block)  # type: ignore[arg-type]
    fspec = KernelSpec(kind, act, d, n, dtype, False, "llvm", **block)  # type: ignore[arg-type]
    gemv = load_kernel(build_kernel(gspec, kernel_cache_dir()), gspec)
    ffn = load_kernel(build_kernel(fspec, kernel_cache_dir()), fspec)
    old_tvm, old_torch = num_threads(), torch.get_num_threads()
    set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        x = aligned_empty((d,))
        x.copy_(torch.randn(d, generator=gen))
        y_g, y_f = aligned_empty((d,)), aligned_empty((d,))
        rows = aligned_empty((d,), torch.int32)
        rows.copy_(torch.arange(d, dtype=torch.int32))
        k = max(1, round(active_fraction * n))
        sel = aligned_empty((k,), torch.int32)
        sel.copy_(torch.sort(torch.randperm(n, generator=gen)[:k]).values.to(torch.int32))

        def args_of(kern: Any, weights: dict[str, Any], idx: Any, y: Any) -> list[Any]:
            named = {"x": x, "b_up": None, "w_gate": None, "s_gate": None, "idx": idx, "y": y, "h": y, **weights}
            return [named.get(a) for a in call_args(kern.spec)]

        g_sets, f_sets = [], []
        for _ in range(max(2, (mib << 20) // max(1, d * d * 2))):
            w = _weights(gspec, "w_up", gen)
            g_sets.append(args_of(gemv, w, rows, y_g))
        g_bytes = sum(t.numel() * t.element_size() for t in g_sets[0] if t is not None and t.dim() == 2)
        mats = ("w_up", "w_gate", "w_down_t") if shape.gated else ("w_up", "w_down_t")
        for _ in range(max(2, (mib << 20) // max(1, len(mats) * n * d * 2))):
            ws: dict[str, Any] = {}
            for m in mats:
                ws.update(_weights(fspec, m, gen))
            f_sets.append(args_of(ffn, ws, sel, y_f))
        per_row = sum(t.numel() * t.element_size() for t in f_sets[0]
                      if t is not None and t.dim() == 2) / n  # bytes of one neuron's rows, every matrix
        f_bytes = per_row * k
        for a in g_sets[:1]:
            gemv(*a)
        for a in f_sets[:1]:
            ffn(*a)
        buf = torch.ones(mib << 18)  # float32: mib MiB
        buf.sum()
        g_rates, f_rates, reads = [], [], []
        for _ in range(repeats):
            t = time.perf_counter()
            for a in g_sets:
                gemv.unchecked(*a)
            g_rates.append(g_bytes * len(g_sets) / (time.perf_counter() - t) / GB)
            t = time.perf_counter()
            for a in f_sets:
                ffn.unchecked(*a)
            f_rates.append(f_bytes * len(f_sets) / (time.perf_counter() - t) / GB)
            t = time.perf_counter()
            buf.sum()
            reads.append(buf.numel() * 4 / (time.perf_counter() - t) / GB)
    finally:
        set_num_threads(old_tvm)
        torch.set_num_threads(old_torch)
    return {"gemv_gbs": statistics.median(g_rates), "ffn_gbs": statistics.median(f_rates),
            "read_gbs": statistics.median(reads), "threads": float(threads), "active_fraction": k / n}


def _bench(copy_fn: Any, read_fn: Any, nbytes: int, repeats: int, clock: Any) -> tuple[list[float], list[float]]:
    reads, copies = [], []
    copy_fn(), read_fn()  # warm up (page faults)
    for _ in range(repeats):
        t = clock()
        copy_fn()
        copies.append(2 * nbytes / (clock() - t) / GB)
        t = clock()
        read_fn()
        reads.append(nbytes / (clock() - t) / GB)
    return reads, copies

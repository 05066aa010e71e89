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
``f_i·(recall + overhead)`` of each neuron's tokens active (:class:`Assumptions`).

Not modelled: compute limits (all kernels are taken to run at the preset bandwidth), prefill, batch > 1,
caches, dequantisation cost of int4, the accuracy side of the predictor (recall < 1 only loses
quality here, never time), multi-GPU and the host memory capacity.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from picompile.errors import BudgetError, PicompileError
from picompile.sparsity.placement import Placement, PlacementProblem, ffn_budget, greedy_placement, solve_placement
from picompile.targets import Target

GB: float = 1e9
GiB: int = 1 << 30

#: bytes per weight. int4 is llama.cpp's q4_0: 32 weights in 16 bytes + one fp16 scale = 18 bytes.
DTYPE_BYTES: dict[str, float] = {"float16": 2.0, "float32": 4.0, "int4": 18.0 / 32.0}

#: CPU read bandwidth measured on the development machine (2 shared cores, 2 threads, torch; medians
#: of 15 rounds over 256 MiB buffers, several runs). Used by ``--cpu-bandwidth host``; the presets keep
#: their desktop figures (rtx4090 = an i9-13900K with dual-channel DDR5). See benchmarks/README.md.
MEASURED_HOST_CPU_GBS: float = 11.0


# --------------------------------------------------------------------------------------------------
# model shapes


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only LM: its shapes, no weights."""

    name: str
    family: str  # "opt" | "llama" | "falcon"
    n_layers: int
    d_model: int
    d_ffn: int  # FFN neurons per layer
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    gated: bool  # gate/up/down (LLaMA) vs up/down (OPT, Falcon)
    act: str = "relu"
    head_dim: int = 0  # 0 = d_model // n_heads
    bias: bool = False  # linear layers carry biases (OPT)
    max_seq_len: int = 2048
    tied: bool = False  # the lm_head is the embedding matrix (stored once)
    description: str = ""

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "d_ffn", "n_heads", "n_kv_heads", "vocab_size"):
            if int(getattr(self, f)) <= 0:
                raise PicompileError(f"model {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.head_dim <= 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    @property
    def attention_params(self) -> int:
        """Weights of one attention block: q, k, v, o (+ biases)."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        w = self.d_model * (q + 2 * kv) + q * self.d_model
        return w + ((q + 2 * kv + self.d_model) if self.bias else 0)

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def ffn_params(self) -> int:
        """Weights of one FFN layer (+ biases)."""
        w = self.ffn_matrices * self.d_model * self.d_ffn
        return w + ((self.d_ffn + self.d_model) if self.bias else 0)

    @property
    def norm_params(self) -> int:
        """Norm weights of one layer (two norms; LayerNorm has a bias too)."""
        return 2 * self.d_model * (2 if self.family in ("opt", "falcon") else 1)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def n_params(self) -> int:
        """All parameters (a tied embedding / lm_head counted once)."""
        per_layer = self.attention_params + self.ffn_params + self.norm_params
        return self.n_layers * per_layer + (1 if self.tied else 2) * self.lm_head_params + self.d_model

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "n_params": self.n_params}


#: Built-in shapes (the real checkpoints' configs; PowerInfer runs the ReLU variants of the
#: LLaMA and Falcon models: ReLU-Falcon-40B, LLaMA-ReGLU-70B, ReLU-LLaMA-7B).
BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape("opt-30b", "opt", 48, 7168, 28672, 56, 56, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-30b"),
        ModelShape("opt-66b", "opt", 64, 9216, 36864, 72, 72, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-66b"),
        ModelShape("falcon-40b", "falcon", 60, 8192, 32768, 128, 8, 65024, False, "relu", tied=True,
                   description="ReLU-Falcon-40B (tiiuae/falcon-40b shape, GQA 8 KV heads)"),
        ModelShape("llama2-70b", "llama", 80, 8192, 28672, 64, 8, 32000, True, "relu", max_seq_len=4096,
                   description="LLaMA-ReGLU-70B (meta-llama/Llama-2-70b shape, GQA 8 KV heads)"),
        ModelShape("llama2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, True, "relu", max_seq_len=4096,
                   description="ReLU-LLaMA-7B (meta-llama/Llama-2-7b shape)"),
        ModelShape("opt-1.3b", "opt", 24, 2048, 8192, 32, 32, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-1.3b (local benchmark shape)"),
        ModelShape("llama-1.1b", "llama", 22, 2048, 5632, 32, 4, 32000, True, "relu",
                   description="TinyLlama-1.1B shape with ReLU (local benchmark shape)"),
    ]
}


def builtin_model(name: str) -> ModelShape:
    try:
        return BUILTIN_MODELS[name.lower()]
    except KeyError:
        raise PicompileError(
            f"unknown model {name!r}: not a file or directory, nor a built-in name; built-in models: "
            f"{', '.join(BUILTIN_MODELS)}"
        ) from None


def shape_from_hf_config(config: dict[str, Any], name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict (OPT, LLaMA/Mistral, Falcon)."""
    mt = str(config.get("model_type", "")).lower()
    archs = [str(a) for a in config.get("architectures") or []]
    if not mt and archs:
        mt = {"OPTForCausalLM": "opt", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "FalconForCausalLM": "falcon"}.get(archs[0], "")
    name = name or str(config.get("_name_or_path") or mt)

    def need(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if config.get(k) is not None:
                return config[k]
        if default is not None:
            return default
        raise PicompileError(f"config of {name!r} lacks {' / '.join(keys)}")

    try:
        if mt == "opt":
            d = int(need("hidden_size"))
            heads = int(need("num_attention_heads"))
            return ModelShape(name, "opt", int(need("num_hidden_layers")), d, int(need("ffn_dim")), heads, heads,
                              int(need("vocab_size")), False, str(config.get("activation_function", "relu")),
                              bias=bool(config.get("enable_bias", True)), tied=bool(config.get("tie_word_embeddings", True)),
                              max_seq_len=int(need("max_position_embeddings", default=2048)))
        if mt in ("llama", "mistral", "qwen2"):
            d = int(need("hidden_size"))
            heads = int(need("num_attention_heads"))
            return ModelShape(name, "llama", int(need("num_hidden_layers")), d, int(need("intermediate_size")), heads,
                              int(need("num_key_value_heads", default=heads)), int(need("vocab_size")), True,
                              str(config.get("hidden_act", "silu")), head_dim=int(config.get("head_dim") or 0),
                              bias=bool(config.get("attention_bias", False)),
                              tied=bool(config.get("tie_word_embeddings", False)),
                              max_seq_len=int(need("max_position_embeddings", default=2048)))
        if mt == "falcon" or mt == "refinedweb":
            d = int(need("hidden_size"))
            heads = int(need("num_attention_heads", "n_head"))
            if config.get("new_decoder_architecture"):
                kv = int(need("num_kv_heads", "n_head_kv", default=heads))
            else:
                kv = 1 if config.get("multi_query", True) else heads
            return ModelShape(name, "falcon", int(need("num_hidden_layers", "n_layer")), d,
                              int(need("ffn_hidden_size", default=4 * d)), heads, kv, int(need("vocab_size")), False,
                              str(config.get("activation", "gelu")), bias=bool(config.get("bias", False)),
                              tied=bool(config.get("tie_word_embeddings", True)),
                              max_seq_len=int(need("max_position_embeddings", default=2048)))
    except (TypeError, ValueError) as e:
        raise PicompileError(f"config of {name!r} has a malformed field: {e}") from None
    raise PicompileError(f"cannot plan model type {mt or '?'!r} of {name!r}; supported: opt, llama, mistral, falcon")


# --------------------------------------------------------------------------------------------------
# activation profile


@dataclass(frozen=True)
class Activity:
    """Per-token activity of FFN neurons: what the synthetic profile is solved for."""

    sparsity: float  # mean fraction of neurons inactive per token
    locality: float  # fraction of neurons that carries 80 % of all activations
    source: str = "default"


def default_activity(shape: ModelShape) -> Activity:
    """Documented defaults: see the module docstring."""
    if shape.act == "relu":
        return Activity(0.90, 0.43 if shape.gated else 0.26, "default for ReLU models")
    return Activity(0.50, 0.50, "default for non-ReLU models (thresholded, CATS-style)")


def _power_law(n: int, alpha: float, mean: float) -> np.ndarray:
    """``min(1, c·(i+1)^-alpha)`` with ``c`` set (bisection) so the mean is ``mean``."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha  # [n], descending
    lo, hi = 0.0, 1.0 / float(w[-1])  # c = hi puts every neuron at 1
    for _ in range(60):
        c = 0.5 * (lo + hi)
        if float(np.minimum(1.0, c * w).mean()) < mean:
            lo = c
        else:
            hi = c
    return np.minimum(1.0, 0.5 * (lo + hi) * w)


def _locality_sorted(f: np.ndarray, share: float = 0.8) -> float:
    cum = np.cumsum(f)
    k = int(np.searchsorted(cum, share * cum[-1] * (1 - 1e-12), side="left")) + 1
    return min(k, f.size) / f.size


@functools.lru_cache(maxsize=64)
def _synthetic(n: int, sparsity: float, locality: float) -> np.ndarray:
    mean = 1.0 - sparsity
    lo, hi = 0.0, 8.0  # alpha: locality falls as alpha rises
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if _locality_sorted(_power_law(n, mid, mean)) > locality:
            lo = mid
        else:
            hi = mid
    f = _power_law(n, 0.5 * (lo + hi), mean)
    f.setflags(write=False)
    return f


def synthetic_frequencies(n: int, sparsity: float, locality: float) -> np.ndarray:
    """Activation frequency per neuron, ``[n]`` descending in [0, 1], for a power-law profile.

    ``f_i = min(1, c·(i+1)^-α)``: mean ``1 - sparsity``, and the top ``locality·n`` neurons carry 80 %
    of all activations. Feasible for ``0.8·(1 - sparsity) <= locality <= 0.8`` (all activity on the
    fewest neurons … uniform).
    """
    if not 0.0 <= sparsity < 1.0:
        raise PicompileError(f"sparsity must be in [0, 1), got {sparsity}")
    lo = 0.8 * (1.0 - sparsity)
    if not lo <= locality <= 0.8:
        raise PicompileError(
            f"locality {locality} is impossible at sparsity {sparsity}: 80 % of the activations need between "
            f"{lo:.3f} (the {1 - sparsity:.0%} always-active neurons) and 0.8 (uniform) of the neurons"
        )
    return _synthetic(int(n), round(float(sparsity), 9), round(float(locality), 9))


# --------------------------------------------------------------------------------------------------
# assumptions and inputs


@dataclass(frozen=True)
class Assumptions:
    """Constants of the model that no preset gives (all documented in benchmarks/README.md)."""

    predictor_recall: float = 0.99  # fraction of truly active neurons the predictor marks
    predictor_overhead: float = 0.20  # false positives, as a fraction of the truly active neurons
    predictor_fraction: float = 0.05  # predictor parameters / FFN parameters, per layer
    context: int = 512  # tokens in the KV cache (allocated, and read by each decode step)
    gpu_layer_overhead_s: float = 20e-6  # kernel launches per layer on the GPU
    cpu_layer_overhead_s: float = 5e-6  # thread barrier per layer on the CPU
    link_latency_s: float = 10e-6  # one host<->GPU transfer + event wait
    gpu_sparse: bool = False  # the GPU reads only predicted-active hot neurons (PowerInfer's GPU operator)
    balance: bool = False  # trim each split layer's hot set to where its GPU half stops being the longer
    placement_batch: int = 64  # neurons per placement decision (the paper's 64)
    min_layer_neurons: int = 0  # PowerInfer's per-layer minimum (0 = off)
    placement: str = "auto"  # "auto" (greedy where it is exact, else ILP) | "ilp" | "greedy"

    def __post_init__(self) -> None:
        if not 0.0 < self.predictor_recall <= 1.0:
            raise PicompileError(f"predictor recall must be in (0, 1], got {self.predictor_recall}")
        if self.predictor_overhead < 0 or self.predictor_fraction < 0:
            raise PicompileError("predictor overhead and fraction must be >= 0")
        if self.context < 1:
            raise PicompileError(f"context must be >= 1 token, got {self.context}")
        if self.placement not in ("auto", "ilp", "greedy"):
            raise PicompileError(f"placement must be auto, ilp or greedy, got {self.placement!r}")


@dataclass
class LayerActivity:
    """Per-layer activity inputs: frequency of each neuron, predictor inflation and size."""

    freq: np.ndarray  # [d_ffn] true activation frequency per neuron
    inflation: float  # predicted-active / truly active
    predictor_params: int

    @property
    def predicted(self) -> np.ndarray:
        """Probability that each neuron is computed (predicted active), ``[d_ffn]``."""
        return np.minimum(1.0, self.freq * self.inflation)


@dataclass
class ModelInputs:
    """Everything :func:`plan` needs about one model."""

    shape: ModelShape
    source: str  # "builtin" | "hf-config" | "artifact"
    layers: list[LayerActivity]
    activity: Activity  # what the profile was made from, or measured figures
    default_dtype: str = "float16"
    notes: list[str] = field(default_factory=list)


def _predictor_rank(shape: ModelShape, fraction: float) -> int:
    """Rank of a ``fc1 [d→r], fc2 [r→n_ff]`` predictor with ``fraction`` of the FFN's parameters."""
    return max(0, int(round(fraction * shape.ffn_matrices * shape.d_model * shape.d_ffn / (shape.d_model + shape.d_ffn))))


def synthetic_inputs(shape: ModelShape, source: str, assumptions: Assumptions,
                     sparsity: float | None = None, locality: float | None = None) -> ModelInputs:
    base = default_activity(shape)
    sp = base.sparsity if sparsity is None else float(sparsity)
    loc = base.locality if locality is None else float(locality)
    notes = []
    if locality is None and loc < 0.8 * (1.0 - sp) * 1.05:  # the default cannot hold at this sparsity
        loc = min(0.8, 0.8 * (1.0 - sp) * 1.05)
        notes.append(f"locality raised to {loc:.3f}: the default is impossible at sparsity {sp}")
    act = Activity(sp, loc, base.source if sparsity is None and locality is None else "given on the command line")
    f = synthetic_frequencies(shape.d_ffn, act.sparsity, act.locality)
    rank = _predictor_rank(shape, assumptions.predictor_fraction)
    infl = assumptions.predictor_recall + assumptions.predictor_overhead
    layers = [LayerActivity(f, infl, rank * (shape.d_model + shape.d_ffn)) for _ in range(shape.n_layers)]
    return ModelInputs(shape, source, layers, act, notes=notes)


def load_model_inputs(spec: str, assumptions: Assumptions, sparsity: float | None = None,
                      locality: float | None = None) -> ModelInputs:
    """A built-in name, an HF checkpoint dir / config.json, or a picompile artifact directory."""
    path = Path(spec)
    if path.is_dir() and (path / "manifest.json").is_file():
        return _artifact_inputs(path, assumptions, sparsity, locality)
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        from picompile.frontend.hf import read_config

        if path.is_dir() and not (path / "config.json").is_file():
            raise PicompileError(f"{path} is neither a picompile artifact nor a checkpoint directory (no config.json)")
        config = read_config(path)
        shape = shape_from_hf_config(config, name=str(path))
        return synthetic_inputs(shape, "hf-config", assumptions, sparsity, locality)
    if path.exists():
        raise PicompileError(f"{path}: plan reads a config.json, a checkpoint directory, an artifact or a built-in name")
    return synthetic_inputs(builtin_model(spec), "builtin", assumptions, sparsity, locality)


def _artifact_inputs(root: Path, assumptions: Assumptions, sparsity: float | None,
                     locality: float | None) -> ModelInputs:
    from picompile.formats.artifact import read_manifest

    m = read_manifest(root, verify=False, schema=False)  # numbers for an estimate: nothing is loaded or run
    model = m.model
    shape = shape_from_hf_config(dict(model.get("config") or {}), name=str(root))
    layers_meta = sorted(m.layers, key=lambda d: int(d.get("index", 0)))
    if layers_meta:  # the artifact's FFN facts win over the config's
        d_ffn = int(layers_meta[0].get("n_neurons", shape.d_ffn))
        shape = dataclasses.replace(shape, d_ffn=d_ffn, gated=layers_meta[0].get("kind", "gated") == "gated",
                                    act=str(layers_meta[0].get("act", shape.act)), max_seq_len=int(model.get("max_seq_len") or shape.max_seq_len))
    dtype = str((m.weights or {}).get("dtype", "float32"))
    notes: list[str] = []
    prof = (m.sections or {}).get("profile")
    counts: dict[int, np.ndarray] = {}
    n_tokens = 0
    if prof and sparsity is None and locality is None:
        from safetensors.numpy import load_file

        from picompile.formats.paths import inside

        pf = inside(root, prof.get("file", "profile.safetensors"), "sections.profile.file")
        if pf.is_file():
            t = load_file(str(pf))
            n_tokens = int(np.asarray(t.get("n_tokens", [prof.get("n_tokens", 0)])).ravel()[0])
            counts = {int(k[len("layer"):-len(".counts")]): np.asarray(v, dtype=np.float64)
                      for k, v in t.items() if k.startswith("layer") and k.endswith(".counts")}
    default_infl = assumptions.predictor_recall + assumptions.predictor_overhead
    default_rank = _predictor_rank(shape, assumptions.predictor_fraction)
    if counts and n_tokens > 0 and len(counts) == shape.n_layers:
        layers = []
        for meta in layers_meta:
            i = int(meta["index"])
            f = np.sort(counts[i] / n_tokens)[::-1]
            pa, ta = meta.get("predicted_active"), meta.get("true_active")
            infl = float(pa) / float(ta) if pa and ta else default_infl
            rank = int(meta.get("predictor_rank", default_rank))
            layers.append(LayerActivity(f, infl, rank * (shape.d_model + f.size)))
        allf = np.concatenate([la.freq for la in layers])
        act = Activity(float(1.0 - allf.mean()),
                       float(np.mean([_locality_sorted(la.freq) for la in layers])),
                       f"artifact profile ({n_tokens} tokens)")
        notes.append("activation counts and predictor sizes/precision from the artifact")
        inputs = ModelInputs(shape, "artifact", layers, act, dtype, notes)
    else:
        inputs = synthetic_inputs(shape, "artifact", assumptions, sparsity, locality)
        inputs.default_dtype = dtype
        inputs.notes.append("no profile in the artifact (or overridden): synthetic power-law profile")
    return inputs


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
        ffn = sum(self.pred_ffn_b) + sum(self.pred_b) if sparse else sum(self.ffn_b)
        nbytes = s.n_layers * (self.attn_b + self.norm_b + self.kv_b) + ffn + self.head_b
        read = nbytes / self.bw_cpu
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
        gpu_s, cpu_s = gpu_bytes / self.bw_gpu, cpu_bytes / self.bw_cpu
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
        t = np.maximum(k * nb / self.bw_gpu, (cold_rest + q_hot[-1] - q_hot) * nb / self.bw_cpu)
        best = int(np.flatnonzero(t <= t.min() * (1 + 1e-12))[-1])  # ties: keep more on the GPU
        if best == order.size:
            return hot
        out = np.zeros_like(hot)
        out[order[:best]] = True
        return out

    def hybrid(self) -> tuple[StrategyCost, dict[str, Any]]:
        s, a = self.shape, self.a
        desc = "PowerInfer hybrid: dense parts + hot neurons on the GPU, predicted-active cold neurons on the CPU"
        if not self.has_gpu:
            c = self.cpu(True)
            return (dataclasses.replace(c, name="hybrid", description=desc + " (no GPU: all on the CPU, sparse)"),
                    {"gpu": False, "note": "no GPU: every neuron is cold"})
        vram = int(self.target.vram_bytes)
        gpu_layers = list(range(s.n_layers))
        parts = self.fixed_parts()
        fallback = None
        try:
            budget, placed = ffn_budget(vram, parts)
        except BudgetError:
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
        kv_gpu = "kv_cache" in placed
        head_gpu = "lm_head" in placed
        placement = self._place(gpu_layers, budget) if gpu_layers else None
        on_gpu = set(gpu_layers)
        hot_mask: dict[int, np.ndarray] = {}
        if placement is not None:
            for j, i in enumerate(gpu_layers):
                m = np.zeros(self.inputs.layers[i].freq.size, dtype=bool)
                m[placement.hot[j]] = True
                hot_mask[i] = m
        n_placed = int(sum(m.sum() for m in hot_mask.values()))
        if a.balance and not a.gpu_sparse:
            for i, m in hot_mask.items():
                if not m.all():
                    hot_mask[i] = self._balance(i, m, placement.hot[gpu_layers.index(i)])

        total = gpu_s = cpu_s = sync_s = over_s = gpu_b = cpu_b = 0.0
        for i in range(s.n_layers):
            la, nb = self.inputs.layers[i], self.neuron_b[i]
            q = la.predicted
            if i not in on_gpu:  # wholly on the CPU, sparse
                b = self.attn_b + self.norm_b + self.kv_b + self.pred_b[i] + self.pred_ffn_b[i]
                t = b / self.bw_cpu
                if i == len(gpu_layers) and gpu_layers:  # the hidden state leaves the GPU here
                    x = self._xfer(s.d_model * 4.0)
                    sync_s += x
                    total += x
                cpu_b += b
                cpu_s += t
                total += t + a.cpu_layer_overhead_s
                over_s += a.cpu_layer_overhead_s
                continue
            hot = hot_mask[i]
            n_cold = int((~hot).sum())
            dense_b = self.attn_b + self.norm_b + (self.pred_b[i] if n_cold else 0.0)
            kv_t = self.kv_b / (self.bw_gpu if kv_gpu else self.bw_cpu)
            hot_b = float((q[hot].sum() if a.gpu_sparse else hot.sum())) * nb
            cold_b = float(q[~hot].sum()) * nb
            t_dense = dense_b / self.bw_gpu + kv_t
            t_hot, t_cold = hot_b / self.bw_gpu, cold_b / self.bw_cpu
            sync = 0.0
            if n_cold:
                sync = self._xfer(s.d_model * 4.0 + s.d_ffn / 8.0) + self._xfer(s.d_model * 4.0)
            if not kv_gpu:
                sync += 2 * self._xfer(s.n_heads * s.head_dim * 4.0)
            over = a.gpu_layer_overhead_s + (a.cpu_layer_overhead_s if n_cold else 0.0)
            total += t_dense + max(t_hot, t_cold + (a.cpu_layer_overhead_s if n_cold else 0.0)) + sync + a.gpu_layer_overhead_s
            gpu_s += (dense_b / self.bw_gpu + (kv_t if kv_gpu else 0.0)) + t_hot
            cpu_s += t_cold + (0.0 if kv_gpu else kv_t)
            gpu_b += dense_b + hot_b + (self.kv_b if kv_gpu else 0.0)
            cpu_b += cold_b + (0.0 if kv_gpu else self.kv_b)
            sync_s += sync
            over_s += over
        head_t = self.head_b / (self.bw_gpu if head_gpu else self.bw_cpu)
        total += head_t + self._xfer(s.d_model * 4.0)  # + the embedding row to the GPU
        sync_s += self._xfer(s.d_model * 4.0)
        if head_gpu:
            gpu_s, gpu_b = gpu_s + head_t, gpu_b + self.head_b
        else:
            cpu_s, cpu_b = cpu_s + head_t, cpu_b + self.head_b
        fixed_on_gpu = sum(b for n, b in parts if n in placed)
        vram_used = int(fixed_on_gpu + sum(int(m.sum()) * self.neuron_b[i] for i, m in hot_mask.items()))
        n_hot = int(sum(m.sum() for m in hot_mask.values()))
        n_all = int(sum(la.freq.size for la in self.inputs.layers))
        # activation share served by the GPU, over all layers
        served = sum(float(self.inputs.layers[i].freq[hot_mask[i]].sum()) for i in hot_mask)
        all_f = sum(float(la.freq.sum()) for la in self.inputs.layers)
        details = {
            "gpu_layers": len(gpu_layers),
            "n_layers": s.n_layers,
            "hot_neuron_fraction": n_hot / n_all,
            "activation_coverage": served / all_f if all_f else 0.0,
            "kv_cache_on_gpu": kv_gpu,
            "lm_head_on_gpu": head_gpu,
        }
        cost = StrategyCost("hybrid", desc, True, total, gpu_s, cpu_s, sync_s, over_s, gpu_b, cpu_b, vram_used, details)
        info: dict[str, Any] = {
            "gpu": True,
            "ffn_budget_bytes": int(budget),
            "fixed_parts": dict(parts),
            "fixed_parts_on_gpu": placed,
            "n_hot": [int(hot_mask[i].sum()) if i in hot_mask else 0 for i in range(s.n_layers)],
            "n_hot_placed": n_placed,
            "n_hot_used": n_hot,
            "n_neurons": [int(la.freq.size) for la in self.inputs.layers],
        }
        if placement is not None:
            pj = placement.to_json()
            info.update({k: pj[k] for k in ("method", "status", "coverage", "gpu_bytes", "solve_time_s")})
        if fallback:
            info["fallback"] = fallback
        return cost, info


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

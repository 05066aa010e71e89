"""What the cost model knows of one model beyond its shape: per-layer activation profiles and predictor sizes.

Without a measured profile every layer gets the same synthetic power-law activation profile
(:func:`synthetic_frequencies`): ``f_i = min(1, c·(i+1)^-α)``, with ``c`` and ``α`` solved so the mean
activity is ``1 - sparsity`` and a fraction ``locality`` of the neurons carries 80 % of all
activations (defaults: :func:`default_activity`). A picompile artifact gives its recorded activation
counts and predictor sizes instead (:func:`load_model_inputs`). :class:`Assumptions` holds the
constants no preset gives.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from picompile.errors import PicompileError
from picompile.tools.model_shapes import ModelShape, builtin_model, shape_from_hf_config


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
    cpu_layer_overhead_s: float = 5e-6  # thread barrier per layer on the CPU (``--cpu-bandwidth kernel``: the glue, measured)
    cpu_sparse_ffn_share: float = 1.0  # the sparse FFN's CPU rate / the CPU bandwidth (``kernel``: measured)
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
        if not 0.0 < self.cpu_sparse_ffn_share <= 10.0:
            raise PicompileError(f"cpu_sparse_ffn_share must be in (0, 10], got {self.cpu_sparse_ffn_share}")
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

    def predicted_active_fraction(self) -> float:
        """The mean over layers of the fraction of neurons the predictors mark active per token."""
        return sum(float(la.predicted.mean()) for la in self.layers) / len(self.layers)


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
    """An artifact's model: its config's shape (FFN facts from the manifest), its recorded activation counts
    and predictor sizes; a synthetic profile when it has none or ``sparsity`` / ``locality`` override it."""
    from picompile.formats.artifact import read_manifest

    m = read_manifest(root, verify=False, schema=False)  # numbers for an estimate: nothing is loaded or run
    shape = _artifact_shape(root, m)
    dtype = str((m.weights or {}).get("dtype", "float32"))
    prof = (m.sections or {}).get("profile")
    counts: dict[int, np.ndarray] = {}
    n_tokens = 0
    if prof and sparsity is None and locality is None:
        counts, n_tokens = _profile_counts(root, prof)
    if counts and n_tokens > 0 and len(counts) == shape.n_layers:
        return _measured_inputs(shape, m.layers, counts, n_tokens, assumptions, dtype)
    inputs = synthetic_inputs(shape, "artifact", assumptions, sparsity, locality)
    inputs.default_dtype = dtype
    inputs.notes.append("no profile in the artifact (or overridden): synthetic power-law profile")
    return inputs


def _artifact_shape(root: Path, m: Any) -> ModelShape:
    """The shape of the artifact's model config, with the FFN facts of its manifest layers (they win)."""
    model = m.model
    shape = shape_from_hf_config(dict(model.get("config") or {}), name=str(root))
    layers_meta = sorted(m.layers, key=lambda d: int(d.get("index", 0)))
    if layers_meta:  # the artifact's FFN facts win over the config's
        d_ffn = int(layers_meta[0].get("n_neurons", shape.d_ffn))
        shape = dataclasses.replace(shape, d_ffn=d_ffn, gated=layers_meta[0].get("kind", "gated") == "gated",
                                    act=str(layers_meta[0].get("act", shape.act)), max_seq_len=int(model.get("max_seq_len") or shape.max_seq_len))
    return shape


def _profile_counts(root: Path, prof: dict[str, Any]) -> tuple[dict[int, np.ndarray], int]:
    """(per layer, each neuron's activation count ``[d_ffn]``; tokens counted) from the artifact's profile file."""
    from safetensors.numpy import load_file

    from picompile.formats.paths import inside

    pf = inside(root, prof.get("file", "profile.safetensors"), "sections.profile.file")
    if not pf.is_file():
        return {}, 0
    t = load_file(str(pf))
    n_tokens = int(np.asarray(t.get("n_tokens", [prof.get("n_tokens", 0)])).ravel()[0])
    counts = {int(k[len("layer"):-len(".counts")]): np.asarray(v, dtype=np.float64)
              for k, v in t.items() if k.startswith("layer") and k.endswith(".counts")}
    return counts, n_tokens


def _measured_inputs(shape: ModelShape, layers_meta: list[dict[str, Any]], counts: dict[int, np.ndarray], n_tokens: int,
                     assumptions: Assumptions, dtype: str) -> ModelInputs:
    """Inputs from recorded counts: each layer's frequencies, its predictor's inflation and rank where recorded."""
    default_infl = assumptions.predictor_recall + assumptions.predictor_overhead
    default_rank = _predictor_rank(shape, assumptions.predictor_fraction)
    layers = []
    for meta in sorted(layers_meta, key=lambda d: int(d.get("index", 0))):
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
    notes = ["activation counts and predictor sizes/precision from the artifact"]
    return ModelInputs(shape, "artifact", layers, act, dtype, notes)

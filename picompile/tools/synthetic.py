"""Seeded random **activation-sparse** checkpoints (synthetic, labelled so everywhere) for benchmarks and tests.

    from picompile.tools.synthetic import make_synthetic
    path = make_synthetic("llama-1b-relu")          # cached under <cache>/synthetic/NAME, reused if present
    python -m picompile.tools.synthetic llama-1b-relu     # prints the path and measured per-layer sparsity/locality

These are *not* language models: the weights are random. They have the shapes of real ReLU LLMs and
FFN activations that are sparse and skewed in a controlled way, so that speed measurements of
activation-sparse inference see realistic work. Every checkpoint's ``config.json`` carries a
``"picompile_synthetic"`` object with all generation parameters, and the directory a ``SYNTHETIC.md``.

How activations are made sparse (per FFN layer, every layer alike):

1. **Target frequencies.** Neuron j fires (ReLU input > 0) with probability p_j. The p_j follow a
   power law over the neuron rank, ``p(u) = min(p_max, a · u^-alpha)`` with ``u = (rank + 0.5) / n``;
   ``a`` and ``alpha`` are solved (bisection) so that ``mean(p) = active`` (the fraction of neurons
   firing per token) and the fraction of neurons that carries 80 % of all activations is ``locality``
   (PowerInfer: 26 % for OPT-30B). Ranks are shuffled per layer (hot neurons sit anywhere).
2. **Biases.** With the pre-activation ``z_j = w_j · x`` of mean mu_j and std sigma_j over calibration
   tokens, a bias ``b_j = -mu_j + sigma_j · Phi^-1(p_j)`` makes ``P(z_j + b_j > 0) = p_j`` (z_j is close
   to Gaussian: a sum over the hidden dimension).
   - OPT: ``fc1.bias = b``.
   - Llama has no gate bias. The residual stream gets a constant component instead: hidden dimension
     ``c = d_model - 1`` of every token embedding is ``const_value``, and every weight that writes the
     residual stream (``o_proj``, ``down_proj``) has row c = 0, so h_c stays constant through all layers;
     the weights that read it (q/k/v/up_proj, lm_head) have column c = 0. After RMSNorm, x_c is nearly
     constant (it varies with 1/rms(h), a few per cent at d_model 2048), and
     ``gate_proj[:, c] = b / mean(x_c)`` is the bias. Works with the unmodified ``LlamaForCausalLM``.
3. **Predictable masks: a low-dimensional residual stream.** Hidden states of trained LLMs are
   strongly anisotropic (few directions carry most of the variance); that is what lets small predictors
   learn the masks from a few thousand tokens. Here a random orthonormal basis Q of ``subspace_rank``
   directions (default d_model / 16) carries ``subspace_share`` (0.9) of the variance of everything
   written to the residual stream: embedding rows and the output columns of o_proj / down_proj (OPT:
   out_proj / fc2) are ``sqrt(s) · Q·(random) + sqrt(1 - s) · (i.i.d. noise)``, entry variance unchanged.
   The gate / fc1 weights are i.i.d., so ~90 % of a pre-activation's variance is a function of the
   few subspace coordinates and ~10 % comes from the other d_model - K directions, which a low-rank
   predictor mostly cannot follow: with ``subspace_share`` 0.9 an ideal rank-limited predictor needs
   ~17 % of the neurons for 99 % recall at 10 % active. ``subspace_share=0`` gives an isotropic
   stream, from which predictors trained on a few thousand tokens learn little.
4. **Scale.** Embeddings are N(0, 1) (OPT, whose lm_head is tied: N(0, 0.1^2)); every matrix starts as
   N(0, 1 / fan_in); the residual branches (attention output, FFN output) are then rescaled, layer by
   layer on the calibration tokens, to an RMS of ``rms(embeddings) / sqrt(n_layers)``, so the residual
   stream grows to about sqrt(3) of its initial RMS by the last layer. Norms have weight 1 and bias 0.

The calibration runs the real HF layers (layer by layer, 256 random tokens by default); the measured
per-layer active fraction and locality (hooks on each layer's ``act_fn`` over other random tokens)
go into ``synthetic_stats.json`` and ``SYNTHETIC.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from picompile.errors import PicompileError

GENERATOR_VERSION: int = 2
STATS_FILE: str = "synthetic_stats.json"
CARD_FILE: str = "SYNTHETIC.md"


@dataclass(frozen=True)
class SyntheticShape:
    """Architecture of a synthetic checkpoint (sizes as in the HF config)."""

    family: str  # "llama" | "opt"
    d_model: int
    n_neurons: int  # intermediate_size (Llama) / ffn_dim (OPT)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    max_pos: int
    like: str = ""  # the real model whose shape this copies


SHAPES: dict[str, SyntheticShape] = {
    "llama-1b-relu": SyntheticShape("llama", 2048, 5632, 22, 32, 4, 32000, 2048,
                                    "TinyLlama-1.1B shape with ReLU (as ReLU-LLaMA / ProSparse)"),
    "opt-1.3b": SyntheticShape("opt", 2048, 8192, 24, 32, 32, 50272, 2048, "facebook/opt-1.3b"),
    "tiny-llama-relu": SyntheticShape("llama", 128, 1024, 2, 4, 2, 512, 256, "tests"),
    "tiny-opt": SyntheticShape("opt", 128, 1024, 2, 4, 4, 512, 256, "tests"),
}


# -- target frequencies ----------------------------------------------------------------------------
def power_law_frequencies(n: int, active: float, locality: float, p_max: float = 0.95) -> tuple[np.ndarray, float, float]:
    """Per-neuron firing probabilities ``[n]``, sorted descending, and the (a, alpha) of the power law.

    ``p(u) = min(p_max, a · u^-alpha)``, ``u = (i + 0.5) / n``: ``mean(p) = active`` and the fraction of
    neurons carrying 80 % of the total is ``locality`` (as closely as the discrete n allows).
    """
    from picompile.sparsity.profile_stats import locality as loc80

    if not 0.0 < active < p_max:
        raise PicompileError(f"active must be in (0, {p_max}), got {active}")
    lo_loc = 0.8 * active / p_max  # everything in the fewest neurons, each at p_max
    if not lo_loc < locality < 0.8:
        raise PicompileError(f"locality must be in ({lo_loc:.3f}, 0.8) for active={active}, got {locality}")
    u = (np.arange(n, dtype=np.float64) + 0.5) / n

    def with_alpha(alpha: float) -> tuple[np.ndarray, float]:
        base = u ** (-alpha)
        lo, hi = 1e-12, 1.0 / float(base.min())  # a = hi puts every neuron at p >= 1 (capped)
        for _ in range(100):
            a = math.sqrt(lo * hi)
            if np.minimum(p_max, a * base).mean() < active:
                lo = a
            else:
                hi = a
        a = math.sqrt(lo * hi)
        return np.minimum(p_max, a * base), a

    lo_a, hi_a = 0.0, 8.0  # locality falls as alpha grows
    for _ in range(60):
        alpha = 0.5 * (lo_a + hi_a)
        p, _ = with_alpha(alpha)
        if loc80(p) > locality:
            lo_a = alpha
        else:
            hi_a = alpha
    alpha = 0.5 * (lo_a + hi_a)
    p, a = with_alpha(alpha)
    return p, a, alpha


# -- the model -------------------------------------------------------------------------------------
def _hf_config(shape: SyntheticShape) -> Any:
    from transformers import LlamaConfig, OPTConfig

    if shape.family == "llama":
        return LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.d_model, intermediate_size=shape.n_neurons,
            num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
            hidden_act="relu", max_position_embeddings=shape.max_pos, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    if shape.n_kv_heads != shape.n_heads:
        raise ValueError("OPT has no grouped-query attention")
    return OPTConfig(
        vocab_size=shape.vocab, hidden_size=shape.d_model, ffn_dim=shape.n_neurons, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads, activation_function="relu", max_position_embeddings=shape.max_pos,
        word_embed_proj_dim=shape.d_model, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0,
        enable_bias=True, bos_token_id=2, eos_token_id=2, pad_token_id=1,
    )


class _Stop(Exception):
    pass


def _layers(model: torch.nn.Module) -> Any:
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.decoder.layers


def _layer_kwargs(model: torch.nn.Module, ids: Tensor) -> tuple[Tensor, dict[str, Any]]:
    """The hidden states entering layer 0 and the keyword arguments the model passes every layer."""
    seen: dict[str, Any] = {}

    def grab(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["h"] = args[0] if args else kwargs.pop("hidden_states")
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = _layers(model)[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["h"], seen["kwargs"]


def _attention_out(layer: torch.nn.Module, h: Tensor, kwargs: dict[str, Any]) -> Tensor:
    """The self-attention branch output of ``layer`` for input ``h`` (the layer is stopped after it)."""
    seen: dict[str, Tensor] = {}

    def grab(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        seen["a"] = out[0] if isinstance(out, tuple) else out
        raise _Stop

    handle = layer.self_attn.register_forward_hook(grab)
    try:
        layer(h, **kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["a"]


def _rms(t: Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def _subspace_rows(n: int, basis: Tensor, share: float, std: float, gen: torch.Generator) -> Tensor:
    """[n, d] rows of entry variance std²: ``sqrt(share)`` of the amplitude in span(basis) ([d, K],
    orthonormal columns), the rest i.i.d. noise."""
    d, k = basis.shape
    rows = torch.randn(n, d, generator=gen) * (std * math.sqrt(1.0 - share))
    if share > 0:
        z = torch.randn(n, k, generator=gen) * (std * math.sqrt(share * d / k))
        rows.addmm_(z, basis.T)
    return rows


@dataclass
class SyntheticParams:
    """Everything that determines a synthetic checkpoint (stored in config.json as picompile_synthetic)."""

    shape: str
    seed: int = 0
    active: float = 0.1
    locality: float = 0.26
    p_max: float = 0.95
    subspace_share: float = 0.9  # variance share of the residual stream in a low-dimensional subspace
    subspace_rank: int = 0  # its dimension; 0 = d_model // 16 (at least 8)
    const_value: float = 1.0  # Llama: value of the constant hidden dimension
    calibration_tokens: int = 256
    generator_version: int = GENERATOR_VERSION

    def rank(self, d_model: int) -> int:
        return self.subspace_rank or max(8, d_model // 16)


def _seq_shape(n_tokens: int, max_pos: int) -> tuple[int, int]:
    t = min(64, max_pos, n_tokens)
    return max(1, n_tokens // t), t


def build_synthetic_model(params: SyntheticParams, emit: Callable[[str], None] = lambda s: None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The synthetic model (float32, eval) and a description of how it was made."""
    from transformers import AutoModelForCausalLM

    if params.shape not in SHAPES:
        raise PicompileError(f"unknown synthetic shape {params.shape!r}; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[params.shape]
    gen = torch.Generator().manual_seed(params.seed)
    config = _hf_config(shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    d, n, L = shape.d_model, shape.n_neurons, shape.n_layers
    llama = shape.family == "llama"
    c = d - 1  # Llama: the constant hidden dimension
    p_sorted, a, alpha = power_law_frequencies(n, params.active, params.locality, params.p_max)
    rank = params.rank(d)
    emit(f"synthetic {params.shape}: power law p = min({params.p_max}, {a:.4g}·u^-{alpha:.3f}), "
         f"mean {p_sorted.mean():.3f}, residual subspace {rank} dims")
    if not 0.0 <= params.subspace_share < 1.0 or not 1 <= rank < d:
        raise PicompileError(f"subspace_share must be in [0, 1) and subspace_rank in [1, {d}), "
                             f"got {params.subspace_share}, {rank}")

    def normal(*size: int, std: float) -> Tensor:
        return torch.randn(*size, generator=gen) * std

    # the residual stream's main subspace (Llama: orthogonal to the constant dimension c)
    basis = torch.zeros(d, rank)
    live = d - 1 if llama else d
    basis[:live] = torch.linalg.qr(torch.randn(live, rank, generator=gen))[0]
    share = params.subspace_share

    def writer(d_out: int, fan_in: int) -> Tensor:  # [d_out = d, fan_in]: output columns mostly in the subspace
        return _subspace_rows(fan_in, basis, share, 1.0 / math.sqrt(fan_in), gen).T.contiguous()

    with torch.no_grad():
        inner = model.model
        if llama:
            emb = _subspace_rows(shape.vocab, basis, share, 1.0, gen)
            emb[:, c] = params.const_value
            inner.embed_tokens.weight.copy_(emb)
            inner.norm.weight.fill_(1.0)
            head = normal(shape.vocab, d, std=1.0 / math.sqrt(d))
            head[:, c] = 0.0
            model.lm_head.weight.copy_(head)
        else:
            dec = inner.decoder
            dec.embed_tokens.weight.copy_(_subspace_rows(shape.vocab, basis, share, 0.1, gen))  # tied with lm_head
            dec.embed_positions.weight.copy_(_subspace_rows(dec.embed_positions.weight.shape[0], basis, share, 0.05, gen))
            dec.final_layer_norm.weight.fill_(1.0)
            dec.final_layer_norm.bias.zero_()
        for layer in _layers(model):  # fan-in scaled random weights; the calibration below fixes the rest
            if llama:
                at, mlp = layer.self_attn, layer.mlp
                for lin in (at.q_proj, at.k_proj, at.v_proj):
                    w = normal(*lin.weight.shape, std=1.0 / math.sqrt(d))
                    w[:, c] = 0.0
                    lin.weight.copy_(w)
                w = writer(d, at.o_proj.weight.shape[1])
                w[c, :] = 0.0
                at.o_proj.weight.copy_(w)
                g = normal(n, d, std=1.0 / math.sqrt(d))
                g[:, c] = 0.0
                mlp.gate_proj.weight.copy_(g)
                w = normal(n, d, std=1.0 / math.sqrt(d))
                w[:, c] = 0.0
                mlp.up_proj.weight.copy_(w)
                w = writer(d, n)
                w[c, :] = 0.0
                mlp.down_proj.weight.copy_(w)
                layer.input_layernorm.weight.fill_(1.0)
                layer.post_attention_layernorm.weight.fill_(1.0)
            else:
                at = layer.self_attn
                for lin in (at.q_proj, at.k_proj, at.v_proj):
                    lin.weight.copy_(normal(*lin.weight.shape, std=1.0 / math.sqrt(lin.weight.shape[1])))
                    lin.bias.zero_()
                at.out_proj.weight.copy_(writer(d, at.out_proj.weight.shape[1]))
                at.out_proj.bias.zero_()
                layer.fc1.weight.copy_(normal(n, d, std=1.0 / math.sqrt(d)))
                layer.fc1.bias.zero_()
                layer.fc2.weight.copy_(writer(d, n))
                layer.fc2.bias.zero_()
                for ln in (layer.self_attn_layer_norm, layer.final_layer_norm):
                    ln.weight.fill_(1.0)
                    ln.bias.zero_()

        # layer-by-layer calibration on random tokens: branch scales and biases
        b, t = _seq_shape(params.calibration_tokens, shape.max_pos)
        ids = torch.randint(0, shape.vocab, (b, t), generator=gen)
        h, kwargs = _layer_kwargs(model, ids)
        keep = [i for i in range(d) if not (llama and i == c)]
        target = _rms(h[..., keep]) / math.sqrt(L)
        layer_info: list[dict[str, Any]] = []
        for li, layer in enumerate(_layers(model)):
            attn = _attention_out(layer, h, kwargs)
            s_attn = target / max(_rms(attn), 1e-12)
            (layer.self_attn.o_proj if llama else layer.self_attn.out_proj).weight.mul_(s_attn)
            h = h + attn * s_attn
            x = (layer.post_attention_layernorm if llama else layer.final_layer_norm)(h).reshape(-1, d)  # [N, d]
            decider = layer.mlp.gate_proj if llama else layer.fc1
            z = torch.nn.functional.linear(x, decider.weight)  # [N, n] (Llama: column c is still 0)
            mu, sigma = z.double().mean(0), z.double().std(0).clamp_min(1e-12)
            perm = torch.randperm(n, generator=gen)
            p = torch.as_tensor(p_sorted)[perm]  # [n] this layer's target frequency per neuron
            bias = (-mu + sigma * torch.special.ndtri(p)).float()  # [n]
            if llama:
                xc = float(x[:, c].double().mean())
                decider.weight[:, c] = bias / xc
                y = layer.mlp(x)
                s_ffn = target / max(_rms(y), 1e-12)
                layer.mlp.down_proj.weight.mul_(s_ffn)
            else:
                xc = float("nan")
                decider.bias.copy_(bias)
                y = layer.fc2(layer.activation_fn(layer.fc1(x)))
                s_ffn = target / max(_rms(y), 1e-12)
                layer.fc2.weight.mul_(s_ffn)
            h = h + (y * s_ffn).reshape(h.shape)
            layer_info.append({"layer": li, "attn_scale": s_attn, "ffn_scale": s_ffn, "x_const_mean": xc,
                               "residual_rms": _rms(h[..., keep])})
    description = {
        "power_law": {"a": a, "alpha": alpha, "p_max": params.p_max, "design_mean": float(p_sorted.mean())},
        "subspace_rank": rank, "branch_rms": target, "const_dim": c if llama else None,
        "calibration": {"batch": b, "seq_len": t}, "layers": layer_info,
    }
    return model, description


# -- measurement -----------------------------------------------------------------------------------
def measure_sparsity(model: torch.nn.Module, n_tokens: int = 256, seed: int = 1) -> list[dict[str, Any]]:
    """Per FFN layer over ``n_tokens`` seeded random tokens: active fraction, sparsity, locality (80 %/50 %).

    Counted by forward hooks on each layer's activation module (``mlp.act_fn`` / ``activation_fn``):
    a neuron is active for a token when its ReLU output is > 0.
    """
    from picompile.sparsity.profile_stats import LayerProfile, locality

    layers = list(_layers(model))
    acts = [layer.mlp.act_fn if hasattr(layer, "mlp") else layer.activation_fn for layer in layers]
    shared = len({id(m) for m in acts}) != len(acts)  # one module for every layer: hook the decider instead
    if shared:
        acts = [layer.mlp.gate_proj if hasattr(layer, "mlp") else layer.fc1 for layer in layers]
    counts: list[Tensor | None] = [None] * len(layers)
    seen = [0] * len(layers)

    def hook(i: int) -> Callable[..., None]:
        def fn(_module: torch.nn.Module, _args: Any, out: Tensor) -> None:
            active = (out > 0).reshape(-1, out.shape[-1])
            counts[i] = active.sum(0) if counts[i] is None else counts[i] + active.sum(0)
            seen[i] += active.shape[0]
        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(acts)]
    cfg = model.config
    b, t = _seq_shape(n_tokens, int(cfg.max_position_embeddings))
    ids = torch.randint(0, int(cfg.vocab_size), (b, t), generator=torch.Generator().manual_seed(seed))
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    finally:
        for hd in handles:
            hd.remove()
    rows = []
    for i, cnt in enumerate(counts):
        assert cnt is not None
        prof = LayerProfile(cnt.numpy().astype(np.int64), seen[i], name=f"layer{i}")
        rows.append({"layer": i, "n_neurons": prof.n_neurons, "n_tokens": prof.n_tokens, "active": 1.0 - prof.sparsity,
                     "sparsity": prof.sparsity, "locality": prof.locality, "locality_50": locality(prof.counts, 0.5),
                     "dead_fraction": prof.dead_fraction})
    return rows


# -- the checkpoint directory ----------------------------------------------------------------------
def default_name(params: SyntheticParams) -> str:
    name = params.shape
    if params.seed != 0:
        name += f"-seed{params.seed}"
    if params.active != 0.1:
        name += f"-active{params.active:g}"
    if params.locality != 0.26:
        name += f"-loc{params.locality:g}"
    return name


def synthetic_params_of(path: Path) -> dict[str, Any] | None:
    """The ``picompile_synthetic`` object of a checkpoint dir's config.json (None: not a synthetic checkpoint)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    meta = cfg.get("picompile_synthetic") if isinstance(cfg, dict) else None
    return meta if isinstance(meta, dict) else None


def _complete(path: Path, params: SyntheticParams) -> bool:
    meta = synthetic_params_of(path)
    if not meta or not (path / CARD_FILE).is_file() or not (path / STATS_FILE).is_file():
        return False
    if not any(path.glob("*.safetensors")):
        return False
    return all(meta.get(k) == v for k, v in asdict(params).items())


def _card(params: SyntheticParams, shape: SyntheticShape, description: dict[str, Any], stats: list[dict[str, Any]]) -> str:
    pl = description["power_law"]
    lines = [
        f"# SYNTHETIC checkpoint `{params.shape}` — random weights, not a language model",
        "",
        f"Made by `picompile.tools.synthetic` (generator version {params.generator_version}) with seed {params.seed}. "
        f"Shape of {shape.like}: {shape.family}, d_model {shape.d_model}, {shape.n_neurons} FFN neurons, "
        f"{shape.n_layers} layers, {shape.n_heads} heads ({shape.n_kv_heads} KV), vocab {shape.vocab}, ReLU.",
        "",
        "It exists to measure activation-sparse inference speed on realistic shapes. Its outputs mean nothing.",
        "",
        "## How the activations were made sparse",
        "",
        f"- Per-neuron firing probabilities follow a power law p(u) = min({pl['p_max']}, {pl['a']:.4g} · u^-{pl['alpha']:.3f}) "
        f"over the neuron rank u: target active fraction {params.active}, target locality {params.locality} "
        "(fraction of neurons carrying 80 % of activations). Ranks are shuffled per layer.",
        "- Each neuron's bias is -mu + sigma · Phi^-1(p) for its pre-activation mean mu and std sigma, measured on "
        f"{params.calibration_tokens} random calibration tokens, layer by layer.",
        ("- Llama has no gate bias: hidden dimension "
         f"{description['const_dim']} is held at {params.const_value} by the embeddings (rows of o_proj/down_proj for it "
         "are 0, columns of q/k/v/up_proj and lm_head are 0), and gate_proj's column for it carries the bias."
         if shape.family == "llama" else "- OPT: the bias is fc1.bias."),
        f"- Residual stream: {params.subspace_share:.0%} of the variance of embeddings and branch outputs lies in a random "
        f"{description['subspace_rank']}-dimensional subspace (trained LLMs' hidden states are anisotropic too), so "
        "predictors can learn the masks from few tokens; the rest is i.i.d. noise.",
        f"- Residual branches rescaled to RMS {description['branch_rms']:.4g} (embedding RMS / sqrt(n_layers)).",
        "",
        "## Measured (forward hooks on each layer's ReLU, "
        f"{stats[0]['n_tokens'] if stats else 0} random tokens)",
        "",
        "| layer | active | locality 80 % | locality 50 % | dead |",
        "|---|---|---|---|---|",
        *[f"| {r['layer']} | {r['active']:.3f} | {r['locality']:.3f} | {r['locality_50']:.3f} | {r['dead_fraction']:.3f} |"
          for r in stats],
        "",
        "Parameters: see `picompile_synthetic` in config.json; layer scales: `synthetic_stats.json`.",
        "",
    ]
    return "\n".join(lines)


def make_synthetic(shape: str, out: Path | str | None = None, seed: int = 0, active: float = 0.1, locality: float = 0.26,
                   *, emit: Callable[[str], None] = lambda s: None, **options: Any) -> Path:
    """Write (or reuse) a synthetic activation-sparse HF checkpoint and return its directory.

    ``out`` None: ``default_cache_dir() / "synthetic" / NAME`` (NAME: the shape, plus non-default
    parameters). A directory already holding a checkpoint made with the same parameters is reused.
    ``options``: the other fields of :class:`SyntheticParams` (p_max, subspace_share, subspace_rank, …).
    """
    from picompile.config import default_cache_dir

    params = SyntheticParams(shape=shape, seed=seed, active=float(active), locality=float(locality), **options)
    if shape not in SHAPES:
        raise PicompileError(f"unknown synthetic shape {shape!r}; choose one of {', '.join(SHAPES)}")
    out = Path(out) if out is not None else default_cache_dir() / "synthetic" / default_name(params)
    if _complete(out, params):
        return out
    if out.exists() and any(out.iterdir()) and synthetic_params_of(out) is None:
        raise PicompileError(f"{out} exists and is not a synthetic checkpoint; refusing to overwrite it")
    model, description = build_synthetic_model(params, emit=emit)
    emit("measuring activation sparsity")
    stats = measure_sparsity(model, n_tokens=256, seed=params.seed + 1)
    model.config.picompile_synthetic = {**asdict(params), "synthetic": True, "like": SHAPES[shape].like,
                                        "note": "random weights with controlled activation sparsity; not a language model"}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        (staging / STATS_FILE).write_text(json.dumps({"params": asdict(params), "generation": description,
                                                      "measured": stats}, indent=1) + "\n")
        (staging / CARD_FILE).write_text(_card(params, SHAPES[shape], description, stats))
        staging.chmod(0o755)  # mkdtemp made it private
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def load_stats(path: Path) -> list[dict[str, Any]]:
    """The measured per-layer statistics stored beside a synthetic checkpoint."""
    return json.loads((Path(path) / STATS_FILE).read_text())["measured"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m picompile.tools.synthetic", description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("-o", "--out", help="checkpoint directory (default: <cache>/synthetic/NAME)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--active", type=float, default=0.1, help="mean fraction of FFN neurons firing per token")
    ap.add_argument("--locality", type=float, default=0.26, help="fraction of neurons carrying 80%% of activations")
    ap.add_argument("--remeasure", action="store_true", help="measure again (else: the numbers stored at generation)")
    ap.add_argument("--tokens", type=int, default=256, help="random tokens for --remeasure")
    args = ap.parse_args(argv)
    try:
        path = make_synthetic(args.shape, args.out, args.seed, args.active, args.locality,
                              emit=lambda s: print(s, file=sys.stderr))
    except PicompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.remeasure:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        stats = measure_sparsity(model, n_tokens=args.tokens, seed=args.seed + 2)
    else:
        stats = load_stats(path)
    print(path)
    print(f"{'layer':>5} {'active':>7} {'sparsity':>8} {'loc80':>6} {'loc50':>6} {'dead':>6}   ({stats[0]['n_tokens']} random tokens)")
    for r in stats:
        print(f"{r['layer']:>5} {r['active']:>7.3f} {r['sparsity']:>8.3f} {r['locality']:>6.3f} {r['locality_50']:>6.3f} "
              f"{r['dead_fraction']:>6.3f}")
    mean = lambda k: sum(r[k] for r in stats) / len(stats)  # noqa: E731
    print(f"{'mean':>5} {mean('active'):>7.3f} {mean('sparsity'):>8.3f} {mean('locality'):>6.3f} {mean('locality_50'):>6.3f} "
          f"{mean('dead_fraction'):>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

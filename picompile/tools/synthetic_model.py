"""The generator of :mod:`picompile.tools.synthetic`: a seeded random HF model (Llama or OPT shape, ReLU FFNs)
whose FFN activations are sparse and skewed in a controlled way. Its weights are random: not a language model.

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
   - dReLU (``ffn="drelu"``, Llama only: ``relu(gate x) * relu(up x)``, config ``ffn_act: "drelu"``): a neuron
     is active when both branches are positive; each branch gets a bias (gate_proj's and up_proj's column c) for
     ``sqrt(p_j)``, so that the product fires with about p_j (the two pre-activations are nearly independent).
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

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from picompile.errors import PicompileError

GENERATOR_VERSION: int = 2


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
    # llama-1b-relu's proportions at a quarter of its width, 4 layers: small enough to travel to a GPU machine
    # (benchmarks/gpu_check.py's hybrid check), the same passes, kernels and schedule
    "gpu-check-small": SyntheticShape("llama", 512, 1408, 4, 8, 4, 2048, 512,
                                      "llama-1b-relu's proportions at 1/4 width, 4 layers (gpu_check)"),
    # ReluLLaMA-7B's shape (Llama-2-7B, ReLU): 6.7B parameters, generated layer by layer and stored in bfloat16
    # (picompile.tools.synthetic_stream; 13.5 GB) since its float32 model would not fit a 24 GB machine
    "llama-7b-relu": SyntheticShape("llama", 4096, 11008, 32, 32, 32, 32000, 2048,
                                    "ReluLLaMA-7B shape (Llama-2-7B with ReLU), bfloat16"),
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
    ffn: str = "relu"  # "relu": relu(gate x) * up x; "drelu" (Llama): relu(gate x) * relu(up x), TurboSparse's dReLU
    generator_version: int = GENERATOR_VERSION
    layers: int = 0  # decoder layers; 0 = the shape's (fewer: a truncated model of the shape's widths)

    def rank(self, d_model: int) -> int:
        return self.subspace_rank or max(8, d_model // 16)

    def shape_of(self) -> SyntheticShape:
        """The shape, with ``layers`` decoder layers when that is set."""
        shape = SHAPES[self.shape]
        if self.layers < 0:
            raise PicompileError(f"layers must be >= 0, got {self.layers}")
        return replace(shape, n_layers=self.layers) if self.layers else shape


def seq_shape(n_tokens: int, max_pos: int) -> tuple[int, int]:
    """(batch, sequence length) of about ``n_tokens`` random tokens in sequences of at most 64."""
    t = min(64, max_pos, n_tokens)
    return max(1, n_tokens // t), t


# -- the model -------------------------------------------------------------------------------------
FFN_FORMS: tuple[str, ...] = ("relu", "drelu")


def _hf_config(shape: SyntheticShape, ffn: str = "relu") -> Any:
    from transformers import LlamaConfig, OPTConfig

    if ffn not in FFN_FORMS:
        raise PicompileError(f"unknown synthetic FFN {ffn!r}; choose one of {', '.join(FFN_FORMS)}")
    if ffn == "drelu" and shape.family != "llama":
        raise PicompileError(f"ffn 'drelu' needs a gated (Llama) shape, not {shape.family}")
    if shape.family == "llama":
        extra = {"ffn_act": "drelu"} if ffn == "drelu" else {}  # frontend.hf.FFN_ACT_KEY
        return LlamaConfig(**extra,
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


def decoder_layers(model: torch.nn.Module) -> Any:
    """The decoder layers of an HF Llama or OPT model."""
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.decoder.layers


def _layer_kwargs(model: torch.nn.Module, ids: Tensor) -> tuple[Tensor, dict[str, Any]]:
    """The hidden states entering layer 0 and the keyword arguments the model passes every layer."""
    seen: dict[str, Any] = {}

    def grab(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["h"] = args[0] if args else kwargs.pop("hidden_states")
        seen["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = decoder_layers(model)[0].register_forward_pre_hook(grab, with_kwargs=True)
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
class _Init:
    """The seeded draws of the initial weights: fan-in scaled normals, and "writers" (weights that write the
    residual stream) whose output columns lie mostly in the subspace ``basis``. Llama's constant hidden
    dimension ``c`` is kept out of everything that reads (columns) or writes (rows) the residual stream."""

    gen: torch.Generator
    basis: Tensor  # [d, rank] orthonormal columns
    share: float  # variance share in span(basis)
    c: int | None  # Llama: the constant hidden dimension; OPT: None

    def normal(self, *size: int, std: float) -> Tensor:
        return torch.randn(*size, generator=self.gen) * std

    def writer(self, fan_in: int) -> Tensor:  # [d, fan_in]: output columns mostly in the subspace
        w = _subspace_rows(fan_in, self.basis, self.share, 1.0 / math.sqrt(fan_in), self.gen).T.contiguous()
        if self.c is not None:
            w[self.c, :] = 0.0
        return w

    def reader(self, n: int, d: int) -> Tensor:  # [n, d]: N(0, 1/d), blind to the constant dimension
        w = self.normal(n, d, std=1.0 / math.sqrt(d))
        if self.c is not None:
            w[:, self.c] = 0.0
        return w


def build_synthetic_model(params: SyntheticParams, emit: Callable[[str], None] = lambda s: None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The synthetic model (float32, eval) and a description of how it was made."""
    if params.shape not in SHAPES:
        raise PicompileError(f"unknown synthetic shape {params.shape!r}; choose one of {', '.join(SHAPES)}")
    shape = params.shape_of()
    gen = torch.Generator().manual_seed(params.seed)
    model = _empty_model(shape, params.seed, params.ffn)
    d, llama = shape.d_model, shape.family == "llama"
    c = d - 1  # Llama: the constant hidden dimension
    p_sorted, a, alpha = power_law_frequencies(shape.n_neurons, params.active, params.locality, params.p_max)
    rank = params.rank(d)
    emit(f"synthetic {params.shape}: power law p = min({params.p_max}, {a:.4g}·u^-{alpha:.3f}), "
         f"mean {p_sorted.mean():.3f}, residual subspace {rank} dims")
    if not 0.0 <= params.subspace_share < 1.0 or not 1 <= rank < d:
        raise PicompileError(f"subspace_share must be in [0, 1) and subspace_rank in [1, {d}), "
                             f"got {params.subspace_share}, {rank}")
    init = _Init(gen, _residual_basis(d, rank, llama, gen), params.subspace_share, c if llama else None)
    with torch.no_grad():
        _init_weights(model, shape, params, init)
        calibration = _calibrate(model, shape, params, p_sorted, gen)
    description = {
        "power_law": {"a": a, "alpha": alpha, "p_max": params.p_max, "design_mean": float(p_sorted.mean())},
        "subspace_rank": rank, "branch_rms": calibration["target"], "const_dim": c if llama else None,
        "calibration": {"batch": calibration["batch"], "seq_len": calibration["seq_len"]},
        "layers": calibration["layers"],
    }
    return model, description


def _empty_model(shape: SyntheticShape, seed: int, ffn: str = "relu") -> torch.nn.Module:
    """The HF model of ``shape`` (float32, eval), initialised under ``seed`` without touching the global RNG;
    ``ffn`` "drelu": with the frontend's dReLU hooks (``frontend.hf.apply_ffn_act``)."""
    from transformers import AutoModelForCausalLM

    from picompile.frontend.hf import apply_ffn_act

    config = _hf_config(shape, ffn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    return apply_ffn_act(model, config.to_dict(), f"synthetic {ffn}")


def is_drelu(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer's FFN computes dReLU (the frontend's hook on its up_proj)."""
    mlp = getattr(layer, "mlp", None)
    return bool(getattr(getattr(mlp, "up_proj", None), "_picompile_drelu", False))


def _residual_basis(d: int, rank: int, llama: bool, gen: torch.Generator) -> Tensor:
    """The residual stream's main subspace ``[d, rank]`` (Llama: orthogonal to the constant dimension d - 1)."""
    basis = torch.zeros(d, rank)
    live = d - 1 if llama else d
    basis[:live] = torch.linalg.qr(torch.randn(live, rank, generator=gen))[0]
    return basis


def _init_weights(model: torch.nn.Module, shape: SyntheticShape, params: SyntheticParams, init: _Init) -> None:
    """Embeddings and head, then every layer: fan-in scaled random weights (the calibration fixes the rest)."""
    if shape.family == "llama":
        _init_llama_ends(model, shape, params, init)
    else:
        _init_opt_ends(model, shape, init)
    for layer in decoder_layers(model):
        if shape.family == "llama":
            _init_llama_layer(layer, shape, init)
        else:
            _init_opt_layer(layer, shape, init)


def _init_llama_ends(model: torch.nn.Module, shape: SyntheticShape, params: SyntheticParams, init: _Init) -> None:
    inner, c, d = model.model, init.c, shape.d_model
    emb = _subspace_rows(shape.vocab, init.basis, init.share, 1.0, init.gen)  # [vocab, d]
    emb[:, c] = params.const_value
    inner.embed_tokens.weight.copy_(emb)
    inner.norm.weight.fill_(1.0)
    head = init.normal(shape.vocab, d, std=1.0 / math.sqrt(d))
    head[:, c] = 0.0
    model.lm_head.weight.copy_(head)


def _init_opt_ends(model: torch.nn.Module, shape: SyntheticShape, init: _Init) -> None:
    dec = model.model.decoder
    dec.embed_tokens.weight.copy_(_subspace_rows(shape.vocab, init.basis, init.share, 0.1, init.gen))  # tied with lm_head
    dec.embed_positions.weight.copy_(_subspace_rows(dec.embed_positions.weight.shape[0], init.basis, init.share, 0.05,
                                                    init.gen))
    dec.final_layer_norm.weight.fill_(1.0)
    dec.final_layer_norm.bias.zero_()


def _init_llama_layer(layer: torch.nn.Module, shape: SyntheticShape, init: _Init) -> None:
    at, mlp, d, n = layer.self_attn, layer.mlp, shape.d_model, shape.n_neurons
    for lin in (at.q_proj, at.k_proj, at.v_proj):
        lin.weight.copy_(init.reader(lin.weight.shape[0], d))
    at.o_proj.weight.copy_(init.writer(at.o_proj.weight.shape[1]))
    mlp.gate_proj.weight.copy_(init.reader(n, d))
    mlp.up_proj.weight.copy_(init.reader(n, d))
    mlp.down_proj.weight.copy_(init.writer(n))
    layer.input_layernorm.weight.fill_(1.0)
    layer.post_attention_layernorm.weight.fill_(1.0)


def _init_opt_layer(layer: torch.nn.Module, shape: SyntheticShape, init: _Init) -> None:
    at, d, n = layer.self_attn, shape.d_model, shape.n_neurons
    for lin in (at.q_proj, at.k_proj, at.v_proj):
        lin.weight.copy_(init.normal(*lin.weight.shape, std=1.0 / math.sqrt(lin.weight.shape[1])))
        lin.bias.zero_()
    at.out_proj.weight.copy_(init.writer(at.out_proj.weight.shape[1]))
    at.out_proj.bias.zero_()
    layer.fc1.weight.copy_(init.normal(n, d, std=1.0 / math.sqrt(d)))
    layer.fc1.bias.zero_()
    layer.fc2.weight.copy_(init.writer(n))
    layer.fc2.bias.zero_()
    for ln in (layer.self_attn_layer_norm, layer.final_layer_norm):
        ln.weight.fill_(1.0)
        ln.bias.zero_()


def _calibrate(model: torch.nn.Module, shape: SyntheticShape, params: SyntheticParams, p_sorted: np.ndarray,
               gen: torch.Generator) -> dict[str, Any]:
    """Layer by layer on random tokens: each branch rescaled to the target RMS and each neuron's bias set so it
    fires with its target frequency. Returns {"target", "batch", "seq_len", "layers": [per-layer facts]}."""
    d, llama = shape.d_model, shape.family == "llama"
    b, t = seq_shape(params.calibration_tokens, shape.max_pos)
    ids = torch.randint(0, shape.vocab, (b, t), generator=gen)
    h, kwargs = _layer_kwargs(model, ids)
    keep = [i for i in range(d) if not (llama and i == d - 1)]  # Llama: all but the constant dimension
    target = _rms(h[..., keep]) / math.sqrt(shape.n_layers)
    layer_info: list[dict[str, Any]] = []
    for li, layer in enumerate(decoder_layers(model)):
        h, info = _calibrate_layer(layer, h, kwargs, shape, p_sorted, target, gen)
        layer_info.append({"layer": li, **info, "residual_rms": _rms(h[..., keep])})
    return {"target": target, "batch": b, "seq_len": t, "layers": layer_info}


def _calibrate_layer(layer: torch.nn.Module, h: Tensor, kwargs: dict[str, Any], shape: SyntheticShape,
                     p_sorted: np.ndarray, target: float, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
    """One layer: scale its attention output to ``target`` RMS, set its FFN biases (a random permutation of the
    target frequencies), scale its FFN output; the hidden states after it and its scales."""
    d, n, llama = shape.d_model, shape.n_neurons, shape.family == "llama"
    c = d - 1
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
    drelu = llama and is_drelu(layer)
    q = p.sqrt() if drelu else p  # dReLU: each branch fires with sqrt(p), the product with ~p
    bias = (-mu + sigma * torch.special.ndtri(q)).float()  # [n]
    if llama:
        xc = float(x[:, c].double().mean())
        decider.weight[:, c] = bias / xc
        if drelu:  # the up branch's own bias, in its column c (still 0 here, as the gate's was)
            zu = torch.nn.functional.linear(x, layer.mlp.up_proj.weight).double()  # [N, n]
            b_u = (-zu.mean(0) + zu.std(0).clamp_min(1e-12) * torch.special.ndtri(q)).float()  # [n]
            layer.mlp.up_proj.weight[:, c] = b_u / xc
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
    return h, {"attn_scale": s_attn, "ffn_scale": s_ffn, "x_const_mean": xc}

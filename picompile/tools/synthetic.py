"""Seeded random **activation-sparse** checkpoints (synthetic, labelled so everywhere) for benchmarks and tests.

    from picompile.tools.synthetic import make_synthetic
    path = make_synthetic("llama-1b-relu")          # cached under <cache>/synthetic/NAME, reused if present
    python -m picompile.tools.synthetic llama-1b-relu     # prints the path and measured per-layer sparsity/locality

These are *not* language models: the weights are random. They have the shapes of real ReLU LLMs and
FFN activations that are sparse and skewed in a controlled way, so that speed measurements of
activation-sparse inference see realistic work. Every checkpoint's ``config.json`` carries a
``"picompile_synthetic"`` object with all generation parameters, and the directory a ``SYNTHETIC.md``.

How the activations are made sparse (target frequencies, biases, a low-dimensional residual stream, branch
scales) is in :mod:`picompile.tools.synthetic_model`, which generates the model. The calibration runs the
real HF layers (layer by layer, 256 random tokens by default); the measured per-layer active fraction and
locality (hooks on each layer's ``act_fn`` over other random tokens) go into ``synthetic_stats.json`` and
``SYNTHETIC.md``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from picompile.errors import PicompileError
from picompile.tools.synthetic_model import (
    SHAPES,
    SyntheticParams,
    SyntheticShape,
    build_synthetic_model,
    decoder_layers,
    is_drelu,
    seq_shape,
)

STATS_FILE: str = "synthetic_stats.json"
STREAMED: frozenset[str] = frozenset({"llama-7b-relu"})  # generated layer by layer, written in bfloat16
CARD_FILE: str = "SYNTHETIC.md"


# -- measurement -----------------------------------------------------------------------------------
def measure_sparsity(model: torch.nn.Module, n_tokens: int = 256, seed: int = 1) -> list[dict[str, Any]]:
    """Per FFN layer over ``n_tokens`` seeded random tokens: active fraction, sparsity, locality (80 %/50 %).

    Counted by forward hooks on each layer's activation module (``mlp.act_fn`` / ``activation_fn``):
    a neuron is active for a token when its ReLU output is > 0.
    """
    from picompile.sparsity.profile_stats import LayerProfile, locality

    layers = list(decoder_layers(model))
    acts = [layer.mlp.act_fn if hasattr(layer, "mlp") else layer.activation_fn for layer in layers]
    shared = len({id(m) for m in acts}) != len(acts)  # one module for every layer: hook the decider instead
    if shared:
        acts = [layer.mlp.gate_proj if hasattr(layer, "mlp") else layer.fc1 for layer in layers]
    counts: list[Tensor | None] = [None] * len(layers)
    seen = [0] * len(layers)

    def count(i: int, active: Tensor) -> None:
        active = active.reshape(-1, active.shape[-1])
        counts[i] = active.sum(0) if counts[i] is None else counts[i] + active.sum(0)
        seen[i] += active.shape[0]

    def hook(i: int) -> Callable[..., None]:
        def fn(_module: torch.nn.Module, _args: Any, out: Tensor) -> None:
            count(i, out > 0)
        return fn

    def down_hook(i: int) -> Callable[..., None]:  # dReLU: active = relu(gate x) * relu(up x) != 0
        def fn(_module: torch.nn.Module, args: Any) -> None:
            count(i, args[0] != 0)
        return fn

    handles = [layer.mlp.down_proj.register_forward_pre_hook(down_hook(i)) if is_drelu(layer)
               else m.register_forward_hook(hook(i)) for i, (m, layer) in enumerate(zip(acts, layers))]
    cfg = model.config
    b, t = seq_shape(n_tokens, int(cfg.max_position_embeddings))
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
    if params.ffn != "relu":
        name += f"-{params.ffn}"
    if params.layers:
        name += f"-{params.layers}l"
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
    defaults = asdict(SyntheticParams(shape=params.shape))  # a field added later: its default (older checkpoints)
    return all(meta.get(k, defaults[k]) == v for k, v in asdict(params).items())


def _card(params: SyntheticParams, shape: SyntheticShape, description: dict[str, Any], stats: list[dict[str, Any]]) -> str:
    pl = description["power_law"]
    lines = [
        f"# SYNTHETIC checkpoint `{params.shape}` — random weights, not a language model",
        "",
        f"Made by `picompile.tools.synthetic` (generator version {params.generator_version}) with seed {params.seed}. "
        f"Shape of {shape.like}: {shape.family}, d_model {shape.d_model}, {shape.n_neurons} FFN neurons, "
        f"{shape.n_layers} layers, {shape.n_heads} heads ({shape.n_kv_heads} KV), vocab {shape.vocab}, "
        + ("dReLU: relu(gate x) * relu(up x) (config ffn_act: drelu)." if params.ffn == "drelu" else "ReLU."),
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
                   *, emit: Callable[[str], None] = lambda s: None, streamed: bool | None = None,
                   **options: Any) -> Path:
    """Write (or reuse) a synthetic activation-sparse HF checkpoint and return its directory.

    ``out`` None: ``default_cache_dir() / "synthetic" / NAME`` (NAME: the shape, plus non-default
    parameters). A directory already holding a checkpoint made with the same parameters is reused.
    ``options``: the other fields of :class:`SyntheticParams` (p_max, subspace_share, subspace_rank, …).
    ``streamed`` (default: for the shapes in ``STREAMED``): generated and written layer by layer in bfloat16
    shards (:func:`picompile.tools.synthetic_stream.write_synthetic_streamed`), never holding the model.
    """
    from picompile.config import default_cache_dir

    params = SyntheticParams(shape=shape, seed=seed, active=float(active), locality=float(locality), **options)
    if shape not in SHAPES:
        raise PicompileError(f"unknown synthetic shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if params.ffn != "relu" and (streamed if streamed is not None else shape in STREAMED):
        raise PicompileError(f"ffn {params.ffn!r} is not made by the streamed (layer by layer) generator of {shape}")
    out = Path(out) if out is not None else default_cache_dir() / "synthetic" / default_name(params)
    if _complete(out, params):
        return out
    if out.exists() and any(out.iterdir()) and synthetic_params_of(out) is None:
        raise PicompileError(f"{out} exists and is not a synthetic checkpoint; refusing to overwrite it")
    meta = {**asdict(params), "synthetic": True, "like": SHAPES[shape].like,
            "note": "random weights with controlled activation sparsity; not a language model"}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        if streamed if streamed is not None else shape in STREAMED:
            from picompile.tools.synthetic_model import _hf_config
            from picompile.tools.synthetic_stream import write_synthetic_streamed

            description, stats = write_synthetic_streamed(params, staging, emit=emit)
            cfg = {**_hf_config(params.shape_of()).to_dict(), "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
                   "picompile_synthetic": {**meta, "streamed": True}}
            (staging / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            model, description = build_synthetic_model(params, emit=emit)
            emit("measuring activation sparsity")
            stats = measure_sparsity(model, n_tokens=256, seed=params.seed + 1)
            model.config.picompile_synthetic = meta
            model.save_pretrained(staging, safe_serialization=True)
            del model
        (staging / STATS_FILE).write_text(json.dumps({"params": asdict(params), "generation": description,
                                                      "measured": stats}, indent=1) + "\n")
        (staging / CARD_FILE).write_text(_card(params, params.shape_of(), description, stats))
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
    ap.add_argument("--ffn", choices=["relu", "drelu"], default="relu",
                    help="FFN form: relu(gate x) * up x, or dReLU relu(gate x) * relu(up x) (Llama shapes)")
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: the shape's; fewer make a truncated model of its widths)")
    ap.add_argument("--remeasure", action="store_true", help="measure again (else: the numbers stored at generation)")
    ap.add_argument("--tokens", type=int, default=256, help="random tokens for --remeasure")
    args = ap.parse_args(argv)
    try:
        path = make_synthetic(args.shape, args.out, args.seed, args.active, args.locality,
                              emit=lambda s: print(s, file=sys.stderr), ffn=args.ffn,
                              layers=args.layers)
    except PicompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.remeasure:
        from transformers import AutoModelForCausalLM

        from picompile.frontend.hf import apply_ffn_act

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        apply_ffn_act(model, model.config.to_dict(), str(path))
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

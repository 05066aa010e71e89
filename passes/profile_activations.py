"""profile-activations: graph unchanged; runs the calibration corpus through it and records, per FFN
layer, each neuron's activation count (→ profile.safetensors) and the (input, active-mask) pairs
train-predictors learns from. ReLU: active = output > 0; other activations: |act| above a per-layer
threshold set to reach ``act_sparsity`` (CATS-style).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import fx

from picompile.calibration import load_calibration
from picompile.context import BuildContext
from picompile.graph import get_tensor
from picompile.ops import activation_score, is_picompile_op, lin
from picompile.passes.registry import register_pass
from picompile.profile_stats import LayerProfile

PROFILE_FILE = "profile.safetensors"


@dataclass
class LayerCalibration:
    """What profiling saw at one FFN: its inputs and which neurons were active."""

    x: torch.Tensor  # [N, d_model] float32
    mask: torch.Tensor  # [N, n_neurons] bool
    threshold: float  # |act| > threshold counts as active (0.0 for ReLU)
    profile: LayerProfile


class _FFNInputs(fx.Interpreter):
    """Runs the graph and keeps every picompile.ffn input ([tokens, d_model]) by layer."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_picompile_op(target, "ffn"):
            x = args[0]
            self.inputs.setdefault(int(args[7]), []).append(x.reshape(-1, x.shape[-1]).detach().clone())
        return super().call_function(target, args, kwargs)


def ffn_nodes(gm: fx.GraphModule) -> dict[int, fx.Node]:
    return {int(n.args[7]): n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "ffn")}


@dataclass
class Decider:
    """What decides if a neuron of one FFN fires: ``activation_score(x, w, b, act, w_mul) > threshold``."""

    w: torch.Tensor  # [n_neurons, d_model] gate rows for gated FFNs, else up rows
    b: torch.Tensor | None  # [n_neurons] up bias of a plain MLP
    act: str
    w_mul: torch.Tensor | None  # [n_neurons, d_model] up rows: the product criterion (gated, non-ReLU), else None

    def score(self, x: torch.Tensor) -> torch.Tensor:  # [N, d_model] -> [N, n_neurons]
        return activation_score(x, self.w, self.b, self.act, self.w_mul)

    @torch.no_grad()
    def margin(self, x: torch.Tensor, threshold: float) -> torch.Tensor:  # [N, d_model] -> [N, n_neurons]
        """How far each neuron is above firing (> 0: fires): ReLU's pre-activation ``w x + b``, else
        ``score - threshold``."""
        if self.act == "relu" and self.w_mul is None:
            return lin(x, self.w, self.b).float() - threshold
        return self.score(x).float() - threshold


def decider_nodes(node: fx.Node, criterion: str = "gate") -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    """The weight nodes (w, b, w_mul) of a picompile.ffn ``node`` that decide if a neuron fires: gate rows for
    gated FFNs (times the up rows for non-ReLU ones under the "product" criterion), else the up rows and bias."""
    _, w_up, b_up, w_gate, _, _, act = node.args[:7]
    if w_gate is not None:
        return w_gate, None, w_up if criterion == "product" and act != "relu" else None  # type: ignore[return-value]
    return w_up, b_up, None  # type: ignore[return-value]


def decider_of(gm: fx.GraphModule, node: fx.Node, criterion: str = "gate") -> Decider:
    """The :class:`Decider` of a picompile.ffn ``node`` (its :func:`decider_nodes` as tensors)."""
    w, b, w_mul = (None if n is None else get_tensor(gm, n) for n in decider_nodes(node, criterion))
    assert w is not None
    return Decider(w, b, str(node.args[6]), w_mul)


@register_pass("profile-activations")
def profile_activations(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    cfg = ctx.config
    ids, corpus = load_calibration(cfg.calibration, ctx.tokenizer, ctx.info.vocab_size, cfg.calibration_tokens, cfg.seed)
    window = min(ctx.max_seq_len, 256)
    chunks = [ids[i : i + window] for i in range(0, ids.numel(), window)]
    recorder = _FFNInputs(gm)
    with torch.no_grad():
        for chunk in ctx.track(chunks, "profiling activations"):
            recorder.run(chunk.unsqueeze(0), *ctx.info.kv_tensors())
    nodes = ffn_nodes(gm)
    ctx.calibration = {}
    tensors: dict[str, torch.Tensor] = {}
    for layer in ctx.ffn_layers:
        node = nodes[layer.index]
        x = torch.cat(recorder.inputs[layer.index])  # [N, d_model]
        with torch.no_grad():
            a = decider_of(gm, node, cfg.act_criterion).score(x)  # [N, n_neurons]
        threshold = 0.0 if layer.act == "relu" else float(torch.quantile(a.flatten()[: 1 << 24].float(), cfg.act_sparsity))
        mask = a > threshold
        prof = LayerProfile.from_mask(mask.numpy(), name=layer.module)
        ctx.calibration[layer.index] = LayerCalibration(x=x, mask=mask, threshold=threshold, profile=prof)
        layer.stats.update({"sparsity": prof.sparsity, "locality": prof.locality, "act_threshold": threshold})
        tensors[f"layer{layer.index}.counts"] = torch.as_tensor(np.asarray(prof.counts, dtype=np.int64))
    tensors["n_tokens"] = torch.tensor([int(ids.numel())], dtype=torch.int64)
    save_file(tensors, str(ctx.staging_dir / PROFILE_FILE))
    ctx.calibration_ids = ids
    ctx.manifest_extra["profile"] = {"file": PROFILE_FILE, "corpus": corpus, "n_tokens": int(ids.numel()),
                                     "window": window, "active": "relu > 0" if all(
                                         layer.act == "relu" for layer in ctx.ffn_layers) else f"{cfg.act_criterion} score > per-layer threshold ({cfg.act_sparsity:.0%} target sparsity for non-ReLU)"}
    return gm


def update_counts(ctx: BuildContext, profiles: dict[int, LayerProfile]) -> None:
    """Rewrite the activation counts of these layers in profile.safetensors (after their thresholds moved)."""
    path = ctx.staging_dir / PROFILE_FILE
    tensors = dict(load_file(str(path)))
    for index, prof in profiles.items():
        tensors[f"layer{index}.counts"] = torch.as_tensor(np.asarray(prof.counts, dtype=np.int64))
    save_file(tensors, str(path))

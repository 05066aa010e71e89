"""profile-activations: graph unchanged; runs the calibration corpus through it and records, per FFN
layer, each neuron's activation count (→ profile.safetensors) and the (input, active-mask) pairs
train-predictors learns from. ReLU: active = output > 0; other activations: |act| above a per-layer
threshold set to reach ``act_sparsity`` (CATS-style).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from picompile.sparsity.calibration import build_calibration, sample_by_default
from picompile.context import BuildContext
from picompile.formats.profile import PROFILE_FILE, write_profile
from picompile.ir.ops import RELU_FAMILY, is_picompile_op
from picompile.ir.patterns import ffn_nodes
from picompile.ir.schema import bind
from picompile.passes.registry import register_pass
from picompile.sparsity.profile_stats import LayerProfile
from picompile.sparsity.widen import WideningInterpreter, float32_decider, release_stored

@dataclass
class LayerCalibration:
    """What profiling saw at one FFN: its inputs and which neurons were active."""

    x: torch.Tensor  # [N, d_model] float32
    mask: torch.Tensor  # [N, n_neurons] bool
    threshold: float  # |act| > threshold counts as active (0.0 for ReLU)
    profile: LayerProfile


class _FFNInputs(WideningInterpreter):
    """Runs the graph and keeps every picompile.ffn input ([tokens, d_model]) by layer (weights stored narrower
    are widened one at a time as they are read: the float32 model's values)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_picompile_op(target, "ffn"):
            call = bind("ffn", args, kwargs)
            x = call["x"]
            self.inputs.setdefault(int(call["layer"]), []).append(x.reshape(-1, x.shape[-1]).detach().clone())
        return super().call_function(target, args, kwargs)


@register_pass("profile-activations")
def profile_activations(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    cfg = ctx.config
    ids, corpus = build_calibration(cfg.calibration, cfg.calibration_source, sample_by_default(cfg), ctx.model,
                                    ctx.info.config, ctx.tokenizer, ctx.info.vocab_size, cfg.calibration_tokens,
                                    cfg.seed, cfg.calibration_cache)
    window = min(ctx.max_seq_len, 256)
    chunks = [ids[i : i + window] for i in range(0, ids.numel(), window)]
    recorder = _FFNInputs(gm)
    with torch.no_grad():
        for chunk in ctx.track(chunks, "profiling activations"):
            recorder.run(chunk.unsqueeze(0), *ctx.info.kv_tensors())
    nodes = ffn_nodes(gm)
    ctx.calibration = {}
    for layer in ctx.ffn_layers:
        node = nodes[layer.index]
        x = torch.cat(recorder.inputs.pop(layer.index))  # [N, d_model]; the chunks go (else held twice)
        with torch.no_grad():
            a = float32_decider(gm, node, cfg.act_criterion).score(x)  # [N, n_neurons]
        threshold = 0.0 if layer.act in RELU_FAMILY else float(torch.quantile(a.flatten()[: 1 << 24].float(), cfg.act_sparsity))
        mask = a > threshold
        prof = LayerProfile.from_mask(mask.numpy(), name=layer.module)
        ctx.calibration[layer.index] = LayerCalibration(x=x, mask=mask, threshold=threshold, profile=prof)
        layer.stats.update({"sparsity": prof.sparsity, "locality": prof.locality, "act_threshold": threshold})
    release_stored(gm)  # the checkpoint's mapped pages this read leave this process's memory
    write_profile(ctx.staging_dir / PROFILE_FILE, {i: cal.profile for i, cal in ctx.calibration.items()}, int(ids.numel()))
    ctx.calibration_ids = ids
    ctx.manifest_extra["profile"] = {"file": PROFILE_FILE, "corpus": corpus, "n_tokens": int(ids.numel()),
                                     "window": window, "active": ("relu(gate) > 0 and relu(up) > 0" if any(layer.act == "drelu" for layer in ctx.ffn_layers)
                                                else "relu > 0") if all(
                                         layer.act in RELU_FAMILY for layer in ctx.ffn_layers) else f"{cfg.act_criterion} score > per-layer threshold ({cfg.act_sparsity:.0%} target sparsity for non-ReLU)"}
    return gm

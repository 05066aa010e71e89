"""place-neurons: graph unchanged; solves PowerInfer's placement ILP (scipy milp / HiGHS) for the
target: hot neurons (GPU) and cold neurons (CPU) per FFN layer, within the VRAM left after attention,
predictors, norms, lm_head and (if it fits) the KV cache → placement.safetensors.
"""
from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import save_file
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.passes.registry import register_pass
from picompile.sparsity.placement import PlacementProblem, ffn_budget, solve_placement

PLACEMENT_FILE = "placement.safetensors"
ELEM_BYTES = 4  # float32 weights


def fixed_parts(ctx: BuildContext) -> list[tuple[str, int]]:
    """(name, bytes) of the non-FFN parts that may go to the GPU, by PowerInfer's categories."""
    ffn_params = {w.removeprefix("model.") for layer in ctx.ffn_layers for w in layer.weights.values()}
    sizes = {"attention": 0, "predictors": 0, "norms": 0, "lm_head": 0}
    seen: set[int] = set()
    for name, p in ctx.model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        nbytes = p.numel() * ELEM_BYTES
        if name in ffn_params:
            continue
        if "embed" in name:
            continue  # token/position embeddings are a lookup: they stay in host memory
        if "lm_head" in name:
            sizes["lm_head"] += nbytes
        elif p.dim() == 1 and "norm" in name:
            sizes["norms"] += nbytes
        else:
            sizes["attention"] += nbytes
    sizes["predictors"] = sum(sum(t.numel() for t in pr.parameters()) * ELEM_BYTES for pr in ctx.predictors.values())
    info = ctx.info
    kv = 2 * info.n_layers * info.n_kv_heads * info.head_dim * ctx.max_seq_len * ELEM_BYTES
    return [*sizes.items(), ("kv_cache", kv)]


@register_pass("place-neurons")
def place_neurons(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    if not ctx.calibration:
        raise PassError("place-neurons needs profile-activations to run first")
    parts = fixed_parts(ctx)
    budget, on_gpu = ffn_budget(ctx.target, parts)
    layers = ctx.ffn_layers
    problem = PlacementProblem(
        freqs=[np.asarray(ctx.calibration[layer.index].profile.counts, dtype=np.float64) for layer in layers],
        neuron_bytes=[(3 if layer.kind == "gated" else 2) * layer.d_model * ELEM_BYTES + (ELEM_BYTES if layer.kind == "mlp" else 0)
                      for layer in layers],
        budget_bytes=budget,
        batch_size=ctx.config.placement_batch,
        min_neurons=ctx.config.min_layer_neurons,
    )
    placement = solve_placement(problem)
    ctx.placement = placement
    tensors: dict[str, torch.Tensor] = {}
    for layer, hot, cold in zip(layers, placement.hot, placement.cold):
        layer.stats.update({"n_hot": int(hot.size), "n_cold": int(cold.size)})
        tensors[f"layer{layer.index}.hot"] = torch.as_tensor(hot, dtype=torch.int64)
        tensors[f"layer{layer.index}.cold"] = torch.as_tensor(cold, dtype=torch.int64)
    save_file(tensors, str(ctx.staging_dir / PLACEMENT_FILE))
    ctx.manifest_extra["placement"] = {
        "file": PLACEMENT_FILE, **placement.to_json(), "vram_bytes": ctx.target.vram_bytes,
        "fixed_parts": dict(parts), "fixed_parts_on_gpu": on_gpu,
    }
    return gm

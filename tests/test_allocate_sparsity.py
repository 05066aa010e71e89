"""allocate-sparsity alone (greedy per-layer thresholds against the calibration loss) and the "product"
activation criterion (|silu(gate)·up|) through profile → oracle masks → split."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.ir.ops import activation_score, is_picompile_op
from picompile.ir.schema import arg
from picompile.passes.allocate_sparsity import greedy_allocation
from picompile.testing import context_for, run_passes


def test_greedy_allocation_prefers_cheap_layers() -> None:
    cost = [4.0, 1.0, 2.0]  # loss per unit sparsity in each layer (an additive toy loss)
    calls: list[list[float]] = []

    def loss(s: list[float]) -> float:
        calls.append(list(s))
        return sum(c * v * v for c, v in zip(cost, s))  # convex: spread, weighted by cost

    alloc = greedy_allocation(loss, 3, target=0.4, step=0.05)
    assert sum(alloc) / 3 == pytest.approx(0.4)
    assert alloc[1] > alloc[2] > alloc[0]  # the cheapest layer takes the most
    assert max(alloc) <= 0.95 + 1e-9 and calls


def test_allocate_sparsity_lowers_calibration_loss(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "silu")], tmp_path, calibration_tokens=256, act_sparsity=0.4,
                      sparsity_allocation="greedy", allocation_step=0.1, allocation_tokens=128)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])
    n_nodes = len(gm.graph.nodes)
    before = {layer.index: ctx.calibration[layer.index].threshold for layer in ctx.ffn_layers}
    gm = run_passes(ctx, ["allocate-sparsity"], gm)
    assert len(gm.graph.nodes) == n_nodes  # an analysis: graph unchanged
    section = ctx.manifest_extra["sparsity_allocation"]
    per_layer = [section["per_layer"][str(layer.index)] for layer in ctx.ffn_layers]
    assert sum(per_layer) / len(per_layer) == pytest.approx(0.4)
    nll = section["calibration_nll"]
    assert nll["allocated"] == min(nll["greedy"], nll["uniform"])  # the pass keeps whichever measured better
    for layer in ctx.ffn_layers:
        cal = ctx.calibration[layer.index]
        # masks and stats follow the new thresholds: measured sparsity = allocated sparsity
        assert float(1 - cal.mask.float().mean()) == pytest.approx(layer.stats["act_sparsity"], abs=0.02)
        if layer.stats["act_sparsity"] != pytest.approx(0.4):
            assert cal.threshold != before[layer.index]


def test_uniform_allocation_is_a_no_op(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "silu")], tmp_path, calibration_tokens=128, act_sparsity=0.3)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])
    before = {i: c.threshold for i, c in ctx.calibration.items()}
    run_passes(ctx, ["allocate-sparsity"], gm)
    assert {i: c.threshold for i, c in ctx.calibration.items()} == before
    assert "sparsity_allocation" not in ctx.manifest_extra


def test_product_criterion_masks_by_real_output(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "silu")], tmp_path, calibration_tokens=256, act_sparsity=0.5,
                      act_criterion="product", predictor="oracle", vram_budget_gib=2e-5)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations", "place-neurons", "insert-predictors"])
    masks = [n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "oracle_mask")]
    assert len(masks) == len(ctx.ffn_layers) and all(len(n.args) == 7 and arg(n, "w_mul") is not None for n in masks)
    layer = ctx.ffn_layers[0]
    cal = ctx.calibration[layer.index]
    mlp = ctx.model.model.layers[layer.index].mlp
    with torch.no_grad():
        h = torch.nn.functional.silu(mlp.gate_proj(cal.x)) * mlp.up_proj(cal.x)  # [N, n_neurons] the real output
        score = activation_score(cal.x, mlp.gate_proj.weight, None, "silu", mlp.up_proj.weight)
    torch.testing.assert_close(score, h.abs())
    assert torch.equal(cal.mask, h.abs() > cal.threshold)
    assert float(1 - cal.mask.float().mean()) == pytest.approx(0.5, abs=0.01)
    # split-ffn permutes the up rows of the mask producer with the neurons: masks still match the parts
    gm = run_passes(ctx, ["split-ffn"], gm)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        out = gm(ids, *ctx.info.kv_tensors())[0]  # [1, 16, vocab]
        ref = _masked_reference(ctx, ids, cal_threshold={l.index: ctx.calibration[l.index].threshold
                                                         for l in ctx.ffn_layers})
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _masked_reference(ctx: object, ids: torch.Tensor, cal_threshold: dict[int, float]) -> torch.Tensor:
    """The HF model with each MLP's neurons zeroed where |silu(gate)·up| <= the layer threshold."""
    model = ctx.model  # type: ignore[attr-defined]
    handles = []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp

        def fwd(x: torch.Tensor, mlp: torch.nn.Module = mlp, t: float = cal_threshold[i]) -> torch.Tensor:
            h = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(h * (h.abs() > t))

        handles.append(mlp.register_forward_hook(lambda mod, inp, out, f=fwd: f(inp[0])))
    try:
        return model(ids).logits
    finally:
        for h in handles:
            h.remove()

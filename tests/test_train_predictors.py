"""train-predictors alone: one predictor per layer (linear or PowerInfer's MLP), recall at target on fresh tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.ir.graph import get_tensor
from picompile.ir.ops import oracle_mask
from picompile.ir.schema import arg
from picompile.testing import context_for, run_passes


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_predictors_find_active_neurons(kind: str, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path, calibration_tokens=2048, predictor_kind=kind)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])
    n_nodes = len(gm.graph.nodes)
    gm = run_passes(ctx, ["train-predictors"], gm)
    assert len(gm.graph.nodes) == n_nodes
    assert sorted(ctx.predictors) == [0, 1]
    budget = 0.2 * 2 * 2 * 64 * 192  # 20% (the default) of the FFN parameters (two matrices per layer, two layers)
    assert sum(p.n_params for p in ctx.predictors.values()) <= budget
    for layer in ctx.ffn_layers:
        pred = ctx.predictors[layer.index]
        r = layer.stats["predictor_rank"]
        assert pred.fc1.weight.shape == (r, 64) and pred.fc2.weight.shape == (192, r)
        assert layer.stats["predictor_kind"] == kind and pred.act == ("none" if kind == "linear" else "relu")
        assert (pred.offset is None) == (kind == "mlp") and (kind == "mlp" or pred.offset.shape == (192,))
        assert layer.stats["recall_target"] == 0.95  # the default for an all-ReLU model
        assert layer.stats["recall"] >= 0.94
        assert layer.stats["precision"] > layer.stats["true_active"]  # better than guessing
        assert layer.stats["predicted_active"] < 0.95  # it skips neurons
        # fresh tokens the predictor never saw: inputs perturbed from the calibration ones
        cal = ctx.calibration[layer.index]
        gen = torch.Generator().manual_seed(123)
        x = cal.x[:512] + 0.05 * cal.x.std() * torch.randn(512, 64, generator=gen)
        node = next(n for n in gm.graph.nodes
                    if n.target == torch.ops.picompile.ffn.default and arg(n, "layer") == layer.index)
        w, b = get_tensor(gm, arg(node, "w_up")), get_tensor(gm, arg(node, "b_up"))  # fc1 rows and bias
        true = oracle_mask(x, w, b, "relu", 0.0, layer.index)
        with torch.no_grad():
            got = pred.mask(x)
        recall = (got & true).sum() / true.sum()
        assert recall > 0.95


def test_oracle_mode_trains_nothing(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path, calibration_tokens=64, predictor="oracle")
    run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations", "train-predictors"])
    assert ctx.predictors == {} and "recall" not in ctx.ffn_layers[0].stats

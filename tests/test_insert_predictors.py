"""insert-predictors alone: one predictor (or oracle) node per FFN feeding its mask; numerics."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.schema import arg
from picompile.testing import context_for, run_passes

PREFIX = ["capture", "canonicalize-ffn", "profile-activations", "train-predictors", "place-neurons"]


def _logits(gm: torch.fx.GraphModule, ctx, ids: list[int]) -> torch.Tensor:
    empty = ctx.info.kv_tensors()
    with torch.no_grad():
        return gm(torch.tensor([ids]), *empty)[0][0]


@pytest.mark.parametrize("mode", ["trained", "oracle", "none"])
def test_predictor_nodes(mode: str, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=512, predictor=mode)
    gm = run_passes(ctx, PREFIX)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    dense = _logits(gm, ctx, ids)
    gm = run_passes(ctx, ["insert-predictors"], gm)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops.get("picompile::predict", 0) == (L if mode == "trained" else 0)
    assert ops.get("picompile::oracle_mask", 0) == (L if mode == "oracle" else 0)
    ffns = [n for n in gm.graph.nodes if n.target == torch.ops.picompile.ffn.default]
    assert len(ffns) == L
    for n in ffns:
        mask = arg(n, "mask")
        assert (mask is None) == (mode == "none")
        if mask is not None:
            assert arg(mask, "x") is arg(n, "x")  # the predictor reads the FFN's own input
    sparse = _logits(gm, ctx, ids)
    if mode in ("oracle", "none"):  # exact for a ReLU model: skipped neurons are exactly zero
        assert (sparse - dense).abs().max().item() < 1e-5
    else:  # trained predictors miss ~1% of active neurons: close, but not identical
        assert 0 < (sparse - dense).abs().max().item()
        assert torch.nn.functional.cosine_similarity(sparse, dense, dim=-1).min() > 0.9


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_predict_node_is_the_trained_predictor(kind: str, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=512, predictor_kind=kind)
    gm = run_passes(ctx, PREFIX + ["insert-predictors"])
    preds = {arg(n, "layer"): n for n in gm.graph.nodes if n.target == torch.ops.picompile.predict.default}
    assert sorted(preds) == sorted(ctx.predictors)
    for layer, node in preds.items():
        pred = ctx.predictors[layer]
        fc1, fc2, threshold, act, offset = (arg(node, k) for k in ("fc1", "fc2", "threshold", "act", "offset"))
        assert act == ("none" if kind == "linear" else "relu") and (offset is None) == (kind == "mlp")
        assert get_tensor(gm, fc1).shape == (pred.rank, pred.d_model) and threshold == float(pred.threshold)
        cal_x = ctx.calibration[layer].x[:256]  # [256, d_model]
        got = torch.ops.picompile.predict(cal_x, get_tensor(gm, fc1), get_tensor(gm, fc2), threshold, layer, act,
                                          None if offset is None else get_tensor(gm, offset))
        with torch.no_grad():
            want = pred(cal_x) > pred.threshold
        assert got.shape == want.shape and (got == want).float().mean() > 0.999  # float rounding at the threshold

"""split-ffn alone: hot + cold + merge per layer with contiguous neuron-major rows; numerics unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.schema import arg, args_of
from picompile.testing import context_for, decode_logits, run_passes

PREFIX = ["capture", "canonicalize-ffn", "profile-activations", "train-predictors", "place-neurons", "insert-predictors"]


@pytest.mark.parametrize("key,mode,target,budget", [
    (("llama", "relu"), "trained", "rtx4090", 0.00045),  # both parts non-empty
    (("opt", "relu"), "oracle", "cpu", None),  # hot part empty (k = 0)
    (("llama", "silu"), "none", "rtx4090", None),  # everything hot, cold part empty, no mask
])
def test_split(key: tuple[str, str], mode: str, target: str, budget: float | None, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path, calibration_tokens=256, predictor=mode, target=target,
                      vram_budget_gib=budget, placement_batch=8)
    gm = run_passes(ctx, PREFIX)
    ids = [7, 3, 99, 42, 5, 61]
    before = decode_logits(gm, ctx, ids)
    gm = run_passes(ctx, ["split-ffn"], gm)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops.get("picompile::ffn", 0) == 0
    assert ops["picompile::sparse_ffn"] == 2 * L and ops["picompile::merge"] == L
    parts = [n for n in gm.graph.nodes if n.target == torch.ops.picompile.sparse_ffn.default]
    for layer in ctx.ffn_layers:
        hot, cold = [args_of(n) for n in parts if arg(n, "layer") == layer.index]
        assert (hot["part"], hot["device"], cold["part"], cold["device"]) == ("hot", "gpu", "cold", "cpu")
        n_hot, n_cold = layer.stats["n_hot"], layer.stats["n_cold"]
        assert get_tensor(gm, hot["w_up"]).shape == (n_hot, layer.d_model)
        assert get_tensor(gm, cold["w_down_t"]).shape == (n_cold, layer.d_model)  # down, transposed: neuron-major
        assert get_tensor(gm, cold["w_down_t"]).is_contiguous()
        assert (hot["mask"] is None) == (mode == "none")
    if key == ("llama", "relu"):
        assert 0 < ctx.ffn_layers[0].stats["n_hot"] < 192
    after = decode_logits(gm, ctx, ids)
    assert (after - before).abs().max().item() < 1e-4

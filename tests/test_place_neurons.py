"""place-neurons alone: budgets that fit all / nothing / part, hot = most frequent, clear budget errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from picompile.errors import BudgetError
from picompile.passes.place_neurons import fixed_parts
from picompile.testing import context_for, run_passes

PREFIX = ["capture", "canonicalize-ffn", "profile-activations"]


def _place(checkpoints: dict, tmp_path: Path, **options: object):
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=256, predictor="oracle", **options)
    gm = run_passes(ctx, PREFIX)
    run_passes(ctx, ["place-neurons"], gm)
    return ctx


def test_everything_fits_all_hot(checkpoints: dict, tmp_path: Path) -> None:
    ctx = _place(checkpoints, tmp_path, target="rtx4090")
    assert all(layer.stats["n_hot"] == 192 and layer.stats["n_cold"] == 0 for layer in ctx.ffn_layers)
    assert "kv_cache" in ctx.manifest_extra["placement"]["fixed_parts_on_gpu"]


def test_cpu_target_all_cold(checkpoints: dict, tmp_path: Path) -> None:
    ctx = _place(checkpoints, tmp_path, target="cpu")
    assert all(layer.stats["n_hot"] == 0 and layer.stats["n_cold"] == 192 for layer in ctx.ffn_layers)
    data = load_file(str(tmp_path / "placement.safetensors"))
    assert sorted(data["layer0.cold"].tolist()) == list(range(192))


def test_partial_budget_takes_most_frequent(checkpoints: dict, tmp_path: Path) -> None:
    ctx0 = context_for(checkpoints[("llama", "relu")], tmp_path / "probe", predictor="oracle")
    run_passes(ctx0, ["capture", "canonicalize-ffn"])
    fixed = sum(b for _, b in fixed_parts(ctx0))  # attention, norms, lm_head, KV cache
    neuron = 3 * 64 * 4
    budget_gib = (fixed + 150 * neuron) / (1 << 30)  # room for 150 of 384 neurons
    ctx = _place(checkpoints, tmp_path, target="rtx4090", vram_budget_gib=budget_gib, placement_batch=8)
    n_hot = sum(layer.stats["n_hot"] for layer in ctx.ffn_layers)
    assert 140 <= n_hot <= 150
    for layer, hot, cold in zip(ctx.ffn_layers, ctx.placement.hot, ctx.placement.cold):
        counts = ctx.calibration[layer.index].profile.counts
        assert sorted(np.concatenate([hot, cold]).tolist()) == list(range(192))
        if hot.size and cold.size:  # every hot neuron fires at least as often as every cold one, up to a batch
            assert counts[hot].min() >= np.sort(counts[cold])[-9]
    assert ctx.manifest_extra["placement"]["gpu_bytes"] <= ctx.manifest_extra["placement"]["budget_bytes"]


def test_budget_too_small_for_dense_parts(checkpoints: dict, tmp_path: Path) -> None:
    with pytest.raises(BudgetError, match="attention"):
        _place(checkpoints, tmp_path, target="rtx4090", vram_budget_gib=1e-6)

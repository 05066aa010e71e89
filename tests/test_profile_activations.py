"""profile-activations alone: counts equal an independent count from forward hooks; graph unchanged."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from picompile.testing import context_for, run_passes


def hook_counts(model: torch.nn.Module, ids: torch.Tensor, window: int) -> list[np.ndarray]:
    """Active-neuron counts from forward hooks on each act_fn (the test's own oracle)."""
    acts: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.mlp.act_fn.register_forward_hook(
            lambda mod, inp, out, i=i: acts.setdefault(i, []).append((out > 0).reshape(-1, out.shape[-1]))))
    with torch.no_grad():
        for s in range(0, ids.numel(), window):
            model(ids[s : s + window].unsqueeze(0))
    for h in handles:
        h.remove()
    return [torch.cat(acts[i]).sum(0).numpy() for i in sorted(acts)]


def test_counts_match_hooks(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=300)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn"])
    n_nodes = len(gm.graph.nodes)
    gm = run_passes(ctx, ["profile-activations"], gm)
    assert len(gm.graph.nodes) == n_nodes  # an analysis: graph unchanged
    data = load_file(str(tmp_path / "profile.safetensors"))
    assert int(data["n_tokens"][0]) == 300
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ctx.info.vocab_size, (300,), generator=gen)  # the synthetic default corpus
    expected = hook_counts(ctx.model, ids, window=min(ctx.max_seq_len, 256))
    for i, exp in enumerate(expected):
        np.testing.assert_array_equal(data[f"layer{i}.counts"], exp)
        cal = ctx.calibration[i]
        assert cal.x.shape == (300, 64) and cal.mask.shape == (300, 192)
        assert 0.3 < ctx.ffn_layers[i].stats["sparsity"] < 0.7  # a random ReLU model: about half inactive
    section = ctx.manifest_extra["profile"]
    assert section["n_tokens"] == 300 and section["corpus"]["kind"] == "synthetic"


@pytest.mark.parametrize("target_sparsity", [0.3, 0.7])
def test_silu_threshold_reaches_target_sparsity(target_sparsity: float, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "silu")], tmp_path, calibration_tokens=256, act_sparsity=target_sparsity)
    run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])
    for layer in ctx.ffn_layers:
        assert abs(layer.stats["sparsity"] - target_sparsity) < 0.01
        assert layer.stats["act_threshold"] > 0


def test_calibration_from_token_file(checkpoints: dict, tmp_path: Path) -> None:
    ids = np.arange(100, dtype=np.int64) % 200
    np.save(tmp_path / "ids.npy", ids)
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path / "s", calibration=tmp_path / "ids.npy")
    run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])
    corpus = ctx.manifest_extra["profile"]["corpus"]
    assert corpus["kind"] == "tokens" and corpus["n_tokens"] == 100 and len(corpus["sha256"]) == 64


def test_calibration_text_without_tokenizer(checkpoints: dict, tmp_path: Path) -> None:
    from picompile.errors import PicompileError

    (tmp_path / "c.txt").write_text("some text " * 50)
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path / "s", calibration=tmp_path / "c.txt")
    with pytest.raises(PicompileError, match="needs a tokenizer, and this model has none"):
        run_passes(ctx, ["capture", "canonicalize-ffn", "profile-activations"])

"""Locality, sparsity and per-layer summaries of activation profiles."""
from __future__ import annotations

import numpy as np
import pytest

from picompile.sparsity.profile_stats import LayerProfile, locality, sparsity, summarize


def test_locality_uniform_skewed_and_edge_cases() -> None:
    assert locality(np.full(100, 7)) == pytest.approx(0.8)
    assert locality(np.r_[1000, np.zeros(99)]) == pytest.approx(0.01)
    # 4 neurons carry 80 of 100 activations; order of the input does not matter
    freq = np.r_[np.ones(20), [20, 20, 20, 20]]
    assert locality(freq) == pytest.approx(4 / 24)
    assert locality(freq, share=0.81) == pytest.approx(5 / 24)
    assert locality(freq, share=1.0) == pytest.approx(1.0)
    assert locality(np.zeros(10)) == 0.0
    with pytest.raises(ValueError):
        locality(freq, share=0.0)
    with pytest.raises(ValueError):
        locality(np.array([1.0, -1.0]))


def test_locality_power_law_is_skewed() -> None:
    counts = np.floor(np.random.default_rng(0).pareto(1.1, 10_000) * 100)
    assert locality(counts) < 0.35


def test_sparsity() -> None:
    assert sparsity(np.array([10, 0, 0, 0]), 10) == pytest.approx(0.75)
    assert sparsity(np.zeros(5, dtype=np.int64), 3) == 1.0
    with pytest.raises(ValueError):
        sparsity(np.ones(3), 0)


def test_layer_profile_from_mask_merge_and_summary() -> None:
    mask = np.array([[1, 0, 0, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=bool)  # [3 tokens, 4 neurons]
    p = LayerProfile.from_mask(mask, name="layers.0.mlp")
    assert p.counts.dtype == np.int64 and p.counts.tolist() == [3, 1, 0, 1] and p.n_tokens == 3
    assert p.sparsity == pytest.approx(1 - 5 / 12)
    assert p.mean_active == pytest.approx(5 / 3)
    assert p.dead_fraction == pytest.approx(0.25)
    assert p.frequency.tolist() == pytest.approx([1.0, 1 / 3, 0.0, 1 / 3])
    both = p.merged(LayerProfile(np.array([0, 0, 2, 0]), 2))
    assert both.counts.tolist() == [3, 1, 2, 1] and both.n_tokens == 5
    rows = summarize([p, both])
    assert [r["layer"] for r in rows] == [0, 1] and rows[0]["name"] == "layers.0.mlp"
    assert rows[0]["sparsity"] == pytest.approx(p.sparsity) and rows[1]["locality"] == pytest.approx(both.locality)
    assert rows[0]["max_frequency"] == 1.0
    with pytest.raises(ValueError):
        LayerProfile(np.array([4, 0]), 3)  # more activations than tokens

"""Hot/cold placement: the MILP, the greedy, the per-layer minimum and the FFN budget."""
from __future__ import annotations

import numpy as np
import pytest

from picompile.errors import BudgetError
from picompile.sparsity.placement import (
    Placement,
    PlacementProblem,
    ffn_budget,
    greedy_placement,
    solve_placement,
)
from picompile.targets import get_target

GiB = 1 << 30


def _power_law(rng: np.random.Generator, n_layers: int, n_neurons: int) -> list[np.ndarray]:
    """Power-law activation counts, one array [n_neurons] per layer."""
    return [np.floor(rng.pareto(1.1, n_neurons) * 50).astype(np.int64) for _ in range(n_layers)]


def _check_partition(problem: PlacementProblem, pl: Placement) -> None:
    """hot ∪ cold is every neuron once; both sorted by frequency desc; bytes add up exactly."""
    used = 0
    for f, nb, hot, cold in zip(problem.freqs, problem.neuron_bytes, pl.hot, pl.cold):
        assert hot.dtype == np.int64 and cold.dtype == np.int64
        assert np.array_equal(np.sort(np.concatenate([hot, cold])), np.arange(f.size))
        assert np.all(np.diff(f[hot]) <= 0) and np.all(np.diff(f[cold]) <= 0)
        used += int(hot.size) * int(nb)
    assert pl.gpu_bytes == used <= problem.budget_bytes
    assert pl.objective == pytest.approx(sum(float(f[h].sum()) for f, h in zip(problem.freqs, pl.hot)))


def test_everything_fits_all_hot() -> None:
    freqs = _power_law(np.random.default_rng(0), 3, 200)
    p = PlacementProblem(freqs, [96] * 3, budget_bytes=3 * 200 * 96, batch_size=64)
    pl = solve_placement(p)
    _check_partition(p, pl)
    assert pl.n_hot == [200, 200, 200] and all(c.size == 0 for c in pl.cold)
    assert pl.coverage == pytest.approx(1.0)


def test_zero_budget_all_cold() -> None:
    freqs = _power_law(np.random.default_rng(1), 3, 200)
    for pl in (solve_placement(PlacementProblem(freqs, [96] * 3, 0)), greedy_placement(PlacementProblem(freqs, [96] * 3, 0))):
        assert pl.n_hot == [0, 0, 0] and pl.gpu_bytes == 0 and pl.objective == 0.0
        assert [c.size for c in pl.cold] == [200, 200, 200]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_equals_greedy_with_equal_batch_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    freqs = _power_law(rng, 6, 512)  # 512 = 8 batches of 64: every batch costs the same
    p = PlacementProblem(freqs, [3 * 256 * 2] * 6, budget_bytes=int(rng.integers(64, 3072)) * 3 * 256 * 2 + 5, mip_rel_gap=0.0)
    pl, gr = solve_placement(p), greedy_placement(p)
    assert pl.method == "milp"
    _check_partition(p, pl)
    _check_partition(p, gr)
    assert pl.objective == pytest.approx(gr.objective, rel=1e-12)


def test_milp_at_least_greedy_with_unequal_bytes() -> None:
    rng = np.random.default_rng(3)
    freqs = [f[: int(n)] for f, n in zip(_power_law(rng, 5, 700), rng.integers(100, 700, 5))]
    p = PlacementProblem(freqs, [1000, 1536, 1000, 2050, 777], budget_bytes=600_000, batch_size=64, mip_rel_gap=0.0)
    pl, gr = solve_placement(p), greedy_placement(p)
    _check_partition(p, pl)
    _check_partition(p, gr)
    assert pl.method == "milp"
    assert pl.objective >= gr.objective * (1 - 1e-12)


def test_min_neurons_respected_and_changes_solution() -> None:
    # Layer 0: 16 hot-ish neurons; layer 1: one very hot batch of 4, the rest near-dead.
    freqs = [np.full(16, 10.0), np.r_[np.full(4, 9.0), np.full(12, 0.1)]]
    base = dict(freqs=freqs, neuron_bytes=[8, 8], budget_bytes=20 * 8, batch_size=4, mip_rel_gap=0.0)
    free = solve_placement(PlacementProblem(**base))
    assert free.n_hot == [16, 4] and free.objective == pytest.approx(196.0)
    p = PlacementProblem(**base, min_neurons=8)
    pinned = solve_placement(p)
    _check_partition(p, pinned)
    assert pinned.method == "milp"
    assert pinned.n_hot == [16, 0] and pinned.objective == pytest.approx(160.0)
    assert greedy_placement(p).n_hot == [16, 0]  # the greedy's repair is feasible as well


def test_min_neurons_random_layers_zero_or_at_least_min() -> None:
    rng = np.random.default_rng(4)
    freqs = _power_law(rng, 8, 256)
    freqs.append(np.array([5.0, 3.0, 1.0]))  # a layer smaller than the minimum may still go whole
    p = PlacementProblem(freqs, [64] * 9, budget_bytes=700 * 64, batch_size=32, min_neurons=160, mip_rel_gap=0.0)
    pl, gr = solve_placement(p), greedy_placement(p)
    for sol in (pl, gr):
        _check_partition(p, sol)
        assert all(n == 0 or n >= min(160, f.size) for n, f in zip(sol.n_hot, freqs))
    assert pl.method == "milp" and pl.objective >= gr.objective * (1 - 1e-12)


def test_budget_above_4gib_int64() -> None:
    rng = np.random.default_rng(5)
    n_layers, n_neurons, neuron_bytes = 16, 16384, 3 * 8192 * 2  # 12 GiB of FFN neurons
    freqs = _power_law(rng, n_layers, n_neurons)
    budget = 5 * GiB + 12345
    p = PlacementProblem(freqs, [neuron_bytes] * n_layers, budget, batch_size=256, mip_rel_gap=0.0)
    assert p.total_bytes > budget > 2**32
    pl = solve_placement(p)
    _check_partition(p, pl)
    assert pl.method == "milp"
    assert 2**32 < pl.gpu_bytes <= budget
    assert budget - pl.gpu_bytes < 256 * neuron_bytes  # no whole batch left unused
    assert pl.objective == pytest.approx(greedy_placement(p).objective, rel=1e-12)


def test_ffn_budget_priority_and_optional_kv() -> None:
    parts = [("kv_cache", 500), ("lm_head", 100), ("attention", 400), ("norms", 10), ("predictors", 50)]
    left, placed = ffn_budget(1000, parts)
    assert placed == ["attention", "predictors", "norms", "lm_head"]  # KV cache (500) does not fit in 440
    assert left == 440
    left, placed = ffn_budget(2000, parts)
    assert placed[-1] == "kv_cache" and left == 2000 - 1060
    assert ffn_budget(get_target("cpu"), parts) == (0, [])
    big = ffn_budget(get_target("h200"), [("attention", 3 * GiB)])
    assert big == (141 * GiB - 3 * GiB, ["attention"])


def test_ffn_budget_error_names_sizes() -> None:
    with pytest.raises(BudgetError) as err:
        ffn_budget(get_target("rtx4090", vram_budget_gib=1.0), [("attention", 2 * GiB), ("lm_head", 500), ("kv_cache", 1)])
    msg = str(err.value)
    assert "attention=2147483648 B" in msg and "lm_head=500 B" in msg and str(GiB) in msg
    assert "kv_cache" not in msg

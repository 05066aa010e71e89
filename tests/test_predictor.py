"""Predictor training, threshold tuning and rank choice on small synthetic layers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from picompile.errors import BudgetError
from picompile.sparsity.predictor import Predictor, choose_ranks, evaluate, train_predictor, tune_threshold

D_MODEL, N_NEURONS = 64, 512


def _synthetic(n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x [n_tokens, D_MODEL] and a mask [n_tokens, N_NEURONS] that is a function of x.

    ``mask = (x @ W + b) > 0`` with a rank-16 ``W`` (unit columns) and a skewed bias: a few hot
    neurons, most rarely active (~87 % sparse, locality ~0.28). Dimension 0 carries a large constant
    offset, like the outlier dimensions of real hidden states, so a bias-free predictor can model ``b``.
    The layer (W, b) is fixed; ``seed`` draws the tokens.
    """
    g = torch.Generator().manual_seed(123)
    w = torch.randn(D_MODEL, 16, generator=g) @ torch.randn(16, N_NEURONS, generator=g)  # [D_MODEL, N_NEURONS]
    w = w / w.norm(dim=0, keepdim=True)
    b = 1.5 - 4.0 * torch.rand(N_NEURONS, generator=g) ** 0.3  # [N_NEURONS]
    x = torch.randn(n_tokens, D_MODEL, generator=torch.Generator().manual_seed(seed))  # [n_tokens, D_MODEL]
    x[:, 0] += 6.0
    return x, (x @ w + b) > 0


@pytest.fixture(scope="module")
def trained() -> tuple[Predictor, object]:
    x, mask = _synthetic(3000, seed=0)
    return train_predictor(x, mask, rank=32, epochs=12, seed=0)


def test_recall_precision_on_fresh_tokens(trained: tuple[Predictor, object]) -> None:
    model, report = trained
    x, mask = _synthetic(2000, seed=1)  # never seen: neither training nor threshold tuning
    base_rate = float(mask.float().mean())
    assert 0.08 < base_rate < 0.2
    m = evaluate(model, x, mask)
    assert m["recall"] >= 0.98
    assert m["precision"] > 3 * base_rate
    assert m["predicted_active_fraction"] < 0.35
    # The report (held-out tokens) reaches the target and agrees with the stored threshold.
    assert report.recall >= 0.99 and report.precision > 3 * base_rate
    assert report.n_train + report.n_holdout == 3000 and report.n_holdout == 600
    assert report.threshold == float(model.threshold) and report.rank == 32
    assert report.predicted_active_fraction < 0.35 and report.true_active_fraction == pytest.approx(base_rate, abs=0.02)
    assert model.mask(x[0]).shape == (N_NEURONS,) and model.mask(x).dtype == torch.bool
    assert model.n_params == 32 * (D_MODEL + N_NEURONS)


def test_deterministic_for_a_seed() -> None:
    x, mask = _synthetic(600, seed=2)
    runs = [train_predictor(x, mask, rank=8, epochs=2, seed=s) for s in (7, 7, 8)]
    (a, ra), (b, rb), (c, _) = runs
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
    assert ra == rb
    assert not torch.equal(a.fc1.weight, c.fc1.weight)


def test_tune_threshold_exact() -> None:
    logits = torch.tensor([[5.0, 1.0, -1.0], [4.0, 3.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])  # positive logits 5, 1, 4, 0
    assert tune_threshold(logits, mask, 1.0) == 0.0
    assert tune_threshold(logits, mask, 0.75) == 1.0  # one of four may be missed
    assert tune_threshold(logits, torch.zeros_like(mask), 0.99) == float("inf")


@dataclass
class _Stats:
    sparsity: float
    locality: float


def test_choose_ranks_budget_and_ordering() -> None:
    stats = [_Stats(0.95, 0.1), _Stats(0.85, 0.3), _Stats(0.6, 0.6)]  # sparse+skewed → dense+flat
    d, n = 512, 2048
    ranks = choose_ranks(stats, d, n)  # default: 10 % of 2·d·n per layer
    assert all(r >= 8 and r % 8 == 0 for r in ranks)
    assert sum(r * (d + n) for r in ranks) <= int(0.1 * 3 * 2 * d * n)
    assert ranks[0] < ranks[1] < ranks[2]
    assert sum(ranks) * (d + n) > 0.9 * 0.1 * 3 * 2 * d * n  # the budget is (nearly) used

    explicit = choose_ranks(stats, d, n, budget_params=3 * 64 * (d + n))
    assert sum(explicit) <= 3 * 64 and all(r % 8 == 0 for r in explicit)
    assert choose_ranks(stats, d, n, budget_params=10**9, max_rank=128) == [128, 128, 128]


def test_choose_ranks_tiny_budget() -> None:
    stats = [_Stats(0.9, 0.3)] * 4
    assert choose_ranks(stats, 64, 256, budget_params=4 * 5 * 320) == [5, 5, 5, 5]  # below 8: uniform
    with pytest.raises(BudgetError):
        choose_ranks(stats, 64, 256, budget_params=100)
    assert choose_ranks([], 64, 256) == []


def test_choose_ranks_kernel_granularity() -> None:
    """1B-class layers get ranks in multiples of 64 (the GEMV kernel's lanes), under the same budget."""
    stats = [_Stats(0.9, 0.26)] * 22
    d, n = 2048, 5632
    ranks = choose_ranks(stats, d, n, budget_fraction=0.1, ffn_matrices=3)
    assert all(r % 64 == 0 and r >= 64 for r in ranks)
    budget = int(0.1 * 22 * 3 * d * n)
    assert budget - 64 * (d + n) < sum(r * (d + n) for r in ranks) <= budget  # used to within one step
    assert all(r % 8 == 0 for r in choose_ranks(stats, d, n, budget_fraction=0.1, granularity=8))


@pytest.mark.parametrize("act", ["none", "relu"])
def test_int8_rows_fold_to_the_same_masks(act: str, tmp_path: Path) -> None:
    """round_weights_(int8) then fold_int8: int8 fc1/fc2 with no scales and a shifted offset, threshold 0, decide
    as the rounded float predictor does (up to float rounding at the threshold itself); the one-token kernel too."""
    from picompile.ir.ops import predict
    from picompile.sparsity.predictor import fold_int8, round_weights_

    torch.manual_seed(0)
    d, n, r = 256, 512, 32
    p = Predictor(d, n, r, act=act)
    p.offset = torch.randn(n)
    with torch.no_grad():
        p.fc2.weight[5].zero_()  # a zero row: a constant decision
    round_weights_(p, torch.int8)
    w1 = p.fc1.weight.detach()
    assert torch.equal(w1, w1.round()) and float(w1.abs().max()) == 127.0
    x = torch.randn(100, d)
    with torch.no_grad():
        logits = p(x).double()  # [100, n]
    thr = float(logits.quantile(0.8))
    q1, q2, off, t = fold_int8(p.fc1.weight, p.fc2.weight, p.offset, thr)
    assert q1.dtype == q2.dtype == torch.int8 and t == 0.0 and not bool(q2[5].any())
    got = predict(x, q1, q2, t, 0, act, off)  # [100, n]
    want = logits > thr
    near = (logits - thr).abs() < 1e-4 * logits.abs().max()
    assert bool((got == want)[~near].all()) and bool(got[:, 5].eq(bool(p.offset[5] > thr)).all())
    # the predict kernel takes the int8 weights as they are
    from picompile.kernels import KernelSpec, as_aligned, build_kernel, load_kernel
    from picompile.kernels.table import threshold_tensor

    spec = KernelSpec(kind="predict", act=act, d_model=d, n_rows=n, weight_dtype="int8", has_bias=True,
                      target="llvm", rank=r)
    kern = load_kernel(build_kernel(spec, tmp_path), spec)
    mask = torch.empty(n, dtype=torch.int8)
    for i in range(20):
        kern(as_aligned(x[i].clone()), as_aligned(q1, copy=True), as_aligned(q2, copy=True), as_aligned(off, copy=True),
             threshold_tensor(t), mask)
        assert bool((mask.bool() == want[i])[~near[i]].all())


def test_fold_int8_refuses_unrounded_weights() -> None:
    from picompile.sparsity.predictor import fold_int8

    p = Predictor(16, 32, 4)
    with pytest.raises(ValueError, match="not int8 row quants"):
        fold_int8(p.fc1.weight, p.fc2.weight, None, 0.0)

"""Linear predictors fitted by reduced-rank regression: exact on a linear layer, rank chosen by cost,
better than the BCE-trained MLP where the margins are low-rank, deterministic."""
from __future__ import annotations

import pytest
import torch

from picompile.sparsity.linear_predictor import candidate_ranks, fit_linear_predictor
from picompile.sparsity.predictor import evaluate, train_predictor

D_MODEL, N_NEURONS, SUBSPACE = 64, 256, 8


def _layer(n_tokens: int, seed: int, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``x [n_tokens, D_MODEL]`` and margins ``z [n_tokens, N_NEURONS]`` of a fixed random layer.

    Like the synthetic 1B models: ``x`` lies mostly in a SUBSPACE-dimensional subspace (plus ``noise``
    isotropic), ``z = W x + b`` with i.i.d. rows W and biases that make ~10 % of the neurons fire, skewed.
    """
    g = torch.Generator().manual_seed(5)
    basis = torch.linalg.qr(torch.randn(D_MODEL, SUBSPACE, generator=g)).Q  # [D_MODEL, SUBSPACE]
    w = torch.randn(N_NEURONS, D_MODEL, generator=g) / D_MODEL ** 0.5  # [N_NEURONS, D_MODEL]
    b = -2.2 + 1.6 * torch.rand(N_NEURONS, generator=g) ** 3  # [N_NEURONS]
    t = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, SUBSPACE, generator=t) @ basis.T * (D_MODEL / SUBSPACE) ** 0.5
    x = x + noise * torch.randn(n_tokens, D_MODEL, generator=t) + 0.5  # [n_tokens, D_MODEL], offset mean
    return x, x @ w.T + b


def test_exact_on_a_noiseless_low_rank_layer() -> None:
    x, z = _layer(2000, seed=0, noise=0.0)  # margins are exactly rank SUBSPACE (+ bias) in x
    pred, report = fit_linear_predictor(x, z, z > 0, [SUBSPACE], row_cost=2 * D_MODEL, recall_target=1.0)
    assert pred.act == "none" and pred.offset is not None and pred.offset.shape == (N_NEURONS,)
    assert pred.n_params == SUBSPACE * (D_MODEL + N_NEURONS) + N_NEURONS
    xf, zf = _layer(1000, seed=1, noise=0.0)
    m = evaluate(pred, xf, zf > 0)
    assert m["recall"] >= 0.999 and m["precision"] > 0.97  # the sign of an exact fit is the mask
    assert report.recall == 1.0 and report.rank == SUBSPACE


def test_rank_follows_the_cost_of_rows() -> None:
    x, z = _layer(3000, seed=0)
    ranks = candidate_ranks(64, 8)
    assert ranks == [8, 16, 24, 32, 40, 48, 56, 64] and candidate_ranks(5, 8) == [5]
    cheap, _ = fit_linear_predictor(x, z, z > 0, ranks, row_cost=0.0, recall_target=0.99)
    assert cheap.rank == 8  # rows cost nothing: the smallest predictor wins
    dear, report = fit_linear_predictor(x, z, z > 0, ranks, row_cost=1e6, recall_target=0.99)
    assert dear.rank >= SUBSPACE and report.recall >= 0.99  # rows are dear: the most selective predictor wins
    xf, zf = _layer(2000, seed=1)
    assert evaluate(dear, xf, zf > 0)["predicted_active_fraction"] <= evaluate(cheap, xf, zf > 0)["predicted_active_fraction"]


def test_fewer_neurons_than_the_mlp_at_equal_recall() -> None:
    x, z = _layer(4000, seed=0)
    lin_pred, lin_rep = fit_linear_predictor(x, z, z > 0, [16], row_cost=2 * D_MODEL, recall_target=0.99)
    mlp_pred, mlp_rep = train_predictor(x, z > 0, rank=16, epochs=10, seed=0, recall_target=0.99)
    xf, zf = _layer(2000, seed=1)
    lin_m, mlp_m = evaluate(lin_pred, xf, zf > 0), evaluate(mlp_pred, xf, zf > 0)
    assert 0.05 < lin_m["true_active_fraction"] < 0.2
    assert lin_m["recall"] >= 0.98 and mlp_m["recall"] >= 0.97
    assert lin_m["predicted_active_fraction"] < 0.8 * mlp_m["predicted_active_fraction"]


def test_deterministic_and_validated() -> None:
    x, z = _layer(800, seed=3)
    a, _ = fit_linear_predictor(x, z, z > 0, [8, 16], row_cost=128.0, seed=4)
    b, _ = fit_linear_predictor(x, z, z > 0, [8, 16], row_cost=128.0, seed=4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    with pytest.raises(ValueError, match="margin and mask"):
        fit_linear_predictor(x, z[:, :10], z > 0, [8], row_cost=1.0)
    with pytest.raises(ValueError, match="too few"):
        fit_linear_predictor(x[:2], z[:2], z[:2] > 0, [8], row_cost=1.0)


def test_no_autograd_history_from_inputs_that_require_grad() -> None:
    x, z = _layer(600, seed=6)
    z = z.requires_grad_()  # e.g. margins computed from a graph's parameters
    pred, _ = fit_linear_predictor(x, z, z.detach() > 0, [8], row_cost=128.0)
    assert pred.offset is not None and pred.offset.grad_fn is None and not pred.offset.requires_grad


def test_weights_rounded_before_the_threshold_is_tuned() -> None:
    x, z = _layer(3000, seed=2)
    ranks = candidate_ranks(64, 8)
    full, _ = fit_linear_predictor(x, z, z > 0, [16], row_cost=128.0, recall_target=0.99)
    half, report = fit_linear_predictor(x, z, z > 0, [16], row_cost=128.0, recall_target=0.99,
                                        weight_dtype=torch.float16)
    for lin in (half.fc1, half.fc2):  # what an artifact stores in float16, exactly
        assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight.half().float(), lin.weight)
    assert not torch.equal(full.fc1.weight, half.fc1.weight)
    xf, zf = _layer(2000, seed=1)
    assert report.recall >= 0.99 and evaluate(half, xf, zf > 0)["recall"] >= 0.97
    # cheaper parameters (float16: 2 bytes against 4 per row weight) buy a larger rank at the same row cost
    dear, _ = fit_linear_predictor(x, z, z > 0, ranks, row_cost=4 * D_MODEL, param_cost=40.0)
    cheap, _ = fit_linear_predictor(x, z, z > 0, ranks, row_cost=4 * D_MODEL, param_cost=0.01)
    assert cheap.rank > dear.rank


def test_top_eigh_subspace_iteration_matches_full_eigh() -> None:
    """Above EXACT_EIGH_DIM (a 7B's d_model) the top eigenpairs come from subspace iteration: the same values and
    directions as the full eigh's where the spectrum decays as a regression's does."""
    from picompile.sparsity.linear_predictor import top_eigh

    gen = torch.Generator().manual_seed(0)
    d, k = 384, 64
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    spectrum = torch.logspace(2, -6, d, dtype=torch.float64)  # [d] decaying
    a = (basis * spectrum) @ basis.T  # [d, d] symmetric PSD
    want_vals, want_vecs = top_eigh(a, k, exact_dim=d)  # the full eigh
    got_vals, got_vecs = top_eigh(a, k, exact_dim=0)
    assert torch.allclose(got_vals, want_vals, rtol=1e-9)
    overlap = (got_vecs * want_vecs).sum(0).abs()  # [k] |cos| per direction (signs are free)
    assert overlap.min() > 1 - 1e-6
    assert got_vecs.shape == (d, k)


def test_wide_layer_fit_on_the_token_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7B layer's path (d_model above EXACT_EIGH_DIM, fewer training tokens than inputs): M Mᵀ formed on the
    token side, its top components by subspace iteration, more found as the rank search reaches them; the same
    predictor as the full path's."""
    import picompile.sparsity.linear_predictor as lp

    gen = torch.Generator().manual_seed(0)
    n_tok, d, n = 200, 240, 400
    x = torch.randn(n_tok, 24, generator=gen) @ torch.randn(24, d, generator=gen) + 0.1 * torch.randn(n_tok, d, generator=gen)
    margin = x @ (torch.randn(d, n, generator=gen) / d**0.5) - 1.5
    args = (x, margin, margin > 0, candidate_ranks(150, 4))
    want = fit_linear_predictor(*args, row_cost=2 * d * 2.0, param_cost=2.0)[1]
    monkeypatch.setattr(lp, "EXACT_EIGH_DIM", 0)
    monkeypatch.setattr(lp, "FIRST_RANKS", 8)  # found 8, 16, 32 as the search climbs to rank 24
    got = fit_linear_predictor(*args, row_cost=2 * d * 2.0, param_cost=2.0)[1]
    assert got.rank == want.rank == 24
    assert got.recall == pytest.approx(want.recall, abs=1e-3)
    assert got.predicted_active_fraction == pytest.approx(want.predicted_active_fraction, abs=1e-3)

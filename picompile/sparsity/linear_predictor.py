"""Low-rank **linear** activation predictors, fitted in closed form (reduced-rank regression).

Neuron ``j`` fires when its *margin* ``z_j`` (the pre-activation ``w_j·x + b_j`` of a ReLU FFN; the
activation score minus the layer's threshold otherwise) is positive. The predictor regresses the margins,
each standardised to unit variance, on the layer input with a rank-``r`` linear map (Deja Vu's predictor
form, ``fc2 · fc1 · x``), then divides each neuron's prediction by the std of its residual on the training
tokens: the score ``ẑ_j / σ_j`` is how many residual stds the neuron is predicted above its firing point,
so one threshold over all neurons (tuned to the recall target on held-out tokens) marks the neurons most
likely to fire. Unlike BCE training on the masks (:func:`picompile.sparsity.predictor.train_predictor`) this uses
*how far* each neuron is from firing, needs no epochs, and is deterministic.

The fit, with centred ``X [N, d]`` and standardised centred margins ``Z [N, n]``:
``G = XᵀX/N + λI = L Lᵀ``, ``C = XᵀZ/N``, ``M = L⁻¹C [d, n]``. The best rank-r fit keeps the top r
right singular vectors ``V_r`` of M (``M = U S Vᵀ``): ``B_r = G⁻¹ C V_r V_rᵀ``, so ``fc1 = (L⁻ᵀ U_r S_r)ᵀ``
``[r, d]`` and ``fc2 = V_r [n, r]``; the residual variance of neuron j is ``1 - Σ_{k<r} (S_k V_jk)²``.
One eigendecomposition of ``M Mᵀ [d, d]`` serves every rank, so :func:`fit_linear_predictor` can choose the
rank that minimises the bytes a decode step reads: the predictor's own weights plus the FFN rows it selects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from picompile.sparsity.predictor import Predictor, PredictorReport, mask_metrics, round_weights_, tune_threshold

RIDGE: float = 1e-3  # λ as a fraction of the mean input variance
# up to this d_model the full eigendecomposition (every build up to 1.1B); above it the top ranks only, by subspace
# iteration: a 4096-wide float64 eigh is most of a 7B layer's fit (tens of seconds on 2 cores, 32 layers)
EXACT_EIGH_DIM: int = 2048
POWER_ITERS: int = 6
FIRST_RANKS: int = 512  # above EXACT_EIGH_DIM: the ranks found first; more when the rank search reaches them


@dataclass
class _Fit:
    """Everything rank-independent of one layer's regression (float64)."""

    mean_x: Tensor  # [d]
    mean_z: Tensor  # [n] mean(z) / scale: where the centred fit's 0 sits relative to the firing point
    chol: Tensor  # [d, d] lower Cholesky factor L of G
    u: Tensor  # [d, k] left singular vectors of M, by decreasing singular value
    s: Tensor  # [k] singular values
    vs: Tensor  # [n, k] V·S = Mᵀ U: neuron loadings per component
    var_z: Tensor  # [n] variance of the standardised margins (1, or 0 for a constant margin)
    a: Tensor | None = None  # [d, d] M Mᵀ, kept while more components can be asked for (``ensure``)
    loadings: Callable[[Tensor], Tensor] | None = None  # U [d, k] -> Mᵀ U [n, k]
    max_rank: int = 0

    def ensure(self, rank: int) -> None:
        """Components up to ``rank`` (at most ``max_rank``) present: found again, twice as many, when short."""
        if self.a is None or self.loadings is None or rank <= self.s.numel() or self.s.numel() >= self.max_rank:
            return
        evals, self.u = top_eigh(self.a, min(self.max_rank, max(rank, 2 * self.s.numel())))
        self.s = evals.clamp_min(0).sqrt()
        self.vs = self.loadings(self.u)
        if self.s.numel() >= self.max_rank:
            self.a = self.loadings = None


@torch.no_grad()
def _prepare(x: Tensor, z: Tensor, max_rank: int) -> _Fit:
    """The regression of standardised margins ``z [N, n]`` (overwritten) on inputs ``x [N, d]``, up to ``max_rank``.

    M = L⁻¹C (C = xcᵀzc / N, G = LLᵀ). Above EXACT_EIGH_DIM with fewer tokens than inputs (a 7B: d 4096, 3277
    training tokens), M Mᵀ = Y (zc zcᵀ) Yᵀ / N² with Y = L⁻¹xcᵀ [d, N] is formed on the token side, without the
    [d, n] products (M itself is never made: Mᵀ U = zcᵀ (Yᵀ U) / N); the same algebra, a fraction of the FLOPs."""
    n_tok, d = x.shape
    mean_x = x.mean(0, dtype=torch.float64)  # [d]
    xc = x - mean_x.float()  # [N, d]
    raw_mean = z.mean(0, dtype=torch.float64)  # [n]
    scale = z.std(0, correction=0).double().clamp_min(1e-12)  # [n]
    zc = z.sub_(raw_mean.float()).div_(scale.float())  # [N, n] standardised, centred (in place: z is ours)
    var_z = (scale > 1e-12).double()  # [n] 1, or 0 for a constant margin
    g = (xc.T @ xc).double() / n_tok  # [d, d]
    g += torch.eye(d, dtype=torch.float64) * (RIDGE * float(g.diagonal().mean()) + 1e-12)
    chol = torch.linalg.cholesky(g)  # [d, d]
    k = min(max_rank, d)
    first = k if d <= EXACT_EIGH_DIM else min(k, FIRST_RANKS)  # the exact eigh gives every rank at once
    if d > EXACT_EIGH_DIM and n_tok < d:
        y = torch.linalg.solve_triangular(chol, xc.T.double(), upper=False)  # [d, N]
        gram = (zc @ zc.T).double()  # [N, N]
        a = (y @ gram @ y.T) / (n_tok * n_tok)  # [d, d]
        del gram

        def loadings(u: Tensor) -> Tensor:
            return (zc.T @ (y.T @ u).float()).double() / n_tok  # [n, k]
    else:
        c = (xc.T @ zc).double() / n_tok  # [d, n]
        m = torch.linalg.solve_triangular(chol, c, upper=False)  # [d, n]
        del c
        a = m @ m.T  # [d, d]

        def loadings(u: Tensor) -> Tensor:
            return m.T @ u  # [n, k]
    evals, u = top_eigh(a, first)  # [first] descending, [d, first]
    s = evals.clamp_min(0).sqrt()  # [first]
    more = first < k
    return _Fit(mean_x, raw_mean / scale, chol, u, s, loadings(u), var_z, a if more else None,
                loadings if more else None, k)


@torch.no_grad()
def top_eigh(a: Tensor, k: int, exact_dim: int = EXACT_EIGH_DIM, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The ``k`` largest eigenvalues (descending, ``[k]``) and their eigenvectors (``[d, k]``) of the symmetric
    positive semi-definite ``a [d, d]``: the full ``eigh`` up to ``exact_dim`` (or when ``k`` is most of ``d``),
    else seeded subspace iteration on ``k`` + oversampling columns (``POWER_ITERS`` rounds, then Rayleigh-Ritz),
    GEMMs instead of a tridiagonalisation: the top eigenpairs to ~1e-10 relative where the spectrum decays."""
    d = a.shape[0]
    k = max(1, min(k, d))
    if d <= exact_dim or 2 * k >= d:
        evals, evecs = torch.linalg.eigh(a)  # ascending
        order = torch.argsort(evals, descending=True)[:k]
        return evals[order], evecs[:, order]
    width = min(d, k + max(32, k // 2))
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(a @ torch.randn(d, width, generator=gen, dtype=a.dtype))[0]  # [d, width]
    for _ in range(POWER_ITERS):
        q = torch.linalg.qr(a @ q)[0]
    evals, vecs = torch.linalg.eigh(q.T @ a @ q)  # [width], [width, width]
    order = torch.argsort(evals, descending=True)[:k]
    return evals[order], q @ vecs[:, order]


def _predictor(fit: _Fit, rank: int) -> Predictor:
    """The rank-``rank`` predictor of ``fit``, scores in residual stds (threshold 0 until tuned)."""
    d, n = fit.mean_x.numel(), fit.mean_z.numel()
    resid = (fit.var_z - fit.vs[:, :rank].pow(2).sum(1)).clamp_min(1e-4 * fit.var_z.clamp_min(1e-12)).sqrt()  # [n]
    fc1 = torch.linalg.solve_triangular(fit.chol.T, fit.u[:, :rank] * fit.s[:rank], upper=True).T  # [rank, d]
    inv_s = torch.where(fit.s[:rank] > 0, 1.0 / fit.s[:rank].clamp_min(1e-300), torch.zeros_like(fit.s[:rank]))
    fc2 = fit.vs[:, :rank] * inv_s / resid[:, None]  # [n, rank]: V_r, each neuron in residual stds
    # a neuron fires when z / scale > 0: score = (mean_z + fc2·fc1·(x - mean_x)) / resid, mean_z = mean(z) / scale
    offset = fit.mean_z / resid - fc2 @ (fc1 @ fit.mean_x)  # [n]
    pred = Predictor(d, n, rank, act="none")
    with torch.no_grad():
        pred.fc1.weight.copy_(fc1.float())
        pred.fc2.weight.copy_(fc2.float())
    pred.offset = offset.float()
    return pred.eval()


def candidate_ranks(max_rank: int, granularity: int) -> list[int]:
    """Multiples of ``granularity`` up to ``max_rank`` (at least one rank: ``min(granularity, max_rank)``)."""
    g = max(1, granularity)
    ranks = list(range(g, max_rank + 1, g))
    return ranks or [max(1, max_rank)]


@torch.no_grad()
def fit_linear_predictor(
    x: Tensor,
    margin: Tensor,
    mask: Tensor,
    ranks: Sequence[int],
    *,
    row_cost: float,
    param_cost: float = 1.0,
    recall_target: float = 0.99,
    holdout: float = 0.2,
    seed: int = 0,
    weight_dtype: torch.dtype = torch.float32,
) -> tuple[Predictor, PredictorReport]:
    """Fit linear predictors of each rank in ``ranks`` and keep the cheapest at ``recall_target``.

    Args:
        x: FFN inputs ``[N, d_model]``.
        margin: ``[N, n_neurons]``, positive where the neuron fires (``mask == margin > 0``).
        mask: true activity, bool ``[N, n_neurons]``.
        ranks: candidate ranks, increasing; the search stops once the cost rose twice in a row.
        row_cost: what a decode step reads per selected neuron, e.g. bytes: ``ffn_matrices · d_model ·
            itemsize``, or ``d_model · itemsize`` where the kernel reads only the deciding row of a selected
            neuron that does not fire (the rows of the firing ones are read at any rank, the recall being
            fixed); ``param_cost``: per predictor parameter, in the same unit (a rank-r predictor reads
            ``r · (d_model + n_neurons)`` of them). The kept rank minimises
            ``param_cost·r·(d + n) + predicted_active_fraction · n · row_cost`` on the held-out tokens.
        recall_target, holdout, seed: as in :func:`picompile.sparsity.predictor.train_predictor`.
        weight_dtype: the dtype fc1/fc2 are stored in; each candidate is rounded to it before its threshold
            is tuned.
    """
    if x.ndim != 2 or margin.shape != mask.shape or x.shape[0] != mask.shape[0]:
        raise ValueError(f"x must be [N, d_model], margin and mask [N, n_neurons], got {tuple(x.shape)}, "
                         f"{tuple(margin.shape)}, {tuple(mask.shape)}")
    if not ranks:
        raise ValueError("no candidate rank")
    n_tokens, d = x.shape
    n = mask.shape[1]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_tokens, generator=gen)  # [N]
    n_hold = int(round(holdout * n_tokens))
    if not 1 <= n_hold < n_tokens - 1:
        raise ValueError(f"{n_tokens} tokens are too few for a {holdout:.0%} holdout")
    train_idx, hold_idx = perm[n_hold:], perm[:n_hold]
    fit = _prepare(x[train_idx].float(), margin[train_idx].float(), max(ranks))  # (indexing copies: z is ours)
    x_hold, true = x[hold_idx].float(), mask[hold_idx].bool()  # [H, d], [H, n]

    best: tuple[float, Predictor, PredictorReport] | None = None
    rises, last = 0, math.inf
    for rank in sorted(set(int(r) for r in ranks if 1 <= r <= fit.max_rank)):
        fit.ensure(rank)
        pred = round_weights_(_predictor(fit, rank), weight_dtype)
        with torch.no_grad():
            logits = pred(x_hold)  # [H, n]
        thr = tune_threshold(logits, true, recall_target)
        pred.threshold.fill_(thr)
        recall, precision, frac, true_frac = mask_metrics(logits >= pred.threshold, true)
        cost = param_cost * rank * (d + n) + frac * n * row_cost
        report = PredictorReport(rank=rank, recall=recall, precision=precision, predicted_active_fraction=frac,
                                 true_active_fraction=true_frac, n_train=int(train_idx.numel()),
                                 n_holdout=int(n_hold), threshold=thr)
        if best is None or cost < best[0]:
            best = (cost, pred, report)
        rises = rises + 1 if cost > last else 0
        last = cost
        if rises >= 2:
            break
    assert best is not None, f"no candidate rank in {list(ranks)} is within 1..{fit.max_rank}"
    return best[1], best[2]

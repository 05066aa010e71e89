"""Activation predictors (Deja Vu / PowerInfer): guess an FFN layer's active neurons from its input.

A predictor is a low-rank map, ``logits = fc2(act(fc1(x))) + offset`` with ``fc1: d_model → r`` and
``fc2: r → n_neurons``; neuron ``j`` is predicted active when ``logits[j] >= threshold``. Two kinds:

* ``"linear"`` (default; Deja Vu's form): ``act`` = identity plus a per-neuron ``offset``, fitted in closed
  form to the neurons' pre-activations by reduced-rank regression (:mod:`picompile.sparsity.linear_predictor`);
* ``"mlp"`` (PowerInfer's form): ``act`` = ReLU, no offset, trained with BCE on the masks
  (:func:`train_predictor`).

One threshold per layer is tuned on held-out tokens so that a target share of the truly active neurons
(pooled over tokens, "recall") is predicted: a missed neuron is a wrong output, an extra one only costs
time. Without biases the MLP relies on the input's own offset (post-norm hidden states of real LLMs have a
large, nearly constant mean component) and on the tuned threshold.

:func:`choose_ranks` sizes the predictors of all layers under one parameter budget;
:func:`train_predictor` trains one on CPU, deterministically for a given seed.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor, nn

from picompile.errors import BudgetError


class LayerStats(Protocol):
    """What :func:`choose_ranks` reads of a layer profile (e.g. ``profile_stats.LayerProfile``)."""

    @property
    def sparsity(self) -> float: ...  # mean fraction of neurons inactive per token

    @property
    def locality(self) -> float: ...  # fraction of neurons carrying 80 % of activations


class Predictor(nn.Module):
    """Low-rank activation predictor of one FFN layer: one logit per neuron."""

    threshold: Tensor  # [] float32 buffer: predict active iff logit >= threshold
    offset: Tensor | None  # [n_neurons] float32 buffer added to the logits ("linear" kind), else None

    def __init__(self, d_model: int, n_neurons: int, rank: int, threshold: float = 0.0, act: str = "relu") -> None:
        super().__init__()
        if min(d_model, n_neurons, rank) < 1:
            raise ValueError(f"d_model, n_neurons and rank must be >= 1, got {d_model}, {n_neurons}, {rank}")
        if act not in ("relu", "none"):
            raise ValueError(f"predictor act must be relu or none, got {act!r}")
        self.d_model, self.n_neurons, self.rank, self.act = d_model, n_neurons, rank, act
        self.fc1 = nn.Linear(d_model, rank, bias=False)  # weight [rank, d_model]
        self.fc2 = nn.Linear(rank, n_neurons, bias=False)  # weight [n_neurons, rank]
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.register_buffer("offset", None)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[..., n_neurons]`` for inputs ``[..., d_model]``."""
        h = self.fc1(x)  # [..., rank]
        logits = self.fc2(torch.relu(h) if self.act == "relu" else h)  # [..., n_neurons]
        return logits if self.offset is None else logits + self.offset

    @torch.no_grad()
    def mask(self, x: Tensor) -> Tensor:
        """Predicted-active mask, bool ``[..., n_neurons]``, for inputs ``[..., d_model]``."""
        return self.forward(x) >= self.threshold

    @property
    def n_params(self) -> int:
        return self.rank * (self.d_model + self.n_neurons) + (0 if self.offset is None else self.n_neurons)


@dataclass
class PredictorReport:
    """How a trained predictor does on the held-out tokens, at the tuned threshold."""

    rank: int
    recall: float  # truly active neurons predicted active, pooled over held-out tokens
    precision: float  # predicted-active neurons truly active
    predicted_active_fraction: float  # mean share of neurons computed per token
    true_active_fraction: float  # mean share of neurons truly active per token
    n_train: int
    n_holdout: int
    threshold: float
    final_loss: float = float("nan")  # mean training loss of the last epoch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def mask_metrics(pred: Tensor, true: Tensor) -> tuple[float, float, float, float]:
    """``(recall, precision, predicted_fraction, true_fraction)`` of bool masks ``[N, n_neurons]``.

    Recall is 1.0 when nothing is truly active; precision is 1.0 when nothing is predicted.
    """
    pred, true = pred.bool(), true.bool()
    tp = int((pred & true).sum())
    n_true, n_pred = int(true.sum()), int(pred.sum())
    recall = tp / n_true if n_true else 1.0
    precision = tp / n_pred if n_pred else 1.0
    return recall, precision, n_pred / pred.numel(), n_true / true.numel()


def evaluate(predictor: Predictor, x: Tensor, mask: Tensor) -> dict[str, float]:
    """Metrics of ``predictor`` on tokens ``x [N, d_model]`` with true activity ``mask [N, n_neurons]``."""
    pred = predictor.mask(x.to(torch.float32))  # [N, n_neurons]
    r, p, pf, tf = mask_metrics(pred, mask)
    return {"recall": r, "precision": p, "predicted_active_fraction": pf, "true_active_fraction": tf}


def int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantization per row: ``(q, s)`` with ``w ≈ s[:, None] · q``, ``s = max|row| / 127`` (0 for a
    zero row), ``q`` the rounded quotients as float32 in [-127, 127]."""
    w = w.float()  # [rows, cols]
    s = w.abs().amax(dim=1) / 127.0  # [rows]
    q = torch.where(s[:, None] > 0, torch.round(w / torch.where(s > 0, s, 1.0)[:, None]), 0.0)  # [rows, cols]
    return q, s


@torch.no_grad()
def round_weights_(predictor: Predictor, dtype: torch.dtype) -> Predictor:
    """Round ``fc1``/``fc2`` to ``dtype`` in place (kept float32): what the artifact will store, so the threshold
    is tuned, and the recall reported, on the weights the decode step reads.

    int8: per-row scales that the stored predictor folds away (``fold_int8``): ``fc1`` becomes its row quants
    ``q1`` (scales ``s1 > 0``, and ``relu(s1 u) = s1 relu(u)``, so ``s1`` moves into ``fc2``'s columns), then
    ``fc2 · diag(s1)`` is quantized per row, ``s2 · q2``; ``s2`` later divides the offset and threshold."""
    if dtype == torch.int8:
        q1, s1 = int8_rows(predictor.fc1.weight)  # [rank, d_model], [rank]
        q2, s2 = int8_rows(predictor.fc2.weight.float() * s1[None, :])  # [n_neurons, rank], [n_neurons]
        predictor.fc1.weight.copy_(q1)
        predictor.fc2.weight.copy_(q2 * s2[:, None])
        return predictor
    for lin_ in (predictor.fc1, predictor.fc2):
        lin_.weight.copy_(lin_.weight.to(dtype).float())
    return predictor


@torch.no_grad()
def fold_int8(fc1: Tensor, fc2: Tensor, offset: Tensor | None, threshold: float,
              ) -> tuple[Tensor, Tensor, Tensor, float]:
    """A predictor rounded by ``round_weights_(…, torch.int8)`` (``fc1 [rank, d_model]`` integral, ``fc2
    [n_neurons, rank]`` rows ``s2 · q2``) → ``(q1, q2, offset', 0.0)``, int8 weights with no scales: neuron j is
    predicted when ``s2_j (q2_j · h) + offset_j > threshold``, i.e. ``q2_j · h + (offset_j - threshold) / s2_j > 0``
    (``s2_j > 0``); a zero row ``j`` is a constant decision, ``offset'_j = ±1``."""
    w1 = fc1.float()  # [rank, d_model]
    q1 = torch.round(w1)
    if q1.abs().max() > 127 or not torch.equal(q1, w1):
        raise ValueError("fc1 is not int8 row quants: round the predictor with round_weights_(…, torch.int8) first")
    q2, s2 = int8_rows(fc2)  # recovers round_weights_'s quants: s2 agrees to float32 rounding
    off = torch.zeros(fc2.shape[0]) if offset is None else offset.float()  # [n_neurons]
    live = s2 > 0
    shifted = torch.where(live, (off - threshold) / torch.where(live, s2, 1.0),
                          torch.where(off > threshold, 1.0, -1.0))  # [n_neurons]
    return q1.to(torch.int8), q2.to(torch.int8), shifted.to(torch.float32).contiguous(), 0.0


def tune_threshold(logits: Tensor, mask: Tensor, recall_target: float) -> float:
    """Largest threshold whose pooled recall on ``(logits, mask)`` (both ``[N, n_neurons]``) is >= target.

    With ``P`` positives, at most ``floor((1 - target)·P)`` of them may fall below the threshold.
    No positive at all gives ``+inf`` (predict nothing).
    """
    if not 0.0 < recall_target <= 1.0:
        raise ValueError(f"recall_target must be in (0, 1], got {recall_target}")
    pos = logits[mask.bool()].float()  # [P]
    if pos.numel() == 0:
        return math.inf
    misses = int(math.floor((1.0 - recall_target) * pos.numel() + 1e-9))
    misses = min(misses, pos.numel() - 1)
    return float(torch.sort(pos).values[misses])


KERNEL_GRANULARITY: int = 64  # predictor ranks of large layers: a multiple of the GEMV kernel's 64 lanes


def rank_granularity(d_model: int, n_neurons: int) -> int:
    """Step of predictor ranks: :data:`KERNEL_GRANULARITY` for layers of 1024+ (d_model and neurons), else 8."""
    return KERNEL_GRANULARITY if min(d_model, n_neurons) >= 1024 else 8


def choose_ranks(
    layer_stats: Sequence[LayerStats],
    d_model: int,
    n_neurons: int,
    budget_params: int | None = None,
    *,
    ffn_matrices: int = 2,
    budget_fraction: float = 0.1,
    max_rank: int | None = None,
    granularity: int | None = None,
) -> list[int]:
    """Predictor rank per layer under one parameter budget.

    Each predictor costs ``r·(d_model + n_neurons)`` parameters. The budget defaults to
    ``budget_fraction`` (10 %) of the FFN parameters, ``n_layers·ffn_matrices·d_model·n_neurons``
    (``ffn_matrices=2`` counts up + down only, the conservative figure; pass 3 for gated FFNs).

    A layer's weight is ``sqrt(density · locality)`` with ``density = 1 - sparsity``: denser and less
    skewed layers are harder to predict and get more rank (PowerInfer sizes predictors the same way,
    by sparsity and skewness). Ranks are multiples of ``g = granularity``, at least g, at most ``max_rank``
    (default ``min(d_model, n_neurons)`` rounded down to a multiple of g). Starting from g everywhere,
    steps of g go to the layer furthest below its weight-proportional share while the budget allows.
    ``granularity`` defaults to :data:`KERNEL_GRANULARITY` (64) for layers of 1024+ (d_model and
    neurons): the predictor's second layer is a GEMV over rows of length r, which the kernels vectorise
    over 64 float32 lanes (r = 456 = 8·57 ran at half the bandwidth of r = 448); else 8.

    If the budget cannot give every layer rank g, every layer gets the same rank
    ``budget // (n_layers·(d_model+n_neurons))`` (below g, not a multiple of g); if that is 0,
    :class:`BudgetError`.
    """
    n_layers = len(layer_stats)
    if n_layers == 0:
        return []
    per_rank = d_model + n_neurons  # parameters per unit of rank
    if budget_params is None:
        budget_params = int(budget_fraction * n_layers * ffn_matrices * d_model * n_neurons)
    budget = int(budget_params)
    g = granularity or rank_granularity(d_model, n_neurons)
    cap = max_rank if max_rank is not None else max(g, (min(d_model, n_neurons) // g) * g)

    if budget < n_layers * g * per_rank:
        r = budget // (n_layers * per_rank)
        if r < 1:
            raise BudgetError(
                f"predictor budget of {budget} parameters cannot give {n_layers} layers rank 1 "
                f"({n_layers * per_rank} parameters)"
            )
        return [min(r, cap)] * n_layers

    weights = [
        math.sqrt(max(1.0 - float(s.sparsity), 1e-6) * max(float(s.locality), 1e-6)) for s in layer_stats
    ]
    total_w = sum(weights)
    target = [w / total_w * budget / per_rank for w in weights]  # ideal (fractional) rank
    ranks = [min(g, cap)] * n_layers
    left = budget - sum(ranks) * per_rank
    step = g * per_rank
    heap = [(-(target[i] - ranks[i]), i) for i in range(n_layers)]  # largest deficit first
    heapq.heapify(heap)
    while heap and left >= step:
        _, i = heapq.heappop(heap)
        if ranks[i] + g > cap:
            continue
        ranks[i] += g
        left -= step
        heapq.heappush(heap, (-(target[i] - ranks[i]), i))
    return ranks


def train_predictor(
    x: Tensor,
    mask: Tensor,
    rank: int,
    *,
    epochs: int = 20,
    lr: float = 1e-2,
    seed: int = 0,
    holdout: float = 0.2,
    recall_target: float = 0.99,
    batch_size: int = 256,
    pos_weight: float | None = None,
    weight_dtype: torch.dtype = torch.float32,
) -> tuple[Predictor, PredictorReport]:
    """Train one layer's predictor and tune its threshold.

    Args:
        x: FFN inputs, ``[N, d_model]`` (any float dtype; trained in float32 on the CPU).
        mask: true activity, bool ``[N, n_neurons]`` (activation > 0).
        rank: hidden width ``r``.
        epochs, lr, batch_size: Adam on mini-batches of shuffled training tokens.
        seed: fixes the split, the initialisation and the shuffling (global RNG state is restored).
        holdout: share of tokens held out to tune the threshold and report; 0 = tune on training tokens.
        recall_target: pooled recall the threshold must reach on the held-out tokens.
        pos_weight: BCE weight of positives; ``None`` = ``sqrt(negatives / positives)`` (>= 1), which
            keeps rare activations from being ignored without flattening the logits.
        weight_dtype: the dtype the artifact stores fc1/fc2 in: the trained weights are rounded to it before
            the threshold is tuned.

    Returns:
        The predictor (threshold set, eval mode) and its :class:`PredictorReport`.
    """
    if x.ndim != 2 or mask.ndim != 2 or x.shape[0] != mask.shape[0]:
        raise ValueError(f"x must be [N, d_model] and mask [N, n_neurons], got {tuple(x.shape)}, {tuple(mask.shape)}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    n_tokens, d_model = x.shape
    n_neurons = mask.shape[1]
    x = x.detach().to(torch.float32).cpu()  # [N, d_model]
    target = mask.detach().to(torch.float32).cpu()  # [N, n_neurons]

    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_tokens, generator=gen)  # [N]
    n_hold = int(round(holdout * n_tokens)) if holdout > 0 else 0
    if holdout > 0 and not 1 <= n_hold < n_tokens:
        raise ValueError(f"{n_tokens} tokens are too few for a {holdout:.0%} holdout")
    train_idx, hold_idx = perm[n_hold:], perm[:n_hold]
    if n_hold == 0:
        hold_idx = train_idx
    x_tr, y_tr = x[train_idx], target[train_idx]  # [N_tr, d_model], [N_tr, n_neurons]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Predictor(d_model, n_neurons, rank)
    if pos_weight is None:
        n_pos = float(y_tr.sum())
        n_neg = float(y_tr.numel()) - n_pos
        pos_weight = max(1.0, math.sqrt(n_neg / n_pos)) if n_pos > 0 else 1.0
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight))
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    model.train()
    epoch_loss = float("nan")
    for _ in range(epochs):
        order = torch.randperm(x_tr.shape[0], generator=gen)  # [N_tr]
        total, seen = 0.0, 0
        for start in range(0, order.numel(), batch_size):
            idx = order[start : start + batch_size]
            loss = loss_fn(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
            seen += idx.numel()
        epoch_loss = total / max(seen, 1)
    model.eval()
    round_weights_(model, weight_dtype)

    with torch.no_grad():
        logits = model(x[hold_idx])  # [N_hold, n_neurons]
    true = mask[hold_idx].bool().cpu()  # [N_hold, n_neurons]
    thr = tune_threshold(logits, true, recall_target)
    model.threshold.fill_(thr)
    recall, precision, pred_frac, true_frac = mask_metrics(logits >= model.threshold, true)
    report = PredictorReport(
        rank=rank,
        recall=recall,
        precision=precision,
        predicted_active_fraction=pred_frac,
        true_active_fraction=true_frac,
        n_train=int(train_idx.numel()),
        n_holdout=int(n_hold),
        threshold=thr,
        final_loss=epoch_loss,
    )
    return model, report

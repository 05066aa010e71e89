"""Hot/cold neuron placement: PowerInfer's ILP, solved with ``scipy.optimize.milp`` (HiGHS).

Within each FFN layer the neurons are sorted by activation frequency (descending) and cut into
batches of ``batch_size`` neurons (the last batch of a layer may be smaller). One binary variable
per batch says "this batch lives on the GPU". The solver maximises the activation frequency the GPU
serves, ``Σ value·x``, under the GPU memory left for FFN neurons, ``Σ bytes·x ≤ budget``. With a
per-layer minimum (PowerInfer's communication constraint) a binary ``y[l]`` per layer adds
``x[l,b] ≤ y[l]`` and ``Σ_b size[l,b]·x[l,b] ≥ min_neurons·y[l]``: a layer either keeps nothing on
the GPU or enough neurons to be worth the synchronisation.

Every byte count is an exact integer (int64 / Python int): PowerInfer's solver overflowed 32 bits.
The budget row is divided by the gcd of all batch sizes in bytes before it reaches HiGHS (exact:
the left side is a multiple of the gcd), and every solution is re-checked in integers.

:func:`ffn_budget` turns a target's VRAM into the budget left for FFN neurons.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from picompile.errors import BudgetError
from picompile.targets import Target

#: Default priority of the non-FFN parts that compete for VRAM (first = placed first).
FIXED_PART_PRIORITY: tuple[str, ...] = ("attention", "predictors", "norms", "lm_head", "kv_cache")


def _fmt_bytes(n: int) -> str:
    return f"{n} B ({n / (1 << 30):.3f} GiB)"


def ffn_budget(
    target_vram: int | Target,
    fixed_parts: Sequence[tuple[str, int]],
    *,
    optional: Collection[str] = ("kv_cache",),
    priority: Sequence[str] = FIXED_PART_PRIORITY,
) -> tuple[int, list[str]]:
    """GPU bytes left for FFN neurons after the non-FFN parts that go to the GPU first.

    Parts are taken in ``priority`` order (names not in ``priority`` keep their given order, after the
    known ones). Mandatory parts (attention weights, predictors, norms, lm_head …) must all fit: if
    they do not and the target has a GPU, :class:`BudgetError` names every size. Parts named in
    ``optional`` (by default the KV cache) are placed only when they fit in what is left; otherwise
    they stay in host memory and the budget is unchanged.

    Args:
        target_vram: usable VRAM in bytes, or a :class:`Target`; 0 / a CPU-only target = no GPU.
        fixed_parts: ``(name, bytes)`` of every non-FFN part that may go to the GPU.
        optional: names of parts placed only if they fit.
        priority: placement order by name.

    Returns:
        ``(budget_bytes, placed)``: bytes left for FFN neurons (>= 0) and the names of the parts
        placed on the GPU, in placement order. A target without GPU gives ``(0, [])``.
    """
    if isinstance(target_vram, Target):
        vram = int(target_vram.vram_bytes) if target_vram.has_gpu else 0
    else:
        vram = int(target_vram)
    if vram < 0:
        raise BudgetError(f"VRAM budget must be >= 0 bytes, got {vram}")
    parts = [(str(name), int(size)) for name, size in fixed_parts]
    for name, size in parts:
        if size < 0:
            raise BudgetError(f"fixed part {name!r} has a negative size ({size} bytes)")
    if vram == 0:
        return 0, []

    rank = {name: i for i, name in enumerate(priority)}
    order = sorted(range(len(parts)), key=lambda i: (rank.get(parts[i][0], len(rank)), i))
    mandatory = [parts[i] for i in order if parts[i][0] not in optional]
    optional_parts = [parts[i] for i in order if parts[i][0] in optional]

    need = sum(size for _, size in mandatory)
    if need > vram:
        sizes = ", ".join(f"{name}={_fmt_bytes(size)}" for name, size in mandatory)
        raise BudgetError(
            f"GPU budget too small: the dense non-FFN parts need {_fmt_bytes(need)} "
            f"but the GPU has {_fmt_bytes(vram)} ({sizes}); "
            "raise --vram-budget, use a smaller model or target 'cpu'"
        )
    left = vram - need
    placed = [name for name, _ in mandatory]
    for name, size in optional_parts:
        if size <= left:
            left -= size
            placed.append(name)
    return left, placed


@dataclass
class PlacementProblem:
    """Inputs of the placement ILP.

    ``freqs[l]`` may be raw counts or frequencies (only ratios matter); ``neuron_bytes[l]`` is what
    one neuron of layer ``l`` costs on the GPU: its rows/columns in all FFN matrices (gated FFN:
    ``3·d_model·elem``; plain: ``2·d_model·elem + bias``).
    """

    freqs: Sequence[np.ndarray]  # per layer [n_neurons_l], >= 0
    neuron_bytes: Sequence[int]  # per layer, bytes of one neuron (int64)
    budget_bytes: int  # GPU bytes for FFN neurons (see ffn_budget)
    batch_size: int = 64  # neurons per ILP variable
    min_neurons: int = 0  # per-layer minimum on the GPU (0 = off)
    time_limit_s: float = 10.0  # HiGHS wall-clock limit; the greedy answers if it finds nothing better
    mip_rel_gap: float = 1e-4  # HiGHS relative optimality gap (0 = prove optimality; may be slow)

    def __post_init__(self) -> None:
        self.freqs = [np.asarray(f, dtype=np.float64).ravel() for f in self.freqs]
        if isinstance(self.neuron_bytes, (int, np.integer)):
            self.neuron_bytes = [int(self.neuron_bytes)] * len(self.freqs)
        nb = [int(b) for b in self.neuron_bytes]
        if len(nb) != len(self.freqs):
            raise ValueError(f"{len(self.freqs)} layers but {len(nb)} neuron_bytes")
        if any(b <= 0 for b in nb):
            raise ValueError("neuron_bytes must be > 0")
        self.neuron_bytes = np.asarray(nb, dtype=np.int64)  # [n_layers]
        for f in self.freqs:
            if f.size == 0 or np.any(f < 0) or not np.all(np.isfinite(f)):
                raise ValueError("each layer needs >= 1 neuron with finite, non-negative frequencies")
        self.budget_bytes = int(self.budget_bytes)
        if self.budget_bytes < 0:
            raise BudgetError(f"FFN GPU budget is negative ({self.budget_bytes} bytes)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.min_neurons < 0:
            raise ValueError(f"min_neurons must be >= 0, got {self.min_neurons}")

    @property
    def n_layers(self) -> int:
        return len(self.freqs)

    @property
    def total_bytes(self) -> int:
        """Bytes of all FFN neurons (Python int)."""
        return sum(int(f.size) * int(b) for f, b in zip(self.freqs, self.neuron_bytes))


@dataclass
class Placement:
    """Solution: which neurons of each layer are hot (GPU) and cold (CPU)."""

    hot: list[np.ndarray]  # per layer [n_hot_l] int64 neuron indices, frequency descending
    cold: list[np.ndarray]  # per layer [n_cold_l] int64 neuron indices, frequency descending
    objective: float  # Σ frequency of hot neurons (units of PlacementProblem.freqs)
    total_frequency: float  # Σ frequency of all neurons
    gpu_bytes: int  # bytes of the hot neurons
    budget_bytes: int
    method: str  # "milp" | "greedy" | "trivial" (all or nothing fits)
    status: str  # solver message
    solve_time_s: float
    n_variables: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_hot(self) -> list[int]:
        return [int(h.size) for h in self.hot]

    @property
    def coverage(self) -> float:
        """Fraction of all activations served by hot neurons."""
        return self.objective / self.total_frequency if self.total_frequency > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """Summary without the index arrays."""
        return {
            "method": self.method,
            "status": self.status,
            "objective": self.objective,
            "coverage": self.coverage,
            "gpu_bytes": self.gpu_bytes,
            "budget_bytes": self.budget_bytes,
            "solve_time_s": self.solve_time_s,
            "n_variables": self.n_variables,
            "n_hot": self.n_hot,
            "n_cold": [int(c.size) for c in self.cold],
        }


@dataclass
class _Batches:
    """All batches of all layers, flattened (B = total number of batches)."""

    order: list[np.ndarray]  # per layer [n_neurons_l] int64, neuron ids by frequency descending
    layer: np.ndarray  # [B] int64
    start: np.ndarray  # [B] int64, offset into order[layer]
    size: np.ndarray  # [B] int64, neurons in the batch
    value: np.ndarray  # [B] float64, Σ frequency
    nbytes: np.ndarray  # [B] int64


def _make_batches(problem: PlacementProblem) -> _Batches:
    order, layer, start, size, value, nbytes = [], [], [], [], [], []
    bs = problem.batch_size
    for l, (f, nb) in enumerate(zip(problem.freqs, problem.neuron_bytes)):
        o = np.argsort(-f, kind="stable").astype(np.int64)  # [n]
        starts = np.arange(0, f.size, bs, dtype=np.int64)  # [n_batches_l]
        sizes = np.minimum(starts + bs, f.size) - starts
        order.append(o)
        layer.append(np.full(starts.size, l, dtype=np.int64))
        start.append(starts)
        size.append(sizes)
        value.append(np.add.reduceat(f[o], starts))
        nbytes.append(sizes * np.int64(nb))
    return _Batches(
        order,
        np.concatenate(layer),
        np.concatenate(start),
        np.concatenate(size),
        np.concatenate(value).astype(np.float64),
        np.concatenate(nbytes).astype(np.int64),
    )


def _layer_minimums(problem: PlacementProblem) -> np.ndarray:
    """Per-layer minimum hot neurons, capped at the layer size (a whole layer may always be hot)."""
    return np.array([min(problem.min_neurons, f.size) for f in problem.freqs], dtype=np.int64)


def _feasible(problem: PlacementProblem, b: _Batches, chosen: np.ndarray) -> bool:
    """Exact integer check of the budget and the per-layer minimum."""
    used = int(b.nbytes[chosen].sum(dtype=np.int64))
    if used > problem.budget_bytes:
        return False
    if problem.min_neurons > 0:
        per_layer = np.bincount(b.layer[chosen], weights=b.size[chosen], minlength=problem.n_layers)
        mins = _layer_minimums(problem)
        if np.any((per_layer > 0) & (per_layer < mins)):
            return False
    return True


def _to_placement(
    problem: PlacementProblem, b: _Batches, chosen: np.ndarray, method: str, status: str, t: float
) -> Placement:
    hot, cold = [], []
    for l, o in enumerate(b.order):
        idx = np.flatnonzero(b.layer == l)  # batches of layer l, in frequency order
        is_hot = np.zeros(o.size, dtype=bool)  # [n_neurons_l] by sorted position
        for i in idx[chosen[idx]]:
            is_hot[b.start[i] : b.start[i] + b.size[i]] = True
        hot.append(o[is_hot])
        cold.append(o[~is_hot])
    return Placement(
        hot=hot,
        cold=cold,
        objective=float(b.value[chosen].sum()),
        total_frequency=float(b.value.sum()),
        gpu_bytes=int(b.nbytes[chosen].sum(dtype=np.int64)),
        budget_bytes=problem.budget_bytes,
        method=method,
        status=status,
        solve_time_s=t,
        n_variables=int(b.layer.size) + (problem.n_layers if problem.min_neurons > 0 else 0),
    )


def _greedy_chosen(problem: PlacementProblem, b: _Batches) -> np.ndarray:
    """Batches by frequency per byte, taking each one that still fits; then repair the minimum."""
    density = b.value / b.nbytes.astype(np.float64)
    ranked = np.lexsort((np.arange(b.layer.size), -density))  # density desc, then batch id
    chosen = np.zeros(b.layer.size, dtype=bool)
    left = problem.budget_bytes
    for i in ranked:
        if b.nbytes[i] <= left:
            chosen[i] = True
            left -= int(b.nbytes[i])
    if problem.min_neurons > 0:
        # Heuristic repair: drop layers below their minimum, refill only layers already above it.
        mins = _layer_minimums(problem)
        per_layer = np.bincount(b.layer[chosen], weights=b.size[chosen], minlength=problem.n_layers)
        below = (per_layer > 0) & (per_layer < mins)
        drop = chosen & below[b.layer]
        chosen &= ~drop
        left += int(b.nbytes[drop].sum(dtype=np.int64))
        on_gpu = per_layer >= mins
        on_gpu &= per_layer > 0
        for i in ranked:
            if not chosen[i] and on_gpu[b.layer[i]] and b.nbytes[i] <= left:
                chosen[i] = True
                left -= int(b.nbytes[i])
    return chosen


def greedy_placement(problem: PlacementProblem) -> Placement:
    """Global greedy: take batches by frequency per byte while they fit.

    Optimal when every batch costs the same bytes (equal ``neuron_bytes`` and layer sizes that are
    multiples of ``batch_size``) and the per-layer minimum is off; otherwise a lower bound for the
    MILP. With a minimum, layers left below it are dropped and the freed bytes refilled (heuristic).
    """
    t0 = time.perf_counter()
    b = _make_batches(problem)
    chosen = _greedy_chosen(problem, b)
    return _to_placement(problem, b, chosen, "greedy", "greedy", time.perf_counter() - t0)


def _solve_milp(problem: PlacementProblem, b: _Batches) -> tuple[np.ndarray | None, str]:
    """The ILP through HiGHS; returns the chosen batches (None if no solution) and the message.

    Symmetry breaking keeps the model small and fast: within a layer the full batches cost the
    same bytes and have non-increasing value, so some optimum takes them as a prefix
    (``x[l,b] <= x[l,b-1]``) — an exchange argument, exact also with the per-layer minimum. The
    smaller last batch of a layer stays free. HiGHS presolve is off: on one dense knapsack row it
    costs seconds and removes nothing.
    """
    n_b = int(b.layer.size)
    n_l = problem.n_layers
    use_min = problem.min_neurons > 0
    n_var = n_b + (n_l if use_min else 0)
    full = b.size == problem.batch_size  # [B]
    first = b.start == 0  # [B] first batch of its layer

    g = int(np.gcd.reduce(b.nbytes))  # exact rescaling of the budget row
    coef = (b.nbytes // g).astype(np.float64)  # [B]
    cap = float(problem.budget_bytes // g)

    c = np.zeros(n_var)
    c[:n_b] = -b.value
    rows = [sp.csr_matrix(np.concatenate([coef, np.zeros(n_var - n_b)])[None, :])]
    lb, ub = [-np.inf], [cap]

    chained = np.flatnonzero(full & ~first)  # x[i] - x[i-1] <= 0 (previous batch is full too)
    if chained.size:
        k = chained.size
        rows.append(
            sp.csr_matrix(
                (np.r_[np.ones(k), -np.ones(k)], (np.r_[np.arange(k), np.arange(k)], np.r_[chained, chained - 1])),
                shape=(k, n_var),
            )
        )
        lb += [-np.inf] * k
        ub += [0.0] * k
    if use_min:
        mins = _layer_minimums(problem).astype(np.float64)
        linked = np.flatnonzero(first | ~full)  # every other batch is chained below one of these
        k = linked.size
        rows.append(  # x[l,b] - y[l] <= 0
            sp.csr_matrix(
                (np.r_[np.ones(k), -np.ones(k)], (np.r_[np.arange(k), np.arange(k)], np.r_[linked, n_b + b.layer[linked]])),
                shape=(k, n_var),
            )
        )
        lb += [-np.inf] * k
        ub += [0.0] * k
        rows.append(  # Σ size·x - min·y >= 0
            sp.csr_matrix(
                (np.r_[b.size.astype(np.float64), -mins], (np.r_[b.layer, np.arange(n_l)], np.r_[np.arange(n_b), n_b + np.arange(n_l)])),
                shape=(n_l, n_var),
            )
        )
        lb += [0.0] * n_l
        ub += [np.inf] * n_l
    a = sp.vstack(rows, format="csr")
    res = milp(
        c,
        integrality=np.ones(n_var),
        bounds=Bounds(0.0, 1.0),
        constraints=LinearConstraint(a, np.array(lb), np.array(ub)),
        options={
            "time_limit": float(problem.time_limit_s),
            "mip_rel_gap": float(problem.mip_rel_gap),
            "presolve": False,
            "disp": False,
        },
    )
    if res.x is None:
        return None, f"status {res.status}: {res.message}"
    return np.asarray(res.x[:n_b]) > 0.5, f"status {res.status}: {res.message}"


def solve_placement(problem: PlacementProblem) -> Placement:
    """Solve the placement ILP (HiGHS); falls back to the greedy if HiGHS finds nothing better.

    The trivial cases skip the solver: everything fits → all hot; not even the smallest batch
    fits → all cold. ``Placement.method`` says which path produced the answer.
    """
    t0 = time.perf_counter()
    b = _make_batches(problem)
    if problem.total_bytes <= problem.budget_bytes:
        chosen = np.ones(b.layer.size, dtype=bool)
        return _to_placement(problem, b, chosen, "trivial", "everything fits", time.perf_counter() - t0)
    if problem.budget_bytes < int(b.nbytes.min()):
        chosen = np.zeros(b.layer.size, dtype=bool)
        return _to_placement(problem, b, chosen, "trivial", "no batch fits", time.perf_counter() - t0)

    greedy = _greedy_chosen(problem, b)
    chosen, status = _solve_milp(problem, b)
    method = "milp"
    if chosen is None or not _feasible(problem, b, chosen):
        chosen, method = greedy, "greedy"
        status += " (no feasible MILP solution; greedy used)"
    elif float(b.value[greedy].sum()) > float(b.value[chosen].sum()) * (1 + 1e-12):
        chosen, method = greedy, "greedy"
        status += " (MILP stopped below the greedy; greedy used)"
    return _to_placement(problem, b, chosen, method, status, time.perf_counter() - t0)

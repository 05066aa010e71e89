"""Input sparsity (TEAL-style): per-tensor magnitude thresholds from calibration quantiles, and their allocation
against a byte target or an accuracy budget by the measured loss per byte saved.

A *group* is a set of projections that read the same input (q/k/v; o; gate/up; down): one threshold on that input
skips the same weight rows (nn.Linear columns) of all of them, so its bytes saved at channel sparsity ``s`` are
``s · bytes``. Its loss curve is the measured KL divergence of the model's next-token distribution from the dense
model's when only that group is sparsified, on held-out calibration tokens sampled from the model (so the KL is
the expected increase of the calibration NLL). The KL is measured at one level (ANCHOR: one resumed forward per
group); its shape over the other levels is the group's relative output error on calibration rows (cheap: one GEMM
per level), scaled to meet the measured KL at the anchor. The allocation walks a greedy path: each step raises the group
whose next level costs the least loss per byte saved; the byte target stops it at the target, an accuracy budget
bisects along it on the real (all groups together) loss.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

LEVELS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # channel sparsities measured per group
ANCHOR: float = 0.5  # the level at which each group's loss is measured end to end
MAX_SAMPLES = 1 << 18  # |x| values kept per group for its quantiles
MAX_ROWS = 256  # calibration input rows kept per group for its output-error curve


@dataclass
class Group:
    """The input of one or more projections of one layer, with its calibration magnitudes."""

    layer: int
    name: str  # "qkv" | "o" | "gate_up" | "down"
    d_in: int
    bytes: int  # weight bytes of every projection reading this input (read per token when dense)
    samples: list[torch.Tensor] = field(default_factory=list)  # |x| [k] chunks, before finish()
    ordered: torch.Tensor | None = None  # [S] sorted |x| (after finish())
    rows: list[torch.Tensor] = field(default_factory=list)  # [r, d_in] input rows, MAX_ROWS in all
    scale: torch.Tensor | None = None  # [d_in] ‖W[:, i]‖₂ over every projection reading channel i (weighted
    # criterion, WINA: a channel's score is |x_i|·scale_i); None = TEAL's |x_i|

    def add(self, x: torch.Tensor, generator: torch.Generator) -> None:
        """Keep a random subset of the entries of ``x`` [..., d_in] (at most MAX_SAMPLES in all) and its first rows."""
        have = sum(int(r.shape[0]) for r in self.rows)
        if have < MAX_ROWS:
            self.rows.append(x.detach().reshape(-1, x.shape[-1])[: MAX_ROWS - have].float().clone())
        flat = x.detach().abs().float()
        flat = (flat if self.scale is None else flat * self.scale).reshape(-1)
        keep = max(1, MAX_SAMPLES // 8)
        if flat.numel() > keep:
            flat = flat[torch.randint(flat.numel(), (keep,), generator=generator)]
        self.samples.append(flat)

    def finish(self) -> None:
        data = torch.cat(self.samples) if self.samples else torch.zeros(1)
        if data.numel() > MAX_SAMPLES:
            data = data[torch.randperm(data.numel(), generator=torch.Generator().manual_seed(0))[:MAX_SAMPLES]]
        self.ordered, self.samples = torch.sort(data).values, []

    def threshold(self, sparsity: float) -> float:
        """|x| at or below which a channel counts as inactive so that ``sparsity`` of the channels are (0: none)."""
        assert self.ordered is not None, "finish() first"
        if sparsity <= 0.0:
            return 0.0
        k = min(int(sparsity * self.ordered.numel()), self.ordered.numel() - 1)
        return float(self.ordered[k])

    def cut(self, sparsity: float) -> float | torch.Tensor:
        """What ``|x|`` is compared with so that ``sparsity`` of the channels' scores fall at or below the threshold:
        the threshold itself (|x| criterion), or per channel threshold / scale_i [d_in] (weighted; a channel whose
        weight column is all zero is never read)."""
        t = self.threshold(sparsity)
        if self.scale is None or t == 0.0:
            return t
        return torch.where(self.scale > 0, t / self.scale.clamp_min(1e-30), torch.tensor(float("inf")))


    def output_error(self, w_ts: Sequence[torch.Tensor], levels: Sequence[float] = LEVELS) -> list[float]:
        """Relative squared error of the projections' outputs (``x Wᵀ`` for each input-major ``w_t`` [d_in, d_out]) on
        the kept rows when the channels below each level's threshold are dropped: one value per level."""
        x = torch.cat(self.rows) if self.rows else torch.zeros(1, self.d_in)  # [r, d_in]
        ys = [x @ w.float() for w in w_ts]
        ref = sum(float((y * y).sum()) for y in ys) or 1.0
        out = []
        for s in levels:
            dropped = x * (x.abs() <= self.cut(s))  # what the mask removes
            out.append(sum(float(((dropped @ w.float()) ** 2).sum()) for w in w_ts) / ref)
        return out


def anchored(kl_at_anchor: float, error: Sequence[float], levels: Sequence[float] = LEVELS) -> list[float]:
    """A loss curve over ``levels``: the output-error curve scaled to equal the measured KL at ANCHOR."""
    at = error[min(range(len(levels)), key=lambda j: abs(levels[j] - ANCHOR))]
    return [kl_at_anchor * e / max(at, 1e-12) for e in error]


@dataclass
class Allocation:
    sparsity: list[float]  # per group, channel sparsity
    saved: float  # fraction of the groups' bytes skipped per token (at the calibration quantiles)
    predicted_loss: float  # sum of the groups' measured loss increases at their levels


def monotone(curve: Sequence[float]) -> list[float]:
    """A measured loss curve made non-decreasing (its running maximum, from 0): noise never rewards sparsity."""
    out, best = [], 0.0
    for v in curve:
        best = max(best, float(v))
        out.append(best)
    return out


def greedy_path(curves: Sequence[Sequence[float]], sizes: Sequence[int],
                levels: Sequence[float] = LEVELS) -> list[Allocation]:
    """Allocations of increasing bytes saved: from all dense, each step moves one group to a higher level — the
    move of least loss per byte saved among every group's higher levels (the lower hull of its curve) — until every
    group is at the last level. ``curves[g][j]``: the loss increase of group g alone at ``levels[j]``."""
    n = len(curves)
    total = float(sum(sizes)) or 1.0
    curves = [monotone(c) for c in curves]
    cur = [-1] * n  # level index per group, -1 = dense

    def loss(g: int, j: int) -> float:
        return 0.0 if j < 0 else curves[g][j]

    def level(j: int) -> float:
        return 0.0 if j < 0 else levels[j]

    path: list[Allocation] = []
    while True:
        best: tuple[float, int, int] | None = None
        for g in range(n):
            for j in range(cur[g] + 1, len(levels)):
                gain = (level(j) - level(cur[g])) * sizes[g]
                ratio = (loss(g, j) - loss(g, cur[g])) / max(gain, 1e-12)
                if best is None or ratio < best[0] - 1e-15:
                    best = (ratio, g, j)
        if best is None:
            return path
        cur[best[1]] = best[2]
        sparsity = [level(j) for j in cur]
        path.append(Allocation(sparsity, sum(s * b for s, b in zip(sparsity, sizes)) / total,
                               sum(loss(g, j) for g, j in enumerate(cur))))


def for_bytes(path: Sequence[Allocation], target: float) -> Allocation:
    """The first allocation on ``path`` that skips at least ``target`` of the bytes (the last if none does)."""
    for a in path:
        if a.saved >= target - 1e-9:
            return a
    return path[-1]


def uniform(n: int, sizes: Sequence[int], target: float) -> Allocation:
    """Every group at the same channel sparsity ``target`` (TEAL without its allocation)."""
    total = float(sum(sizes)) or 1.0
    return Allocation([target] * n, sum(target * b for b in sizes) / total, float("nan"))


def within_budget(path: Sequence[Allocation], within: Callable[[Allocation], bool]) -> tuple[Allocation | None, int]:
    """The furthest allocation on ``path`` that ``within`` accepts, by bisection (the real loss grows along the
    path, nearly monotonically); (None, evaluations) when even the first is refused."""
    lo, hi, evals = -1, len(path) - 1, 0  # path[lo] accepted (-1: dense), path[> hi] refused
    while lo < hi:
        mid = (lo + hi + 1) // 2
        evals += 1
        if within(path[mid]):
            lo = mid
        else:
            hi = mid - 1
    return (path[lo] if lo >= 0 else None), evals


CURVES_VERSION = 1  # bump when the measurement changes: older cached curves are then not used


def curves_key(*parts: Any) -> str:
    """A cache key for loss curves over what they depend on (model fingerprint, calibration hash, options)."""
    return hashlib.sha256(json.dumps([CURVES_VERSION, LEVELS, ANCHOR, *parts], default=str).encode()).hexdigest()[:32]


def cached_curves(cache_dir: Path, key: str, names: Sequence[str]) -> list[list[float]] | None:
    """The loss curves stored under ``key`` for exactly these groups (``layer.name`` in order), else None."""
    try:
        data = json.loads((Path(cache_dir) / "curves" / f"{key}.json").read_text())
        curves = [[float(v) for v in c] for c in data["curves"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("groups") != list(names) or any(len(c) != len(LEVELS) for c in curves):
        return None
    return curves


def store_curves(cache_dir: Path, key: str, names: Sequence[str], curves: Sequence[Sequence[float]]) -> None:
    """Keep measured loss curves for a later build of the same model and calibration (best effort)."""
    path = Path(cache_dir) / "curves" / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent builds each write their own
        tmp.write_text(json.dumps({"groups": list(names), "curves": [list(map(float, c)) for c in curves]}))
        tmp.replace(path)
    except OSError:
        pass

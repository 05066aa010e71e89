"""allocate-sparsity: graph unchanged; the |act| thresholds of non-ReLU FFNs (one quantile, --act-sparsity,
for every layer after profile-activations) → per-layer thresholds allocated greedily against the calibration
loss, mean sparsity unchanged (--sparsity-allocation greedy). ReLU FFNs keep their natural sparsity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from picompile.context import BuildContext, FFNLayer
from picompile.errors import PassError
from picompile.formats.profile import PROFILE_FILE, update_counts
from picompile.ir.ops import RELU_FAMILY, is_picompile_op
from picompile.ir.patterns import Decider, ffn_nodes
from picompile.ir.schema import bind, call_args
from picompile.passes.registry import register_pass
from picompile.sparsity.profile_stats import LayerProfile
from picompile.sparsity.widen import WideningInterpreter, float32_decider, release_stored

MAX_LAYER_SPARSITY = 0.95  # no layer is pushed past this share of inactive neurons


@dataclass
class _Layer:
    """One non-ReLU FFN: its decider scores on the calibration tokens, for thresholds by quantile."""

    index: int
    scores: torch.Tensor  # [N, n_neurons] activation_score of each calibration token and neuron
    ordered: torch.Tensor  # [N * n_neurons] the same, flat and sorted ascending

    def threshold(self, sparsity: float) -> float:
        """Score above which a neuron counts as active so that ``sparsity`` of them are not."""
        if sparsity <= 0.0:
            return 0.0
        k = min(int(sparsity * self.ordered.numel()), self.ordered.numel() - 1)
        return float(self.ordered[k])


class _Thresholded(WideningInterpreter):
    """Runs the graph with each picompile.ffn masked at a per-layer |act| threshold."""

    def __init__(self, gm: fx.GraphModule, deciders: dict[int, Decider],
                 thresholds: dict[int, float]) -> None:
        super().__init__(gm)
        self.deciders = deciders
        self.thresholds = thresholds

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_picompile_op(target, "ffn"):
            call = bind("ffn", args, kwargs)
            layer = int(call["layer"])
            if self.thresholds.get(layer, 0.0) > 0.0:
                call["mask"] = self.deciders[layer].score(call["x"]) > self.thresholds[layer]  # [..., n_neurons]
                args, kwargs = call_args("ffn", call), {}
        return super().call_function(target, args, kwargs)


def _loss(gm: fx.GraphModule, ctx: BuildContext, chunks: list[torch.Tensor],
          deciders: dict[int, Decider], thresholds: dict[int, float]) -> float:
    """Mean next-token cross-entropy (nats) over the calibration chunks at these thresholds."""
    total, count = 0.0, 0
    runner = _Thresholded(gm, deciders, thresholds)
    with torch.no_grad():
        for chunk in chunks:
            logits = runner.run(chunk.unsqueeze(0), *ctx.info.kv_tensors())[0][0]  # [seq, vocab]
            total += float(torch.nn.functional.cross_entropy(logits[:-1].float(), chunk[1:], reduction="sum"))
            count += int(chunk.numel()) - 1
    return total / max(count, 1)


def greedy_allocation(loss_at: Callable[[list[float]], float], n_layers: int, target: float, step: float,
                      on_step: Callable[[], None] = lambda: None) -> list[float]:
    """Raise one layer's sparsity by ``step`` at a time — the layer whose raise costs the least loss — until
    the mean reaches ``target`` (the last raise is partial so the mean is exact)."""
    sparsity = [0.0] * n_layers
    remaining = target * n_layers
    while remaining > 1e-9:
        inc = min(step, remaining)
        best: tuple[float, int] | None = None
        for i in range(n_layers):
            if sparsity[i] + inc > MAX_LAYER_SPARSITY + 1e-9:
                continue
            trial = list(sparsity)
            trial[i] += inc
            loss = loss_at(trial)
            if best is None or loss < best[0]:
                best = (loss, i)
        if best is None:
            raise PassError(f"allocate-sparsity: cannot reach a mean sparsity of {target:.2f} with every layer at "
                            f"most {MAX_LAYER_SPARSITY:.2f}")
        sparsity[best[1]] += inc
        remaining -= inc
        on_step()
    return sparsity


def _score_layers(gm: fx.GraphModule, ctx: BuildContext,
                  layers: list[FFNLayer]) -> tuple[dict[int, Decider], list[_Layer]]:
    """Each layer's decider and its scores on the calibration tokens."""
    nodes = ffn_nodes(gm)
    deciders: dict[int, Decider] = {}
    infos: list[_Layer] = []
    for layer in layers:
        decider = deciders[layer.index] = float32_decider(gm, nodes[layer.index], ctx.config.act_criterion)
        with torch.no_grad():
            scores = decider.score(ctx.calibration[layer.index].x)  # [N, n_neurons]
        infos.append(_Layer(layer.index, scores, torch.sort(scores.flatten()).values))
    return deciders, infos


def _windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    """``ids`` [T] cut into chunks of ``window`` tokens (each [<= window]); a last single token is dropped."""
    return [ids[i : i + window] for i in range(0, ids.numel(), window) if ids[i : i + window].numel() > 1]


def _record(ctx: BuildContext, layers: list[FFNLayer], infos: list[_Layer], sparsity: list[float]) -> None:
    """Each layer's allocated threshold, mask and profile into the calibration and the layer's stats."""
    for layer, info, s in zip(layers, infos, sparsity):
        cal = ctx.calibration[info.index]
        cal.threshold = info.threshold(s)
        cal.mask = info.scores > cal.threshold  # [N, n_neurons]
        prof = LayerProfile.from_mask(cal.mask.numpy(), name=layer.module)
        cal.profile = prof
        layer.stats.update({"act_sparsity": round(s, 4), "act_threshold": cal.threshold,
                            "sparsity": prof.sparsity, "locality": prof.locality})


@register_pass("allocate-sparsity")
def allocate_sparsity(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    cfg = ctx.config
    if not ctx.calibration:
        raise PassError("allocate-sparsity needs profile-activations to run first")
    target = cfg.act_sparsity
    layers = [layer for layer in ctx.ffn_layers if layer.act not in RELU_FAMILY]
    if cfg.sparsity_allocation == "uniform" or not layers or target <= 0.0:
        for layer in layers:
            layer.stats["act_sparsity"] = target
        return gm
    deciders, infos = _score_layers(gm, ctx, layers)
    ids = ctx.calibration_ids[: cfg.allocation_tokens]  # [T]
    chunks = _windows(ids, min(ctx.max_seq_len, 256))
    cache: dict[tuple[float, ...], float] = {}

    def loss_at(sparsity: list[float]) -> float:
        key = tuple(round(s, 6) for s in sparsity)
        if key not in cache:
            cache[key] = _loss(gm, ctx, chunks, deciders, {l.index: l.threshold(s) for l, s in zip(infos, sparsity)})
        return cache[key]

    bar = iter(ctx.track(range(math.ceil(target * len(infos) / cfg.allocation_step)), "allocating sparsity"))
    sparsity = greedy_allocation(loss_at, len(infos), target, cfg.allocation_step, lambda: next(bar, None))
    dense_loss = loss_at([0.0] * len(infos))
    uniform_loss = loss_at([target] * len(infos))
    greedy_loss = loss_at(sparsity)
    method = "greedy"
    if greedy_loss > uniform_loss:  # greedy is myopic: keep whichever measured better
        sparsity, method = [target] * len(infos), "uniform (greedy measured worse)"
    _record(ctx, layers, infos, sparsity)
    ctx.manifest_extra["sparsity_allocation"] = {
        "method": method, "target": target, "step": cfg.allocation_step, "tokens": int(ids.numel()),
        "per_layer": {str(i.index): round(s, 4) for i, s in zip(infos, sparsity)},
        "calibration_nll": {"dense": dense_loss, "uniform": uniform_loss, "greedy": greedy_loss,
                            "allocated": min(greedy_loss, uniform_loss)},
        "evaluations": len(cache),
    }
    update_counts(ctx.staging_dir / PROFILE_FILE, {info.index: ctx.calibration[info.index].profile for info in infos})
    release_stored(gm)
    return gm

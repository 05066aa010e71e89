"""train-predictors: graph unchanged; trains one low-rank predictor per FFN layer
(fc1 [d_model→r] → ReLU → fc2 [r→n_neurons]) on the profiled (input, active-mask) pairs, with its
threshold tuned on held-out tokens to the recall target. Skipped for --predictor oracle / none.
"""
from __future__ import annotations

from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.passes.registry import register_pass
from picompile.predictor import choose_ranks, train_predictor


@register_pass("train-predictors")
def train_predictors(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    cfg = ctx.config
    ctx.predictors = {}
    if cfg.predictor != "trained":
        return gm
    if not ctx.calibration:
        raise PassError("train-predictors needs profile-activations to run first")
    layers = ctx.ffn_layers
    first = layers[0]
    ranks = choose_ranks(
        [ctx.calibration[layer.index].profile for layer in layers], first.d_model, first.n_neurons,
        ffn_matrices=3 if first.kind == "gated" else 2, budget_fraction=cfg.predictor_budget,
    )
    recall_target = cfg.recall_for(all(layer.act == "relu" for layer in layers))
    for layer, rank in ctx.track(list(zip(layers, ranks)), "training predictors"):
        cal = ctx.calibration[layer.index]
        predictor, report = train_predictor(cal.x, cal.mask, rank, epochs=cfg.predictor_epochs, seed=cfg.seed + layer.index,
                                            recall_target=recall_target)
        ctx.predictors[layer.index] = predictor
        layer.stats.update({
            "predictor_rank": rank, "recall_target": recall_target, "recall": report.recall, "precision": report.precision,
            "predicted_active": report.predicted_active_fraction, "true_active": report.true_active_fraction,
        })
    return gm

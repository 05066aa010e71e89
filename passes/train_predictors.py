"""train-predictors: graph unchanged; one low-rank predictor per FFN layer from the profiled (input, margin, mask):
``linear`` (default) fc2·fc1·x + offset by reduced-rank regression, rank chosen for the fewest bytes per token
(scattered FFN rows weighed by ``SCATTERED_ROW_COST``), or ``mlp`` fc2(ReLU(fc1 x)) trained with BCE
(PowerInfer); threshold tuned to the recall target, on the weights as stored. Skipped for oracle/none."""
from __future__ import annotations

from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.kernels import SCATTERED_ROW_COST, skips_inactive
from picompile.sparsity.linear_predictor import candidate_ranks, fit_linear_predictor
from picompile.ir.ops import RELU_FAMILY
from picompile.ir.patterns import PREDICTOR_DTYPES, ffn_nodes, weight_itemsize
from picompile.passes.registry import register_pass
from picompile.sparsity.predictor import choose_ranks, rank_granularity, train_predictor
from picompile.sparsity.widen import float32_decider, release_stored


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
    matrices = 3 if first.kind == "gated" else 2
    d, n = first.d_model, first.n_neurons
    # mlp: these ranks, shared out under the budget (which this also checks: BudgetError when too small);
    # linear: up to an equal share of the budget each, the cheapest per token kept
    ranks = choose_ranks([ctx.calibration[layer.index].profile for layer in layers], d, n, ffn_matrices=matrices,
                         budget_fraction=cfg.predictor_budget)
    max_rank = max(1, min(d, n, int(cfg.predictor_budget * matrices * d * n) // (d + n)))
    granularity = rank_granularity(d, n)
    recall_target = cfg.recall_for(all(layer.act in RELU_FAMILY for layer in layers))
    pred_dtype = PREDICTOR_DTYPES[cfg.predictor_storage()]  # int8: per-row scales, folded away (convert-weights)
    row_itemsize = weight_itemsize(cfg.weight_dtype, cfg.quant_block)  # as convert-weights stores them (scales too)
    nodes = ffn_nodes(gm)
    for layer, rank in ctx.track(list(zip(layers, ranks)), "fitting predictors"):
        cal = ctx.calibration[layer.index]
        seed = cfg.seed + layer.index
        if cfg.predictor_kind == "linear":
            margin = float32_decider(gm, nodes[layer.index], cfg.act_criterion).margin(cal.x, cal.threshold)  # [N, n]
            # bytes a decode step reads per selected neuron beyond those of the firing ones (read at any rank):
            # one row where the kernel skips the rest of a neuron that does not fire, else all its rows; weighed
            # against the predictor's own bytes by how much slower scattered rows read (SCATTERED_ROW_COST)
            kind = "ffn_gated" if layer.kind == "gated" else "ffn_relu"
            rows = 1 if skips_inactive(kind, layer.act, "gate_bias" in layer.weights) else matrices
            predictor, report = fit_linear_predictor(
                cal.x, margin, cal.mask, candidate_ranks(max_rank, granularity),
                row_cost=SCATTERED_ROW_COST * rows * layer.d_model * row_itemsize, param_cost=pred_dtype.itemsize,
                recall_target=recall_target, seed=seed, weight_dtype=pred_dtype)
            del margin
        else:
            predictor, report = train_predictor(cal.x, cal.mask, rank, epochs=cfg.predictor_epochs, seed=seed,
                                                recall_target=recall_target, weight_dtype=pred_dtype)
        ctx.predictors[layer.index] = predictor
        layer.stats.update({
            "predictor_kind": cfg.predictor_kind, "predictor_rank": report.rank, "recall_target": recall_target,
            "recall": report.recall, "precision": report.precision,
            "predicted_active": report.predicted_active_fraction, "true_active": report.true_active_fraction,
        })
    release_stored(gm)  # the decider rows read from a mapped checkpoint leave this process's memory
    return gm

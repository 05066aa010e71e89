"""insert-predictors: ffn(x, …) → ffn(x, …, mask=predict(x, fc1, fc2, threshold, act, offset))   (trained)
                   or ffn(x, …, mask=oracle_mask(x, w_decider, …[, w_up]))          (--predictor oracle);
--predictor none leaves the graph dense.
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.ir.patterns import add_buffer, decider_nodes, ffn_nodes
from picompile.ir.schema import arg, call_args, set_args
from picompile.passes.registry import register_pass


@register_pass("insert-predictors")
def insert_predictors(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    mode = ctx.config.predictor
    if mode == "none":
        return gm
    nodes = ffn_nodes(gm)
    for layer in ctx.ffn_layers:
        node = nodes[layer.index]
        x = arg(node, "x")
        if mode == "trained":
            pred = ctx.predictors.get(layer.index)
            if pred is None:
                raise PassError(f"no trained predictor for layer {layer.index} (run train-predictors first)")
            fc1 = add_buffer(gm, f"predictor{layer.index}_fc1", pred.fc1.weight, node)  # [rank, d_model]
            fc2 = add_buffer(gm, f"predictor{layer.index}_fc2", pred.fc2.weight, node)  # [n_neurons, rank]
            offset = None if pred.offset is None else add_buffer(gm, f"predictor{layer.index}_offset", pred.offset,
                                                                  node)  # [n_neurons]
            with gm.graph.inserting_before(node):
                mask = gm.graph.call_function(torch.ops.picompile.predict.default, call_args("predict", dict(
                    x=x, fc1=fc1, fc2=fc2, threshold=float(pred.threshold), layer=layer.index, act=pred.act,
                    offset=offset)))
        else:
            cal = ctx.calibration.get(layer.index)
            threshold = 0.0 if cal is None else float(cal.threshold)
            w, b, w_mul, b_mul = decider_nodes(node, ctx.config.act_criterion)
            with gm.graph.inserting_before(node):
                mask = gm.graph.call_function(torch.ops.picompile.oracle_mask.default, call_args("oracle_mask", dict(
                    x=x, w=w, b=b, act=layer.act, threshold=threshold, layer=layer.index, w_mul=w_mul,
                    b_mul=b_mul)))
        set_args(node, mask=mask)
    gm.recompile()
    return gm

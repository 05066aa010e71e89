"""capture: HF model (nn.Module) → torch.export graph of one decoder step.

forward(input_ids [1, seq], past_0 … past_{2L-1} [1, kv_heads, past, head_dim]) -> (logits, present_0 …)
(the calling convention of picompile.frontend.decoder).
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.frontend.decoder import FlatDecoder, dynamic_shapes, example_inputs
from picompile.ir.graph import flatten_codegen
from picompile.passes.registry import register_pass


@register_pass("capture")
def capture(gm: fx.GraphModule | None, ctx: BuildContext) -> fx.GraphModule:
    if gm is not None:
        raise PassError("capture must be the first pass of a pipeline")
    wrapper = FlatDecoder(ctx.model, ctx.info.n_layers).eval()
    ids, past = example_inputs(ctx.info)
    try:
        with torch.no_grad():
            ep = torch.export.export(wrapper, (ids, past), dynamic_shapes=dynamic_shapes(ctx.max_seq_len, len(past)), strict=False)
    except Exception as e:
        raise PassError(f"torch.export could not capture {ctx.info.architecture}: {type(e).__name__}: {e}") from e
    return flatten_codegen(ep.module())

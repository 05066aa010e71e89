"""capture: HF model (nn.Module) → torch.export graph of one decoder step.

forward(input_ids [1, seq], past_0 … past_{2L-1} [1, kv_heads, past, head_dim]) -> (logits, present_0 …).
"""
from __future__ import annotations

import torch
from torch import fx
from transformers import DynamicCache

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.graph import flatten_codegen
from picompile.passes.registry import register_pass


class FlatDecoder(torch.nn.Module):
    """A flat calling convention around an HF causal LM, so the KV cache is plain tensors.

    Prefill passes empty past tensors (past length 0); decode passes the previous presents.
    """

    def __init__(self, model: torch.nn.Module, n_layers: int) -> None:
        super().__init__()
        self.model = model
        self.n_layers = n_layers

    def forward(self, input_ids: torch.Tensor, past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache(config=self.model.config)
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        past_len = past[0].shape[2]
        positions = torch.arange(past_len, past_len + input_ids.shape[1]).unsqueeze(0)  # [1, seq]
        out = self.model(input_ids=input_ids, cache=cache, position_ids=positions, use_cache=True)
        presents: list[torch.Tensor] = []
        for layer in cache.layers:
            presents += [layer.keys, layer.values]  # [1, kv_heads, past + seq, head_dim]
        return (out.logits, *presents)


def example_inputs(ctx: BuildContext, seq: int = 3, past_len: int = 4) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    info = ctx.info
    ids = torch.zeros(1, seq, dtype=torch.long)  # [1, seq]
    past = info.kv_tensors(past_len)
    return ids, past


def dynamic_shapes(ctx: BuildContext, n_past: int) -> tuple[dict[int, object], tuple[dict[int, object], ...]]:
    max_len = ctx.max_seq_len
    seq = torch.export.Dim("seq", min=1, max=max_len)
    past = torch.export.Dim("past", min=0, max=max_len)
    return {1: seq}, tuple({2: past} for _ in range(n_past))


@register_pass("capture")
def capture(gm: fx.GraphModule | None, ctx: BuildContext) -> fx.GraphModule:
    if gm is not None:
        raise PassError("capture must be the first pass of a pipeline")
    wrapper = FlatDecoder(ctx.model, ctx.info.n_layers).eval()
    ids, past = example_inputs(ctx)
    try:
        with torch.no_grad():
            ep = torch.export.export(wrapper, (ids, past), dynamic_shapes=dynamic_shapes(ctx, len(past)), strict=False)
    except Exception as e:
        raise PassError(f"torch.export could not capture {ctx.info.architecture}: {type(e).__name__}: {e}") from e
    return flatten_codegen(ep.module())

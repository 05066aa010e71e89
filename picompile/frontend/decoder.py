"""The decoder step's calling convention: an HF causal LM with its KV cache as flat tensors, and the example
inputs and dynamic dimensions torch.export captures it (and the packaged graph) with.

forward(input_ids [1, seq], past_0 … past_{2L-1} [1, kv_heads, past, head_dim]) -> (logits, present_0 …).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from picompile.frontend.base import ModelInfo


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


def example_inputs(info: ModelInfo, seq: int = 3, past_len: int = 4) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    ids = torch.zeros(1, seq, dtype=torch.long)  # [1, seq]
    return ids, info.kv_tensors(past_len)


def dynamic_shapes(max_seq_len: int, n_past: int) -> tuple[dict[int, object], tuple[dict[int, object], ...]]:
    seq = torch.export.Dim("seq", min=1, max=max_seq_len)
    past = torch.export.Dim("past", min=0, max=max_seq_len)
    return {1: seq}, tuple({2: past} for _ in range(n_past))

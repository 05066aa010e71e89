"""capture alone: the decoder-step graph's structure and numerics against the HF model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.passes.capture import capture
from picompile.testing import context_for


@pytest.mark.parametrize("key", [("opt", "relu"), ("llama", "silu")])
def test_capture_flat_kv_graph(key: tuple[str, str], checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path)
    gm = capture(None, ctx)
    phs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    n_past = 2 * ctx.info.n_layers
    assert phs == ["input_ids"] + [f"past_{i}" for i in range(n_past)]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert len(out.args[0]) == 1 + n_past
    assert not any(n.op == "call_module" for n in gm.graph.nodes)

    ids = torch.tensor([[3, 9, 27, 81, 11]])
    empty = ctx.info.kv_tensors()
    with torch.no_grad():
        logits, *present = gm(ids, *empty)
        ref = ctx.model(ids).logits
        assert torch.allclose(logits, ref, atol=1e-5)
        assert present[0].shape == (1, ctx.info.n_kv_heads, 5, ctx.info.head_dim)
        step, *_ = gm(torch.tensor([[5]]), *present)  # decode one token on the cache
        ref2 = ctx.model(torch.cat([ids, torch.tensor([[5]])], 1)).logits[:, -1]
        assert torch.allclose(step[:, -1], ref2, atol=1e-5)

"""canonicalize-ffn alone: one picompile.ffn per layer, same numerics, and clear reasons when it fails."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.errors import PatternError
from picompile.ir.graph import count_ops
from picompile.passes.canonicalize_ffn import canonicalize_ffn
from picompile.passes.capture import capture
from picompile.testing import context_for

aten = torch.ops.aten


def _run(gm: torch.fx.GraphModule, n_past: int, kv: tuple[int, int]) -> torch.Tensor:
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    empty = tuple(torch.zeros(1, kv[0], 0, kv[1]) for _ in range(n_past))
    with torch.no_grad():
        return gm(ids, *empty)[0]


@pytest.mark.parametrize("key", [("opt", "relu"), ("llama", "relu"), ("llama", "silu")])
def test_one_ffn_op_per_layer(key: tuple[str, str], checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path)
    gm = capture(None, ctx)
    kv = (ctx.info.n_kv_heads, ctx.info.head_dim)
    before = _run(gm, 2 * ctx.info.n_layers, kv)
    n_linear = count_ops(gm)["aten::linear"]
    gm = canonicalize_ffn(gm, ctx)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops["picompile::ffn"] == L
    per_ffn = 3 if key[0] == "llama" else 2
    assert ops["aten::linear"] == n_linear - per_ffn * L
    assert ops.get("aten::relu", 0) == 0 and ops.get("aten::silu", 0) == 0
    assert [layer.index for layer in ctx.ffn_layers] == list(range(L))
    assert all(layer.kind == ("gated" if key[0] == "llama" else "mlp") and layer.act == key[1] for layer in ctx.ffn_layers)
    assert all(layer.n_neurons == 192 and layer.d_model == 64 for layer in ctx.ffn_layers)
    after = _run(gm, 2 * L, kv)
    assert torch.allclose(before, after, atol=1e-6)


def test_unmatched_layer_says_why(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path)
    gm = capture(None, ctx)
    acts = [n for n in gm.graph.nodes if n.target == aten.relu.default]
    acts[1].target = aten.sigmoid.default  # layer 1's activation is no longer one we know
    with pytest.raises(PatternError, match=r"1 of 2 layers:\s+layer 1: no relu/silu/gelu activation found"):
        canonicalize_ffn(gm, ctx)


def test_extra_user_of_activation_says_why(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path)
    gm = capture(None, ctx)
    act = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        extra = gm.graph.call_function(aten.sum.default, (act,))
    out.args = ((*out.args[0], extra),)
    with pytest.raises(PatternError, match=r"layer 0: relu \(relu\) has 2 users, expected 1"):
        canonicalize_ffn(gm, ctx)

"""fold-kv-repeat alone: repeat_kv (unsqueeze → expand → reshape) before each sdpa folds into enable_gqa;
logits unchanged; models without grouped KV heads (OPT) say why nothing matched."""
from __future__ import annotations

from pathlib import Path

import torch

from picompile.testing import context_for, run_passes

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _count(gm: torch.fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_folds_grouped_kv_and_keeps_logits(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path)  # 4 heads, 2 KV heads
    gm = run_passes(ctx, ["capture", "canonicalize-ffn"])
    ids = torch.arange(3, 12).unsqueeze(0)
    past = ctx.info.kv_tensors()
    with torch.no_grad():
        before = gm(ids, *past)
    n_expand = _count(gm, torch.ops.aten.expand.default)
    gm = run_passes(ctx, ["fold-kv-repeat"], gm)
    sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]
    assert len(sdpa) == 2 and all(n.kwargs.get("enable_gqa") for n in sdpa)
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in sdpa)  # keys straight from the 2-head cache
    assert _count(gm, torch.ops.aten.expand.default) == n_expand - 4  # K and V of both layers
    assert ctx.manifest_extra["fold_kv_repeat"] == {"folded": 2, "left": []}
    with torch.no_grad():
        after = gm(ids, *past)
        decode = gm(torch.tensor([[5]]), *after[1:])[0]
        ref = run_passes(context_for(checkpoints[("llama", "relu")], tmp_path / "r"), ["capture"])(
            torch.tensor([[5]]), *before[1:])[0]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode, ref, atol=1e-5, rtol=1e-5)


def test_no_grouped_kv_says_why(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn", "fold-kv-repeat"])
    section = ctx.manifest_extra["fold_kv_repeat"]
    assert section["folded"] == 0 and len(section["left"]) == 2  # one reason per attention
    assert _count(gm, SDPA) == 2 and not any(n.kwargs.get("enable_gqa") for n in gm.graph.nodes
                                             if n.op == "call_function" and n.target is SDPA)

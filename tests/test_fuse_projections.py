"""fuse-projections alone: q/k/v (same input) become one linear over stacked rows plus slices; numerics unchanged."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.patterns import linear_parts
from picompile.testing import context_for, decode_logits, run_passes

PREFIX = ["capture", "canonicalize-ffn", "fold-kv-repeat", "convert-weights"]


@pytest.mark.parametrize("key,dtype", [(("llama", "relu"), "float16"), (("opt", "relu"), "float32")])
def test_fuse(key: tuple[str, str], dtype: str, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path, calibration_tokens=64, weight_dtype=dtype)
    gm = run_passes(ctx, PREFIX)
    op = "picompile::linear" if dtype == "float16" else "aten::linear"
    before_ops = count_ops(gm)
    ids = [7, 3, 99, 42, 5, 61]
    before = decode_logits(gm, ctx, ids)
    gm = run_passes(ctx, ["fuse-projections"], gm)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops[op] == before_ops[op] - 2 * L  # q, k, v → one per layer
    assert ops.get("aten::slice.Tensor", 0) == before_ops.get("aten::slice.Tensor", 0) + 3 * L
    section = ctx.manifest_extra["fuse_projections"]
    assert section["groups"] == L and all(len(g["linears"]) == 3 for g in section["fused"])
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).endswith("linear.default")
             and str(linear_parts(n)[1].target).startswith("fused_")]
    assert len(fused) == L
    for n in fused:
        _, w_node, b = linear_parts(n)
        w = get_tensor(gm, w_node)
        assert w.shape[1] == ctx.info.d_model and w.dtype == getattr(torch, dtype)
        assert (b is None) == (key[0] == "llama")  # OPT's q/k/v biases are stacked too
    after = decode_logits(gm, ctx, ids)
    assert (after - before).abs().max().item() < 1e-5

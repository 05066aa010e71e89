"""lower-tvm alone: every sparse part becomes a TVM kernel call, kernels land in the artifact, and
decode through the kernels matches the reference ops."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.errors import PassError
from picompile.ir.graph import count_ops
from picompile.ir.schema import arg
from picompile.runtime.loader import load_kernels
from picompile.testing import context_for, run_passes

PREFIX = ["capture", "canonicalize-ffn", "profile-activations", "train-predictors", "place-neurons",
          "insert-predictors", "split-ffn"]


def _decode(gm: torch.fx.GraphModule, ctx, ids: list[int]) -> torch.Tensor:
    past = ctx.info.kv_tensors()
    outs = []
    with torch.no_grad():
        out = gm(torch.tensor([ids[:3]]), *past)  # prefill: several tokens, the dense masked path
        outs.append(out[0][0])
        for t in ids[3:]:  # decode: one token at a time, through the kernels
            out = gm(torch.tensor([[t]]), *out[1:])
            outs.append(out[0][0])
    return torch.cat(outs)


@pytest.mark.parametrize("key,mode", [(("llama", "relu"), "trained"), (("opt", "relu"), "oracle"), (("llama", "silu"), "none")])
def test_lowered_graph_matches_reference(key: tuple[str, str], mode: str, checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path, target="rtx4090", vram_budget_gib=0.0004, placement_batch=8,
                      calibration_tokens=256, predictor=mode)
    gm = run_passes(ctx, PREFIX)
    ids = [9, 8, 7, 60, 50, 40, 30, 20]
    before = _decode(gm, ctx, ids)
    before_nodes = [n.target.name() for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")]
    gm = run_passes(ctx, ["lower-tvm"], gm)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops.get("picompile::sparse_ffn", 0) == 0 and ops["picompile::tvm_sparse_ffn"] == 2 * L
    # float32 predictors too: one kernel call each instead of torch's GEMVs
    assert ops.get("picompile::predict", 0) == 0 and ops.get("picompile::tvm_predict", 0) == (L if mode == "trained" else 0)
    # every float32 linear (q, k, v, o, lm_head) is a TVM GEMV too, its checkpoint weight realigned for the kernel
    n_linear = sum(1 for n in before_nodes if n == "aten::linear")
    assert ops.get("aten::linear", 0) == 0 and ops["picompile::tvm_linear"] == n_linear == 4 * L + 1
    entries = ctx.manifest_extra["kernels"]
    targets = sorted({e["spec"]["target"] for e in entries})
    assert targets == ["cuda:sm_89", "llvm"]  # CPU kernels for both parts, CUDA for the hot part
    for e in entries:
        assert (tmp_path / e["file"]).is_file() and (tmp_path / e["meta"]).is_file()
    for node in gm.graph.nodes:
        if node.target == torch.ops.picompile.tvm_sparse_ffn.default:
            part, cpu_key, gpu_key = (arg(node, k) for k in ("part", "kernel", "gpu_kernel"))
            assert cpu_key and (bool(gpu_key) == (part == "hot"))
    load_kernels(tmp_path, entries)
    after = _decode(gm, ctx, ids)
    assert (after - before).abs().max().item() < 1e-4


def test_needs_split(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("opt", "relu")], tmp_path, predictor="oracle")
    gm = run_passes(ctx, ["capture", "canonicalize-ffn"])
    with pytest.raises(PassError, match="no sparse_ffn node to lower"):
        run_passes(ctx, ["lower-tvm"], gm)


def test_unsupported_activation_is_reported(tmp_path: Path) -> None:
    from picompile.testing import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "gelu", "opt", "gelu", seed=1)
    ctx = context_for(ckpt, tmp_path / "s", calibration_tokens=64, predictor="oracle")
    gm = run_passes(ctx, PREFIX + ["lower-tvm"])
    assert count_ops(gm)["picompile::sparse_ffn"] == 4  # left on the reference op …
    assert any("activation gelu has no TVM kernel" in r for r in ctx.manifest_extra["kernels_skipped"])  # … saying why

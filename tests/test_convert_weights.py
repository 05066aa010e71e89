"""convert-weights alone (structure + numerics), and float16 artifacts end to end (TVM GEMV kernels, hybrid)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import picompile
from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.schema import arg, args_of
from picompile.testing import context_for, decode_logits, run_passes

PREFIX = ["capture", "canonicalize-ffn", "fold-kv-repeat", "profile-activations", "train-predictors", "place-neurons",
          "insert-predictors", "split-ffn"]
PROMPT = [5, 17, 33, 4, 99, 120, 7]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("key", [("llama", "relu"), ("opt", "relu")])
def test_convert_float16(key: tuple[str, str], checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[key], tmp_path, calibration_tokens=256, target="rtx4090", vram_budget_gib=0.0004,
                      placement_batch=8, weight_dtype="float16")
    gm = run_passes(ctx, PREFIX)
    ids = [7, 3, 99, 42, 5, 61]
    before = decode_logits(gm, ctx, ids)
    n_linear = count_ops(gm)["aten::linear"]
    gm = run_passes(ctx, ["convert-weights"], gm)
    ops = count_ops(gm)
    assert "aten::linear" not in ops and ops["picompile::linear"] == n_linear
    fp16 = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if is_picompile_op(node.target, "linear"):
            assert get_tensor(gm, arg(node, "w")).dtype == torch.float16
            if arg(node, "b") is not None:  # biases stay float32
                assert get_tensor(gm, arg(node, "b")).dtype == torch.float32
            fp16 += 1
        elif is_picompile_op(node.target, "sparse_ffn") or is_picompile_op(node.target, "predict"):
            a = args_of(node)
            predict = is_picompile_op(node.target, "predict")
            weights = ("fc1", "fc2") if predict else ("w_up", "b_up", "w_gate", "w_down_t")
            for w in (a[name] for name in weights):
                if isinstance(w, torch.fx.Node) and w.op == "get_attr":
                    assert get_tensor(gm, w).dtype == torch.float16, node.format_node()
        elif node.target is torch.ops.aten.embedding.default:
            assert get_tensor(gm, node.args[0]).dtype == torch.float32
    assert fp16 == n_linear
    # no float32 copy of a converted weight is left behind (it would go into the artifact)
    for node in gm.graph.find_nodes(op="get_attr"):
        t = get_tensor(gm, node)
        if t.dim() == 2 and t.dtype == torch.float32:  # only embedding tables (an OPT one is tied to lm_head)
            assert {u.target for u in node.users} == {torch.ops.aten.embedding.default}, node.name
    info = ctx.manifest_extra["convert_weights"]
    assert info["bytes_after"] * 2 == info["bytes_before"] and info["converted"] > 0
    after = decode_logits(gm, ctx, ids)
    assert 0 < _rel(after, before) < 1e-2  # float16 rounding: changed, but little


def test_float32_is_unchanged(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=256, predictor="oracle")
    gm = run_passes(ctx, PREFIX)
    text = gm.code
    gm = run_passes(ctx, ["convert-weights"], gm)
    assert gm.code == text and ctx.manifest_extra["convert_weights"]["converted"] == 0


def test_float16_predictors_in_a_float32_build(checkpoints: dict, tmp_path: Path) -> None:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=256, predictor_dtype="float16")
    gm = run_passes(ctx, PREFIX)
    ids = [7, 3, 99, 42, 5, 61]
    before = decode_logits(gm, ctx, ids)
    text = gm.code
    gm = run_passes(ctx, ["convert-weights"], gm)
    assert "aten.linear" in gm.code and gm.code != text  # linears stay float32; the predictors' weights move
    preds = [n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "predict")]
    assert len(preds) == 2
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_picompile_op(node.target, "predict"):
            assert [get_tensor(gm, arg(node, a)).dtype for a in ("fc1", "fc2")] == [torch.float16, torch.float16]
            assert get_tensor(gm, arg(node, "offset")).dtype == torch.float32  # the offset
        elif node.op == "call_function" and is_picompile_op(node.target, "sparse_ffn"):
            assert get_tensor(gm, arg(node, "w_up")).dtype == torch.float32
    info = ctx.manifest_extra["convert_weights"]
    assert info["converted"] == 4 and info["predictor_dtype"] == "float16" and info["bytes_after"] * 2 == info["bytes_before"]
    # the threshold was tuned on the rounded weights (train-predictors): the masks, so the logits, are the same
    assert torch.equal(decode_logits(gm, ctx, ids), before)


@pytest.mark.parametrize("predictor", ["trained", "oracle"])
def test_float16_artifact(predictor: str, checkpoints: dict, tmp_path: Path) -> None:
    ckpt = checkpoints[("llama", "relu")]
    opts = dict(target="rtx4090", vram_budget_gib=0.0004, placement_batch=8, calibration_tokens=256,
                predictor=predictor, emit=lambda s: None)
    out16 = picompile.build(ckpt, output=tmp_path / "h.pic", weight_dtype="float16", **opts)
    ref16 = picompile.build(ckpt, output=tmp_path / "r.pic", weight_dtype="float16", pipeline="reference", **opts)
    session = picompile.load(out16, hybrid="off")
    ops = count_ops(session.graph)
    assert "aten::linear" not in ops and ops["picompile::tvm_linear"] == 2 * 2 + 1  # fused qkv and o of 2 layers + lm_head
    assert session.manifest.weights["dtype"] == "float16"
    kinds = {(k["spec"]["kind"], k["spec"]["act"], k["spec"]["weight_dtype"]) for k in session.manifest.sections["kernels"]}
    assert ("up", "none", "float16") in kinds and ("ffn_gated", "relu", "float16") in kinds
    if predictor == "trained":
        preds = [n for n in session.graph.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "tvm_predict")]
        # linear predictors (act "none"), with an offset
        assert len(preds) == 2 and all(arg(n, "act") == "none" and arg(n, "offset") is not None for n in preds)
        # one kernel per predictor (kind "predict": fc1, fc2, offset and the threshold test in one call)
        assert all(arg(n, "kernel2") == "" and arg(n, "kernel1").startswith("pi_predict_") for n in preds)
        assert ("predict", "none", "float16") in kinds
    with safe_open(str(out16 / "weights.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert "F16" in dtypes
    # TVM kernels (one token) and torch float16 (prefill) against the reference ops, decode by decode
    ref = picompile.load(ref16)
    new = session.generate(PROMPT, 12, stop_at_eos=False)
    old = ref.generate(PROMPT, 12, stop_at_eos=False)
    # the reference computes float16 linears in float16 (ops.lin), the kernels accumulate in float32: the
    # gap grows with the neurons computed (a rank-8 predictor selecting ~80 % of them: ~0.4-1 %)
    assert _rel(session.last_logits, ref.last_logits) < 2e-2 and new == old
    if predictor == "oracle":  # exact masks: against the float32 model, float16 rounding only
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        with torch.no_grad():
            dense = model(torch.tensor([PROMPT + new])).logits[0]
        exact = picompile.load(out16, hybrid="off", prefill_dtype="weights")  # prefill in float16 (the default
        assert _rel(exact.logits(PROMPT + new), dense) < 2e-2  # may be bfloat16: runtime/compute_dtype.choose)
        got = session.logits(PROMPT + new)
        assert float((got - dense).norm() / dense.norm()) < 2e-2  # test_compute_dtype's bfloat16 tolerance
        assert new == old
        with torch.no_grad():
            steps = model(torch.tensor([PROMPT + new[:-1]])).logits[0, len(PROMPT) - 1:]
        assert _rel(session.last_logits, steps) < 2e-2
    # hybrid scheduling (thread) on float16 parts gives the same logits as the graph as built
    threaded = picompile.load(out16, hybrid="thread")
    assert threaded.generate(PROMPT, 12, stop_at_eos=False) == new
    assert (threaded.last_logits - session.last_logits).abs().max().item() < 1e-4


def test_float16_artifact_exports_onnx(checkpoints: dict, tmp_path: Path) -> None:
    import onnx

    from picompile.cli import main

    out = picompile.build(checkpoints[("llama", "relu")], output=tmp_path / "h.pic", weight_dtype="float16",
                          calibration_tokens=256, emit=lambda s: None)
    assert main(["inspect", str(out), "--export-onnx", str(tmp_path / "g.onnx")]) == 0
    model = onnx.load(str(tmp_path / "g.onnx"))
    onnx.checker.check_model(model, full_check=True)
    types = [n.op_type for n in model.graph.node if n.domain == "picompile"]
    assert types.count("TvmLinear") == 5 and types.count("TvmPredict") == 2 and types.count("TvmSparseFFN") == 4
    fp16 = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16}
    assert len(fp16) >= 5 + 2 * 2 + 4 * 3 - 3  # linears (q/k/v fused), predictors, FFN rows (an empty hot part may be shared)


def test_int8_predictors_fold_their_scales(checkpoints: dict, tmp_path: Path) -> None:
    """--predictor-dtype int8 (auto in an int8/int4 build): fc1/fc2 stored int8 with no scales, the per-row scales
    folded into fc2 and the offset, threshold 0; the same masks, so the same logits, as the rounded predictor."""
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=256, predictor_dtype="int8")
    gm = run_passes(ctx, PREFIX)
    ids = [7, 3, 99, 42, 5, 61]
    before = decode_logits(gm, ctx, ids)
    thresholds = [float(arg(n, "threshold")) for n in gm.graph.nodes
                  if n.op == "call_function" and is_picompile_op(n.target, "predict")]
    assert len(thresholds) == 2 and any(t != 0.0 for t in thresholds)
    gm = run_passes(ctx, ["convert-weights"], gm)
    preds = [n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "predict")]
    assert len(preds) == 2
    for node in preds:
        fc1, fc2 = (get_tensor(gm, arg(node, a)) for a in ("fc1", "fc2"))
        assert fc1.dtype == fc2.dtype == torch.int8 and float(arg(node, "threshold")) == 0.0
        assert get_tensor(gm, arg(node, "offset")).dtype == torch.float32
        # per-row symmetric quants: every nonzero row reaches ±127 (its scale is its max)
        for w in (fc1, fc2):
            live = w.abs().amax(dim=1) > 0
            assert bool((w[live].abs().amax(dim=1) == 127).all())
    info = ctx.manifest_extra["convert_weights"]
    assert info["predictor_dtype"] == "int8" and info["bytes_after"] * 4 == info["bytes_before"]
    assert torch.allclose(decode_logits(gm, ctx, ids), before, rtol=0, atol=1e-5)

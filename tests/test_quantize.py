"""int8 / int4 weights (``--weight-dtype``, pass convert-weights): the pass alone, llama.cpp's blocks kept, the
float16 fallback, the manifest's record and its schema, quantized artifacts on the TVM kernels against the
reference ops, and the logits' error against the float32 model.

Measured relative error of the logits (‖Δ‖/‖ref‖ over 19 prompt positions, the dense pipeline, against
transformers' float32 model) on the seeded synthetic ``tiny-llama-relu`` (d_model 128, 1024 neurons, 2 layers):
float16 7.4e-4, int8 1.6e-2, int4 2.6e-1 (top-1 token equal at 100 / 95 / 84 % of the positions); the
default pipeline (oracle masks, kernels for decode) gives the same figures (1.6e-2, 2.7e-1). Random weights are
the worst case of block quantization (no outliers to spend the scale on, no redundancy).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import picompile
from picompile.errors import ArtifactError
from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.patterns import quantized_weights
from picompile.ir.schema import arg, args_of, node_op
from picompile.kernels.qformat import QFormat, dequantize, format_of, quantize
from picompile.testing import context_for, decode_logits, run_passes

PREFIX = ["capture", "canonicalize-ffn", "fold-kv-repeat", "profile-activations", "train-predictors", "place-neurons",
          "insert-predictors", "split-ffn"]
IDS = [7, 3, 99, 42, 5, 61]
PROMPT = [5, 17, 33, 4, 99, 120, 7]
QUANTS = {"int8": torch.int8, "int4": torch.uint8}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _prefix(checkpoints: dict, tmp_path: Path, weight_dtype: str, **options: object) -> tuple:
    ctx = context_for(checkpoints[("llama", "relu")], tmp_path, calibration_tokens=256, predictor="oracle",
                      weight_dtype=weight_dtype, **options)
    return ctx, run_passes(ctx, PREFIX)


@pytest.mark.parametrize("name,tol", [("int8", 0.05), ("int4", 0.6)])
def test_quantize_pass(name: str, tol: float, checkpoints: dict, tmp_path: Path) -> None:
    ctx, gm = _prefix(checkpoints, tmp_path, name)
    before = decode_logits(gm, ctx, IDS)
    n_linear = count_ops(gm)["aten::linear"]
    gm = run_passes(ctx, ["convert-weights"], gm)
    ops = count_ops(gm)
    assert "aten::linear" not in ops and ops["picompile::linear"] == n_linear
    seen = 0
    for node in gm.graph.nodes:
        op = node_op(node)
        if op in ("linear", "sparse_ffn"):
            q = quantized_weights(node)
            assert set(q) == ({"w"} if op == "linear" else {"w_up", "w_gate", "w_down_t"}), node.format_node()
            for w, s in q.values():
                qt, st = get_tensor(gm, w), get_tensor(gm, s)
                assert qt.dtype == QUANTS[name] and format_of(qt, st) == QFormat(name, 32)
            seen += 1
            if op == "sparse_ffn":  # b_up stays float32 (the quantized kernels take it so); here: no bias
                assert arg(node, "b_up") is None or get_tensor(gm, arg(node, "b_up")).dtype == torch.float32
        elif op == "oracle_mask":  # the oracle's deciding rows: float16
            assert get_tensor(gm, arg(node, "w")).dtype == torch.float16
    assert seen == n_linear + 4
    # no float32 matrix left but the embedding
    for node in gm.graph.find_nodes(op="get_attr"):
        t = get_tensor(gm, node)
        if t.dim() == 2 and t.dtype == torch.float32:
            assert {u.target for u in node.users} == {torch.ops.aten.embedding.default}, node.name
    info = ctx.manifest_extra["convert_weights"]
    assert info["dtype"] == name and info["block"] == 32 and info["fallback"] == [] and info["quantized"] > 0
    # quants + scales, and the oracle's float16 deciding rows (float16 alone would be 0.5)
    assert info["bytes_after"] < info["bytes_before"] * {"int8": 0.35, "int4": 0.25}[name]
    err = _rel(decode_logits(gm, ctx, IDS), before)
    assert 0 < err < tol, err


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_llama_cpp_blocks_are_kept(name: str, checkpoints: dict, tmp_path: Path) -> None:
    """A float32 weight that is whole q8_0 / q4_0 blocks (a GGUF import dequantizes them exactly) is quantized
    back to exactly those blocks: quantize → dequantize → quantize is the identity on (q, s), in the pass too."""
    fmt = QFormat(name, 32)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    q, s = quantize(w, fmt)
    q2, s2 = quantize(dequantize(q, s), fmt)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    ctx, gm = _prefix(checkpoints, tmp_path, name)
    blocks = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.linear.default:
            t = get_tensor(gm, node.args[1])
            blocks[str(node.args[1].target)] = quantize(t, fmt)
            with torch.no_grad():  # as a Q8_0 / Q4_0 GGUF import gives it
                t.copy_(dequantize(*blocks[str(node.args[1].target)]))
    gm = run_passes(ctx, ["convert-weights"], gm)
    checked = 0
    for node in gm.graph.nodes:
        if node_op(node) == "linear":
            w_node, s_node = quantized_weights(node)["w"]
            source = str(w_node.target).removesuffix(f"_{name}_q")
            q0, s0 = next(v for k, v in blocks.items() if k.replace(".", "_") == source)
            assert torch.equal(get_tensor(gm, w_node), q0) and torch.equal(get_tensor(gm, s_node), s0)
            checked += 1
    assert checked == len(blocks) > 0


@pytest.mark.parametrize("name,block", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_ops_dequantize_is_qformats(name: str, block: int) -> None:
    from picompile.ir.ops import deq

    q, s = quantize(torch.randn(40, 256, generator=torch.Generator().manual_seed(4)), QFormat(name, block))
    assert torch.equal(deq(q, s), dequantize(q, s))
    assert torch.equal(deq(q[5:9], s[5:9]), dequantize(q, s)[5:9])  # gathered rows (one token's reference path)


def test_rows_not_whole_blocks_fall_back_to_float16(checkpoints: dict, tmp_path: Path) -> None:
    ctx, gm = _prefix(checkpoints, tmp_path, "int8", quant_block=128)  # d_model 64 and 192 neurons: no whole blocks
    gm = run_passes(ctx, ["convert-weights"], gm)
    info = ctx.manifest_extra["convert_weights"]
    assert info["quantized"] == 0 and info["fallback"] and "128-element blocks" in info["fallback"][0]["reason"]
    for node in gm.graph.nodes:
        if node_op(node) == "linear":
            assert arg(node, "s") is None and get_tensor(gm, arg(node, "w")).dtype == torch.float16


def _auto_prefill(art: Path, per_call: picompile.Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_dtype="auto" on a quantized artifact: bfloat16 copies (their size the dequantized weights', from
    the weight file's header) where this CPU has a fast bfloat16 GEMM and the copy fits; streamed without the
    copy otherwise (here: memory made short), with the reason, and the same logits. Without a fast bfloat16 GEMM
    (AVX2): float32 copies where they fit, else dequantized per call."""
    from picompile.runtime import compute_dtype

    from safetensors import safe_open

    m = per_call.manifest
    with safe_open(str(art / m.weights["file"]), "pt") as f:  # int4: two weights a byte, bfloat16 two bytes each
        want = sum(2 * 2 * f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in m.weights["quantized"])
    assert compute_dtype.copy_bytes(m, art) == want > 0
    auto = picompile.load(art)
    if compute_dtype.has_bf16_gemm():
        assert auto.prefill_dtype == "bfloat16" and "int4 weights with a fast bfloat16 GEMM" in auto.prefill_reason
        assert "compute-dtype" in auto.load_steps
        assert _rel(auto.logits(PROMPT), per_call.logits(PROMPT)) < 5e-2
    monkeypatch.setattr(compute_dtype, "_meminfo", lambda: {"MemAvailable": want + (1 << 30), "MemTotal": 16 << 30})
    short = picompile.load(art)  # the copy would leave 1 GiB, under the 2 GiB kept free: streamed, no copy
    if not compute_dtype.has_bf16_gemm():  # AVX2: float32 copies (auto above) where they fit, else per call
        assert auto.prefill_dtype == "float32" and "int4 weights dequantized once at load" in auto.prefill_reason
        assert short.prefill_dtype is None and "compute-dtype" not in short.load_steps
        assert "dequantized to float32 per call" in short.prefill_reason
        return
    assert short.prefill_dtype == "bfloat16-stream" and "compute-dtype" in short.load_steps
    assert "kept free: each weight converted to bfloat16 per call instead (no copy)" in short.prefill_reason
    # the copies' values and GEMMs without the copies: the same logits (the down rows' layout aside, 1e-5)
    want_logits, got = auto.logits(PROMPT), short.logits(PROMPT)
    assert float((got - want_logits).abs().max() / want_logits.abs().max()) < 1e-5
    assert not [b for b, t in short.prefill_graph.named_buffers() if t.dtype == torch.bfloat16]


def test_quantized_artifact(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from picompile.cli import main
    from picompile.formats.manifest_schema import validate_manifest

    ckpt = checkpoints[("llama", "relu")]
    opts = dict(calibration_tokens=256, emit=lambda s: None, weight_dtype="int4")
    out = picompile.build(ckpt, output=tmp_path / "q.pic", **opts)
    ref = picompile.build(ckpt, output=tmp_path / "r.pic", pipeline="reference", **opts)
    # prefill in the artifact's own maths (dequantize + float32 GEMM): the TVM kernels' decode is compared at 1e-4
    session, reference = picompile.load(out, prefill_dtype="weights"), picompile.load(ref)
    ops = count_ops(session.graph)
    assert ops["picompile::tvm_linear"] == 2 * 2 + 1 and ops["picompile::tvm_sparse_ffn"] == 4
    kinds = {(k["spec"]["kind"], k["spec"]["weight_dtype"], k["spec"].get("block"))
             for k in session.manifest.sections["kernels"]}
    # --predictor-dtype auto: int8 predictors (per-row scales folded into fc2 and the offset) in a quantized build
    assert {("up", "int4", 32), ("ffn_gated", "int4", 32), ("predict", "int8", None)} <= kinds
    # the TVM kernels (one token) against the reference ops (dequantize + torch), decode by decode
    new = session.generate(PROMPT, 10, stop_at_eos=False)
    assert new == reference.generate(PROMPT, 10, stop_at_eos=False)
    assert _rel(session.last_logits, reference.last_logits) < 1e-4
    # --prefill-dtype bfloat16: prefill reads dense bfloat16 copies of the quantized weights (no scales left)
    from picompile.runtime.compute_dtype import with_compute_dtype

    prefill = with_compute_dtype(session.graph, torch.bfloat16)
    rewritten = 0
    for node in prefill.graph.nodes:
        if node_op(node) in ("linear", "sparse_ffn"):
            assert not quantized_weights(node)
            w = get_tensor(prefill, arg(node, "w" if node_op(node) == "linear" else "w_up"))
            assert w.dtype == torch.bfloat16 or w.shape[0] == 0  # (an empty part keeps its empty quants)
            rewritten += 1
    assert rewritten == 5 + 4
    from picompile.runtime import compute_dtype

    if compute_dtype.has_bf16_gemm():
        low = picompile.load(out, prefill_dtype="bfloat16")
        assert _rel(low.logits(PROMPT), session.logits(PROMPT)) < 5e-2  # bfloat16 rounding (measured ~1.5e-2)
    f32 = picompile.load(out, prefill_dtype="float32")  # copies dequantized once: the same float32 values
    assert _rel(f32.logits(PROMPT), session.logits(PROMPT)) < 1e-5
    _auto_prefill(out, session, monkeypatch)
    w = session.manifest.weights
    assert w["dtype"] == "int4" and w["block"] == 32 and len(w["quantized"]) == 5 + 4 * 3
    assert w["bytes_per_token"]["int4"] > w["bytes_per_token"]["int8"] > 0  # the int8 predictors
    assert main(["inspect", str(out), "--export-onnx", str(tmp_path / "q.onnx")]) == 0
    assert "int4 (blocks of 32, float16 scales; 17 quantized tensors)" in capsys.readouterr().out
    import onnx

    graph = onnx.load(str(tmp_path / "q.onnx")).graph
    assert sum(n.op_type == "TvmSparseFFN" and len(n.input) == 9 for n in graph.node) == 4  # + s_up, s_gate, s_down
    # the manifest's record is schema-checked: formats, blocks and scales named in graph.weights
    m = json.loads((out / "manifest.json").read_text())
    validate_manifest(m)
    key = next(iter(m["weights"]["quantized"]))
    for field, value, needle in [("format", "int3", "format"), ("block", 48, "block"), ("scales", "nope", "scales")]:
        bad = copy.deepcopy(m)
        bad["weights"]["quantized"][key][field] = value
        with pytest.raises(ArtifactError, match=needle):
            validate_manifest(bad)
    bad = copy.deepcopy(m)
    bad["weights"]["quantized"]["not_a_weight"] = m["weights"]["quantized"][key]
    with pytest.raises(ArtifactError, match="graph.weights"):
        validate_manifest(bad)


@pytest.mark.slow  # ~50 s: a synthetic checkpoint and two builds; test_quantize_pass bounds the error too
def test_logits_close_to_float32(tmp_path: Path) -> None:
    """The dense pipeline's int8 / int4 artifacts against transformers' float32 model (module docstring)."""
    from transformers import AutoModelForCausalLM

    from picompile.tools.synthetic import make_synthetic

    ckpt = make_synthetic("tiny-llama-relu", tmp_path / "synth")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = list(range(3, 60, 3))
    with torch.no_grad():
        dense = model(torch.tensor([ids])).logits[0]
    errors = {}
    for name in ("int8", "int4"):
        art = picompile.build(ckpt, output=tmp_path / f"{name}.pic", pipeline="dense", weight_dtype=name,
                              emit=lambda s: None)
        errors[name] = _rel(picompile.load(art).logits(ids), dense)
    assert 1e-3 < errors["int8"] < 3e-2 and 0.1 < errors["int4"] < 0.4, errors

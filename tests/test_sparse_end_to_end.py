"""The default (PowerInfer) pipeline end to end: oracle = dense for ReLU, trained predictors, stories260K."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import picompile
from picompile.cli import main
from picompile.ir.graph import count_ops

PROMPT = [5, 17, 33, 4, 99, 120, 7]


@pytest.mark.parametrize("key", [("opt", "relu"), ("llama", "relu")])
def test_oracle_equals_dense(key: tuple[str, str], checkpoints: dict, tmp_path: Path) -> None:
    out = picompile.build(checkpoints[key], target="rtx4090", output=tmp_path / "o.pic", predictor="oracle",
                          vram_budget_gib=0.0004, placement_batch=8, calibration_tokens=256, emit=lambda s: None)
    session = picompile.load(out)
    layers = session.manifest.layers
    assert all(0 < layer["n_hot"] < layer["n_neurons"] for layer in layers)  # both partitions in use
    model = AutoModelForCausalLM.from_pretrained(checkpoints[key], dtype=torch.float32).eval()
    new = session.generate(PROMPT, 16, stop_at_eos=False)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert new == ref.sequences[0, len(PROMPT):].tolist()
    assert (session.last_logits - torch.cat(ref.logits)).abs().max().item() < 1e-5
    with torch.no_grad():
        dense = model(torch.tensor([PROMPT + new])).logits[0]
    assert (session.logits(PROMPT + new) - dense).abs().max().item() < 1e-5


def test_trained_build_reports_layers(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.pic"
    assert main(["build", str(checkpoints[("llama", "relu")]), "-o", str(out), "-q", "--target", "rtx4090",
                 "--vram-budget", "0.0004", "--calibration-tokens", "1024", "--print-after", "split-ffn"]) == 0
    graph = capsys.readouterr().out
    assert graph.count("picompile.predict.default(") == 2 and graph.count("picompile.merge.default(") == 2
    assert graph.count("picompile.sparse_ffn.default(") == 4
    assert main(["inspect", str(out), "--json", "--profile"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for layer in summary["layers"]:
        assert {"n_hot", "n_cold", "predictor_rank", "recall", "sparsity"} <= set(layer)
        assert layer["n_hot"] + layer["n_cold"] == layer["n_neurons"] == 192
        assert layer["recall"] >= layer["recall_target"] - 0.02
    assert summary["placement"]["method"] in ("milp", "greedy", "trivial")
    assert len(summary["profile_summary"]) == 2
    png = tmp_path / "p.png"
    assert main(["inspect", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    session = picompile.load(out)
    assert len(session.generate(PROMPT, 8, stop_at_eos=False)) == 8
    # the same artifact with every neuron computed is the exact dense model
    dense = picompile.load(out, dense=True)
    ops, dense_ops = count_ops(session.graph), count_ops(dense.graph)
    assert ops.get("picompile::tvm_predict") == 2 and "picompile::predict" not in ops  # float32: the TVM kernel too
    assert not {"picompile::predict", "picompile::tvm_predict"} & set(dense_ops)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[("llama", "relu")], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert (dense.logits(PROMPT) - ref).abs().max().item() < 1e-5
    # prefill (several tokens) is dense: every neuron, so the dense model's logits; decode runs the masks
    assert session.dense_prefill and not dense.dense_prefill
    assert (session.logits(PROMPT) - ref).abs().max().item() < 1e-5
    sparse_dec, dense_dec = session.decoder(), dense.decoder()
    sparse_dec.feed(PROMPT), dense_dec.feed(PROMPT)
    step = sparse_dec.feed([3])
    assert (step - dense_dec.feed([3])).abs().max().item() > 1e-5  # trained predictors do skip neurons
    # … exactly the artifact's masked graph decoding after the dense graph's prefill
    with torch.inference_mode():
        past = dense.graph(torch.tensor([PROMPT]), *dense.empty_past())[1:]
        want = session.graph(torch.tensor([[3]]), *past)[0][0]
    torch.testing.assert_close(step, want, atol=1e-5, rtol=1e-5)  # (the decoder's attention is matmuls: load step decode-attention)


def test_stories260k(shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real llama2.c model: dense greedy text as published; the sparse build for rtx4090 runs."""
    model = shared_data / "model" / "stories260K.bin"
    dense = tmp_path / "dense.pic"
    assert main(["build", str(model), "-o", str(dense), "-q", "--pipeline", "dense"]) == 0
    assert main(["run", str(dense), "-n", "24"]) == 0
    assert "Once upon a time, there was a little girl named Lily" in capsys.readouterr().out
    sparse = tmp_path / "sparse.pic"
    assert main(["build", str(model), "-o", str(sparse), "-q", "--target", "rtx4090", "--vram-budget", "0.0006",
                 "--calibration", str(shared_data / "tinystories_sample.txt"), "--act-sparsity", "0.3"]) == 0
    s = picompile.load(sparse)
    assert s.manifest.sections["profile"]["corpus"]["kind"] == "text"
    assert all(abs(layer["sparsity"] - 0.3) < 0.02 and layer["n_hot"] + layer["n_cold"] == 172 for layer in s.manifest.layers)
    text = s.decode(s.generate("Once upon a time", 24))
    assert len(text) > 20

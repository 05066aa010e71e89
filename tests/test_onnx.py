"""ONNX interchange: the transformed graph as ONNX / DOT (inspection), and the dense ORT reference."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from picompile.testing import save_tiny_checkpoint


def _attrs(node: "onnx.NodeProto") -> dict[str, object]:
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


@pytest.fixture(scope="module")
def sparse_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama-relu artifact whose layers have both a hot (GPU) and a cold (CPU) part.

    The reference pipeline (no TVM compile) keeps the test fast; TvmSparseFFN is covered below."""
    import picompile

    root = tmp_path_factory.mktemp("onnx")
    ckpt = save_tiny_checkpoint(root / "llama_relu", "llama", "relu", seed=7)
    return picompile.build(ckpt, target="rtx4090", output=root / "llama.pic", pipeline="reference",
                           vram_budget_gib=0.0004, placement_batch=8, calibration_tokens=256, predictor_epochs=4,
                           emit=lambda s: None)


def test_inspect_exports_onnx_and_dot(sparse_artifact: Path, tmp_path: Path) -> None:
    from picompile.formats.artifact import read_manifest
    from picompile.cli import main

    out, dot = tmp_path / "g.onnx", tmp_path / "g.dot"
    assert main(["inspect", str(sparse_artifact), "--export-onnx", str(out), "--dot", str(dot)]) == 0
    m = read_manifest(sparse_artifact)
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}.get("picompile") == 1
    assert [i.name for i in model.graph.input] == ["input_ids", *[f"past_{i}" for i in range(m.graph["n_past"])]]
    assert model.graph.output[0].name == "logits"
    assert {p.key for p in model.metadata_props} >= {"picompile.source", "picompile.shapes"}
    custom = [n for n in model.graph.node if n.domain == "picompile"]
    by_layer: dict[int, Counter] = {}
    for n in custom:
        a = _attrs(n)
        key = n.op_type if n.op_type != "SparseFFN" else f"SparseFFN.{a['part']}"
        by_layer.setdefault(int(a["layer"]), Counter())[key] += 1
    assert by_layer == {layer["index"]: Counter({"Predict": 1, "SparseFFN.hot": 1, "SparseFFN.cold": 1, "Merge": 1})
                        for layer in m.layers}
    for n in custom:
        a, layer = _attrs(n), m.layers[int(_attrs(n)["layer"])]
        if n.op_type == "Predict":
            assert (a["n_rows"], a["rank"], a["d_model"]) == (layer["n_neurons"], layer["predictor_rank"], layer["d_model"])
            assert isinstance(a["threshold"], float)
        elif n.op_type == "SparseFFN":
            assert a["device"] == {"hot": "gpu", "cold": "cpu"}[a["part"]]
            assert a["n_rows"] == layer[f"n_{a['part']}"] > 0
            assert (a["act"], a["gated"]) == ("relu", 1)
            assert n.input[2] == "" and n.input[5] != ""  # no up bias; a mask from the predictor
            assert n.input[1] in m.graph["weights"]  # initializers carry the artifact's weight keys
    text = dot.read_text()
    assert text.startswith("digraph")
    from picompile.runtime.loader import load_graph
    from picompile.ir.ops import is_picompile_op

    gm = load_graph(sparse_artifact, m)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target)]
    assert len(names) == 4 * len(m.layers)
    for name in names:
        assert f'"{name}" [label=' in text
    assert "hot on gpu" in text and "cold on cpu" in text


def test_every_picompile_op_translates(tmp_path: Path) -> None:
    """FFN, OracleMask, TvmSparseFFN (and the others) become picompile-domain nodes with their attributes."""
    import picompile.ir.ops  # noqa: F401
    from picompile.formats.onnx_export import quiet_exporter, translation_table

    ops = torch.ops.picompile

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            for name, shape in {"w_up": (6, 4), "w_gate": (6, 4), "w_down": (4, 6), "b_down": (4,)}.items():
                self.register_buffer(name, torch.randn(*shape, generator=g))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = ops.oracle_mask(x, self.w_gate, None, "relu", 0.0, 0)
            dense = ops.ffn(x, self.w_up, None, self.w_gate, self.w_down, self.b_down, "relu", 0, mask)
            wt = self.w_down.t().contiguous()
            hot = ops.tvm_sparse_ffn(x, self.w_up[:2], None, self.w_gate[:2], wt[:2], mask[..., :2], "relu", 1, "hot",
                                     "gpu", "k_cpu_hot", "k_gpu_hot")
            cold = ops.tvm_sparse_ffn(x, self.w_up[2:], None, self.w_gate[2:], wt[2:], mask[..., 2:], "relu", 1, "cold",
                                      "cpu", "k_cpu_cold", "")
            return ops.merge(hot, cold, self.b_down, 1) + dense

    with quiet_exporter():
        program = torch.onnx.export(Tiny().eval(), (torch.randn(1, 1, 4),), dynamo=True,
                                    custom_translation_table=translation_table(), verbose=False)
    program.save(str(tmp_path / "t.onnx"))
    model = onnx.load(str(tmp_path / "t.onnx"))
    onnx.checker.check_model(model, full_check=True)
    nodes = {(n.op_type, _attrs(n).get("part")): _attrs(n) for n in model.graph.node if n.domain == "picompile"}
    assert set(nodes) == {("OracleMask", None), ("FFN", None), ("TvmSparseFFN", "hot"), ("TvmSparseFFN", "cold"),
                          ("Merge", None)}
    assert nodes[("OracleMask", None)] == {"act": "relu", "threshold": 0.0, "layer": 0, "n_rows": 6, "d_model": 4}
    assert (nodes[("FFN", None)]["n_rows"], nodes[("FFN", None)]["gated"]) == (6, 1)
    hot, cold = nodes[("TvmSparseFFN", "hot")], nodes[("TvmSparseFFN", "cold")]
    assert (hot["device"], hot["kernel"], hot["gpu_kernel"], hot["n_rows"]) == ("gpu", "k_cpu_hot", "k_gpu_hot", 2)
    assert (cold["device"], cold["kernel"], cold["gpu_kernel"], cold["n_rows"]) == ("cpu", "k_cpu_cold", "", 4)


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_ort_dense_matches_hf(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    import picompile.tools.ort_reference as ort_ref

    ckpt = save_tiny_checkpoint(tmp_path / family, family, "relu", seed=3)
    session = ort_ref.OrtDenseSession(ckpt, tmp_path / "cache")
    prompt, decode = [1, 17, 42, 99, 5, 230], [7, 64, 3, 128]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + decode])).logits[0].numpy()  # [10, vocab]
    logits, past = session.step(prompt)
    assert logits.shape == (len(prompt), session.vocab_size)
    np.testing.assert_allclose(logits, ref[: len(prompt)], atol=1e-4, rtol=0)
    for i, tok in enumerate(decode):
        logits, past = session.step([tok], past)
        np.testing.assert_allclose(logits[0], ref[len(prompt) + i], atol=1e-4, rtol=0)
        assert past[0].shape[2] == len(prompt) + i + 1
    # a second session of the same model reuses the cached export
    monkeypatch.setattr(ort_ref, "export_dense_onnx", lambda *a, **k: pytest.fail("re-exported a cached model"))
    again = ort_ref.OrtDenseSession(ckpt, tmp_path / "cache")
    assert again.model_path == session.model_path
    np.testing.assert_allclose(again.logits(prompt), ref[: len(prompt)], atol=1e-4, rtol=0)

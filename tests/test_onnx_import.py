"""ONNX in: ``picompile build model.onnx`` gives the same artifact behaviour as building the PyTorch
checkpoint; linear-like FFN forms other frontends leave (matmul of a transposed / [d_in, d_out]
weight, bias adds, decomposed SiLU / GELU) are canonicalised; Falcon builds through them."""
from __future__ import annotations

import json
import math
import shutil
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import picompile
from picompile.cli import main
from picompile.errors import ModelLoadError, PatternError, UnsupportedArchitectureError
from picompile.ir.graph import count_ops
from picompile.passes.canonicalize_ffn import canonicalize_ffn

PROMPT = [5, 17, 33, 4, 99, 120, 7]
ONNX_KEYS = [("opt", "relu"), ("llama", "relu")]


class _LogitsOnly(torch.nn.Module):
    """An HF causal LM as input_ids -> logits (no KV cache), for a logits-only ONNX export."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def onnx_models(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """torch.onnx exports (flat KV-cache signature) of the tiny checkpoints, alone in their folder:
    every model fact comes from the graph (no config.json beside)."""
    from picompile.tools.ort_reference import export_dense_onnx

    root = tmp_path_factory.mktemp("onnx")
    out = {}
    for key in ONNX_KEYS:
        d = root / f"{key[0]}_{key[1]}"
        d.mkdir()
        export_dense_onnx(checkpoints[key], d / "model.onnx")
        out[key] = d / "model.onnx"
    return out


def _manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


@pytest.mark.parametrize("key", ONNX_KEYS, ids=[f"{f}-{a}" for f, a in ONNX_KEYS])
def test_onnx_build_matches_pytorch_build(key: tuple[str, str], onnx_models: dict, artifacts: dict, tmp_path: Path) -> None:
    built = picompile.build(onnx_models[key], output=tmp_path / "onnx.pic", predictor="oracle",
                            calibration_tokens=128, emit=lambda s: None)
    ours, ref = picompile.load(built), picompile.load(artifacts[key])
    new = ours.generate(PROMPT, 16, stop_at_eos=False)
    assert new == ref.generate(PROMPT, 16, stop_at_eos=False)
    assert ours.last_logits is not None and ref.last_logits is not None
    assert (ours.last_logits - ref.last_logits).abs().max().item() < 1e-4
    full = PROMPT + new
    assert (ours.logits(full) - ref.logits(full)).abs().max().item() < 1e-4
    m, r = _manifest(built), _manifest(artifacts[key])
    assert m["model"]["source_format"] == "onnx" and m["model"]["extra"]["onnx"]["kv_cache"] == "inputs"
    assert (m["model"]["n_layers"], m["model"]["d_model"], m["model"]["vocab_size"]) == (2, 64, 256)
    assert m["graph"]["kv_shape"] == r["graph"]["kv_shape"]
    # the FFN weights carry the source model's names (read from torch.onnx's module metadata)
    for a, b in zip(m["layers"], r["layers"]):
        assert (a["kind"], a["act"], a["n_neurons"]) == (b["kind"], b["act"], b["n_neurons"])
        assert a["weights"]["up"] == b["weights"]["up"] and a["weights"]["down"] == b["weights"]["down"]
        assert a["n_hot"] + a["n_cold"] == a["n_neurons"]


def test_onnx_without_kv_cache_reruns_the_sequence(checkpoints: dict, artifacts: dict, tmp_path: Path) -> None:
    """A logits-only export decodes through a token-history cache (full forward each step)."""
    from picompile.frontend import load_model
    from picompile.formats.onnx_export import quiet_exporter, save_onnx_program

    key = ("llama", "relu")
    model, _ = load_model(str(checkpoints[key]))
    d = tmp_path / "nokv"
    d.mkdir()
    shutil.copy(checkpoints[key] / "config.json", d / "config.json")  # facts from config.json this time
    with torch.no_grad(), quiet_exporter():
        program = torch.onnx.export(_LogitsOnly(model).eval(), (torch.zeros(1, 4, dtype=torch.long),), dynamo=True,
                                    input_names=["input_ids"], output_names=["logits"],
                                    dynamic_shapes=({1: torch.export.Dim("seq", min=1, max=128)},))
    save_onnx_program(program, d / "model.onnx")
    built = picompile.build(d / "model.onnx", output=tmp_path / "nokv.pic", pipeline="dense", emit=lambda s: None)
    ours, ref = picompile.load(built), picompile.load(artifacts[key])
    assert ours.generate(PROMPT, 16, stop_at_eos=False) == ref.generate(PROMPT, 16, stop_at_eos=False)
    assert (ours.last_logits - ref.last_logits).abs().max().item() < 1e-4
    m = _manifest(built)
    assert m["graph"]["kv_shape"] == [1, 1, "past", 1]
    assert m["model"]["extra"]["onnx"]["kv_cache"] == "token-history"
    assert m["model"]["architecture"] == "LlamaForCausalLM" and m["model"]["max_seq_len"] == 128


def _onnx_file(path: Path, nodes: list, inputs: list, outputs: list, inits: list | None = None) -> Path:
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return path


def test_unsupported_onnx_shapes_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    not_lm = _onnx_file(tmp_path / "mlp.onnx", [helper.make_node("Relu", ["x"], ["y"])],
                        [helper.make_tensor_value_info("x", f32, [1, 8])], [helper.make_tensor_value_info("y", f32, [1, 8])])
    with pytest.raises(UnsupportedArchitectureError, match=r"input 'x' \(float \[1, 8\]\) is not token ids"):
        picompile.build(not_lm, output=tmp_path / "a.pic", emit=lambda s: None)
    assert not (tmp_path / "a.pic").exists()

    emb = numpy_helper.from_array(np.zeros((16, 4), np.float32), "emb")
    ids = helper.make_tensor_value_info("input_ids", i64, [1, "seq"])
    logits = helper.make_tensor_value_info("logits", f32, [1, "seq", 16])
    odd_op = _onnx_file(tmp_path / "einsum.onnx", [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
        helper.make_node("Einsum", ["h", "emb"], ["logits"], equation="bsd,vd->bsv")], [ids], [logits], [emb])
    with pytest.raises(UnsupportedArchitectureError, match=r"ONNX op\(s\) Einsum \(×1\) are not supported"):
        picompile.build(odd_op, output=tmp_path / "b.pic", emit=lambda s: None)

    past = [helper.make_tensor_value_info(f"past_{i}", f32, [1, 2, "past", 8]) for i in range(2)]
    present = helper.make_tensor_value_info("present_0", f32, [1, 2, "total", 8])
    kv = _onnx_file(tmp_path / "kv.onnx", [
        helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["logits"]),
        helper.make_node("Concat", ["past_0", "past_1"], ["present_0"], axis=2)],
        [ids, *past], [logits, present], [emb, numpy_helper.from_array(np.zeros((4, 16), np.float32), "w")])
    with pytest.raises(UnsupportedArchitectureError, match="2 KV-cache inputs but 1 present outputs"):
        picompile.build(kv, output=tmp_path / "c.pic", emit=lambda s: None)

    # the CLI: one line, exit code 2
    assert main(["build", str(not_lm), "-o", str(tmp_path / "d.pic"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "is not token ids" in err and "Traceback" not in err


def test_truncated_onnx_is_a_model_load_error(onnx_models: dict, tmp_path: Path) -> None:
    data = onnx_models[("opt", "relu")].read_bytes()
    for cut, name in ((len(data) // 2, "half.onnx"), (0, "empty.onnx")):
        bad = tmp_path / name
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"corrupt or truncated ONNX file {bad}"):
            picompile.build(bad, output=tmp_path / "t.pic", emit=lambda s: None)
        assert not (tmp_path / "t.pic").exists()


def test_onnx_graph_runs_in_its_module_hierarchy(tmp_path: Path) -> None:
    """A hand-written logits-only graph: weights named after the modules using them, ``x @ W`` stored in
    nn.Linear layout, nodes run under their module path, the token-history cache, facts from the graph."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from picompile.frontend.decoder import FlatDecoder, dynamic_shapes
    from picompile.frontend.onnx import DEFAULT_MAX_SEQ_LEN, load_onnx

    rng = np.random.default_rng(0)
    emb = rng.standard_normal((16, 4)).astype(np.float32)  # [vocab, d_model]
    w = rng.standard_normal((4, 16)).astype(np.float32)  # [d_in, d_out]: read as x @ W
    nodes = [
        helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h"], name="/model/embed_tokens/Gather"),
        helper.make_node("Shape", ["h"], ["shape"], name="/model/layers.0/Shape"),
        helper.make_node("Reshape", ["h", "shape"], ["h2"], name="/model/layers.0/Reshape"),
        helper.make_node("Relu", ["h2"], ["a"], name="/model/layers.0/mlp/act_fn/Relu"),
        helper.make_node("MatMul", ["a", "val_3"], ["logits"], name="/model/layers.0/mlp/up_proj/MatMul"),
    ]
    path = _onnx_file(tmp_path / "tiny.onnx", nodes,
                      [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", 16])],
                      [numpy_helper.from_array(emb, "model.embed_tokens.weight"), numpy_helper.from_array(w, "val_3")])
    module, info = load_onnx(path)
    assert (info.n_layers, info.d_model, info.vocab_size, info.max_seq_len) == (1, 4, 16, DEFAULT_MAX_SEQ_LEN)
    assert (info.n_kv_heads, info.head_dim) == (1, 1)
    assert info.extra["onnx"]["kv_cache"] == "token-history"
    assert info.extra["onnx"]["facts_from"]["num_hidden_layers"] == "layer names"
    params = dict(module.named_parameters())
    assert sorted(params) == ["embed_tokens.weight", "layers.0.mlp.up_proj.weight"]  # the shared root "model" dropped
    assert torch.equal(params["layers.0.mlp.up_proj.weight"], torch.from_numpy(w.T))  # [d_out, d_in]

    def expected(ids: list[int]) -> torch.Tensor:  # [1, seq, vocab]
        return torch.from_numpy(np.maximum(emb[ids], 0) @ w)[None]

    empty = [torch.zeros(1, 1, 0, 1), torch.zeros(1, 1, 0, 1)]
    logits, *hist = module.flat(torch.tensor([[3, 1, 4]]), *empty)
    assert torch.allclose(logits, expected([3, 1, 4]), atol=1e-5)
    assert [h.reshape(-1).tolist() for h in hist] == [[3.0, 1.0, 4.0]] * 2  # [1, 1, past, 1]: the tokens so far
    logits, *hist = module.flat(torch.tensor([[1, 5]]), *hist)
    assert logits.shape == (1, 2, 16) and torch.allclose(logits, expected([1, 5]), atol=1e-5)
    assert hist[0].shape == (1, 1, 5, 1)

    ids, past = torch.tensor([[2, 7]]), tuple(torch.zeros(1, 1, 3, 1) for _ in range(2))
    ep = torch.export.export(FlatDecoder(module, 1).eval(), (ids, past), strict=False,
                             dynamic_shapes=dynamic_shapes(64, 2))
    stacks = {str(n.target): [p for p, _ in n.meta.get("nn_module_stack", {}).values()]
              for n in ep.graph.nodes if n.op == "call_function"}
    mm = next(stack for target, stack in stacks.items() if "mm" in target or "matmul" in target)
    assert mm[-1] == "model.layers.0.mlp.up_proj"  # canonicalize-ffn finds the layer by this path
    assert torch.allclose(ep.module()(ids, past)[0], module.flat(ids, *past)[0])


# ---- canonicalize-ffn on the linear-like forms other frontends produce

class _Mlp(torch.nn.Module):
    """ONNX-style: x @ W [d, n] + b, GELU written out with erf, then @ W2 [n, d] + b2."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(d, n) / d ** 0.5)
        self.b_in = torch.nn.Parameter(torch.randn(n))
        self.w_out = torch.nn.Parameter(torch.randn(n, d) / n ** 0.5)
        self.b_out = torch.nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w_in + self.b_in
        h = h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))
        return h @ self.w_out + self.b_out


class _Gated(torch.nn.Module):
    """Falcon-style: x @ W.T (nn.Linear layout), SiLU written as g * sigmoid(g)."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(n, d) / d ** 0.5)
        self.up = torch.nn.Parameter(torch.randn(n, d) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(d, n) / n ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x @ self.gate.T
        u = torch.matmul(x, self.up.t())
        return (g * torch.sigmoid(g) * u) @ self.down.permute(1, 0)


class _Stack(torch.nn.Module):
    def __init__(self, blocks: list[torch.nn.Module], name: str) -> None:
        super().__init__()
        setattr(self, name, torch.nn.ModuleList(blocks))
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in getattr(self, self.name):
            x = x + block(x)
        return x


def _captured(model: torch.nn.Module) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        gm = torch.export.export(model.eval(), (x,), strict=False).module()
    return gm, x


@pytest.mark.parametrize("container", ["layers", "blocks"])  # "blocks": no layer index in any name
def test_matmul_and_decomposed_forms_canonicalize(container: str) -> None:
    torch.manual_seed(0)
    gm, x = _captured(_Stack([_Mlp(16, 24), _Gated(16, 24)], container))
    with torch.no_grad():
        before = gm(x)
    ctx = SimpleNamespace(info=SimpleNamespace(n_layers=2), ffn_layers=[])
    gm = canonicalize_ffn(gm, ctx)  # type: ignore[arg-type]
    ops = count_ops(gm)
    assert ops["picompile::ffn"] == 2
    assert not {"aten::matmul", "aten::erf", "aten::sigmoid", "aten::numpy_T", "aten::t"} & set(ops), ops
    mlp, gated = ctx.ffn_layers
    assert (mlp.index, mlp.kind, mlp.act, mlp.n_neurons, mlp.d_model) == (0, "mlp", "gelu", 24, 16)
    assert (gated.index, gated.kind, gated.act, gated.n_neurons, gated.d_model) == (1, "gated", "silu", 24, 16)
    assert set(mlp.weights) == {"up", "up_bias", "down", "down_bias"}
    # [d_in, d_out] weights got transposed copies; Wᵀ-read weights are used as they are
    w_in = attrgetter(f"{container}.0.w_in")(gm)
    assert mlp.weights["up"].endswith("_t") and torch.equal(attrgetter(mlp.weights["up"])(gm), w_in.t())
    assert (gated.weights["gate"], gated.weights["down"]) == (f"{container}.1.gate", f"{container}.1.down")
    with torch.no_grad():
        assert torch.allclose(before, gm(x), atol=1e-5)


def test_matmul_by_a_computed_weight_says_why() -> None:
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 24))
            self.w2 = torch.nn.Parameter(torch.randn(16, 24))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ (self.w * 2.0)) @ self.w2.t()

    gm, _ = _captured(_Stack([Odd()], "layers"))
    ctx = SimpleNamespace(info=SimpleNamespace(n_layers=1), ffn_layers=[])
    with pytest.raises(PatternError, match=r"layer 0: the input of relu \(relu\) is aten.matmul.default, not a linear"):
        canonicalize_ffn(gm, ctx)  # type: ignore[arg-type]


# ---- Falcon (FalconLinear is input @ weight.T): builds, and generates like transformers

def test_falcon_generates_like_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, FalconConfig

    cfg = FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                       alibi=False, max_position_embeddings=128)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():  # HF's init is tiny; widen it so logits differ clearly between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    model.save_pretrained(tmp_path / "falcon")
    built = picompile.build(tmp_path / "falcon", output=tmp_path / "falcon.pic", pipeline="reference",
                            predictor="oracle", act_sparsity=0.0, calibration_tokens=128, emit=lambda s: None)
    session = picompile.load(built)
    new = session.generate(PROMPT, 16, stop_at_eos=False)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert new == ref.sequences[0, len(PROMPT):].tolist()
    assert (session.last_logits - torch.cat(ref.logits)).abs().max().item() < 1e-4
    layers = _manifest(built)["layers"]
    assert [(layer["kind"], layer["act"], layer["n_neurons"]) for layer in layers] == [("mlp", "gelu", 256)] * 2

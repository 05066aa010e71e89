"""Model variants users have: Llama with MLP biases (gate/up/down, ``mlp_bias``) and attention biases (q/k/v/o,
``attention_bias``), and TurboSparse's dReLU FFN (``relu(gate x) * relu(up x)``, config ``ffn_act: "drelu"``).

Through every layer: the HF, GGUF and ONNX frontends, canonicalize-ffn / split-ffn, the predictors' deciders,
the TVM kernels with a gate bias (fp32, f16, int8, int4) and with act ``drelu``, and the GGUF / ONNX exporters.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import picompile
from picompile.errors import ModelLoadError, PatternError
from picompile.frontend.hf import apply_ffn_act
from picompile.ir.graph import count_ops, get_tensor
from picompile.ir.patterns import ffn_nodes
from picompile.ir.schema import args_of
from picompile.kernels import KernelSpec, KernelSpecError, aligned_empty, as_aligned, build_kernel, load_kernel
from picompile.kernels.qformat import QFormat, dequantize, quantize
from picompile.testing import context_for, decode_logits, run_passes, tiny_config

PROMPT = [5, 17, 33, 4, 99, 120, 7]


def _save(path: Path, *, act: str = "relu", mlp_bias: bool = True, attention_bias: bool = True,
          drelu: bool = False, seed: int = 3) -> Path:
    """A tiny random Llama checkpoint with the biases asked for (each N(0, 0.1²), so they matter)."""
    cfg = tiny_config("llama", act)
    cfg.mlp_bias, cfg.attention_bias = mlp_bias, attention_bias
    if drelu:
        cfg.ffn_act = "drelu"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def _hf(path: Path) -> torch.nn.Module:
    """transformers' model of a checkpoint, as the frontend makes it (dReLU: its up_proj hooks)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return apply_ffn_act(model, model.config.to_dict(), str(path))


def _teacher_forced(session: "picompile.Session", seq: list[int], n_prompt: int) -> torch.Tensor:
    """Prefill seq[:n_prompt], then one decode step per token of the rest: the logits that chose each next token."""
    logits, past = session.step(torch.tensor([seq[:n_prompt]]), session.empty_past())
    outs = [logits[-1]]
    for t in seq[n_prompt:-1]:
        logits, past = session.step(torch.tensor([[t]]), past)
        outs.append(logits[-1])
    return torch.stack(outs)  # [len(seq) - n_prompt, vocab]


def _check_against_hf(artifact: Path, model: torch.nn.Module, tol: float = 1e-4) -> None:
    """Greedy text equal to transformers', decode and prefill logits within ``tol``."""
    session = picompile.load(artifact)
    new = session.generate(PROMPT, 8, stop_at_eos=False)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert new == ref[0, len(PROMPT):].tolist()
    seq = ref[0].tolist()
    with torch.no_grad():
        dense = model(torch.tensor([seq])).logits[0]  # [len, vocab]
    assert (_teacher_forced(session, seq, len(PROMPT)) - dense[len(PROMPT) - 1:-1]).abs().max().item() < tol
    assert (session.logits(seq) - dense).abs().max().item() < tol


@pytest.fixture(scope="module")
def biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("biased") / "ckpt")


@pytest.fixture(scope="module")
def drelu_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("drelu") / "ckpt", mlp_bias=True, attention_bias=False, drelu=True)


# -- whole builds against transformers ---------------------------------------------------------------
def test_biased_llama_builds_and_matches_transformers(biased: Path, tmp_path: Path) -> None:
    """mlp_bias + attention_bias: the default pipeline (TVM kernels with a gate bias, fused q/k/v with biases)
    and the oracle predictor give transformers' greedy text and logits."""
    art = picompile.build(biased, output=tmp_path / "b.pic", predictor="oracle", calibration_tokens=256,
                          max_seq_len=64, emit=lambda s: None, progress=False)
    _check_against_hf(art, _hf(biased))
    man = json.loads((art / "manifest.json").read_text())
    assert all({"gate_bias", "up_bias", "down_bias"} <= set(layer["weights"]) for layer in man["layers"])
    specs = [k["spec"] for k in man["sections"]["kernels"] if k["spec"]["kind"] == "ffn_gated"]
    assert specs and all(s["gate_bias"] and s["has_bias"] for s in specs)
    assert "kernels_skipped" not in man["sections"]
    assert man["sections"]["fuse_projections"]["groups"] == 2  # q/k/v of each layer, their biases stacked


def test_qwen2_builds_like_llama_with_qkv_biases(tmp_path: Path) -> None:
    """transformers' Qwen2 (Llama's layers, q/k/v biases without an o bias) captures with the HF frontend; its
    q/k/v fuse into one linear with the stacked biases."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, hidden_act="relu", max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, use_sliding_window=False)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path / "qwen2", safe_serialization=True)
    art = picompile.build(tmp_path / "qwen2", output=tmp_path / "q.pic", predictor="oracle", calibration_tokens=128,
                          max_seq_len=64, emit=lambda s: None, progress=False)
    _check_against_hf(art, _hf(tmp_path / "qwen2"))
    man = json.loads((art / "manifest.json").read_text())
    assert man["model"]["architecture"] == "Qwen2ForCausalLM"
    assert man["sections"]["fuse_projections"]["groups"] == 2


def test_biased_llama_through_gguf_export_and_import(tmp_path: Path) -> None:
    """HF → gguf_export (blk.N.ffn_{gate,up,down}.bias, attn_{q,k,v,output}.bias, as llama.cpp names them) →
    the GGUF frontend: the same model (llama.cpp's llama graph is SiLU, so the checkpoint is SiLU here)."""
    pytest.importorskip("gguf")
    from picompile.formats.gguf_export import export_gguf
    from picompile.frontend.gguf import load_gguf

    ckpt = _save(tmp_path / "silu", act="silu")
    gguf_file = export_gguf(ckpt, tmp_path / "m.gguf", outtype="f32")
    import gguf

    names = {t.name for t in gguf.GGUFReader(str(gguf_file)).tensors}
    assert {f"blk.0.{t}.bias" for t in ("ffn_gate", "ffn_up", "ffn_down", "attn_q", "attn_k", "attn_v",
                                        "attn_output")} <= names
    model, config, _, _ = load_gguf(gguf_file)
    assert config["mlp_bias"] and config["attention_bias"]
    ref = _hf(ckpt)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([PROMPT])).logits, ref(torch.tensor([PROMPT])).logits)
    # the exported file's tokenizer is a placeholder (no calibration text tokenizes): the dense pipeline
    art = picompile.build(gguf_file, output=tmp_path / "g.pic", pipeline="dense", max_seq_len=64,
                          emit=lambda s: None, progress=False)
    _check_against_hf(art, ref)


def test_biased_llama_through_onnx(biased: Path, tmp_path: Path) -> None:
    """An ONNX export of the biased model (bias adds after MatMuls) builds into the same model."""
    pytest.importorskip("onnx")
    from picompile.tools.ort_reference import export_dense_onnx

    (tmp_path / "o").mkdir()
    export_dense_onnx(biased, tmp_path / "o" / "model.onnx")
    art = picompile.build(tmp_path / "o" / "model.onnx", output=tmp_path / "o.pic", predictor="oracle",
                          pipeline="reference", calibration_tokens=128, emit=lambda s: None, progress=False)
    _check_against_hf(art, _hf(biased))


def test_drelu_model_builds_oracle_equals_dense(drelu_ckpt: Path, tmp_path: Path) -> None:
    """dReLU (with MLP biases): captured as act drelu, its kernel (ffn_gated, act drelu) runs; the oracle's
    masks (both branches > 0) leave the output that of the dense artifact and of transformers."""
    art = picompile.build(drelu_ckpt, output=tmp_path / "d.pic", predictor="oracle", calibration_tokens=256,
                          max_seq_len=64, emit=lambda s: None, progress=False)
    man = json.loads((art / "manifest.json").read_text())
    assert {layer["act"] for layer in man["layers"]} == {"drelu"}
    assert any(k["spec"]["act"] == "drelu" for k in man["sections"]["kernels"])
    assert man["sections"]["profile"]["active"] == "relu(gate) > 0 and relu(up) > 0"
    model = _hf(drelu_ckpt)
    _check_against_hf(art, model)
    sparse, dense = picompile.load(art), picompile.load(art, dense=True)
    seq = PROMPT + sparse.generate(PROMPT, 8, stop_at_eos=False)
    # the oracle computes every firing neuron: equal to dense up to the order of float32 sums
    assert (_teacher_forced(sparse, seq, len(PROMPT)) - _teacher_forced(dense, seq, len(PROMPT))).abs().max() < 1e-5
    # and the profile counted the product's nonzeros, not the gate's: fewer active than relu(gate) > 0 alone
    mlp = model.model.layers[0].mlp
    x = torch.randn(256, mlp.gate_proj.in_features)
    with torch.no_grad():
        both = ((mlp.gate_proj(x) > 0) & (mlp.up_proj(x) > 0)).float().mean()  # up_proj's hook: relu(up x)
        gate_only = (mlp.gate_proj(x) > 0).float().mean()
    assert both < gate_only
    assert man["layers"][0]["sparsity"] > 0.6  # ~3/4 of random dReLU neurons are zero


# -- passes ------------------------------------------------------------------------------------------
def test_canonicalize_and_split_carry_biases(biased: Path, tmp_path: Path) -> None:
    """canonicalize-ffn: one ffn per layer with b_up, b_gate, b_down; split-ffn: the bias rows follow their
    neurons into the hot/cold parts in placement order, b_down once in the merge; numerics unchanged."""
    ctx = context_for(biased, tmp_path, target="rtx4090", predictor="oracle", calibration_tokens=256)
    gm = run_passes(ctx, ["capture", "canonicalize-ffn"])
    before = decode_logits(gm, ctx, PROMPT)
    nodes = ffn_nodes(gm)
    assert len(nodes) == 2
    hf = _hf(biased)
    for i, node in nodes.items():
        a = args_of(node)
        mlp = hf.model.layers[i].mlp
        for name, ref in (("b_up", mlp.up_proj.bias), ("b_gate", mlp.gate_proj.bias), ("b_down", mlp.down_proj.bias)):
            assert torch.equal(get_tensor(gm, a[name]), ref), name
    gm = run_passes(ctx, ["fold-kv-repeat", "profile-activations", "allocate-sparsity", "train-predictors",
                          "place-neurons", "insert-predictors"], gm)
    for layer in ctx.ffn_layers:  # the profile's masks are those of the biased gate: relu(gate x + b_gate) > 0
        cal, mlp = ctx.calibration[layer.index], hf.model.layers[layer.index].mlp
        with torch.no_grad():
            pre = mlp.gate_proj(cal.x)  # [N, n_neurons], with its bias
        assert torch.equal(cal.mask, pre > 0)
        assert not torch.equal(cal.mask, cal.x @ mlp.gate_proj.weight.T > 0)  # the bias matters here
    gm = run_passes(ctx, ["split-ffn"], gm)
    assert count_ops(gm).get("picompile::sparse_ffn", 0) == 4 and count_ops(gm).get("picompile::merge", 0) == 2
    for layer, hot, cold in zip(ctx.ffn_layers, ctx.placement.hot, ctx.placement.cold):
        mlp = hf.model.layers[layer.index].mlp
        parts = [n for n in gm.graph.nodes if n.op == "call_function" and "sparse_ffn" in str(n.target)
                 and args_of(n)["layer"] == layer.index]
        for node in parts:
            a = args_of(node)
            rows = torch.as_tensor(hot if a["part"] == "hot" else cold, dtype=torch.long)
            assert torch.equal(get_tensor(gm, a["b_gate"]), mlp.gate_proj.bias[rows])
            assert torch.equal(get_tensor(gm, a["b_up"]), mlp.up_proj.bias[rows])
        merge = next(iter(parts[0].users))
        assert torch.equal(get_tensor(gm, args_of(merge)["bias"]), mlp.down_proj.bias)
    assert (decode_logits(gm, ctx, PROMPT) - before).abs().max().item() < 1e-4


def test_bias_of_the_wrong_shape_is_one_line(biased: Path, tmp_path: Path) -> None:
    """A checkpoint whose gate bias is not one value per neuron is refused in one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in biased.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.gate_proj.bias"] = tensors["model.layers.1.mlp.gate_proj.bias"][:-3].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as e:
        picompile.build(bad, output=tmp_path / "x.pic", emit=lambda s: None, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.1.mlp.gate_proj.bias" in msg and "(189,)" in msg


def test_ffn_act_key_is_checked(drelu_ckpt: Path, tmp_path: Path) -> None:
    config = json.loads((drelu_ckpt / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(drelu_ckpt, dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="ffn_act 'dgelu' is not one of"):
        apply_ffn_act(model, {**config, "ffn_act": "dgelu"}, "cfg")
    with pytest.raises(ModelLoadError, match="needs hidden_act 'relu'"):
        apply_ffn_act(model, {**config, "hidden_act": "silu"}, "cfg")


def test_canonicalize_refuses_a_broadcast_bias(tmp_path: Path) -> None:
    """A bias add that broadcasts one value over the FFN's rows (ONNX can write it) is not a per-row bias."""
    from torch import fx

    from picompile.passes.canonicalize_ffn import canonicalize_ffn

    class FFN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("wg", torch.randn(12, 8))
            self.register_buffer("wu", torch.randn(12, 8))
            self.register_buffer("wd", torch.randn(8, 12))
            self.register_buffer("bg", torch.randn(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = torch.nn.functional.linear(x, self.wg, self.bg)
            return torch.nn.functional.linear(torch.relu(g) * torch.nn.functional.linear(x, self.wu), self.wd)

    gm = torch.export.export(FFN(), (torch.randn(1, 8),)).run_decompositions({}).module()
    gm = fx.GraphModule(gm, gm.graph)
    from types import SimpleNamespace

    ctx = SimpleNamespace(info=SimpleNamespace(n_layers=1), ffn_layers=[])
    with pytest.raises(PatternError, match=r"gate projection's bias .* has shape \(1,\), expected \(12,\)"):
        canonicalize_ffn(gm, ctx)  # type: ignore[arg-type]


# -- kernels -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernel(spec: KernelSpec, cache_dir: Path):  # -> SparseKernel
    return load_kernel(build_kernel(spec, cache_dir), spec)


def _weight(spec: KernelSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored weight, its scales or None, the values the kernel computes with in float64) ``[n_rows, d_model]``."""
    w = torch.randn(spec.n_rows, spec.d_model, generator=gen)
    if spec.quantized:
        q, s = quantize(w, QFormat(spec.weight_dtype, spec.block))
        return as_aligned(q), as_aligned(s), dequantize(q, s, torch.float64)
    w = w.to(getattr(torch, spec.weight_dtype))
    return as_aligned(w), None, w.double()


@pytest.mark.parametrize("dtype,act,gate_bias", [
    ("float32", "relu", True), ("float16", "relu", True), ("int8", "relu", True), ("int4", "relu", True),
    ("float32", "drelu", True), ("int4", "drelu", False), ("float16", "drelu", False),
])
def test_gated_kernel_with_gate_bias_and_drelu(dtype: str, act: str, gate_bias: bool,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """ffn_gated with a gate bias (and an up bias) and/or act drelu equals the float64 torch reference of the
    stored weights' maths: one token (the row-skipping schedule where it applies) and batched."""
    spec = KernelSpec(kind="ffn_gated", act=act, d_model=64, n_rows=96, weight_dtype=dtype, has_bias=True,  # type: ignore[arg-type]
                      target="llvm", gate_bias=gate_bias)
    kern = _kernel(spec, tmp_path_factory.getbasetemp() / "bias_kernels")
    gen = torch.Generator().manual_seed(5)
    (up, s_up, up64), (gate, s_gate, gate64), (down, s_down, down64) = (_weight(spec, gen) for _ in range(3))
    bias_dtype = torch.float32 if spec.quantized else getattr(torch, dtype)
    b_up = as_aligned(torch.randn(96, generator=gen).to(bias_dtype))
    b_gate = as_aligned(torch.randn(96, generator=gen).to(bias_dtype)) if gate_bias else None
    idx = as_aligned(torch.randperm(96, generator=gen)[:40].sort().values.to(torch.int32))
    rows = idx.long()
    for tokens in (None, 3):
        x = as_aligned(torch.randn((tokens, 64) if tokens else (64,), generator=gen))
        g = x.double() @ gate64[rows].T + (0 if b_gate is None else b_gate.double()[rows])
        u = x.double() @ up64[rows].T + b_up.double()[rows]
        h = torch.relu(g) * (torch.relu(u) if act == "drelu" else u)
        ref = h @ down64[rows]  # [t?, d_model]
        y = aligned_empty(ref.shape)
        tail = (b_gate,) if gate_bias else ()
        if spec.quantized:
            kern(x, up, s_up, gate, s_gate, b_up, down, s_down, idx, y, *tail)
        else:
            kern(x, up, gate, b_up, down, idx, y, *tail)
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, (tokens, float(err))


def test_gate_bias_spec_rules() -> None:
    with pytest.raises(KernelSpecError, match="gate_bias is for gated kinds"):
        KernelSpec(kind="ffn_relu", act="relu", d_model=64, n_rows=8, weight_dtype="float32", has_bias=True,
                   target="llvm", gate_bias=True)
    with pytest.raises(KernelSpecError, match="drelu"):
        KernelSpec(kind="ffn_relu", act="drelu", d_model=64, n_rows=8, weight_dtype="float32", has_bias=False,
                   target="llvm")
    plain = KernelSpec(kind="ffn_gated", act="relu", d_model=64, n_rows=8, weight_dtype="float32", has_bias=False,
                       target="llvm")
    assert "gate_bias" not in plain.to_json()  # keys of specs without a gate bias are unchanged
    from picompile.kernels import skips_inactive

    assert skips_inactive("ffn_gated", "drelu") and not skips_inactive("ffn_gated", "relu", gate_bias=True)


def test_synthetic_drelu_checkpoint(tmp_path: Path) -> None:
    """``synthetic --ffn drelu``: a config the HF frontend reads as dReLU, the product's active fraction near the
    target (each branch biased for sqrt(p)), and a checkpoint whose model computes relu(gate x) * relu(up x)."""
    from picompile.frontend import load_model
    from picompile.tools.synthetic import load_stats, make_synthetic

    path = make_synthetic("tiny-llama-relu", tmp_path / "syn", ffn="drelu")
    config = json.loads((path / "config.json").read_text())
    assert config["ffn_act"] == "drelu" and config["picompile_synthetic"]["ffn"] == "drelu"
    active = [r["active"] for r in load_stats(path)]
    assert all(0.06 < a < 0.16 for a in active), active  # target 0.1
    model, _ = load_model(str(path))
    mlp = model.model.layers[0].mlp
    x = torch.randn(4, mlp.gate_proj.in_features)
    with torch.no_grad():
        ref = mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(x @ mlp.up_proj.weight.T))
        assert torch.allclose(mlp(x), ref, atol=1e-6)

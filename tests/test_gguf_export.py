"""picompile.formats.gguf_export on the tiny synthetic Llama: GGUF tensors and metadata, and llama.cpp's logits vs
transformers (optional extras: skipped without ``gguf``; the llama.cpp checks without ``llama_cpp``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from picompile.errors import PicompileError  # noqa: E402
from picompile.formats.gguf_export import export_gguf, main, permute_qk, read_hparams, tensor_names  # noqa: E402
from picompile.tools.synthetic import make_synthetic  # noqa: E402

TOKENS: list[int] = [1, 7, 42, 300, 511, 5, 99, 256]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic("tiny-llama-relu", tmp_path_factory.mktemp("synth") / "tiny-llama-relu")


@pytest.fixture(scope="module")
def tiny_gguf(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {t: export_gguf(tiny, root / f"tiny-{t}.gguf", t) for t in ("f32", "f16")}


def _hf_state(ckpt: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_tensors_and_metadata(tiny: Path, tiny_gguf: dict[str, Path], outtype: str) -> None:
    hp = read_hparams(tiny)
    reader = gguf.GGUFReader(tiny_gguf[outtype])
    tensors = {t.name: t for t in reader.tensors}
    assert sorted(tensors) == sorted(tensor_names(hp))
    assert len(tensors) == 2 + 9 * hp.n_layer + 1  # embeddings, 9 per block, norm, lm_head
    kv_dim = hp.n_head_kv * hp.head_dim
    expected = {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output.weight": (hp.n_vocab, hp.n_embd),
                "blk.0.attn_q.weight": (hp.n_embd, hp.n_embd), "blk.0.attn_k.weight": (kv_dim, hp.n_embd),
                "blk.1.ffn_gate.weight": (hp.n_ff, hp.n_embd), "blk.1.ffn_down.weight": (hp.n_embd, hp.n_ff),
                "blk.1.ffn_norm.weight": (hp.n_embd,), "output_norm.weight": (hp.n_embd,)}
    for name, shape in expected.items():
        assert tuple(int(n) for n in tensors[name].shape[::-1]) == shape, name  # GGUF lists ggml order
    want = gguf.GGMLQuantizationType.F32 if outtype == "f32" else gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ffn_up.weight"].tensor_type == want
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay f32

    state = _hf_state(tiny)
    q = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(hp.n_embd, hp.n_embd)
    k = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(kv_dim, hp.n_embd)
    tol = 0 if outtype == "f32" else 1e-3
    np.testing.assert_allclose(q, permute_qk(state["model.layers.0.self_attn.q_proj.weight"], hp.n_head), atol=tol)
    np.testing.assert_allclose(k, permute_qk(state["model.layers.0.self_attn.k_proj.weight"], hp.n_head_kv), atol=tol)

    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == hp.n_layer
    assert fields["llama.attention.head_count_kv"].contents() == hp.n_head_kv
    assert fields["llama.feed_forward_length"].contents() == hp.n_ff
    assert fields["general.file_type"].contents() == (0 if outtype == "f32" else 1)
    assert len(fields["tokenizer.ggml.tokens"].contents()) == hp.n_vocab
    assert "hidden_act=relu" in fields["general.description"].contents()


def test_permute_matches_rope_layouts() -> None:
    """HF's rotate-half RoPE on q equals llama.cpp's interleaved-pairs RoPE on permute_qk(q), row for row."""
    rng = np.random.default_rng(0)
    n_head, d, pos = 2, 8, 5
    w = rng.standard_normal((n_head * d, 3))
    theta = pos * 10000.0 ** (-np.arange(0, d, 2) / d)  # d/2 frequencies
    cos, sin = np.cos(theta), np.sin(theta)

    def hf_rope(x: np.ndarray) -> np.ndarray:  # pairs (i, i + d/2)
        x1, x2 = x[: d // 2], x[d // 2:]
        return np.concatenate([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]])

    def interleaved_rope(x: np.ndarray) -> np.ndarray:  # pairs (2i, 2i + 1)
        out = x.copy()
        out[0::2] = x[0::2] * cos[:, None] - x[1::2] * sin[:, None]
        out[1::2] = x[1::2] * cos[:, None] + x[0::2] * sin[:, None]
        return out

    p = permute_qk(w, n_head)
    for h in range(n_head):
        rows = slice(h * d, (h + 1) * d)
        a, b = hf_rope(w[rows]), interleaved_rope(p[rows])
        np.testing.assert_allclose(permute_qk(a, 1), b, atol=1e-12)  # the same vectors, llama.cpp's row order


def test_refuses_non_llama_and_bad_outtype(tmp_path: Path, tiny: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "architectures": ["OPTForCausalLM"]}))
    with pytest.raises(PicompileError, match="Llama-family"):
        export_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(PicompileError, match="outtype"):
        export_gguf(tiny, tmp_path / "x.gguf", "q8_0")


def test_cli_writes_atomically(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "t.gguf"
    assert main([str(tiny), str(out), "--outtype", "f16", "-q"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert [p.name for p in out.parent.iterdir()] == ["t.gguf"]  # no temporary file left behind
    assert main([str(tmp_path / "missing"), str(out)]) == 1


def _hf_logits_silu(ckpt: Path, ids: list[int]) -> np.ndarray:
    """transformers on the same weights with hidden_act silu (what llama.cpp's llama graph computes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    config.hidden_act = "silu"
    model = AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def test_llama_cpp_logits_match_transformers(tiny: Path, tiny_gguf: dict[str, Path]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tiny_gguf["f32"]), n_ctx=32, n_batch=32, n_threads=1, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    llm.eval(TOKENS)
    ours = np.asarray(llm.scores[: len(TOKENS)])
    ref = _hf_logits_silu(tiny, TOKENS)
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(ours, ref, atol=1e-4 * scale, rtol=0)  # seen: 5e-7 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_bench_auto_gguf(tiny: Path, tmp_path: Path) -> None:
    """--gguf auto converts once into the cache and reuses the file; the llama.cpp engine runs on it."""
    from picompile.tools.engines import auto_gguf, llama_cpp_engine

    out = auto_gguf(str(tiny), "f16", tmp_path)
    assert out == tmp_path / "gguf" / "tiny-llama-relu-f16.gguf" and out.is_file()
    mtime = out.stat().st_mtime_ns
    assert auto_gguf(str(tiny), "f16", tmp_path) == out and out.stat().st_mtime_ns == mtime
    assert "cannot convert" in str(auto_gguf(str(tmp_path / "missing"), "f16", tmp_path))
    pytest.importorskip("llama_cpp")
    eng = llama_cpp_engine("auto", 32, 1, source=str(tiny), gguf_type="f16", cache_dir=tmp_path)
    assert not isinstance(eng, str), eng
    assert eng.label == "llama.cpp f16 (dense; SiLU kernel, same weights)"
    eng.run(TOKENS[:4], 3)
    assert len(eng.tokens) == 4 and all(0 <= t < 512 for t in eng.tokens)


def _llama_quantize() -> Path | None:
    """The pinned llama.cpp build's llama-quantize in the user's cache (benchmarks/build_llama_cpp.py), if built."""
    import os

    from picompile.tools.llama_bench import llama_cpp_dir

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picompile"  # the user's, not the test's
    exe = llama_cpp_dir(cache) / "bin" / "llama-quantize"
    return exe if exe.is_file() else None


def test_quantize_refuses_bad_input(tmp_path: Path, tiny_gguf: dict[str, Path]) -> None:
    from picompile.formats.gguf_export import quantize_gguf

    with pytest.raises(PicompileError, match="must be one of q8_0, q4_0"):
        quantize_gguf(tiny_gguf["f16"], tmp_path / "x.gguf", "q5_k", Path("/bin/false"))
    with pytest.raises(PicompileError, match="does not exist"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf", "q8_0", Path("/bin/false"))
    with pytest.raises(PicompileError, match=r"llama-quantize q8_0 of tiny-f16.gguf failed \(exit 1\)"):
        quantize_gguf(tiny_gguf["f16"], tmp_path / "x.gguf", "q8_0", Path("/bin/false"))
    assert not list(tmp_path.iterdir())  # nothing left behind


@pytest.mark.skipif(_llama_quantize() is None, reason="no llama.cpp build in the cache (benchmarks/build_llama_cpp.py)")
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_llama_quantize_matches_qformat(tiny: Path, tiny_gguf: dict[str, Path], tmp_path: Path, qtype: str) -> None:
    """llama-quantize's q8_0 / q4_0 of the f16 GGUF dequantize to what kernels/qformat gives the same f16 weights:
    exactly (q8_0's ties ``x / d = k + 0.5`` included: both round them away from zero, as C's ``roundf``)."""
    from picompile.formats.gguf_export import quantize_gguf
    from picompile.kernels.qformat import QFormat, dequantize, quantize

    exe = _llama_quantize()
    assert exe is not None
    out = quantize_gguf(tiny_gguf["f16"], tmp_path / f"tiny-{qtype}.gguf", qtype, exe)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == (7 if qtype == "q8_0" else 2)
    tensors = {t.name: t for t in reader.tensors}
    f16 = {t.name: t for t in gguf.GGUFReader(tiny_gguf["f16"]).tensors}
    want_type = gguf.GGMLQuantizationType.Q8_0 if qtype == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    fmt = QFormat("int8" if qtype == "q8_0" else "int4")
    for name in ("blk.0.ffn_up.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight"):
        t = tensors[name]
        assert t.tensor_type == want_type, name
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))  # [rows, cols]
        w = torch.from_numpy(np.asarray(f16[name].data, dtype=np.float32).reshape(got.shape))
        q, scales = quantize(w, fmt)
        ref = dequantize(q, scales).numpy()
        assert np.array_equal(got, ref), (name, int((got != ref).sum()))

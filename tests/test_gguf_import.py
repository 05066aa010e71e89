"""The GGUF frontend: llama.cpp's dequantized tensors exactly, Q/K unpermuted, Q8_0/Q4_0 blocks kept bit for bit,
SmolLM2's tokenizer and greedy text as transformers gives them, bad files refused with one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from picompile.errors import ModelLoadError, UnsupportedArchitectureError  # noqa: E402
from picompile.frontend.gguf import load_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
# tiny Llama: rows of 256 elements, so every K-quant (256-element super-blocks) fits each linear
D_MODEL, N_FF, N_HEAD, N_KV, VOCAB, LAYERS = 256, 512, 4, 2, 256, 1
HEAD_DIM = D_MODEL // N_HEAD
# GGUF names and HF shapes ([out, in]) of the tiny model's tensors
LINEARS: dict[str, tuple[int, int]] = {
    "token_embd.weight": (VOCAB, D_MODEL),
    "output.weight": (VOCAB, D_MODEL),
    "blk.0.attn_q.weight": (N_HEAD * HEAD_DIM, D_MODEL),
    "blk.0.attn_k.weight": (N_KV * HEAD_DIM, D_MODEL),
    "blk.0.attn_v.weight": (N_KV * HEAD_DIM, D_MODEL),
    "blk.0.attn_output.weight": (D_MODEL, N_HEAD * HEAD_DIM),
    "blk.0.ffn_gate.weight": (N_FF, D_MODEL),
    "blk.0.ffn_up.weight": (N_FF, D_MODEL),
    "blk.0.ffn_down.weight": (D_MODEL, N_FF),
}
NORMS: tuple[str, ...] = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")
# byte offsets of the float16 scales in one block of the K-quants gguf-py cannot quantize
K_QUANT_SCALES: dict[Any, tuple[int, ...]] = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _raw_blocks(qtype: Any, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid raw blocks [rows, bytes per row]: gguf-py's quantizer, else random bits with sane scales."""
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype not in K_QUANT_SCALES:
        return gguf.quants.quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in K_QUANT_SCALES[qtype]:
        scale = rng.uniform(1e-3, 1e-2, (rows, cols // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, qtype: Any = Q.F32, *, arch: str = "llama", seed: int = 0,
                    skip: tuple[str, ...] = (), meta: Callable[[Any], None] | None = None) -> Path:
    """A one-layer Llama GGUF written with gguf's writer: linears in ``qtype``, norms F32."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    if meta is not None:
        meta(w)
    for name, (rows, cols) in LINEARS.items():
        if name in skip:
            continue
        if qtype == Q.F32:
            w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))
        else:
            w.add_tensor(name, _raw_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    for name in NORMS:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(D_MODEL)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference_tensors(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader: gguf.quants.dequantize of every tensor, Q/K unpermuted its way."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantized_tensors_equal_llama_cpp(qtype: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", Q[qtype])
    model, config, tokenizer, extra = load_gguf(path)
    assert tokenizer is None  # the file has no tokenizer.* metadata
    assert config["hidden_size"] == D_MODEL and config["num_key_value_heads"] == N_KV
    assert config["tie_word_embeddings"] is False
    ref = _reference_tensors(path, model)
    ours = model.state_dict()
    assert set(ref) == set(ours)
    for name, t in ref.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], t.float()), name
    types = extra["gguf"]["tensor_types"]
    assert types["model.layers.0.mlp.down_proj.weight"] == qtype
    assert types["model.norm.weight"] == "F32"


@pytest.mark.parametrize("qtype,fmt", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_q8_0_q4_0_blocks_kept_bit_for_bit(qtype: str, fmt: str, tmp_path: Path) -> None:
    """Re-quantized with qformat (llama.cpp's rounding), every imported linear gives back the file's blocks."""
    from picompile.kernels.qformat import QFormat, quantize
    from picompile.formats.gguf_export import permute_qk
    from picompile.frontend.gguf import hf_name

    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", Q[qtype], seed=3)
    model, _, _, _ = load_gguf(path)
    ours = model.state_dict()
    reader = gguf.GGUFReader(str(path))
    block_bytes = 34 if fmt == "int8" else 18
    for t in reader.tensors:
        if t.name in NORMS:
            continue
        rows, cols = LINEARS[t.name]
        raw = np.asarray(t.data).reshape(rows, cols // 32, block_bytes)
        file_s = torch.from_numpy(raw[:, :, :2].copy().view(np.float16).reshape(rows, cols // 32))
        body = raw[:, :, 2:].copy()
        file_q = torch.from_numpy(body.view(np.int8) if fmt == "int8" else body).reshape(rows, -1)
        w = ours[hf_name(t.name)]
        if ".attn_q." in t.name or ".attn_k." in t.name:  # back to the file's row order (whole rows move)
            w = torch.from_numpy(permute_qk(w.numpy(), N_HEAD if ".attn_q." in t.name else N_KV))
        q, s = quantize(w, QFormat(fmt, 32))
        assert torch.equal(q, file_q), t.name
        assert torch.equal(s.view(torch.int16), file_s.view(torch.int16)), t.name


ROPES: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},  # a rope_freqs tensor in GGUF
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_hf_export_round_trip_same_logits(rope: str, tmp_path: Path) -> None:
    """A tiny HF Llama written by picompile.formats.gguf_export (Q/K permuted for llama.cpp, RoPE scaling as
    metadata or a rope_freqs tensor) and read back here gives the HF model's logits over 100 positions."""
    from transformers import AutoModelForCausalLM

    from picompile.formats.gguf_export import export_gguf
    from picompile.frontend import load_model
    from picompile.testing import make_tiny_model

    hf = make_tiny_model("llama", "silu", seed=5)
    if ROPES[rope] is not None:
        hf.config.rope_parameters = ROPES[rope]
    hf.save_pretrained(tmp_path / "ckpt")
    out = export_gguf(tmp_path / "ckpt", tmp_path / "tiny.gguf", outtype="f32")
    model, info = load_model(str(out))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32).eval()
    assert info.source_format == "gguf" and info.family == "llama" and info.n_kv_heads == ref.config.num_key_value_heads
    ids = torch.randint(0, info.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- bad files

def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_non_llama_architecture_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_gguf(path)
    assert "unsupported GGUF architecture gpt2" in _one_line(e)
    path = write_tiny_gguf(tmp_path / "moe.gguf", meta=lambda w: w.add_expert_count(8))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_gguf(path)
    assert "mixture-of-experts llama model (8 experts)" in _one_line(e)


def test_truncated_gguf_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "ok.gguf", Q.Q8_0)
    data = path.read_bytes()
    for cut, name in [(len(data) - 1000, "data"), (200, "header")]:
        bad = tmp_path / f"cut-{name}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as e:
            load_gguf(bad)
        assert "corrupt or truncated GGUF file" in _one_line(e), name


def test_unknown_tensor_type_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "ok.gguf", Q.Q8_0)
    # a tensor-info record: name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32), offset (u64)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == int(Q.Q8_0)
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        load_gguf(bad)
    assert "unknown GGML tensor type" in _one_line(e)


def test_missing_tensor_and_wrong_shape_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "missing.gguf", skip=("blk.0.ffn_down.weight",))
    with pytest.raises(ModelLoadError) as e:
        load_gguf(path)
    assert "lacks 1 tensors" in _one_line(e) and "mlp.down_proj" in str(e.value)
    path = write_tiny_gguf(tmp_path / "shape.gguf", meta=lambda w: w.add_key_value(
        "llama.feed_forward_length", N_FF // 2, gguf.GGUFValueType.UINT32))
    with pytest.raises(ModelLoadError) as e:
        load_gguf(path)
    assert "has shape" in _one_line(e) and "the metadata implies" in str(e.value)


def test_cli_refuses_bad_gguf_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.cli import main

    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    rc = main(["build", str(bad), "-o", str(tmp_path / "a.pic"), "-q", "--pipeline", "dense"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "corrupt or truncated GGUF file" in err
    assert not (tmp_path / "a.pic").exists()


def _greedy_run(artifact: Path, prompt: list[int], n: int, capsys: pytest.CaptureFixture[str]) -> list[int]:
    """``picompile run ART --ids … -n N --json``: the ids it generated."""
    from picompile.cli import main

    assert main(["run", str(artifact), "--ids", ",".join(map(str, prompt)), "-n", str(n), "--json"]) == 0
    return list(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ids"])


def test_tiny_gguf_build_and_run_equals_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """picompile build model.gguf + picompile run: the greedy ids of the HF model the GGUF was exported from."""
    from transformers import AutoModelForCausalLM

    import picompile
    from picompile.formats.gguf_export import export_gguf
    from picompile.testing import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama", "silu", seed=9)
    src = export_gguf(Path(ckpt), tmp_path / "tiny.gguf", outtype="f32")
    art = picompile.build(src, output=tmp_path / "tiny.pic", pipeline="dense", emit=lambda s: None, progress=False)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["model"]["source_format"] == "gguf" and manifest["model"]["source"] == "tiny.gguf"
    assert json.loads((art / "tokenizer" / "tokenizer_config.json").read_text())["add_bos_token"] is False  # as written
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    prompt = [1, 17, 99, 4, 250]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert _greedy_run(art, prompt, 8, capsys) == want


def test_spm_tokenizer_adds_bos_by_default(tmp_path: Path) -> None:
    """A SentencePiece ("llama") vocabulary without tokenizer.ggml.add_bos_token adds BOS, as in llama.cpp; the
    directory written tokenizes as transformers' GGUF tokenizer does."""
    from transformers import AutoTokenizer

    from picompile.frontend.gguf import open_reader
    from picompile.frontend.gguf_tokenizer import tokenizer_dir

    toks = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581a", "\u2581b", "ab", "\u2581ab"]
    types = [2, 3, 3, *([6] * 256), 1, 1, 1, 1]  # unknown, control ×2, byte ×256, normal
    path = write_tiny_gguf(tmp_path / "spm.gguf", meta=lambda w: (
        w.add_tokenizer_model("llama"), w.add_token_list(toks), w.add_token_scores([-float(i) for i in range(len(toks))]),
        w.add_token_types(types), w.add_unk_token_id(0), w.add_bos_token_id(1), w.add_eos_token_id(2)))
    tok_dir = tokenizer_dir(path, "spm-test", open_reader(path))
    assert tok_dir is not None
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["add_bos_token"] is True
    ours = AutoTokenizer.from_pretrained(str(tok_dir))("a b ab").input_ids
    assert ours[0] == 1 and ours == AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)("a b ab").input_ids


# ----------------------------------------------------------------------------- SmolLM2 (a real trained model)

@pytest.fixture(scope="module")
def smollm2() -> Path:
    from picompile.testing import smollm2_gguf

    try:
        return smollm2_gguf()
    except RuntimeError as e:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not available: {e}")


SMOLLM2_TEXT = "The capital of France is Paris. <|im_start|>user\nWhat is 2+2?<|im_end|> naïve café 12345"


def test_smollm2_config_and_tokenizer(smollm2: Path) -> None:
    """Config from the metadata; the tokenizer directory written is a standard HF one giving transformers'
    GGUF tokenizer's ids (no BOS: SmolLM2's add_bos_token is false) and chat template."""
    from transformers import AutoTokenizer

    from picompile.frontend.gguf import config_from_metadata, open_reader
    from picompile.frontend.gguf_tokenizer import tokenizer_dir

    reader = open_reader(smollm2)
    c = config_from_metadata(reader, smollm2)
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["vocab_size"], c["max_position_embeddings"]) == (30, 576, 1536, 9, 3, 49152, 8192)
    assert c["tie_word_embeddings"] is True and c["rope_parameters"]["rope_theta"] == 100000.0
    assert abs(c["rms_norm_eps"] - 1e-5) < 1e-9 and (c["bos_token_id"], c["eos_token_id"]) == (1, 2)

    tok_dir = tokenizer_dir(smollm2, "smollm2-test", reader)
    assert tok_dir is not None
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert "<|im_start|>assistant" in cfg["chat_template"]
    ref_tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    our_tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = our_tok(SMOLLM2_TEXT).input_ids
    assert ids == ref_tok(SMOLLM2_TEXT).input_ids and ids[0] != ref_tok.bos_token_id
    chat = [{"role": "user", "content": "Hi"}]
    assert our_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    from picompile.formats.tokenizers import HFTokenizer

    assert HFTokenizer.from_file(tok_dir).encode(SMOLLM2_TEXT, bos=False) == ids


def _transformers_reference(path: Path) -> torch.nn.Module:
    """SmolLM2 in transformers from its own GGUF loader (config and dequantized weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = load_gguf_checkpoint(str(path))["config"]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")}))
    model.load_state_dict(_reference_tensors(path, model), strict=False)
    model.tie_weights()
    return model.eval()


@pytest.mark.slow
def test_smollm2_build_run_greedy_equals_transformers(smollm2: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """picompile build SmolLM2.gguf + picompile run: 16 greedy tokens = transformers' generate on the same
    dequantized weights (~2-3 min on 2 busy cores: a 30-layer capture, two GGUF reads)."""
    import picompile

    art = picompile.build(smollm2, output=tmp_path / "smollm2.pic", pipeline="dense", max_seq_len=256,
                          emit=lambda s: None, progress=False)
    m = json.loads((art / "manifest.json").read_text())["model"]
    assert (m["source_format"], m["n_layers"], m["n_kv_heads"], m["head_dim"]) == ("gguf", 30, 3, 64)
    assert m["extra"]["gguf"]["type_counts"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert m["source"] == smollm2.name and "/" not in json.dumps(m["extra"])
    assert json.loads((art / "tokenizer" / "tokenizer_config.json").read_text())["add_bos_token"] is False

    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(art / "tokenizer"))(SMOLLM2_TEXT).input_ids[:12]
    ref = _transformers_reference(smollm2)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert _greedy_run(art, prompt, 16, capsys) == want

"""llama2.c importer and tokenizers: real stories260K behaviour, a reference forward, bad inputs, save/load."""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from picompile.errors import ArtifactError, ModelLoadError
from picompile.frontend.llama2c import load_llama2c
from picompile.formats.tokenizers import (
    HFTokenizer,
    Llama2cTokenizer,
    Tokenizer,
    load_tokenizer,
    load_tokenizer_entry,
    save_tokenizer,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODEL = DATA / "model" / "stories260K.bin"
TOK = DATA / "model" / "tok512.bin"
SAMPLE = DATA / "tinystories_sample.txt"
needs_data = pytest.mark.skipif(
    not (MODEL.is_file() and TOK.is_file() and SAMPLE.is_file()),
    reason=f"shared data (stories260K.bin, tok512.bin, tinystories_sample.txt) not found under {DATA}",
)


@pytest.fixture(scope="module")
def stories():
    model, meta = load_llama2c(MODEL)
    return model, meta, Llama2cTokenizer.from_file(TOK)


# ----------------------------------------------------------------------------- a llama2.c reference


def _read_llama2c(path: Path) -> dict:
    """Independent parse of a llama2.c v0 file into numpy arrays, laid out as run.c reads them."""
    dim, hid, n_l, nh, nkv, vocab, seq = struct.unpack("<7i", path.read_bytes()[:28])
    v, hs = abs(vocab), dim // nh
    kv = hs * nkv
    flat = np.fromfile(path, dtype="<f4", offset=28)
    shapes = [("emb", (v, dim)), ("rms_att", (n_l, dim)), ("wq", (n_l, dim, dim)), ("wk", (n_l, kv, dim)),
              ("wv", (n_l, kv, dim)), ("wo", (n_l, dim, dim)), ("rms_ffn", (n_l, dim)), ("w1", (n_l, hid, dim)),
              ("w2", (n_l, dim, hid)), ("w3", (n_l, hid, dim)), ("rms_final", (dim,)), ("freq", (seq * hs,))]
    w, pos = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        w[name] = torch.from_numpy(flat[pos:pos + n].reshape(shape).copy())
        pos += n
    w["wcls"] = w["emb"] if vocab > 0 else torch.from_numpy(flat[pos:pos + v * dim].reshape(v, dim).copy())
    w.update(n_l=n_l, nh=nh, nkv=nkv, hs=hs)
    return w


def _reference_logits(w: dict, ids: list[int]) -> torch.Tensor:
    """run.c's forward for a whole sequence: interleaved-pair RoPE, GQA, SwiGLU. -> [T, vocab]."""
    T, nh, nkv, hs = len(ids), w["nh"], w["nkv"], w["hs"]

    def rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * g

    def rope(x: torch.Tensor, n: int) -> torch.Tensor:  # x: [T, n*hs], pairs (2j, 2j+1) rotated
        freq = 1.0 / 10000.0 ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # [hs/2]
        ang = torch.arange(T, dtype=torch.float64)[:, None] * freq  # [T, hs/2]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]  # [T, 1, hs/2]
        p = x.view(T, n, hs // 2, 2)
        a, b = p[..., 0], p[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(T, n * hs)

    x = w["emb"][ids]  # [T, dim]
    mask = torch.ones(T, T).tril().bool()
    for l in range(w["n_l"]):
        xb = rms(x, w["rms_att"][l])
        q = rope(xb @ w["wq"][l].T, nh).view(T, nh, hs)
        k = rope(xb @ w["wk"][l].T, nkv).view(T, nkv, hs).repeat_interleave(nh // nkv, 1)
        v = (xb @ w["wv"][l].T).view(T, nkv, hs).repeat_interleave(nh // nkv, 1)
        att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hs)  # [nh, T, T]
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, -1) @ w["wo"][l].T
        xb = rms(x, w["rms_ffn"][l])
        x = x + (F.silu(xb @ w["w1"][l].T) * (xb @ w["w3"][l].T)) @ w["w2"][l].T
    return rms(x, w["rms_final"]) @ w["wcls"].T


def _write_tiny(path: Path, vocab: int = -40, seed: int = 0, poison: bool = False) -> None:
    """A random llama2.c v0 file: dim 16, hidden 24, 2 layers, 4 heads, 2 kv heads, seq 32.
    A negative vocab writes a separate classifier after the freq_cis tables."""
    dim, hid, n_l, nh, nkv, seq = 16, 24, 2, 4, 2, 32
    v, kv = abs(vocab), dim // nh * nkv
    n = v * dim + n_l * (dim + 2 * dim * dim + 2 * kv * dim + dim + 3 * hid * dim) + dim + seq * (dim // nh)
    n += 0 if vocab > 0 else v * dim
    body = np.random.default_rng(seed).normal(0, 0.3, n).astype("<f4")
    if poison:
        body[5] = np.nan
    path.write_bytes(struct.pack("<7i", dim, hid, n_l, nh, nkv, vocab, seq) + body.tobytes())


# ----------------------------------------------------------------------------- real model


@needs_data
def test_greedy_from_bos_reproduces_known_text(stories) -> None:
    model, meta, tok = stories
    assert meta["format"] == "llama2c" and meta["source"] == str(MODEL) and len(meta["sha256"]) == 64
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa" and not model.training
    ids = torch.tensor([[tok.bos_id]])  # [1, T]
    with torch.no_grad():
        for _ in range(30):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            ids = torch.cat([ids, nxt], dim=1)
    text = tok.decode(ids[0].tolist())
    assert text.startswith("Once upon a time, there was a little girl named Lily"), text


@needs_data
def test_hf_model_matches_llama2c_reference_forward(stories) -> None:
    model, _, tok = stories
    ids = tok.encode("Once upon a time, Tom saw a big dog.")
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, _reference_logits(_read_llama2c(MODEL), ids), atol=1e-4, rtol=1e-4)


@needs_data
def test_mean_nll_on_tinystories_sample(stories) -> None:
    model, _, tok = stories
    text = SAMPLE.read_text(encoding="utf-8")
    total, count = 0.0, 0
    for story in (s.strip() for s in text.split("<|endoftext|>")):
        if not story or count >= 500:
            continue
        ids = torch.tensor([tok.encode(story)[:512]])  # [1, T], T <= context 512
        with torch.no_grad():
            logits = model(ids).logits[0]  # [T, vocab]
        total += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    assert count >= 500
    assert 1.1 <= total / count <= 1.5, total / count


def test_unshared_classifier_and_gqa_match_reference(tmp_path: Path) -> None:
    path = tmp_path / "tiny.bin"
    _write_tiny(path, vocab=-40)
    model, _ = load_llama2c(path)
    assert not model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    ids = [1, 5, 9, 30, 2, 17, 39]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, _reference_logits(_read_llama2c(path), ids), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- tokenizer


@needs_data
@pytest.mark.parametrize("text", ["", "Once upon a time", "Hello\nworld  twice", "héllo wörld ✓ 日本 🙂"])
def test_llama2c_tokenizer_round_trip(stories, text: str) -> None:
    tok = stories[2]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=False) == ids[1:]


@needs_data
def test_llama2c_tokenizer_details(stories) -> None:
    tok = stories[2]
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 512 and tok.eos_id == 2
    assert tok.encode("") == [1] and tok.encode("", bos=False) == []
    # the dummy-prefix " " merges into the first word; unknown chars fall back to bytes + 3
    ids = tok.encode("日", bos=False)
    assert [tok.pieces[i] for i in ids][-3:] == [b"<0xE6>", b"<0x97>", b"<0xA5>"]
    assert ids[-3:] == [0xE6 + 3, 0x97 + 3, 0xA5 + 3]
    assert tok.decode([0xE6 + 3]) == "\ufffd"  # a lone lead byte decodes with errors="replace"


def test_tokenizer_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer("llama2c", tmp_path / "nope.bin")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer("hf", tmp_path / "nope.json")
    with pytest.raises(ModelLoadError, match="unknown tokenizer kind"):
        load_tokenizer("spm", tmp_path / "x")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ not json")
    with pytest.raises(ModelLoadError, match="not a valid tokenizer.json"):
        load_tokenizer("hf", bad)
    if TOK.is_file():
        cut = tmp_path / "tok_cut.bin"
        cut.write_bytes(TOK.read_bytes()[:3000])
        with pytest.raises(ModelLoadError, match="truncated"):
            load_tokenizer("llama2c", cut)


@needs_data
def test_llama2c_tokenizer_save_load(stories, tmp_path: Path) -> None:
    entry = save_tokenizer(stories[2], tmp_path)
    assert entry["kind"] == "llama2c" and entry["files"] == ["tokenizer/tok512.bin"]
    tok = load_tokenizer(entry["kind"], tmp_path / entry["files"][0])
    assert tok.encode("The cat sat.") == stories[2].encode("The cat sat.")
    assert isinstance(load_tokenizer_entry(entry, tmp_path), Llama2cTokenizer)
    (tmp_path / "tokenizer" / "tok512.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ArtifactError, match="sha256"):
        load_tokenizer_entry(entry, tmp_path)


def test_hf_tokenizer_save_load_round_trip(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["the cat sat on the mat", "a dog ran to the park", "the sun was hot"] * 3, trainer)
    src = tmp_path / "src"
    src.mkdir()
    raw.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))

    tok = load_tokenizer("hf", src)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.vocab_size == raw.get_vocab_size()
    entry = save_tokenizer(tok, tmp_path / "artifact")
    assert entry["kind"] == "hf"
    assert entry["files"] == ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    back = load_tokenizer_entry(entry, tmp_path / "artifact")
    for text in ["the cat sat on the mat", "naïve dog ✓", ""]:
        ids = back.encode(text)  # special tokens as transformers adds them: this post-processor adds no BOS
        assert ids == tok.encode(text) and (not ids or ids[0] != 1)
        assert back.decode(ids) == text
    assert back.encode("the", bos=False)[0] != 1
    # no side files -> no bos/eos
    shutil.copy(src / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = load_tokenizer("hf", tmp_path / "tokenizer.json")
    assert bare.bos_id is None and bare.eos_id is None and bare.encode("the cat", bos=True) == tok.encode("the cat")


# ----------------------------------------------------------------------------- bad model files


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nope\.bin does not exist"):
        load_llama2c(tmp_path / "nope.bin")


def test_truncated_and_oversized_model(tmp_path: Path) -> None:
    src = tmp_path / "tiny.bin"
    _write_tiny(src, vocab=40)
    data = src.read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match=r"cut\.bin: truncated"):
        load_llama2c(cut)
    cut.write_bytes(data[:10])
    with pytest.raises(ModelLoadError, match="too short"):
        load_llama2c(cut)
    cut.write_bytes(data + b"\0" * 4)
    with pytest.raises(ModelLoadError, match="wrong size"):
        load_llama2c(cut)
    # the freq_cis tail is optional with a shared classifier
    cut.write_bytes(data[: len(data) - 4 * 32 * 4])
    assert load_llama2c(cut)[0].config.vocab_size == 40


@needs_data
def test_truncated_real_model(tmp_path: Path) -> None:
    cut = tmp_path / "stories_cut.bin"
    cut.write_bytes(MODEL.read_bytes()[:500_000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_llama2c(cut)


@pytest.mark.parametrize("header, why", [
    ((-64, 172, 5, 8, 4, 512, 512), "dim must be"),
    ((64, 172, 5, 7, 7, 512, 512), "not a multiple of n_heads"),
    ((64, 172, 5, 8, 3, 512, 512), "n_kv_heads"),
    ((64, 172, 5, 8, 4, 0, 512), "vocab_size"),
    ((0x616B3432, 2, 0, 0, 0, 0, 0), "versioned llama2.c export"),
])
def test_garbage_header(tmp_path: Path, header: tuple[int, ...], why: str) -> None:
    bad = tmp_path / "garbage.bin"
    bad.write_bytes(struct.pack("<7i", *header) + b"\0" * 4096)
    with pytest.raises(ModelLoadError, match=why) as exc:
        load_llama2c(bad)
    assert "garbage.bin" in str(exc.value)


def test_random_bytes_and_nan_weights(tmp_path: Path) -> None:
    bad = tmp_path / "random.bin"
    bad.write_bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="random.bin"):
        load_llama2c(bad)
    _write_tiny(bad, vocab=40, poison=True)
    with pytest.raises(ModelLoadError, match="NaN"):
        load_llama2c(bad)


# ----------------------------------------------------------------------------- fast encode == run.c's merge loop


def _reference_encode(tok: Llama2cTokenizer, text: str, bos: bool = True) -> list[int]:
    """The straightforward run.c encode(): rescan the whole sequence for the best pair before every merge."""
    raw = text.encode("utf-8")
    tokens = [tok.bos_id] if bos else []
    if raw:
        tokens += tok._char_ids(b" ")
    start = 0
    for i in range(len(raw)):
        nxt_is_cont = i + 1 < len(raw) and (raw[i + 1] & 0xC0) == 0x80
        if (raw[i] & 0xC0) != 0x80:
            start = i
        if nxt_is_cont and i + 1 - start < 4:
            continue
        tokens += tok._char_ids(raw[start:i + 1])
        start = i + 1
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            tid = tok._lookup.get(tok.pieces[tokens[i]] + tok.pieces[tokens[i + 1]])
            if tid is not None and tok.scores[tid] > best_score:
                best_score, best_id, best_idx = tok.scores[tid], tid, i
        if best_idx == -1:
            break
        tokens[best_idx:best_idx + 2] = [best_id]
    return tokens


ENCODE_TEXTS = ["", " ", "\n", "\n\n", "a", "Once upon a time", "Hello\nworld  twice\n", "  leading", "trailing  ",
                "héllo wörld ✓ 日本 🙂", "\x00\x01\x7f", "𝔘𝔫𝔦 \U0010ffff é\u0301", "<s>\n</s>\n", "<0x0A>",
                "the the the the", "aaaaaaaaaaaaaaaaaaaa", "Lily said, \"Mom!\"\r\nTom's cat."]


def _synthetic_tokenizer(extra: list[tuple[bytes, float]]) -> Llama2cTokenizer:
    """Special tokens, all 256 byte-fallback tokens, single characters, then `extra` (piece, score) merges."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    scores = [0.0] * len(pieces)
    for c in b" abc\n":
        pieces.append(bytes([c]))
        scores.append(-100.0)
    for p, s in extra:
        pieces.append(p)
        scores.append(s)
    return Llama2cTokenizer(pieces, scores, max(len(p) for p in pieces))


def _chunks_joined(tok: Llama2cTokenizer, text: str, bos: bool = True) -> list[int]:
    return [t for chunk in tok.iter_encode(text, bos=bos) for t in chunk]


@needs_data
@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_llama2c_encode_matches_reference(stories, text: str) -> None:
    """The heap-based merge gives run.c's ids, byte fallback and unicode included; iter_encode's chunks join to them."""
    tok = stories[2]
    for bos in (True, False):
        ref = _reference_encode(tok, text, bos)
        assert tok.encode(text, bos=bos) == ref
        assert _chunks_joined(tok, text, bos) == ref
    assert tok.encode(text, eos=True) == _reference_encode(tok, text) + [tok.eos_id]


@needs_data
def test_llama2c_encode_matches_reference_on_sample(stories) -> None:
    tok = stories[2]
    text = SAMPLE.read_text(encoding="utf-8")
    lines = text.splitlines()[:12]
    for line in lines:
        assert tok.encode(line) == _reference_encode(tok, line)
    block = "\n".join(lines)
    assert tok.encode(block) == _reference_encode(tok, block) == _chunks_joined(tok, block)
    assert len(list(tok.iter_encode(block))) > 1  # the newline cuts are used: nothing in tok512 spans a "\n"


def test_llama2c_encode_ties_and_cross_line_merges() -> None:
    """Synthetic vocabularies: equal scores (leftmost pair wins), merges of merges, pieces spanning a newline (the
    line cut must not be used there), scores at/below -1e10 (never merged); random strings against run.c's loop."""
    import random

    vocabs = [
        [(b"ab", 1.0), (b"bc", 1.0), (b"abc", 2.0), (b" a", 0.5), (b"aa", 1.0), (b"aaa", 1.0)],
        [(b"c\n", 3.0), (b"\na", 3.0), (b"c\na", 4.0), (b"ab", 1.0), (b"\n\n", 2.0), (b"bb", -1e10), (b"cc", -2e10)],
        [(b"a\n", 1.0), (b"b\n", 1.0), (b"\n ", 1.0), (b"\n b", 5.0), (b" b", 0.0)],
    ]
    rng = random.Random(0)
    for extra in vocabs:
        tok = _synthetic_tokenizer(extra)
        for k in range(200):
            text = "".join(rng.choice("abc \n\ná") for _ in range(rng.randint(0, 60)))
            for bos in (True, False):
                ref = _reference_encode(tok, text, bos)
                assert tok.encode(text, bos=bos) == ref, (extra, text, bos)
                assert _chunks_joined(tok, text, bos) == ref, (extra, text, bos)
    tok = _synthetic_tokenizer(vocabs[1])  # no " a" piece: the dummy prefix " " stands alone
    assert len(list(tok.iter_encode("abc\nabc\nab"))) == 2  # " " | "abc\nabc\nab": "c\na" spans both newlines
    assert len(list(tok.iter_encode("ab\nb\nba"))) == 4  # " " | "ab\n" | "b\n" | "ba": nothing holds "\nb"

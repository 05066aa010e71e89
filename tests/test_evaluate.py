"""``picompile eval``: sliding-window perplexity and zero-shot task scoring, sparse vs the artifact's dense reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import picompile
from picompile.cli import main
from picompile.errors import PicompileError
from picompile.tools.eval_inputs import prepare_for, read_task, windows
from picompile.tools.eval_scoring import run_one
from picompile.tools.eval_sweep import rebuild_options, sweep, sweep_plan
from picompile.tools.evaluate import evaluate
from picompile.formats.artifact import read_manifest

KEY = ("llama", "relu")
CTX = 128  # the tiny models' context


class ByteTokenizer:
    """Text → UTF-8 bytes (the tiny models' vocab is 256), BOS = 1: lets tokenizer-less models score tasks."""

    bos_id, eos_id = 1, 2

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([1] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def oracle_art(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return picompile.build(checkpoints[KEY], output=tmp_path_factory.mktemp("ev") / "oracle.pic", predictor="oracle",
                           pipeline="reference", calibration_tokens=512, emit=lambda s: None)


@pytest.fixture(scope="module")
def bad_art(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deliberately poor predictor: tuned to find only half of the active neurons."""
    return picompile.build(checkpoints[KEY], output=tmp_path_factory.mktemp("ev") / "bad.pic", predictor="trained",
                           recall_target=0.5, pipeline="reference", calibration_tokens=256, emit=lambda s: None)


@pytest.fixture(scope="module")
def hf_model(checkpoints: dict) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(checkpoints[KEY], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def token_files(tmp_path_factory: pytest.TempPathFactory, oracle_art: Path) -> dict[str, Path]:
    """random.json: 300 uniform random ids (3 windows); sampled.npy: 2 × 96 tokens the model itself sampled,
    so the dense model is the distribution they come from and a worse FFN must lose likelihood."""
    root = tmp_path_factory.mktemp("tokens")
    gen = torch.Generator().manual_seed(3)
    (root / "random.json").write_text(json.dumps(torch.randint(0, 256, (300,), generator=gen).tolist()))
    dense = picompile.load(oracle_art, dense=True)
    sampled: list[int] = []
    for seed in range(2):
        sampled += [1] + dense.generate([1], 95, temperature=1.0, seed=seed, stop_at_eos=False)
    np.save(root / "sampled.npy", np.asarray(sampled, dtype=np.int64))
    (root / "short.json").write_text(json.dumps(sampled[:100]))
    return {"random": root / "random.json", "sampled": root / "sampled.npy", "short": root / "short.json"}


def test_windows_score_every_token_once() -> None:
    for n in (2, 5, 127, 128, 129, 300, 1000):
        for ctx, stride in ((128, None), (128, 1), (128, 127), (16, 5), (2, 1)):
            ws = windows(n, ctx, stride)
            scored = [t for _, end, first in ws for t in range(first, end)]
            assert scored == list(range(1, n)), (n, ctx, stride)
            step = stride or ctx // 2
            assert ws[0][0] == 0 and ws[0][2] == 1  # the first window scores all its tokens
            for begin, end, first in ws:
                assert end - begin <= ctx and first > begin
                if begin > 0:  # later windows: at least context − stride tokens of left context
                    assert first - begin >= min(ctx - step, first)
    with pytest.raises(PicompileError, match="stride"):
        windows(10, 8, 8)


def test_oracle_sparse_equals_dense(oracle_art: Path, token_files: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(oracle_art), "--ppl", str(token_files["random"]), "--json", "-q"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["dense"]["tokens"] == r["sparse"]["tokens"] == 299 and r["stride"] == CTX // 2
    assert abs(r["sparse"]["ppl"] - r["dense"]["ppl"]) <= 1e-6 * r["dense"]["ppl"]
    # measured from the oracle masks: about half the ReLU neurons are zero on this random model
    assert r["skipped_fraction_source"] == "measured"
    assert 0.3 < r["skipped_fraction"] < 0.7 and abs(r["skipped_fraction"] - r["skipped_fraction_manifest"]) < 0.1
    assert set(r["skipped_per_layer"]) == {"0", "1"}
    assert main(["eval", str(oracle_art), "--ppl", str(token_files["random"]), "-q"]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and "skipped FFN neurons" in table


def test_sliding_window_matches_transformers(oracle_art: Path, token_files: dict, hf_model: torch.nn.Module) -> None:
    session = picompile.load(oracle_art, dense=True)
    for name in ("short", "random"):  # one window, then three overlapping windows
        ids = [int(i) for i in json.loads(token_files[name].read_text())]
        inputs = prepare_for(session, token_files[name])
        r = run_one(session, inputs)
        # the HF recipe ("perplexity of fixed-length models"): labels -100 on the context part of each window
        nll_sum, count, prev_end = 0.0, 0, 0
        with torch.no_grad():
            for begin in range(0, len(ids), CTX // 2):
                end = min(begin + CTX, len(ids))
                trg = end - prev_end
                x = torch.tensor([ids[begin:end]])
                labels = x.clone()
                labels[:, :-trg] = -100
                n_valid = int((labels[:, 1:] != -100).sum())
                nll_sum += float(hf_model(x, labels=labels).loss) * n_valid
                count += n_valid
                prev_end = end
                if end == len(ids):
                    break
        assert r["tokens"] == count == len(ids) - 1
        assert abs(r["nll"] - nll_sum / count) < 1e-5 * nll_sum / count, name


def test_bad_predictor_is_clearly_worse(bad_art: Path, oracle_art: Path, token_files: dict) -> None:
    bad = evaluate(bad_art, token_files["sampled"])
    good = evaluate(oracle_art, token_files["sampled"])
    assert all(abs(layer["recall"] - 0.5) < 0.05 for layer in picompile.load(bad_art).manifest.layers)
    assert abs(bad["dense"]["ppl"] - good["dense"]["ppl"]) < 1e-4 * good["dense"]["ppl"]  # same weights
    assert bad["sparse"]["ppl"] > 1.1 * bad["dense"]["ppl"], bad
    assert bad["skipped_fraction"] > good["skipped_fraction"] + 0.1  # it drops true positives too


def _write_tasks(root: Path) -> tuple[Path, Path, Path]:
    mc = root / "mini_mc.jsonl"
    rows = [
        {"query": "The cat sat on the", "choices": ["mat.", "moon, far away."], "gold": 0},
        {"query": "Question: What is two plus two?\n", "choices": ["four", "five", "a fish"], "gold": 2},
        {"query": "x" * 200 + " so", "choices": ["it ended.", "no"], "gold": 1},  # context longer than the window
    ]
    mc.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    wg = root / "mini_wg.jsonl"
    wg.write_text(json.dumps({"context_options": ["Ann beat Bo so Ann", "Ann beat Bo so Bo"],
                              "continuation": "was sad.", "gold": 1}) + "\n")
    rte = root / "mini_rte.jsonl"
    rte.write_text(json.dumps({"premise": "It rains.", "hypothesis": "It is wet.", "label": "entailment", "idx": 0}) + "\n"
                   + json.dumps({"premise": "It is dry.", "hypothesis": "It rains.", "label": "not_entailment", "idx": 1}) + "\n")
    return mc, wg, rte


def test_task_scoring_matches_direct_loglik(oracle_art: Path, hf_model: torch.nn.Module, tmp_path: Path) -> None:
    mc, wg, rte = _write_tasks(tmp_path)
    tok = ByteTokenizer()
    assert read_task(mc, limit=2).examples.__len__() == 2
    t = read_task(mc)
    assert t.examples[1].requests[0] == ("Question: What is two plus two?\nAnswer:", " four")
    assert read_task(wg).examples[0].requests[1] == ("Ann beat Bo so Bo", " was sad.")
    assert read_task(rte).examples[1].requests[1] == (
        "It is dry.\nQuestion: It rains. True or False?\nAnswer:", " False")
    assert read_task(rte).examples[1].gold == 1

    session = picompile.load(oracle_art, dense=True)
    inputs = prepare_for(session, None, [mc, wg, rte], tokenizer=tok)
    r = run_one(session, inputs)
    for name, task in zip(("mini_mc", "mini_wg", "mini_rte"), inputs.tasks):
        score = r["tasks"][name]
        assert 0.0 <= score["acc"] <= 1.0 and 0.0 <= score["acc_norm"] <= 1.0
        direct = []
        for ex in task.examples:
            ll = []
            for ctx, cont in ex.requests:
                seq = ([1] + list(ctx.encode()) + list(cont.encode()))[-(CTX + 1):]  # left-truncated like lm-eval
                n = len(cont.encode())
                with torch.no_grad():
                    lp = torch.log_softmax(hf_model(torch.tensor([seq[:-1]])).logits[0], -1)
                ll.append(float(lp[-n:].gather(1, torch.tensor(seq[-n:])[:, None]).sum()))
            direct.append(ll)
        for got, want in zip(score["logliks"], direct):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        expect = sum(int(np.argmax(ll)) == ex.gold for ll, ex in zip(direct, task.examples)) / len(task.examples)
        assert score["acc"] == expect


def test_tasks_dense_vs_sparse(oracle_art: Path, tmp_path: Path) -> None:
    mc, wg, rte = _write_tasks(tmp_path)
    r = evaluate(oracle_art, None, [mc, wg, rte], limit=2, tokenizer=ByteTokenizer())
    assert set(r["tasks"]) == {"mini_mc", "mini_wg", "mini_rte"} and r["tasks"]["mini_mc"]["n"] == 2
    for t in r["tasks"].values():  # the oracle is exact on a ReLU model
        assert t["dense"] == t["sparse"] and t["agreement"] == 1.0
    assert "ppl" not in r["dense"]


def test_bad_input(oracle_art: Path, token_files: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("some words")
    mc, _, _ = _write_tasks(tmp_path)
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"question": "?", "answer": 1}\n')
    bad_ids = tmp_path / "ids.json"
    bad_ids.write_text("[1, 2, 999]")
    cases = [
        (["--ppl", str(tmp_path / "missing.txt")], "does not exist"),
        (["--ppl", str(text)], "no tokenizer"),
        (["--tasks", str(mc)], "no tokenizer"),
        (["--tasks", str(tmp_path / "missing.jsonl")], "does not exist"),
        ([], "nothing to evaluate"),
        (["--ppl", str(bad_ids)], "outside the vocabulary"),
        (["--ppl", str(token_files["random"]), "--limit", "0"], "--limit"),
    ]
    for extra, message in cases:
        assert main(["eval", str(oracle_art), "-q", *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(PicompileError, match="unknown task format"):
        read_task(bad_rows)
    assert main(["eval", str(tmp_path / "nope.pic"), "--ppl", str(token_files["random"])]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(oracle_art), "--ppl", str(token_files["random"]), "--sweep", "-q"]) == 2
    assert "oracle" in capsys.readouterr().err  # nothing to sweep: the oracle is exact on ReLU


def test_sweep(bad_art: Path, token_files: dict, checkpoints: dict) -> None:
    manifest = read_manifest(bad_art)
    assert sweep_plan(manifest) == ("recall_target", [0.9, 0.95, 0.99, 0.999])
    opts = rebuild_options(manifest)
    assert opts["model"] == str(checkpoints[KEY]) and opts["pipeline"] == "reference" and opts["target"] == "cpu"
    assert opts["recall_target"] == 0.5 and opts["calibration_tokens"] == 256 and opts["predictor"] == "trained"
    session = picompile.load(bad_art)
    inputs = prepare_for(session, token_files["short"])
    out = sweep(bad_art, inputs, [0.5, 0.999])
    lo, hi = out["points"]
    assert out["knob"] == "recall_target" and lo["recall_target"] == 0.5 and hi["recall_target"] == 0.999
    assert lo["skipped_fraction"] > hi["skipped_fraction"]  # a higher recall target computes more neurons
    assert lo["ppl"] > hi["ppl"]
    # the 0.5 point rebuilds the artifact itself: same predictor, same ppl
    assert abs(lo["ppl"] - run_one(session, inputs)["ppl"]) < 1e-4 * lo["ppl"]


def test_stories260k(shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real model on in-distribution text: mean NLL ≈ 1.27 nats/token over the whole sample (the figure the
    shared data's README gives; its first 1000 tokens alone are easier, ≈ 1.19)."""
    art = picompile.build(shared_data / "model" / "stories260K.bin", output=tmp_path / "s.pic", pipeline="dense",
                          emit=lambda s: None)
    assert main(["eval", str(art), "--ppl", str(shared_data / "tinystories_sample.txt"),
                 "--tasks", str(shared_data / "tasks" / "copa.jsonl"), str(shared_data / "tasks" / "rte_val.jsonl"),
                 str(shared_data / "tasks" / "winogrande.jsonl"), "--limit", "3", "--json", "-q"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["context"] == 512 and r["dense"]["tokens"] > 1500
    assert abs(r["dense"]["nll"] - 1.27) < 0.03 and 3.5 <= r["dense"]["ppl"] <= 4.5
    assert r["sparse"]["ppl"] == pytest.approx(r["dense"]["ppl"], rel=1e-6)  # a dense build: nothing skipped
    assert r["skipped_fraction"] == 0.0
    for name in ("copa", "rte_val", "winogrande"):
        assert r["tasks"][name]["n"] == 3 and 0.0 <= r["tasks"][name]["dense"]["acc"] <= 1.0


def test_vs_ort_reference(oracle_art: Path, token_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--vs ort: the dense model in ONNX Runtime scores the same perplexity as picompile's dense reference."""
    pytest.importorskip("onnxscript")
    monkeypatch.setenv("PICOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    result = evaluate(oracle_art, token_files["random"], max_tokens=150, vs_ort=True)
    assert result["ort_dense"]["tokens"] == result["dense"]["tokens"]
    assert abs(result["ort_dense"]["ppl"] / result["dense"]["ppl"] - 1) < 1e-4


# ----------------------------------------------------------------------------- --ppl-tokens encodes only a prefix


def test_ppl_tokens_encodes_only_a_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--ppl-tokens N on a big text file: the llama2.c tokenizer is run line by line until N tokens are there
    (same ids as encoding the whole file), and documents after the first N tokens are never encoded."""
    from picompile.tools.eval_inputs import read_eval_tokens
    from picompile.formats.tokenizers import Llama2cTokenizer

    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    merges = [b" ", b"e", b"t", b"h", b"th", b"the", b" the", b"er", b" c", b"at"]
    tok = Llama2cTokenizer(pieces + merges, [0.0] * len(pieces) + [float(i) for i in range(len(merges))], 6)
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "mat", "héllo", "日本", "🙂", "there"]
    lines = [" ".join(rng.choice(words, size=int(rng.integers(3, 15)))) for _ in range(4000)]
    big = tmp_path / "big.txt"
    big.write_text("\n".join(lines) + "\n", encoding="utf-8")
    encoded_bytes = [0]
    initial_ids = tok._initial_ids

    def counting(raw: bytes) -> list[int]:
        encoded_bytes[0] += len(raw)
        return initial_ids(raw)

    monkeypatch.setattr(tok, "_initial_ids", counting)
    ids = read_eval_tokens(big, tok, tok.vocab_size, max_tokens=300)
    assert len(ids) == 300 and ids[0] == tok.bos_id
    assert encoded_bytes[0] < big.stat().st_size // 50  # a few lines, not the file
    prefix = "".join(line + "\n" for line in lines[:80])  # ≥ 300 tokens; each newline cut is exact for this vocab
    assert ids == tok.encode(prefix)[:300]
    encoded_bytes[0] = 0
    assert read_eval_tokens(big, tok, tok.vocab_size)[:300] == ids  # no cap: the whole file
    assert encoded_bytes[0] == big.stat().st_size

    # a tokenizer without iter_encode: whole documents, but none after the first N tokens
    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text: str, bos: bool = True) -> list[int]:
            Counting.calls += 1
            return super().encode(text, bos)

    docs = tmp_path / "docs.txt"
    docs.write_text("<|endoftext|>".join(f"document {i} " * 5 for i in range(1000)), encoding="utf-8")
    ids = read_eval_tokens(docs, Counting(), 256, max_tokens=200)
    assert len(ids) == 200 and Counting.calls <= 4
    expected: list[int] = []
    for i in range(4):
        expected += ByteTokenizer().encode((f"document {i} " * 5).strip())
    assert ids == expected[:200]


def test_default_build_of_embedded_model_meets_accuracy_target(tmp_path: Path) -> None:
    """The shipped model with default options: perplexity within +1 % of dense while skipping >= 80 % of FFN
    neurons (issue target; measured: -0.01 %, 83.7 % on 4000 tokens)."""
    import picompile
    from picompile.builder import default_model

    model_dir = Path(default_model())
    if not (model_dir / "config.json").is_file():
        pytest.skip(f"embedded model not present at {model_dir}")
    art = picompile.build(str(model_dir), output=tmp_path / "d.pic", emit=lambda s: None)
    r = evaluate(art, model_dir / "validation.txt", max_tokens=1500)
    assert r["sparse"]["ppl"] <= 1.01 * r["dense"]["ppl"]
    assert r["skipped_fraction"] >= 0.8
    assert all(layer["recall_target"] == 0.95 for layer in picompile.load(art).manifest.layers)


def test_bytes_skipped_measured_for_input_sparsity_and_cats(checkpoints: dict, token_files: dict,
                                                            tmp_path: Path) -> None:
    """Input sparsity at 40 % of the bytes: eval measures about that; CATS rebuilt at the same bytes measures
    about the same too, and its neuron sparsity is higher (an inactive neuron saves 2 of its 3 rows)."""
    art = picompile.build(checkpoints[("llama", "silu")], output=tmp_path / "isp.pic", predictor="none",
                          input_sparsity="all", act_sparsity=0.4, pipeline="reference", calibration_tokens=512,
                          input_loss_tokens=128, emit=lambda s: None)
    r = evaluate(art, token_files["random"], cats=True)
    assert r["dense"]["ppl"] != r["sparse"]["ppl"]
    assert 0.25 < r["bytes_skipped_fraction"] < 0.55  # measured on other text than the thresholds' calibration
    c = r["cats"]
    assert abs(c["bytes_skipped_fraction"] - r["bytes_skipped_fraction"]) < 0.1
    assert c["skipped_fraction"] > r["bytes_skipped_fraction"]

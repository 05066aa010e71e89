"""The command line as a user types it: build with --print-after / --dump-ir, inspect, run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from picompile.cli import main


def test_build_print_after_and_dump_ir(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, ir = tmp_path / "m.pic", tmp_path / "ir"
    rc = main(["build", str(checkpoints[("llama", "relu")]), "-o", str(out), "-q", "--pipeline", "dense",
               "--print-after", "canonicalize-ffn", "--dump-ir", str(ir)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "graph after pass canonicalize-ffn" in printed
    assert printed.count("torch.ops.picompile.ffn.default(") == 2  # one per layer
    assert "aten.relu" not in printed
    files = sorted(p.name for p in ir.iterdir())
    assert files == ["001_capture.txt", "002_canonicalize-ffn.txt", "003_fold-kv-repeat.txt", "004_convert-weights.txt",
                     "005_package.txt"]
    assert "aten.relu.default" in (ir / "001_capture.txt").read_text()

    rc = main(["inspect", str(out), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["format_version"] == 1
    assert summary["model"]["architecture"] == "LlamaForCausalLM"
    assert summary["target"]["name"] == "cpu"
    assert [(layer["index"], layer["n_neurons"]) for layer in summary["layers"]] == [(0, 192), (1, 192)]
    assert set(summary["files"]) == {"graph.pt2", "weights.safetensors"}
    assert all(len(f["sha256"]) == 64 for f in summary["files"].values())

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FFN layers" in text and "LlamaForCausalLM" in text and "weights.safetensors" in text

    assert main(["inspect", str(out), "--graph"]) == 0
    assert capsys.readouterr().out.count("torch.ops.picompile.ffn.default(") == 2

    assert main(["run", str(out), "--ids", "5,6,7", "-n", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt"] == [5, 6, 7] and len(result["ids"]) == 5


def test_print_after_unknown_pass(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["build", str(checkpoints[("opt", "relu")]), "-o", str(tmp_path / "x.pic"), "--print-after", "nope"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown pass(es) nope" in err and "canonicalize-ffn" in err
    assert not (tmp_path / "x.pic").exists()


def test_unknown_target_lists_known(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["build", str(checkpoints[("opt", "relu")]), "-o", str(tmp_path / "x.pic"), "--target", "tpu9"])
    assert rc == 2
    assert "unknown target 'tpu9'; known targets: rtx4090" in capsys.readouterr().err


def test_run_streams_as_tokens_come(default_artifact: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`picompile run` writes each token's text as it is chosen (before generation ends), stops at --stop, clamps
    --max-tokens to the context with a warning, and reports prefill and decode tok/s."""
    import sys

    from picompile.cli import main
    from picompile.runtime.session import Decoder

    feeds = {"n": 0}
    real_feed = Decoder.feed

    def counting_feed(self: Decoder, ids: object, **kw: object) -> object:
        feeds["n"] += 1
        return real_feed(self, ids, **kw)  # type: ignore[arg-type]

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[tuple[int, str]] = []  # (decoder feeds so far, text)

        def write(self, text: str) -> int:
            self.writes.append((feeds["n"], text))
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(Decoder, "feed", counting_feed)
    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    assert main(["run", str(default_artifact), "--prompt", "ROMEO:", "-n", "24"]) == 0
    monkeypatch.undo()
    text = "".join(t for _, t in rec.writes)
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:\n")
    during = [n for n, t in rec.writes if t.strip() and n < feeds["n"]]
    assert len(during) >= 5  # text arrived while tokens were still being decoded
    err = capsys.readouterr().err
    assert "prefill 3 tokens at" in err and "decode" in err and "tok/s" in err
    stop = text[len("ROMEO:"):][3:6]
    assert main(["run", str(default_artifact), "--prompt", "ROMEO:", "-n", "24", "--stop", stop]) == 0
    out = capsys.readouterr().out
    assert stop not in out[len("ROMEO:"):] and text.startswith(out.rstrip("\n"))
    assert main(["run", str(default_artifact), "--prompt", "ROMEO:", "--max-tokens", "100000", "--json",
                 "--temperature", "0.7", "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.3",
                 "--seed", "4"]) == 0
    cap = capsys.readouterr()
    assert "clamped to 253" in cap.err
    result = json.loads(cap.out)
    assert 0 < len(result["ids"]) <= 253 and result["finish_reason"] in ("stop", "length")

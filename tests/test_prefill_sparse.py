"""Prefill's ReLU FFN only where its gate fired (``kernels/cpu_prefill.py``, load step ``sparse-prefill-ffn``):
the two kernels against torch references of the same maths, and the step alone on tiny quantized artifacts —
structure (which parts it rewrites, which it leaves, and why) and numerics against the dense prefill."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import picompile
from picompile.kernels import aligned_empty, as_aligned, build_kernel, cpu_prefill, load_kernel, qformat
from picompile.kernels.cpu import build_cores, host_target
from picompile.kernels.cpu_qdot import isa_for
from picompile.kernels.spec import KernelSpec, KernelSpecError
from picompile.runtime.prefill_sparse import SparsePrefillFFN
from picompile.testing import save_tiny_checkpoint

PROMPT = [5, 17, 33, 4, 99, 120, 7, 64, 3, 18, 200, 11]
needs_qdot = pytest.mark.skipif(isa_for(host_target(None)) is None, reason="no integer dot products (AVX2) on this CPU")


def _kernel(kind: str, wdt: str, d: int, cache: Path) -> object:
    spec = KernelSpec(kind=kind, act="none", d_model=d, n_rows=1, weight_dtype=wdt, has_bias=False,  # type: ignore[arg-type]
                      target="llvm")
    return load_kernel(build_kernel(spec, cache), spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("wdt", ["int8", "int4", "float16", "float32"])
def test_kernels_equal_torch_reference(wdt: str, tmp_path: Path) -> None:
    quant = wdt in ("int8", "int4")
    if quant and isa_for(host_target(None)) is None:
        pytest.skip("no integer dot products (AVX2) on this CPU")
    torch.manual_seed(0)
    d, n, t = 512, 200, 7  # 200 rows: the last block of 64 rows is partial
    up, down = _kernel("prefill_up", wdt, d, tmp_path), _kernel("prefill_down", wdt, d, tmp_path)
    if quant:
        fmt = qformat.QFormat(wdt, 32)
        wu, wd = ([as_aligned(a) for a in qformat.quantize(torch.randn(n, d), fmt)] for _ in range(2))
        w_down = qformat.dequantize(*wd)
    else:
        wu, wd = ([as_aligned(torch.randn(n, d).to(getattr(torch, wdt)))] for _ in range(2))
        w_down = wd[0].float()
    x = as_aligned(torch.randn(t, d))
    g = torch.randn(t, n)
    g[:, 50:80] = -1.0  # rows no token fires
    g[3] = -1.0  # a token with no row
    h = aligned_empty((t, n))
    up(x, *wu, g, h)
    if quant:  # x quantized per token, as decode's kernels do
        dots = torch.stack([qformat.qdot_reference(x[i], *wu) for i in range(t)]).float()  # [t, n]
    else:
        dots = x.double() @ wu[0].double().t()
    want = (torch.relu(g.double()) * dots).float()
    assert torch.equal(h == 0, want == 0)  # nothing computed where the gate did not fire
    assert _rel(h, want) < 1e-5
    tokptr, rows = cpu_prefill.prefill_runs(h)
    assert tokptr[-1] == rows.numel() - 1 == int(h.ne(0).sum()) and rows[-1] == n  # the sentinel
    assert not ((rows[:-1] >= 50) & (rows[:-1] < 80)).any() and tokptr[3] == tokptr[4]
    parts = build_cores()
    y = aligned_empty((parts, t, d))
    down(h, tokptr, rows, *wd, y)
    assert _rel(y.sum(0), (h.double() @ w_down.double()).float()) < 1e-5
    assert torch.equal(y[:, 3], torch.zeros(parts, d))
    zero = torch.zeros_like(h)  # no pair at all: y written as zeros
    down(zero, *cpu_prefill.prefill_runs(zero), *wd, y)
    assert not y.any()


def test_specs_and_shapes() -> None:
    with pytest.raises(KernelSpecError, match="no bias"):
        KernelSpec(kind="prefill_down", act="none", d_model=512, n_rows=1, weight_dtype="float16", has_bias=True,
                   target="llvm")
    with pytest.raises(KernelSpecError, match="n_rows 1"):
        KernelSpec(kind="prefill_up", act="none", d_model=512, n_rows=64, weight_dtype="int4", has_bias=False,
                   target="llvm")
    assert cpu_prefill.chunk_columns(2048, 32) == min(256, cpu_prefill.COLUMNS)
    assert cpu_prefill.chunk_columns(576, 32) == 64
    assert cpu_prefill.chunk_columns(64, 64) == 64 and cpu_prefill.chunk_columns(100, 32) == 0


def _steps(session: picompile.Session) -> list[SparsePrefillFFN]:
    return [n.target for n in session.prefill_graph.graph.nodes
            if n.op == "call_function" and isinstance(n.target, SparsePrefillFFN)]


def _build(ckpt: Path, out: Path, wdt: str = "int4") -> Path:
    return picompile.build(ckpt, output=out, weight_dtype=wdt, calibration_tokens=128, max_seq_len=64,
                           emit=lambda s: None, progress=False)


@needs_qdot
def test_gated_relu_prefill(tmp_path: Path) -> None:
    """Llama-ReLU (gated), d_model 512: each layer's part becomes a SparsePrefillFFN; its prompt logits are the
    dense prefill's up to x's int8 rounding in up's dot products (as decode's kernels)."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama", "relu", seed=3, d_model=512, n_neurons=384, n_heads=4,
                                n_kv_heads=2)
    art = _build(ckpt, tmp_path / "g.pic")
    sparse = picompile.load(art, prefill_dtype="float32")
    dense = picompile.load(art, prefill_dtype="float32", sparse_prefill=False)
    assert "sparse-prefill-ffn" in sparse.load_steps and "sparse-prefill-ffn" not in dense.load_steps
    fns = _steps(sparse)
    assert sparse.sparse_prefill_parts == len(fns) == 2 and all(f.gated and f.up is not None for f in fns)
    assert not _steps(dense) and sparse.sparse_prefill_skipped == []
    assert "2 ReLU FFN parts computed where their gate fires" in sparse.prefill_reason
    assert "gate fires" not in dense.prefill_reason
    a, b = sparse.logits(PROMPT), dense.logits(PROMPT)
    assert _rel(a, b) < 3e-2  # measured ~6e-3
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.9
    # decode continues from the cache prefill wrote: the same greedy tokens as after the dense prefill
    assert sparse.generate(PROMPT, 6, stop_at_eos=False) == dense.generate(PROMPT, 6, stop_at_eos=False)
    assert picompile.load(art, prefill_dtype="weights").sparse_prefill_parts == 0  # no copy for the gate GEMM


def test_relu_and_silu_prefill(checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-ReLU (not gated, d_model 64): the up GEMM stays dense, the down rows only where h > 0 — the dense
    maths to float rounding. No kernel to be had (no TVM compiler): the dense GEMMs, with the reason.
    Llama-SiLU: no exact zeros, left to the dense GEMMs with the reason."""
    art = _build(checkpoints[("opt", "relu")], tmp_path / "o.pic")
    sparse = picompile.load(art, prefill_dtype="float32")
    dense = picompile.load(art, prefill_dtype="float32", sparse_prefill=False)
    fns = _steps(sparse)
    assert len(fns) == sparse.sparse_prefill_parts >= 2 and not any(f.gated for f in fns)
    assert _rel(sparse.logits(PROMPT), dense.logits(PROMPT)) < 1e-5
    from picompile.runtime import prefill_sparse

    def no_compiler(*args: object) -> None:
        raise ImportError("tvm's compiler is not installed")

    monkeypatch.setattr(prefill_sparse, "prefill_kernels", no_compiler)
    without = picompile.load(art, prefill_dtype="float32")
    assert without.sparse_prefill_parts == 0 and not _steps(without)
    assert any("not installed" in r for r in without.sparse_prefill_skipped)
    assert _rel(without.logits(PROMPT), dense.logits(PROMPT)) < 1e-6
    monkeypatch.undo()
    silu = picompile.load(_build(checkpoints[("llama", "silu")], tmp_path / "s.pic"), prefill_dtype="float32")
    assert silu.sparse_prefill_parts == 0 and not _steps(silu)
    assert any("act 'silu'" in r for r in silu.sparse_prefill_skipped)


@pytest.mark.parametrize("prefill_dtype", ["float32", "weights"])
def test_float16_prefill(f16_cpu_artifact: Path, prefill_dtype: str) -> None:
    """float16 rows (Llama-ReLU, gated): float dot products, so the dense prefill's logits to float rounding;
    with prefill dtype "weights" the gate GEMM reads the stored rows (no copy)."""
    sparse = picompile.load(f16_cpu_artifact, prefill_dtype=prefill_dtype)
    dense = picompile.load(f16_cpu_artifact, prefill_dtype=prefill_dtype, sparse_prefill=False)
    fns = _steps(sparse)
    assert len(fns) == sparse.sparse_prefill_parts >= 2 and all(f.gated for f in fns) and not _steps(dense)
    # "weights": the dense GEMMs take few-row prompts in float16 (x rounded, ops.lin; measured 1.2e-3 off), the
    # sparse kernels keep x float32
    assert _rel(sparse.logits(PROMPT), dense.logits(PROMPT)) < (1e-4 if prefill_dtype == "float32" else 5e-3)
    copies = [b for b, _ in sparse.prefill_graph.named_buffers() if b.startswith("sparse_prefill_")]
    assert bool(copies) == (prefill_dtype == "float32")  # "weights": the gate GEMM on the artifact's own rows

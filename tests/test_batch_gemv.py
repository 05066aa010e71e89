"""Kind ``gemv`` (``kernels/batch_gemv.py``): several tokens' dot products with selected rows, each row read once
for all of them. Against a float64 reference, and a token's result independent of how many others it is with."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.kernels import KernelSpec, KernelSpecError, aligned_empty, as_aligned, build_kernel, load_kernel

TOL = 1e-5  # max abs error / max abs reference: float32 accumulation over float16 / float32 weights


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gemv_matches_reference_and_is_batch_invariant(tmp_path: Path, dtype: str) -> None:
    rows, d = 72, 96
    spec = KernelSpec(kind="gemv", act="none", d_model=d, n_rows=rows, weight_dtype=dtype, has_bias=False,  # type: ignore[arg-type]
                      target="llvm")
    kern = load_kernel(build_kernel(spec, tmp_path), spec)
    g = torch.Generator().manual_seed(0)
    w = as_aligned(torch.randn(rows, d, generator=g).to(getattr(torch, dtype)))  # [n_rows, d_model]
    xs = torch.randn(9, d, generator=g)  # [9, d_model]
    idx = torch.tensor([0, 3, 4, 17, 40, 41, 71], dtype=torch.int32)
    alone = []
    for i in range(xs.shape[0]):
        y1 = aligned_empty((1, idx.numel()))
        kern(as_aligned(xs[i:i + 1].clone()), w, idx, y1)
        alone.append(y1[0])
    for t in (1, 2, 3, 4, 5, 6, 7, 9):  # tiles of 4, 2 and 1 tokens
        y = aligned_empty((t, idx.numel()))  # [t, k]
        kern(as_aligned(xs[:t].clone()), w, idx, y)
        ref = xs[:t].double() @ w.double()[idx.long()].T
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < TOL
        for i in range(t):  # bit for bit what the token gets alone
            assert torch.equal(y[i], alone[i])
    empty = aligned_empty((3, 0))
    kern(as_aligned(xs[:3].clone()), w, torch.zeros(0, dtype=torch.int32), empty)  # k = 0: nothing to do


def test_gemv_spec_limits() -> None:
    with pytest.raises(KernelSpecError, match="gemv"):
        KernelSpec(kind="gemv", act="none", d_model=64, n_rows=8, weight_dtype="int8", has_bias=False, target="llvm")
    with pytest.raises(KernelSpecError, match="gemv"):
        KernelSpec(kind="gemv", act="relu", d_model=64, n_rows=8, weight_dtype="float16", has_bias=False, target="llvm")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gemv_down_matches_reference_and_is_batch_invariant(tmp_path: Path, dtype: str) -> None:
    rows, d = 40, 128
    spec = KernelSpec(kind="gemv_down", act="none", d_model=d, n_rows=rows, weight_dtype=dtype, has_bias=False,  # type: ignore[arg-type]
                      target="llvm")
    kern = load_kernel(build_kernel(spec, tmp_path), spec)
    g = torch.Generator().manual_seed(1)
    w = as_aligned(torch.randn(rows, d, generator=g).to(getattr(torch, dtype)))  # [n_rows, d_model] (w_down_t)
    idx = torch.tensor([1, 2, 5, 8, 9, 10, 11, 12, 13, 20, 21, 30, 39], dtype=torch.int32)  # 13: a group and a rest
    hs = torch.randn(9, idx.numel(), generator=g)  # [9, k]
    hs[0, 3] = 0.0
    alone = []
    for i in range(hs.shape[0]):
        y1 = aligned_empty((1, d))
        kern(as_aligned(hs[i:i + 1].clone()), w, idx, y1)
        alone.append(y1[0])
    for t in (1, 2, 3, 4, 5, 8, 9):
        y = aligned_empty((t, d))  # [t, d_model]
        kern(as_aligned(hs[:t].clone()), w, idx, y)
        ref = hs[:t].double() @ w.double()[idx.long()]
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < TOL
        for i in range(t):
            assert torch.equal(y[i], alone[i])
    y = aligned_empty((2, d)).fill_(7.0)
    kern(aligned_empty((2, 0)), w, torch.zeros(0, dtype=torch.int32), y)  # k = 0: y = 0
    assert bool((y == 0).all())


@pytest.mark.parametrize("rows,d", [(40, 2048), (24, 192)])
def test_gemv_one_token_equals_the_float16_gemv_kernel(tmp_path: Path, rows: int, d: int) -> None:
    """The server's batched linear takes the one-token ``up`` kernel for a lone float16 token
    (``runtime/batch.py``, ``_linear_rows``): it must give what ``gemv`` gives that token in a batch, bit for bit."""
    up = KernelSpec(kind="up", act="none", d_model=d, n_rows=rows, weight_dtype="float16", has_bias=False, target="llvm")
    gv = KernelSpec(kind="gemv", act="none", d_model=d, n_rows=rows, weight_dtype="float16", has_bias=False, target="llvm")
    k_up, k_gv = (load_kernel(build_kernel(s, tmp_path), s) for s in (up, gv))
    g = torch.Generator().manual_seed(2)
    w = as_aligned(torch.randn(rows, d, generator=g).half())
    xs = torch.randn(5, d, generator=g)
    idx = torch.arange(rows, dtype=torch.int32)
    batch = aligned_empty((5, rows))
    k_gv(as_aligned(xs.clone()), w, idx, batch)
    for i in range(5):
        y = aligned_empty((rows,))
        k_up(as_aligned(xs[i].clone()), w, None, None, idx, y)
        assert torch.equal(y, batch[i])

"""Kind ``gemv`` (``kernels/batch_gemv.py``): several tokens' dot products with selected rows, each row read once
for all of them. Against a float64 reference, and a token's result independent of how many others it is with."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.kernels import KernelSpec, KernelSpecError, aligned_empty, as_aligned, build_kernel, load_kernel

TOL = 1e-5  # max abs error / max abs reference: float32 accumulation over float16 / float32 weights


@pytest.mark.parametrize("dtype,lanes", [("float16", 0), ("float32", 0), ("float32", 64), ("float16", 16)])
def test_gemv_matches_reference_and_is_batch_invariant(tmp_path: Path, dtype: str, lanes: int) -> None:
    rows, d = 72, 192
    spec = KernelSpec(kind="gemv", act="none", d_model=d, n_rows=rows, weight_dtype=dtype, has_bias=False,  # type: ignore[arg-type]
                      target="llvm", lanes=lanes)
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
    with pytest.raises(KernelSpecError, match="lanes"):
        KernelSpec(kind="gemv", act="none", d_model=96, n_rows=8, weight_dtype="float16", has_bias=False,
                   target="llvm", lanes=64)  # 64 does not divide 96
    with pytest.raises(KernelSpecError, match="lanes"):
        KernelSpec(kind="gemv_down", act="none", d_model=128, n_rows=8, weight_dtype="float16", has_bias=False,
                   target="llvm", lanes=32)
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


@pytest.mark.parametrize("dtype,rank", [("float16", 128), ("float32", 128), ("float16", 48)])
def test_batched_predictor_masks_are_the_predict_kernels(tmp_path: Path, dtype: str, rank: int) -> None:
    """The serving batch's predictor (two ``gemv`` calls, ``runtime/batch_predict.py``) forms each score as the
    one-token ``predict`` kernel does, bit for bit: with the threshold set to any one of the batch's scores, the
    kernel's mask of that token is the batch's (a score one rounding off would flip its own bit)."""
    from picompile.runtime.batch_predict import batched_predict

    d, n = 256, 160
    dt = getattr(torch, dtype)
    spec = KernelSpec(kind="predict", act="relu", d_model=d, n_rows=n, weight_dtype=dtype, has_bias=True,  # type: ignore[arg-type]
                      target="llvm", rank=rank)
    kern = load_kernel(build_kernel(spec, tmp_path), spec)
    g = torch.Generator().manual_seed(3)
    fc1 = as_aligned((torch.randn(rank, d, generator=g) / 16).to(dt))
    fc2 = as_aligned((torch.randn(n, rank, generator=g) / 8).to(dt))
    offset = torch.randn(n, generator=g) * 0.1
    xs = torch.randn(3, 1, d, generator=g)
    scores = _scores(xs, fc1, fc2, offset)  # [3, n]: the batch's own, recovered by bisecting its masks
    for t in range(3):
        for j in (0, 7, 80, n - 1):
            thr = float(scores[t, j])
            batch = batched_predict(xs, fc1, fc2, thr, "relu", offset)  # [3, 1, n] bool
            mask = torch.empty(n, dtype=torch.int8)
            kern(as_aligned(xs[t].reshape(d).clone()), fc1, fc2, offset, torch.tensor([thr]), mask)
            assert torch.equal(mask.bool(), batch[t].reshape(n)), (t, j)
            assert not bool(batch[t].reshape(n)[j])  # its own score is not above itself


def _scores(xs: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """fc2 relu(fc1 x) + offset for each token, in float32 as the gemv kernels compute them."""
    from picompile.kernels.spec import dot_lanes
    from picompile.runtime.batch_predict import multi_gemv_kernel

    b, d = xs.shape[0], xs.shape[-1]
    rank, n = fc1.shape[0], fc2.shape[0]
    name = str(fc1.dtype).removeprefix("torch.")
    h, s = aligned_empty((b, rank)), aligned_empty((b, n))
    k1 = multi_gemv_kernel(rank, d, fc1.dtype, lanes=dot_lanes(d, name))
    k2 = multi_gemv_kernel(n, rank, fc2.dtype, lanes=dot_lanes(rank, name))
    if k1 is None or k2 is None:  # a rank the gemv kernel does not take: its fallback's scores, by float64
        return ((xs.reshape(b, d).double() @ fc1.double().T).relu() @ fc2.double().T + offset.double()).float()
    k1(as_aligned(xs.reshape(b, d).clone()), fc1, torch.arange(rank, dtype=torch.int32), h)
    h.relu_()
    k2(h, fc2, torch.arange(n, dtype=torch.int32), s)
    return s + offset

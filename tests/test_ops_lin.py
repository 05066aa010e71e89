"""picompile.ir.ops.lin: a float16 weight times float32 activations, on every path it takes.

On CPUs without a native float16 GEMM, a transposed float16 weight (the sparse FFN's down rows in prefill,
``w_down_t.t()``) or many rows of x widen the weight to float32 for the call; the result must match the
float64 product as the native path does, and be no worse than it.
"""
from __future__ import annotations

import pytest
import torch

from picompile.ir import ops


def _case(rows: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)  # [rows, d_in]
    w = torch.randn(80, 96, generator=gen).half()  # [d_out, d_in]
    w = w.t().contiguous().t() if transposed else w  # the same values, column-major storage
    b = torch.randn(80, generator=gen)
    return x, w, b


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rows", [1, ops.WIDEN_ROWS - 1, ops.WIDEN_ROWS, 64])
@pytest.mark.parametrize("native", [False, True])
def test_lin_matches_float64_on_every_path(rows: int, transposed: bool, native: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "native_half_gemm", lambda: native)
    x, w, b = _case(rows, transposed)
    assert w.is_contiguous() != transposed
    ref = (x.double() @ w.double().t() + b.double()).float()  # [rows, d_out]
    out = ops.lin(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (rows, 80)
    widened = not native and (transposed or rows >= ops.WIDEN_ROWS)
    # float32 accumulation of float16 weights: exact to float32 rounding; the native path also rounds x to float16
    tol = 1e-4 if widened else 2e-2
    assert torch.allclose(out, ref, rtol=0, atol=tol * ref.abs().max().item()), (out - ref).abs().max()


def test_bfloat16_weights_are_never_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bfloat16 prefill (runtime/compute_dtype.py) exists to run bfloat16 GEMMs: lin keeps them."""
    monkeypatch.setattr(ops, "native_half_gemm", lambda: False)
    seen: list[torch.dtype] = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: seen.append(w.dtype) or real(x, w, b))
    x, w, _ = _case(64, transposed=True)
    ops.lin(x, w.bfloat16())
    ops.lin(x, w)
    assert seen == [torch.bfloat16, torch.float32]

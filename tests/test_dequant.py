"""Kind ``dequant`` (``kernels/dequant.py``): a stored weight's bfloat16 values, bit for bit those of
``qformat.dequantize(q, s).to(torch.bfloat16)`` (float16: ``w.to(torch.bfloat16)``) for every format and block,
with AVX512-BF16's conversion instruction and with TVM's own cast (a target without it); and the buffer that
streamed prefill converts into (``runtime/prefill_stream.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.kernels import KernelSpec, KernelSpecError, as_aligned, build_kernel, load_kernel
from picompile.kernels.qformat import QFormat, dequantize, quantize


def _weight(fmt: str, block: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(w, s, want): a stored weight with outliers, zeros and a denormal-range float16 value, and its bfloat16 values."""
    g = torch.Generator().manual_seed(rows + cols + block)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :block] = 0.0  # an all-zero block: scale 0
    w[1, 3] = 40.0  # an outlier
    if fmt == "float16":
        w[2, 5] = 3e-7  # a float16 subnormal
        w16 = w.half()
        return as_aligned(w16), None, w16.to(torch.bfloat16)
    q, s = quantize(w, QFormat(fmt, block))
    return as_aligned(q), as_aligned(s), dequantize(q, s).to(torch.bfloat16)


@pytest.mark.parametrize("mcpu", [None, "x86-64-v3"])  # this CPU's (AVX512-BF16 here), and one without it
@pytest.mark.parametrize("fmt,block", [("float16", 32), ("int8", 32), ("int8", 64), ("int4", 32), ("int4", 64),
                                       ("int4", 128)])
def test_dequant_is_bit_exact(tmp_path: Path, fmt: str, block: int, mcpu: str | None) -> None:
    from picompile.kernels import cpu

    if mcpu is not None and "x86" not in cpu.host_target().attrs.get("mtriple", "x86_64"):
        pytest.skip("an x86-64 target name on another architecture")
    cols = 256
    spec = KernelSpec(kind="dequant", act="none", d_model=cols, n_rows=1, weight_dtype=fmt,  # type: ignore[arg-type]
                      has_bias=False, target="llvm", block=block)
    kern = load_kernel(build_kernel(spec, tmp_path, mcpu=mcpu), spec)
    for rows in (3, 7, 40):  # rows are symbolic: one kernel for every weight of this width
        w, s, want = _weight(fmt, block, rows, cols)
        out = as_aligned(torch.full((rows, cols), float("nan"), dtype=torch.bfloat16))
        kern(w, s, out) if s is not None else kern(w, out)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (fmt, block, rows)


def test_dequant_spec_limits() -> None:
    base = dict(kind="dequant", act="none", d_model=64, has_bias=False, target="llvm")
    KernelSpec(n_rows=1, weight_dtype="int4", **base)  # type: ignore[arg-type]
    for bad in (dict(n_rows=8, weight_dtype="int4"), dict(n_rows=1, weight_dtype="float32")):
        with pytest.raises(KernelSpecError, match="dequant"):
            KernelSpec(**bad, **base)  # type: ignore[arg-type]


def test_scratch_converts_without_a_kernel() -> None:
    """A width with no kernel (not a multiple of 32) converts with torch: the same values; the buffer is reused,
    grown only for a larger weight, and the FFN's [up; gate] block is one contiguous view."""
    from picompile.runtime.prefill_stream import Scratch

    sc = Scratch()
    w = torch.randn(10, 48).half()  # 48 columns: no kernel
    q, s = quantize(torch.randn(6, 64), QFormat("int4"))
    a = sc.bf16(w, None)
    assert torch.equal(a, w.to(torch.bfloat16)) and sc.buf is not None
    buf = sc.buf
    b = sc.bf16(q, s, offset=0)
    assert torch.equal(b, dequantize(q, s).to(torch.bfloat16)) and sc.buf is buf  # 6·64 < 10·48: reused
    big = sc.bf16(torch.randn(64, 64).half(), None)
    assert sc.buf is not buf and sc.buf.numel() >= big.numel()

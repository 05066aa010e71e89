"""Prefill's bfloat16 GEMMs without bfloat16 copies: each weight converted per call into one reused buffer.

``prefill_dtype="bfloat16-stream"`` (``runtime/compute_dtype.py``): a linear → a ``StreamedLinear`` call on the
same stored weights (float16, int8 / int4; float32 ones convert with torch); an FFN part → a ``StreamedFFN`` call. Each call
first converts its weights to bfloat16 into a ``Scratch`` buffer with the ``dequant`` kernel
(``kernels/dequant.py``: memory speed, ~1 ms for a [5632, 2048] weight on two cores, bit-equal to the copy's
values), then runs the GEMMs the copies would (``ops.lin``, ``PrefillFFN``). The memory is the largest weight's
bfloat16 size (an FFN part's up, gate and down rows: 0.27 GB for a 7B layer), not the model's again; the price is
the conversion, once per weight per prompt chunk: about +35 % of a [5632, 2048] GEMM's time at 64 tokens, +5 % at
512 (``benchmarks/README.md``, "Float16 prefill").
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import Tensor

from picompile.ir.ops import deq, lin
from picompile.runtime.prefill_gemm import PrefillFFN

_KERNEL_FORMATS: dict[torch.dtype, str] = {torch.float16: "float16", torch.int8: "int8", torch.uint8: "int4"}


def _weight_format(w: Tensor, s: Optional[Tensor]) -> tuple[str, int, int]:
    """(format, columns, block) of a stored weight: float16 (float32 too: no kernel), or quants ``w`` with float16
    scales ``s``."""
    fmt = _KERNEL_FORMATS.get(w.dtype, str(w.dtype).removeprefix("torch."))
    cols = int(w.shape[1]) * (2 if fmt == "int4" else 1)
    return fmt, cols, (cols // int(s.shape[1]) if s is not None else 32)


class Scratch:
    """The bfloat16 buffer streamed weights are converted into (grown to the largest call's need, then reused)
    and the ``dequant`` kernels, one per (format, width, block), built or taken from the kernel cache at load
    (``prepare``); a weight without one (a width not a multiple of 32; no compiler here) converts with torch
    (``deq(w, s).to(bfloat16)``: the same values, slower). Calls of one graph hold its lock: one buffer."""

    def __init__(self) -> None:
        self.buf: Tensor | None = None  # [n] bfloat16, 64-byte aligned
        self.kernels: dict[tuple[str, int, int], Any] = {}
        self.lock = threading.Lock()

    def prepare(self, w: Tensor, s: Optional[Tensor]) -> None:
        """Build (or find in the cache) the kernel for ``w``'s format; None where there is none."""
        if w.dim() != 2:
            return
        key = _weight_format(w, s)
        if key in self.kernels:
            return
        fmt, cols, block = key
        kern = None
        if w.dtype in _KERNEL_FORMATS and cols % 32 == 0:
            from picompile.config import kernel_cache_dir
            from picompile.kernels import KernelSpec, build_kernel, load_kernel

            try:
                spec = KernelSpec(kind="dequant", act="none", d_model=cols, n_rows=1, weight_dtype=fmt,  # type: ignore[arg-type]
                                  has_bias=False, target="llvm", block=block)
                kern = load_kernel(build_kernel(spec, kernel_cache_dir()), spec)
            except Exception:  # noqa: BLE001 - no compiler / no schedule: the torch conversion below
                kern = None
        self.kernels[key] = kern

    def reserve(self, n: int) -> Tensor:
        """The buffer, grown to at least ``n`` elements (what it held is lost when it grows)."""
        if self.buf is None or self.buf.numel() < n:
            from picompile.kernels import aligned_empty

            self.buf = None  # the old buffer goes before the larger one comes
            self.buf = aligned_empty((n,), dtype=torch.bfloat16)
        return self.buf

    def bf16(self, w: Tensor, s: Optional[Tensor], offset: int = 0) -> Tensor:
        """``w`` (with its scales ``s``) as bfloat16 ``[rows, cols]`` in the buffer from element ``offset`` (a
        multiple of 32: the view stays 64-byte aligned); valid until the next call that writes there. The caller
        ``reserve``s first where it keeps earlier views."""
        key = _weight_format(w, s)
        rows, cols = int(w.shape[0]), key[1]
        out = self.reserve(offset + rows * cols)[offset:offset + rows * cols].view(rows, cols)  # [rows, cols]
        if rows == 0:
            return out
        if key not in self.kernels:
            self.prepare(w, s)
        kern = self.kernels.get(key)
        if kern is not None and w.is_contiguous() and (s is None or s.is_contiguous()):
            kern(w, s, out) if s is not None else kern(w, out)
        else:
            out.copy_(deq(w, s))  # float32 (or float16) → bfloat16, rounded as the kernel rounds
        return out


def _padded(n: int) -> int:
    return (n + 31) // 32 * 32


class StreamedLinear:
    """``lin(x, bf16(w, s), b)``: picompile::linear on a bfloat16 weight, the weight converted for this call."""

    __name__ = "streamed_linear"  # fx's code generation names the call after it

    def __init__(self, scratch: Scratch, input_major: bool = False) -> None:
        self.scratch = scratch
        self.input_major = input_major  # w is an input-sparse linear's w_t [d_in, d_out] (its GEMM reads wᵀ)

    @torch.compiler.disable  # a compiled step calls it as it is (a TVM kernel and a lock inside)
    def __call__(
        self,
        x: Tensor,  # [..., d_in] float32
        w: Tensor,  # [d_out, d_in] float16 / float32, or int8 / int4 quants ([d_in, d_out] when input_major)
        b: Optional[Tensor],  # [d_out] float32
        s: Optional[Tensor],  # [d_out, d_in / block] float16 scales, None for float16 weights
    ) -> Tensor:
        with self.scratch.lock:
            wb = self.scratch.bf16(w, s)
            y = lin(x, wb.t() if self.input_major else wb, None)  # [..., d_out]
        return y if b is None else y + b

    def __repr__(self) -> str:
        return f"StreamedLinear(input_major={self.input_major})"


class StreamedFFN:
    """One FFN part for several tokens as ``PrefillFFN`` computes it on packed copies, its up and gate rows
    converted into one ``[up; gate]`` block of the buffer and its down rows after them, for this call."""

    def __init__(self, scratch: Scratch, layer: int, act: str, n_ff: int, gated: bool, down_t: bool) -> None:
        self.scratch = scratch
        self.layer = layer
        self.act = act
        self.gated = gated
        self.down_t = down_t  # the down weight is w_down_t [k, d_model] (else w_down [d_model, k])
        self.gemms = PrefillFFN(layer, act, n_ff, gated)  # the packed copies' maths on the converted rows
        self.__name__ = f"streamed_ffn_{layer}"

    @torch.compiler.disable  # as StreamedLinear
    def __call__(
        self,
        x: Tensor,  # [..., d_model] float32
        w_up: Tensor, s_up: Optional[Tensor],  # [k, d_model]
        w_gate: Optional[Tensor], s_gate: Optional[Tensor],  # [k, d_model]
        b_up: Optional[Tensor],  # [k]
        w_down: Tensor, s_down: Optional[Tensor],  # [k, d_model] (down_t) or [d_model, k]
        bias: Optional[Tensor],  # [d_model] float32
    ) -> Tensor:
        sc = self.scratch
        k, d = int(w_up.shape[0]), int(x.shape[-1])
        n_in = (2 if self.gated else 1) * k * d
        with sc.lock:
            buf = sc.reserve(_padded(n_in) + k * d)  # [up; gate] then the down rows
            sc.bf16(w_up, s_up)  # [k, d_model]
            if self.gated:
                assert w_gate is not None
                sc.bf16(w_gate, s_gate, offset=k * d)  # right after up: [up; gate] is one [2k, d_model] block
            w_in = buf[:n_in].view(-1, d)  # [2k | k, d_model]
            down = sc.bf16(w_down, s_down, offset=_padded(n_in))
            w_out = down.t() if self.down_t else down  # [d_model, k]
            return self.gemms(x, w_in, None if b_up is None else b_up.float(), w_out, bias)

    def __repr__(self) -> str:
        return f"StreamedFFN(layer={self.layer}, act={self.act}, gated={self.gated})"

"""How fast this machine's GEMMs run on a model's prefill shape, beside what prefill achieved (``bench``).

``probe_gemm(rows, d_model, n_out)``: GFLOP/s of torch's GEMM ``[rows, d_model] × [n_out, d_model]ᵀ`` on
weights stored in each dtype with a fast path here (float32 always; bfloat16 with AMX or AVX512-BF16; float16
with a native float16 GEMM), medians of a few calls. ``prefill_gemm_rate``: the GFLOP/s a prefill ran its
GEMMs at, from its tokens/s and the model's GEMM FLOPs per token (``ModelShape``; attention's matmuls left out;
lm_head counted once per prompt: generation computes the last position's logits only).
``picompile bench`` reports both; a prefill far below the probe's best rate means a GEMM path (a layout, a dtype
conversion per call) loses what the machine has.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from picompile.tools.model_shapes import shape_from_hf_config


def _dtypes() -> list[torch.dtype]:
    from picompile.ir.ops import native_half_gemm

    out = [torch.float32]
    if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
        out.append(torch.bfloat16)
    if native_half_gemm():
        out.append(torch.float16)
    return out


def probe_gemm(rows: int, d_model: int, n_out: int, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s per weight dtype (``"float32"``, ``"bfloat16"``, …) of ``[rows, d_model] × [n_out, d_model]ᵀ``,
    activations rounded to the weights' dtype as prefill does; each the median of ``repeats`` calls."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_model, generator=gen)  # [rows, d_model]
    w = torch.randn(n_out, d_model, generator=gen) * 0.02  # [n_out, d_model]
    out: dict[str, float] = {}
    for dtype in _dtypes():
        wd, xd = w.to(dtype), x.to(dtype)
        torch.nn.functional.linear(xd, wd)  # warm: oneDNN's primitive for this shape
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            times.append(time.perf_counter() - start)
        out[str(dtype).removeprefix("torch.")] = 2 * rows * d_model * n_out / statistics.median(times) / 1e9
    return out


def gemm_flop_per_token(config: dict[str, Any]) -> float:
    """The FLOPs of a token's linear layers and FFN (2 per weight: q/k/v/o, FFN, lm_head) for a HF config."""
    shape = shape_from_hf_config(config)
    return 2.0 * (shape.n_layers * (shape.attention_params + shape.ffn_params) + shape.lm_head_params)


def prefill_gemm_rate(config: dict[str, Any], prompt_len: int, prefill_tokens_per_s: float) -> dict[str, Any]:
    """The probe on this model's FFN shape at ``prompt_len`` rows, and the rate prefill ran its GEMMs at."""
    shape = shape_from_hf_config(config)
    probe = probe_gemm(prompt_len, shape.d_model, shape.d_ffn)
    flop = gemm_flop_per_token(config)
    # generation's prefill (what bench times) computes lm_head for the last position only (runtime/logit_rows.py)
    lm_head = 2.0 * shape.lm_head_params
    per_prefill = prompt_len * (flop - lm_head) + lm_head
    return {"gemm_probe_gflops": probe, "gemm_flop_per_token": flop,
            "prefill_gemm_gflops": prefill_tokens_per_s * per_prefill / max(prompt_len, 1) / 1e9}

"""Benchmark the input-sparse linear kernel (kind ``input_sparse``) against the dense GEMV of the same weights.

    python benchmarks/input_sparse.py [--shapes 2048x2048,2048x5632] [--dtype float16] [--rounds 60]

For each ``d_in x d_out`` projection, one token: the dense TVM GEMV (kind ``up``, act ``none``, every row: how
``lower-tvm`` runs a linear layer, weight ``[d_out, d_in]``) against the input-sparse kernel over the same weights
input-major (``[d_in, d_out]``), at 0 / 25 / 40 / 50 % of the input channels below the threshold (the channels
with the smallest |x|, x normal). The weights are rotated over copies totalling ``--rotate-mib`` so every call
reads DRAM; the methods are interleaved call by call (load from other processes hits both alike) and medians
are reported, with the dense GEMV's GB/s and the speed-up. Not a test.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: see picompile/__init__.py

import argparse
import statistics
import time
from pathlib import Path

import torch

from picompile.config import kernel_cache_dir
from picompile.kernels import KernelSpec, aligned_empty, as_aligned, build_kernel, load_kernel

SPARSITIES: tuple[float, ...] = (0.0, 0.25, 0.40, 0.50)


def bench_shape(d_in: int, d_out: int, dtype: str, rounds: int, rotate_mib: int) -> list[dict[str, float]]:
    tdt = getattr(torch, dtype)
    cache = kernel_cache_dir()
    gemv = KernelSpec(kind="up", act="none", d_model=d_in, n_rows=d_out, weight_dtype=dtype, has_bias=False,
                      target="llvm")
    isl = KernelSpec(kind="input_sparse", act="none", d_model=d_out, n_rows=d_in, weight_dtype=dtype,
                     has_bias=False, target="llvm")
    g, k = load_kernel(build_kernel(gemv, cache), gemv), load_kernel(build_kernel(isl, cache), isl)
    nbytes = d_in * d_out * tdt.itemsize
    copies = max(2, (rotate_mib << 20) // nbytes)
    gen = torch.Generator().manual_seed(0)
    ws = [as_aligned((torch.randn(d_out, d_in, generator=gen) * 0.02).to(tdt)) for _ in range(copies)]  # [d_out, d_in]
    wts = [as_aligned(w.t().contiguous()) for w in ws]  # [d_in, d_out]
    x = as_aligned(torch.randn(d_in, generator=gen))
    rows = torch.arange(d_out, dtype=torch.int32)
    y = aligned_empty(d_out)
    out = []
    for s in SPARSITIES:
        thr = float(x.abs().quantile(s)) if s > 0 else -1.0
        mask = (x.abs() > thr).to(torch.int8)  # [d_in]
        k(x, mask, wts[0], y)
        ref = (x * mask) @ wts[0].float()
        assert float((y - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), "kernel disagrees with torch"
        dense, sparse = [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            g.unchecked(x, ws[r % copies], None, None, rows, y)
            t1 = time.perf_counter()
            k.unchecked(x, mask, wts[(r + copies // 2) % copies], y)
            t2 = time.perf_counter()
            dense.append(t1 - t0)
            sparse.append(t2 - t1)
        d, sp = statistics.median(dense[5:]), statistics.median(sparse[5:])
        out.append({"sparsity": s, "dense_us": d * 1e6, "sparse_us": sp * 1e6, "dense_gbs": nbytes / d / 1e9,
                    "speedup": d / sp, "bound": 1.0 / max(1e-9, 1.0 - s)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x2048,2048x5632")
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--rotate-mib", type=int, default=192)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"| shape ({a.dtype}) | sparsity | dense GEMV µs (GB/s) | input-sparse µs | speed-up | bound 1/(1-s) |")
    print("|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        d_in, d_out = (int(v) for v in shape.split("x"))
        for r in bench_shape(d_in, d_out, a.dtype, a.rounds, a.rotate_mib):
            print(f"| {d_in} → {d_out} | {r['sparsity']:.2f} | {r['dense_us']:.0f} ({r['dense_gbs']:.1f}) | "
                  f"{r['sparse_us']:.0f} | {r['speedup']:.2f}× | {r['bound']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()

"""The serving step's ``gemv`` / ``gemv_down`` kernels (``kernels/batch_gemv.py``) at 1, 2, 4 and 8 tokens: time
and bandwidth.

    python benchmarks/batch_gemv.py [--kind gemv|gemv_down] [--shapes 2048x2048,5632x2048,32000x2048]
                                    [--rows-fraction 1.0] [--tokens 1,2,4,8] [--dtype float16] [--rounds 40]
                                    [--rotate-mib 160]

``--kind gemv_down``: the union FFN's down sums (``y [T, d_model] = h [T, k] · w_down_t[idx]``), shape ``n_rows x
d_model`` as for ``gemv`` (rows of the input-major down weight).

Per shape (``n_rows x d_model``) the kernel the server builds (``runtime/batch_predict.multi_gemv_kernel``), over
every row (a linear layer) or a sorted random ``--rows-fraction`` of them (the union FFN's rows), for each token
count: the median call time over ``--rounds`` calls, the token counts interleaved call by call and each call on
the next of enough weight copies (``--rotate-mib``) that the rows come from memory, not from the last level cache.
Reported: µs, weight GB/s, and the time against one token's (a batch of T tokens reading each row once should
cost about one token's time while the kernel is memory-bound).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from picompile.kernels import aligned_empty, as_aligned
from picompile.runtime.batch_predict import multi_gemv_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x2048,256x2048,5632x2048,32000x2048", help="n_rows x d_model, comma-separated")
    ap.add_argument("--rows-fraction", type=float, default=1.0, help="the share of rows selected (sorted, random)")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--kind", choices=["gemv", "gemv_down"], default="gemv")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rotate-mib", type=int, default=160, help="weight copies rotated per call, in MiB")
    args = ap.parse_args()
    if not 0 < args.rows_fraction <= 1 or args.rounds < 5:
        raise SystemExit("--rows-fraction must be in (0, 1] and --rounds at least 5")
    dtype = getattr(torch, args.dtype)
    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':>12} {'rows':>6} " + " ".join(f"{f'T={t} µs (GB/s, ×T=1)':>26}" for t in tokens))
    for shape in args.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        kern = multi_gemv_kernel(n, d, dtype, args.kind)
        if kern is None:
            raise SystemExit(f"no {args.kind} kernel for {shape} {args.dtype} here")
        size = n * d * dtype.itemsize
        copies = max(3, args.rotate_mib * 2**20 // size + 1)
        ws = [torch.randn(n, d, generator=g).to(dtype) for _ in range(copies)]  # [n_rows, d_model] each
        if args.rows_fraction == 1:
            idx = torch.arange(n, dtype=torch.int32)
        else:
            idx = torch.randperm(n, generator=g)[: max(1, int(n * args.rows_fraction))].sort().values.to(torch.int32)
        k = idx.numel()
        if args.kind == "gemv":
            xs = {t: as_aligned(torch.randn(t, d, generator=g)) for t in tokens}  # [T, d_model]
            ys = {t: aligned_empty((t, k)) for t in tokens}  # [T, k]
        else:  # gemv_down: h [T, k] in, y [T, d_model] out
            xs = {t: as_aligned(torch.randn(t, k, generator=g)) for t in tokens}
            ys = {t: aligned_empty((t, d)) for t in tokens}
        times: dict[int, list[float]] = {t: [] for t in tokens}
        call = 0
        for _ in range(args.rounds):
            for t in tokens:
                w = ws[call % copies]
                call += 1
                t0 = time.perf_counter()
                kern.unchecked(xs[t], w, idx, ys[t])
                times[t].append(time.perf_counter() - t0)
        med = {t: statistics.median(v[3:]) for t, v in times.items()}
        read = idx.numel() * d * dtype.itemsize
        cells = [f"{med[t] * 1e6:8.0f} ({read / med[t] / 1e9:5.1f}, {med[t] / med[tokens[0]]:4.2f})" for t in tokens]
        print(f"{shape:>12} {idx.numel():>6} " + " ".join(f"{c:>26}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

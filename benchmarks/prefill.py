"""Prefill of a float16 artifact with lin's float32 widening on and off, side by side in one process.

    python benchmarks/prefill.py ART [--prompt-len 64,512] [--rounds 5]

On CPUs without a native float16 GEMM (``picompile.ir.ops.native_half_gemm``: AMD EPYC, Intel without AMX),
``ops.lin`` widens a float16 weight to float32 for a call with a transposed weight or ``WIDEN_ROWS``+ rows
of x; ``--off`` is torch's float16 GEMM for every call, as before. Each round runs one prefill of each
setting (interleaved; medians), from an empty KV cache, the same seeded prompt; prompt logits are
compared between the two. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import picompile
from picompile.ir import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--prompt-len", default="64,512", help="comma-separated prompt lengths (default 64,512)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    session = picompile.load(args.artifact)
    print(f"native float16 GEMM on this CPU: {ops.native_half_gemm()}; torch threads {torch.get_num_threads()}")
    for n in (int(v) for v in args.prompt_len.split(",")):
        ids = torch.randint(0, session.manifest.model["config"]["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
        times: dict[str, list[float]] = {"widen": [], "float16": []}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, native in (("widen", ops.native_half_gemm()), ("float16", True)):
                real = ops.native_half_gemm
                ops.native_half_gemm = (lambda v=native: v)  # type: ignore[assignment]
                try:
                    start = time.perf_counter()
                    logits[name] = session.logits(ids)
                    times[name].append(time.perf_counter() - start)
                finally:
                    ops.native_half_gemm = real  # type: ignore[assignment]
        med = {k: statistics.median(v) for k, v in times.items()}
        rel = ((logits["widen"] - logits["float16"]).abs().max() / logits["float16"].abs().max()).item()
        print(f"prompt {n}: widen {n / med['widen']:.1f} tok/s, float16 {n / med['float16']:.1f} tok/s "
              f"({med['float16'] / med['widen']:.2f}x); logits max rel diff {rel:.2e}")


if __name__ == "__main__":
    main()

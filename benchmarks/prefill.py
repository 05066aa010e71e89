"""Prefill of a float16 artifact with lin's float32 widening on and off, side by side in one process.

    python benchmarks/prefill.py ART [--prompt-len 64,512] [--rounds 5]

On CPUs without a native float16 GEMM (``picompile.ir.ops.native_half_gemm``: AMD EPYC, Intel without AMX),
``ops.lin`` widens a float16 weight to float32 for a call with a transposed weight or ``WIDEN_ROWS``+ rows
of x; ``--off`` is torch's float16 GEMM for every call, as before. Each round runs one prefill of each
setting (interleaved; medians), from an empty KV cache, the same seeded prompt; prompt logits are
compared between the two. ``--bf16`` adds the same artifact loaded with ``prefill_dtype="bfloat16"`` (bfloat16
copies of the weights, on CPUs with AMX or AVX512-BF16). Not a test.
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
    ap.add_argument("--bf16", action="store_true", help="add the prefill_dtype=bfloat16 load")
    ap.add_argument("--no-float16", action="store_true", help="skip torch's float16 GEMM (very slow on some CPUs)")
    args = ap.parse_args()
    session = picompile.load(args.artifact)
    bf16 = picompile.load(args.artifact, prefill_dtype="bfloat16") if args.bf16 else None
    print(f"native float16 GEMM on this CPU: {ops.native_half_gemm()}; torch threads {torch.get_num_threads()}")
    for n in (int(v) for v in args.prompt_len.split(",")):
        ids = torch.randint(0, session.manifest.model["config"]["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
        settings = [("widen", session, ops.native_half_gemm())]
        settings += [] if args.no_float16 else [("float16", session, True)]
        settings += [] if bf16 is None else [("bfloat16", bf16, ops.native_half_gemm())]
        times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name, sess, native in settings:
                real = ops.native_half_gemm
                ops.native_half_gemm = (lambda v=native: v)  # type: ignore[assignment]
                try:
                    start = time.perf_counter()
                    logits[name] = sess.logits(ids)
                    times[name].append(time.perf_counter() - start)
                finally:
                    ops.native_half_gemm = real  # type: ignore[assignment]
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = logits["widen"]
        cols = [f"{k} {n / med[k]:.1f} tok/s" + ("" if k == "widen" else
                f" ({med[k] / med['widen']:.2f}x the time; logits max rel diff "
                f"{((logits[k] - ref).abs().max() / ref.abs().max()).item():.2e})") for k in med]
        print(f"prompt {n}: " + "; ".join(cols))

if __name__ == "__main__":
    main()

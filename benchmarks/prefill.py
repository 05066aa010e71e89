"""Prefill of a float16 artifact with lin's float32 widening on and off, side by side in one process.

    python benchmarks/prefill.py ART [--prompt-len 64,512] [--rounds 5] [--settings widen,float16,bfloat16]

On CPUs without a native float16 GEMM (``picompile.ir.ops.native_half_gemm``: AMD EPYC, Intel without AMX),
``ops.lin`` widens a float16 weight to float32 for a call with a transposed weight or ``WIDEN_ROWS``+ rows
of x; ``--off`` is torch's float16 GEMM for every call, as before. Each round runs one prefill of each
setting (interleaved; medians), from an empty KV cache, the same seeded prompt; prompt logits are
compared with the first setting's. ``bfloat16`` is the same artifact loaded with ``prefill_dtype="bfloat16"``
(bfloat16 copies of the weights, on CPUs with AMX or AVX512-BF16). Not a test.
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
    ap.add_argument("--settings", default="widen,float16",
                    help="comma-separated: widen (lin as shipped), float16 (torch's float16 GEMM for every call; very "
                         "slow on some CPUs), bfloat16 (prefill_dtype='bfloat16'); default widen,float16")
    args = ap.parse_args()
    names = [v.strip() for v in args.settings.split(",") if v.strip()]
    unknown = set(names) - {"widen", "float16", "bfloat16"}
    if unknown or not names:
        raise SystemExit(f"--settings: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    session = picompile.load(args.artifact) if {"widen", "float16"} & set(names) else None
    bf16 = picompile.load(args.artifact, prefill_dtype="bfloat16") if "bfloat16" in names else None
    print(f"native float16 GEMM on this CPU: {ops.native_half_gemm()}; torch threads {torch.get_num_threads()}")
    for n in (int(v) for v in args.prompt_len.split(",")):
        any_session = session or bf16
        ids = torch.randint(0, any_session.manifest.model["config"]["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
        sessions = {"widen": (session, ops.native_half_gemm()), "float16": (session, True),
                    "bfloat16": (bf16, ops.native_half_gemm())}
        settings = [(name, *sessions[name]) for name in names]
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
        first = names[0]
        ref = logits[first]
        cols = [f"{k} {n / med[k]:.1f} tok/s" + ("" if k == first else
                f" ({med[k] / med[first]:.2f}x the time; logits max rel diff "
                f"{((logits[k] - ref).abs().max() / ref.abs().max()).item():.2e})") for k in med]
        print(f"prompt {n}: " + "; ".join(cols))

if __name__ == "__main__":
    main()

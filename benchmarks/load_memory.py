"""Resident memory of a load, step by step, then after generating (issue #24: decode RSS ≤ artifact + 1 GiB).

    python benchmarks/load_memory.py ART [--weights copied|mapped] [--prefill-dtype auto|weights|bfloat16|bfloat16-stream] [-n 8]

Prints each load step's seconds and the process's RSS after it (``session.load_seconds`` /
``load_rss_bytes``), the peak RSS (VmHWM) after the load and after ``-n`` greedy tokens from a 4-token prompt,
and the artifact's size beside them. Not a test.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import picompile
from picompile.builder import peak_rss_bytes

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--weights", choices=["copied", "mapped"], default="copied")
    ap.add_argument("--prefill-dtype", default=None, help="auto (default), weights, bfloat16 or bfloat16-stream")
    ap.add_argument("-n", type=int, default=8, help="tokens to generate after the load")
    args = ap.parse_args()
    size = sum(p.stat().st_size for p in args.artifact.rglob("*") if p.is_file())
    t0 = time.perf_counter()
    s = picompile.load(args.artifact, weights=args.weights, prefill_dtype=args.prefill_dtype)
    loaded = time.perf_counter() - t0
    for step, secs in s.load_seconds.items():
        print(f"{step:24s} {secs:7.2f} s   RSS {s.load_rss_bytes.get(step, 0) / GIB:6.2f} GiB")
    print(f"loaded in {loaded:.1f} s, peak RSS {peak_rss_bytes() / GIB:.2f} GiB; prefill: {s.prefill_reason}")
    t0 = time.perf_counter()
    s.generate([1, 450, 4996, 17354], max_new_tokens=args.n)
    print(f"{args.n} tokens in {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_bytes() / GIB:.2f} GiB "
          f"against an artifact of {size / GIB:.2f} GiB (+{(peak_rss_bytes() - size) / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()

"""A/B the eager decode step of several artifacts in one process: alternated rounds, medians.

    python benchmarks/ab_decode.py ART_A ART_B [...] [--rounds 16] [--tokens 24] [--prompt-len 64] [--threads 2]

Each round feeds every artifact (in alternating order) a ``--prompt-len`` prompt, then times ``--tokens`` greedy
decode steps; the medians and each artifact's speed relative to the first are printed. One process and
alternation keep a noisy machine's drift (other tenants' memory traffic) out of the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import picompile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sessions = [(a, picompile.load(a)) for a in args.artifacts]
    times: dict[str, list[float]] = {a: [] for a in args.artifacts}
    for r in range(args.rounds):
        for art, session in sessions if r % 2 == 0 else sessions[::-1]:
            dec = session.decoder()
            logits = dec.feed(list(range(10 + r, 10 + r + args.prompt_len)))
            tok = int(logits[-1].argmax())
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                logits = dec.feed([tok])
                tok = int(logits[-1].argmax())
            times[art].append((time.perf_counter() - t0) / args.tokens)
    base = statistics.median(times[args.artifacts[0]])
    for art in args.artifacts:
        med = statistics.median(times[art])
        print(f"{art}: median {med * 1e3:.3f} ms/token (min {min(times[art]) * 1e3:.3f}), {base / med:.3f}x the first")


if __name__ == "__main__":
    main()

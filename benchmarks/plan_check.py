"""``picompile plan`` against the decode it predicts, side by side: interleaved rounds of the plan's kernel-rate
measurement and the artifact's own decode, one ratio per round, medians.

    python benchmarks/plan_check.py ART [--glue GLUE_ART] [--rounds 5] [--tokens 8] [--prompt-len 16]

Each round measures picompile's GEMV and sparse FFN kernels on ART's shape and dtype
(``costmodel.measure_kernel_rates``, what ``plan --cpu-bandwidth kernel`` does), predicts ART's CPU-only sparse
decode from them (``plan(ART, "cpu", …)``: ART's own profile; the glue per layer measured once on GLUE_ART,
default ART, as ``plan --glue`` does), then times ``--tokens`` greedy decode steps of ART (default load options)
after a ``--prompt-len`` prompt. On a machine whose memory bandwidth moves from one minute to the next (a VM with
neighbours: 28–50 GB/s within minutes here), a plan and a decode measured minutes apart disagree by that much;
measured in the same round they see the same machine. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import picompile  # first: it sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP
from picompile.tools.costmodel import measure_kernel_rates
from picompile.tools.kernel_calls import glue_per_layer
from picompile.tools.plan import plan
from picompile.tools.plan_inputs import Assumptions, load_model_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--glue", type=Path, help="artifact whose step outside its kernels gives the glue (default ART)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    args = ap.parse_args()
    glue = glue_per_layer(args.glue or args.artifact)["glue_per_layer_s"]
    inputs = load_model_inputs(str(args.artifact), Assumptions(), None, None)
    dtype = inputs.default_dtype
    active = inputs.predicted_active_fraction()
    session = picompile.load(args.artifact)
    dec = session.decoder()
    prompt = [(7 * i + 3) % session.vocab_size for i in range(args.prompt_len)]
    first = int(dec.feed(prompt)[-1].argmax())
    print(f"{args.artifact}: {dtype}, predicted active {active:.1%}, glue {glue * 1e3:.2f} ms per layer "
          f"(from {args.glue or args.artifact}); prefill {session.prefill_dtype or 'the weights'}")
    ratios, preds, meas = [], [], []
    for r in range(args.rounds):
        k = measure_kernel_rates(inputs.shape, dtype, active)
        a = Assumptions(cpu_sparse_ffn_share=k["ffn_gbs"] / k["gemv_gbs"], cpu_layer_overhead_s=glue)
        predicted = plan(str(args.artifact), "cpu", cpu_bandwidth=k["gemv_gbs"], assumptions=a)[
            "strategies"]["cpu_sparse"]["tokens_per_s"]
        dec.truncate(args.prompt_len)
        tok = first
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(dec.feed([tok])[-1].argmax())
        measured = args.tokens / (time.perf_counter() - t0)
        ratios.append(predicted / measured)
        preds.append(predicted)
        meas.append(measured)
        print(f"round {r}: GEMV {k['gemv_gbs']:.1f} GB/s, FFN {k['ffn_gbs']:.1f}, read {k['read_gbs']:.1f}; "
              f"plan {predicted:.2f} tok/s, decode {measured:.2f} tok/s, plan / decode {predicted / measured:.2f}")
    print(f"medians: plan {statistics.median(preds):.2f} tok/s, decode {statistics.median(meas):.2f} tok/s, "
          f"plan / decode {statistics.median(ratios):.2f} (range {min(ratios):.2f}–{max(ratios):.2f})")


if __name__ == "__main__":
    main()

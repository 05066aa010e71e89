"""A/B of CPU schedule parameters (``kernels/cpu.py``'s ``CpuScheduleParams``) on one layer shape, side by side.

    python benchmarks/schedules.py ffn [--dtype float16] [--kind ffn_gated] [--selected 0.155] [--firing 0.65]
    python benchmarks/schedules.py gemv [--dtype float16] [--rows 2560]

``ffn``: the fused one-token sparse FFN kernel with ``skip_inactive`` off and on (and 32 lanes), over
``--layers`` copies of a 1B layer (d_model 2048, 5632 neurons; 22 copies, ~1.5 GB in f16: every call
reads its rows from DRAM). Each layer's index list selects ``--selected`` of the rows, of which
``--firing`` fire (the gate, for ``ffn_relu`` up + bias, is positive for that share of them): a trained
predictor's precision. ``gemv``: kind ``up`` over every row (a float16 linear layer) at 64 and 32
lanes, and 32 without the software prefetch of the next row (float32: and torch's ``F.linear``), the weights
rotated over copies totalling ~1 GB, with the copy and the read (a sum) bandwidth measured in the same rounds. Every variant is checked against the first (``ffn`` skip on/off: bit-identical), rounds are interleaved
(A B C, C B A, …) and medians are reported. Not a test.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: see picompile/__init__.py

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from picompile.kernels import KernelSpec, aligned_empty, as_aligned
from picompile.kernels.loader import ensure_runtime


def _compile(spec: KernelSpec, variants: dict[str, dict[str, Any]]) -> dict[str, Callable[..., None]]:
    """One compiled function per variant (same description, different schedule parameters)."""
    import tvm

    from picompile.kernels import compute, cpu

    fns = {}
    for name, changes in variants.items():
        if spec.kind in ("ffn_relu", "ffn_gated"):
            desc = compute.describe_partitioned(spec, cpu.build_cores())
        else:
            desc = compute.describe(spec)
        params = dataclasses.replace(cpu.default_params(spec), **changes)
        sym = f"v_{len(fns)}"
        mod = tvm.IRModule({sym: cpu.as_named(cpu.schedule(desc, spec, params), sym)})
        fns[name] = tvm.compile(mod, target=cpu.host_target())[sym]
    return fns


def _rounds(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Interleaved rounds (reversed every other one); the median of each variant's measure."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            samples[name].append(fns[name]())
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_ffn(args: argparse.Namespace) -> None:
    d, n = args.d_model, args.n_rows
    relu = args.kind == "ffn_relu"
    spec = KernelSpec(kind=args.kind, act="relu", d_model=d, n_rows=n, weight_dtype=args.dtype, has_bias=relu,
                      target="llvm")
    fns = _compile(spec, {"whole rows": {"skip_inactive": False}, "skip inactive": {},
                          "skip inactive, 32 lanes": {"up_lanes": 32, "down_lanes": 32}})
    dt = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    k = int(args.selected * n)
    layers = []
    for _ in range(args.layers):
        w = {name: as_aligned((torch.randn(n, d, generator=gen) / d**0.5).to(dt)) for name in ("up", "gate", "down")}
        b = as_aligned(torch.full((n,), -0.5).to(dt))  # [n]
        x = as_aligned(torch.randn(d, generator=gen))  # [d]
        z = (w["up"].float() @ x + b.float()) if relu else w["gate"].float() @ x  # [n] the deciding value
        pos, neg = (z > 0).nonzero().flatten(), (z <= 0).nonzero().flatten()
        n_pos = int(args.firing * k)
        rows = torch.cat([pos[torch.randperm(len(pos), generator=gen)[:n_pos]],
                          neg[torch.randperm(len(neg), generator=gen)[: k - n_pos]]])
        idx = as_aligned(rows.sort().values.to(torch.int32))  # [k]
        call = [x, w["up"]] + ([] if relu else [w["gate"]]) + ([b] if relu else []) + [w["down"], idx]
        layers.append(call)
    y = aligned_empty((d,), torch.float32)
    ref = None
    for name, fn in fns.items():
        fn(*layers[0], y)
        ref = y.clone() if ref is None else ref
        if "32 lanes" in name:  # another summation order: equal up to rounding
            assert torch.allclose(y, ref, rtol=1e-4, atol=1e-5), f"{name}: output differs from the first variant's"
        else:  # skipping adds exactly nothing: bit-identical
            assert torch.equal(y, ref), f"{name}: output differs from the first variant's"

    def timed(fn: Callable[..., None]) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            for call in layers:
                fn(*call, y)
            return (time.perf_counter() - t0) / len(layers)
        return once

    med = _rounds({k_: timed(fn) for k_, fn in fns.items()}, args.repeats)
    first = next(iter(med.values()))
    rows_read = 2 + (not relu)  # row matrices a selected neuron costs when read whole
    print(f"{args.kind} {args.dtype}, d_model {d}, {n} neurons, {k} selected ({args.selected:.1%}), "
          f"{args.firing:.0%} of them firing; {args.layers} layers, {args.repeats} rounds, medians")
    print(f"  bytes ratio whole/skip: {rows_read / (1 + (rows_read - 1) * args.firing):.2f}")
    for name, t in med.items():
        print(f"  {name:26s} {t * 1e3:7.3f} ms/layer  {first / t:5.2f}x")


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_gemv(args: argparse.Namespace) -> None:
    from picompile.tools.traffic import copy_bandwidth

    d, rows = args.d_model, args.rows
    spec = KernelSpec(kind="up", act="none", d_model=d, n_rows=rows, weight_dtype=args.dtype, has_bias=False,
                      target="llvm")
    fns = _compile(spec, {"64 lanes": {"up_lanes": 64}, "32 lanes": {"up_lanes": 32},
                          "32 lanes, no prefetch": {"up_lanes": 32, "prefetch": False}})
    dt = getattr(torch, args.dtype)
    nbytes = rows * d * dt.itemsize
    copies = [as_aligned((torch.randn(rows, d) * 0.02).to(dt)) for _ in range(max(8, (1 << 30) // nbytes))]
    x = as_aligned(torch.randn(d))  # [d]
    idx = as_aligned(torch.arange(rows, dtype=torch.int32))  # [rows]
    y = aligned_empty((rows,), torch.float32)
    ref = copies[0].float() @ x
    for name, fn in fns.items():
        fn(x, copies[0], idx, y)
        assert torch.allclose(y, ref, rtol=1e-3, atol=1e-3), name

    def timed(fn: Callable[..., None]) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            for w in copies:
                fn(x, w, idx, y)
            return len(copies) * nbytes / (time.perf_counter() - t0) / 1e9
        return once

    src = torch.ones(256 << 18)
    dst = torch.zeros_like(src)
    measures = {k: timed(fn) for k, fn in fns.items()}
    if args.dtype == "float32":  # what a float32 artifact's linear layers run (aten.linear: oneDNN/MKL GEMV)
        xt = x.reshape(1, d)
        measures["torch F.linear"] = timed(lambda x_, w, i_, y_: torch.nn.functional.linear(xt, w))
    measures["copy (read + write)"] = lambda: copy_bandwidth(src, dst) / 1e9
    buf = torch.ones(512 << 18)  # float32, 512 MiB: the read bandwidth (the decode bound's denominator)
    measures["read (sum)"] = lambda: buf.numel() * 4 / _seconds(buf.sum) / 1e9
    med = _rounds(measures, args.repeats)
    print(f"GEMV {args.dtype} [{rows}, {d}], weights rotated over {len(copies)} copies, {args.repeats} rounds, medians")
    for name, gbs in med.items():
        print(f"  {name:20s} {gbs:6.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["ffn", "gemv"])
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float16")
    ap.add_argument("--kind", choices=["ffn_gated", "ffn_relu"], default="ffn_gated")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--n-rows", type=int, default=5632)
    ap.add_argument("--rows", type=int, default=2560, help="gemv: output rows")
    ap.add_argument("--selected", type=float, default=0.155, help="ffn: share of the rows in the index list")
    ap.add_argument("--firing", type=float, default=0.65, help="ffn: share of the selected rows that fire")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    ensure_runtime()  # TVM's thread count and spin count, as the runtime sets them
    torch.set_num_threads(args.threads)
    (bench_ffn if args.what == "ffn" else bench_gemv)(args)


if __name__ == "__main__":
    main()

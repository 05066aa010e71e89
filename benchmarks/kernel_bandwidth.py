"""Benchmark the TVM sparse FFN kernel against torch (dense matmuls, gather + matmul) and a copy bound.

    python benchmarks/kernel_bandwidth.py [--d-model 4096] [--n-rows 16384] [--dtype float32] [--kind ffn_relu]
    python benchmarks/kernel_bandwidth.py --kind up [--d-model 2048] [--n-rows 5632] [--dtype float16]
    python benchmarks/kernel_bandwidth.py --formats float16,int8,int4 [--kind ffn_gated] [--d-model 2048] [--n-rows 5632]
    python benchmarks/kernel_bandwidth.py --formats int4,int4-float,int8,int8-float --kind up --d-model 2048 --n-rows 2048

``--formats``: each weight format's kernel of ``--kind`` (``ffn_gated`` act silu / ``ffn_relu`` relu / ``up`` /
``down``: every selected row is read) at k = 1, 5, 10, 25, 100 % of the rows, the weights rotated over layer copies
totalling ``--rotate-mib`` per format (every call reads DRAM), against the **read** bandwidth (torch ``sum`` over
``--copy-mib``) measured in the same interleaved rounds: GB/s of weight bytes read (quants + scales) and their
share of the read bandwidth. ``int4-float`` / ``int8-float``: the same format built without the integer dot
products (``build_kernel(..., integer_dot=False)``, the float path), measured in the same rounds: the A/B of
``kernels/cpu_qdot.py``.

``--act relu`` with ``--kind ffn_gated`` is ReGLU (the 1B synthetic model's FFN: the gate rows of every selected
row, up and down rows of the ~half of them that fire on random weights; GB/s still counts all three rows, compare
the ms); ``--fractions 0.21`` the share the 1B int4 artifact's predictors select; ``int4@DIR`` the kernel that DIR
holds for the same spec (``DIR/<key>.so``, e.g. built by another checkout's code), measured in the same rounds.

``--kind up`` measures the dense GEMV instead (kind ``up``, act ``none``, idx = all rows: how every
linear layer of a model runs), against torch's float32 ``F.linear`` and the copy bandwidth, with
the weights rotated over enough copies (``--rotate-mib``) that every call reads them from DRAM.

For k = 1, 5, 10, 25, 50, 100 % of the rows (one token): every method is timed once per round, rounds
are interleaved (so load from other processes hits all methods alike) and medians are reported.
"bytes" are the weight rows the sparse kernel must read (k rows of w_up [+ w_gate] + w_down_t);
"copy GB/s" is torch ``dst.copy_(src)`` on a buffer far larger than the caches, measured in the same
rounds (read + write bytes / time); "bound" is bytes / copy bandwidth. Each round draws a new active
set. The TVM kernel is called through ``SparseKernel.unchecked`` (no per-call Python checks); "tvm ms"
is a call right after another kernel call (as in a decode step: one call per layer), "cold ms" the
call before it, made after the other methods ran (TVM's idle worker threads must be woken). Not a test.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: see picompile/__init__.py

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from picompile.kernels import (
    KernelSpec,
    aligned_empty,
    build_kernel,
    dense_ffn,
    load_kernel,
    num_threads,
    set_num_threads,
    validate_indices,
)

FRACTIONS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.25, 0.50, 1.00)


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _randn_aligned(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    out = aligned_empty(shape, dtype)
    for i in range(0, shape[0], 1024):  # chunked: no second full-size temporary
        out[i : i + 1024] = (torch.randn(out[i : i + 1024].shape, generator=gen) * 0.02).to(dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--n-rows", type=int, default=16384)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--kind", choices=["ffn_relu", "ffn_gated", "up", "down"], default="ffn_relu")
    ap.add_argument("--rotate-mib", type=int, default=1024, help="--kind up: weight copies rotated per call")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copy-mib", type=int, default=512, help="size of the copy-bandwidth buffer")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "picompile_kernel_cache")
    ap.add_argument("--formats", default=None, help="comma-separated weight formats: the bandwidth-share table")
    ap.add_argument("--block", type=int, default=32, help="--formats: quantization block")
    ap.add_argument("--act", default=None, help="--formats: the kernel's activation (default: silu for ffn_gated, "
                    "relu for ffn_relu); relu on ffn_gated is ReGLU, the 1B synthetic model's FFN")
    ap.add_argument("--fractions", default=None, help="--formats: comma-separated fractions of the rows selected "
                    "(default 0.01,0.05,0.1,0.25,1)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if args.formats:
        formats_table(args)
        return
    if args.kind == "up":
        dense_gemv(args)
        return
    d, n, wdt = args.d_model, args.n_rows, getattr(torch, args.dtype)
    gated = args.kind == "ffn_gated"
    spec = KernelSpec(args.kind, "silu" if gated else "relu", d, n, args.dtype, False, "llvm")
    t0 = time.perf_counter()
    path = build_kernel(spec, args.cache_dir)
    kern = load_kernel(path, spec)
    set_num_threads(args.threads)
    print(f"kernel {spec.key()} ({time.perf_counter() - t0:.1f} s build/load), TVM threads {num_threads()}, "
          f"torch threads {torch.get_num_threads()}")

    gen = torch.Generator().manual_seed(0)
    w_up = _randn_aligned((n, d), wdt, gen)  # [n_rows, d_model]
    w_gate = _randn_aligned((n, d), wdt, gen) if gated else None  # [n_rows, d_model]
    w_down_t = _randn_aligned((n, d), wdt, gen)  # [n_rows, d_model]
    w_up_f, w_gate_f, w_down_f = w_up.float(), (w_gate.float() if gated else None), w_down_t.float()
    x = torch.randn(d, generator=gen)  # [d_model]
    y = aligned_empty(d)  # [d_model]
    copy_src = torch.randn(args.copy_mib * 2**18, generator=gen)  # float32: copy_mib MiB
    copy_dst = torch.empty_like(copy_src)
    copy_dst.copy_(copy_src)  # fault the pages in
    act = torch.nn.functional.silu if gated else torch.relu

    def dense() -> torch.Tensor:  # the whole FFN with torch matmuls (what the sparse kernel replaces)
        up = torch.mv(w_up_f, x)
        h = act(torch.mv(w_gate_f, x)) * up if gated else act(up)
        return torch.mv(w_down_f.t(), h)

    # a fresh active set every round (as from token to token): rows read in one round are not
    # still in the (here 300 MB) last-level cache in the next
    idxs: dict[float, list[torch.Tensor]] = {}
    for frac in FRACTIONS:
        k = max(1, round(frac * n))
        idxs[frac] = [
            torch.randperm(n, generator=gen)[:k].sort().values.to(torch.int32).contiguous()
            for _ in range(2 * args.repeats + 1)
        ]
        for idx in idxs[frac]:
            validate_indices(idx, n)
    # correctness spot check at 10 %
    ref = dense_ffn(x, w_up, w_gate, None, w_down_t, idxs[0.10][0], spec.act, torch.float64)
    kern(x, w_up, w_gate, None, w_down_t, idxs[0.10][0], y)
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    print(f"max relative error at 10 %: {err:.2e}")

    tm = Timings()
    for name, fn in [("copy", lambda: copy_dst.copy_(copy_src)), ("dense", dense)]:
        fn()  # warm up
    for frac in FRACTIONS:
        kern.unchecked(x, w_up, w_gate, None, w_down_t, idxs[frac][0], y)
    for r in range(1, args.repeats + 1):
        tm.add("copy", _time(lambda: copy_dst.copy_(copy_src)))
        tm.add("dense", _time(dense))
        for frac in FRACTIONS:
            # "cold": the first call after other work (TVM's worker threads have gone to sleep);
            # "warm": the next call right after it, as in a decode step (one call per layer)
            cold, idx = idxs[frac][2 * r - 1], idxs[frac][2 * r]
            tm.add(f"cold{frac}", _time(lambda: kern.unchecked(x, w_up, w_gate, None, w_down_t, cold, y)))
            tm.add(f"tvm{frac}", _time(lambda: kern.unchecked(x, w_up, w_gate, None, w_down_t, idx, y)))
            tm.add(f"gather{frac}", _time(lambda: dense_ffn(x, w_up, w_gate, None, w_down_t, idx, spec.act)))

    wbytes = torch.empty((), dtype=wdt).element_size()
    copy_gbs = 2 * copy_src.numel() * 4 / tm.median("copy") / 1e9
    copy_best = 2 * copy_src.numel() * 4 / min(tm.samples["copy"]) / 1e9
    dense_ms = tm.median("dense") * 1e3
    n_mats = 3 if gated else 2
    print(f"d_model {d}, n_rows {n}, {args.kind}, weights {args.dtype}, {args.repeats} interleaved rounds (medians)")
    print(f"copy bandwidth {copy_gbs:.1f} GB/s (best round {copy_best:.1f}); dense torch FFN {dense_ms:.2f} ms "
          f"({n_mats * n * d * 4 / (dense_ms / 1e3) / 1e9:.1f} GB/s of fp32 weights)")
    header = f"{'k %':>5} {'k':>6} {'MB':>7} {'tvm ms':>8} {'GB/s':>6} {'%copy':>6} {'bound ms':>8} " \
             f"{'cold ms':>8} {'dense ms':>8} {'x dense':>7} {'gath ms':>8} {'x gath':>6}"
    print(header)
    print("-" * len(header))
    for frac in FRACTIONS:
        k = idxs[frac][0].numel()
        nbytes = n_mats * k * d * wbytes
        t_tvm = tm.median(f"tvm{frac}")
        t_gather = tm.median(f"gather{frac}")
        gbs = nbytes / t_tvm / 1e9
        print(f"{frac * 100:5.0f} {k:6d} {nbytes / 1e6:7.1f} {t_tvm * 1e3:8.3f} {gbs:6.1f} {gbs / copy_gbs * 100:5.0f}% "
              f"{nbytes / (copy_gbs * 1e9) * 1e3:8.3f} {tm.median(f'cold{frac}') * 1e3:8.3f} "
              f"{dense_ms:8.2f} {dense_ms / (t_tvm * 1e3):7.1f} "
              f"{t_gather * 1e3:8.2f} {t_gather / t_tvm:6.1f}")


def dense_gemv(args: argparse.Namespace) -> None:
    """``--kind up``: h = W x over all rows (act none) vs torch float32 F.linear and the copy bound."""
    d, n, wdt = args.d_model, args.n_rows, getattr(torch, args.dtype)
    spec = KernelSpec("up", "none", d, n, args.dtype, False, "llvm")
    kern = load_kernel(build_kernel(spec, args.cache_dir), spec)
    set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    first = _randn_aligned((n, d), wdt, gen)  # [n_rows, d_model]

    def copies(t: torch.Tensor) -> list[torch.Tensor]:  # enough that no call finds its weights in cache
        count = max(2, -(-args.rotate_mib * 2**20 // (t.numel() * t.element_size())))
        out = [t]
        for _ in range(count - 1):
            c = aligned_empty(t.shape, t.dtype)
            c.copy_(t)
            out.append(c)
        return out

    ws, ws_f = copies(first), copies(first.float())
    x = aligned_empty((d,))  # [d_model]
    x.copy_(torch.randn(d, generator=gen))
    idx = aligned_empty((n,), torch.int32)  # [n_rows]: every row
    idx.copy_(torch.arange(n, dtype=torch.int32))
    h = aligned_empty((n,))  # [n_rows]
    kern(x, ws[0], None, None, idx, h)
    ref = torch.nn.functional.linear(x.double(), first.double())
    print(f"kernel {spec.key()}, TVM threads {num_threads()}, torch threads {torch.get_num_threads()}, "
          f"{len(ws)} weight copies; max relative error {float((h.double() - ref).abs().max() / ref.abs().max()):.2e}")
    copy_src = torch.randn(args.copy_mib * 2**18, generator=gen)
    copy_dst = torch.empty_like(copy_src)
    copy_dst.copy_(copy_src)
    it = {"tvm": 0, "torch": 0}

    def tvm_call() -> None:
        it["tvm"] += 1
        kern.unchecked(x, ws[it["tvm"] % len(ws)], None, None, idx, h)

    def torch_call() -> None:
        it["torch"] += 1
        torch.nn.functional.linear(x, ws_f[it["torch"] % len(ws_f)])

    calls = {"copy": lambda: copy_dst.copy_(copy_src), "tvm": tvm_call, "torch fp32": torch_call}
    tm = Timings()
    for fn in calls.values():
        fn()
    for _ in range(args.repeats * 2):  # interleaved rounds
        for name, fn in calls.items():
            tm.add(name, _time(fn))
    copy_gbs = 2 * copy_src.numel() * 4 / tm.median("copy") / 1e9
    print(f"[{n} x {d}] {args.dtype}, {args.repeats * 2} interleaved rounds (medians); copy {copy_gbs:.1f} GB/s (r+w)")
    for name, nbytes in (("tvm", n * d * first.element_size()), ("torch fp32", n * d * 4)):
        t = tm.median(name)
        print(f"{name:>10}: {t * 1e3:8.3f} ms {nbytes / t / 1e9:6.1f} GB/s ({nbytes / t / 1e9 / copy_gbs * 100:.0f} % of copy)")


SHARE_FRACTIONS: tuple[float, ...] = (0.01, 0.05, 0.10, 0.25, 1.00)
_ACTS: dict[str, str] = {"ffn_gated": "silu", "ffn_relu": "relu", "up": "none", "down": "none"}


def _layer_args(spec: KernelSpec, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    """One layer's kernel arguments by name (weights random, quantized per ``spec``), outputs allocated."""
    from picompile.kernels import as_aligned
    from picompile.kernels.qformat import QFormat, quantize

    d, n = spec.d_model, spec.n_rows
    out: dict[str, torch.Tensor | None] = {"w_gate": None, "s_gate": None, "b_up": None}
    for w, sc in (("w_up", "s_up"), ("w_gate", "s_gate"), ("w_down_t", "s_down")):
        if w == "w_gate" and not spec.gated:
            continue
        if spec.quantized:
            q, s = quantize(_randn_aligned((n, d), torch.float32, gen), QFormat(spec.weight_dtype, spec.block))
            out[w], out[sc] = as_aligned(q, copy=True), as_aligned(s, copy=True)
        else:
            out[w] = _randn_aligned((n, d), getattr(torch, spec.weight_dtype), gen)
    return out


def formats_table(args: argparse.Namespace) -> None:
    """``--formats``: bytes read per second by each format's kernel at 1-100 % of the rows, against the read
    bandwidth of the same rounds."""
    from picompile.kernels import as_aligned, call_args
    from picompile.kernels.qformat import QFormat

    d, n, kind = args.d_model, args.n_rows, args.kind
    formats = args.formats.split(",")
    fractions = tuple(float(f) for f in args.fractions.split(",")) if args.fractions else SHARE_FRACTIONS
    gen = torch.Generator().manual_seed(0)
    kernels, layers, row_bytes = {}, {}, {}
    for fmt in formats:
        name, _, other = fmt.partition("@")  # int4@DIR: DIR's build of the kernel (e.g. another branch's code)
        base, float_path = name.removesuffix("-float"), name.endswith("-float")  # int4-float: without cpu_qdot
        spec = KernelSpec(kind, args.act or _ACTS[kind], d, n, base, False, "llvm", block=args.block)
        t0 = time.perf_counter()
        cache = args.cache_dir / "float-path" if float_path else args.cache_dir
        path = Path(other) / f"{spec.key()}.so" if other else build_kernel(spec, cache, integer_dot=not float_path)
        kernels[fmt] = load_kernel(path, spec)
        row_bytes[fmt] = QFormat(base, args.block).bytes_per_row(d) if spec.quantized else \
            d * torch.empty((), dtype=getattr(torch, base)).element_size()
        mats = 3 if spec.gated else 2 if spec.has_up and spec.has_down else 1
        count = max(2, -(-args.rotate_mib * 2**20 // (mats * n * row_bytes[fmt])))
        first = _layer_args(spec, gen)  # the copies hold the same values at other addresses
        layers[fmt] = [first] + [{k: None if t is None else as_aligned(t, copy=True) for k, t in first.items()}
                                 for _ in range(count - 1)]
        print(f"{fmt}: kernel {spec.key()} ({time.perf_counter() - t0:.1f} s build/load/quantize), {count} layers")
    set_num_threads(args.threads)
    x = aligned_empty((d,))
    x.copy_(torch.randn(d, generator=gen))
    n_sets = 7  # index sets per fraction, cycled independently of the layer copies (7 is prime to their count)
    idxs = {f: [torch.randperm(n, generator=gen)[: max(1, round(f * n))].sort().values.to(torch.int32)
                for _ in range(n_sets)] for f in fractions}
    outs = {f: aligned_empty((d,) if kind != "up" else (idxs[f][0].numel(),)) for f in fractions}
    hs = {f: aligned_empty((idxs[f][0].numel(),)) for f in fractions}
    for f in fractions:
        hs[f].copy_(torch.randn(hs[f].numel(), generator=gen))
    read_src = torch.randn(args.copy_mib * 2**18, generator=gen)
    turn = {fmt: 0 for fmt in formats}

    def call(fmt: str, frac: float) -> Callable[[], None]:
        def run() -> None:
            turn[fmt] += 1
            lay = layers[fmt][turn[fmt] % len(layers[fmt])]
            named = {**lay, "x": x, "idx": idxs[frac][turn[fmt] // len(layers[fmt]) % n_sets], "y": outs[frac],
                     "h": hs[frac] if kind == "down" else outs[frac]}
            kernels[fmt].unchecked(*(named[a] for a in call_args(kernels[fmt].spec)))
        return run

    calls = {"read": lambda: read_src.sum()}
    for fmt in formats:
        for frac in fractions:
            calls[f"{fmt}@{frac}"] = call(fmt, frac)
    tm = Timings()
    order = list(calls)
    for fn in calls.values():
        fn()
    for r in range(args.repeats):
        for name in order if r % 2 == 0 else order[::-1]:
            tm.add(name, _time(calls[name]))
    read_gbs = read_src.numel() * 4 / tm.median("read") / 1e9
    mats = 3 if kind == "ffn_gated" else 2 if kind == "ffn_relu" else 1
    print(f"{kind}, d_model {d}, n_rows {n}, block {args.block}, {args.threads} threads, {args.repeats} interleaved "
          f"rounds (medians); read bandwidth {read_gbs:.1f} GB/s (torch sum over {args.copy_mib} MiB, same rounds)")
    header = f"{'format':>8} {'B/row':>6}" + "".join(f" {f'{f * 100:.0f}% ms':>9} {'GB/s':>5} {'share':>5}"
                                                     for f in fractions)
    print(header)
    print("-" * len(header))
    for fmt in formats:
        line = f"{fmt:>8} {row_bytes[fmt]:6d}"
        for frac in fractions:
            t = tm.median(f"{fmt}@{frac}")
            gbs = mats * idxs[frac][0].numel() * row_bytes[fmt] / t / 1e9
            line += f" {t * 1e3:9.3f} {gbs:5.1f} {gbs / read_gbs * 100:4.0f}%"
        print(line)


if __name__ == "__main__":
    main()

"""Prefill of a float16 or int8 / int4 artifact per prefill path, side by side in one process (or one path per process).

    python benchmarks/prefill.py ART [--prompt-len 64,512] [--rounds 5] [--settings auto,dense-ffn,weights,float16,bfloat16,bfloat16-stream]
    python benchmarks/prefill.py --gemm [--prompt-len 64,512] [--rounds 5] [--shape 2048,5632]

``--gemm``: each prefill GEMM path alone on the FFN's up shape ``[rows, d_model] × [n_ff, d_model]ᵀ`` (GFLOP/s,
interleaved rounds, medians): float32 weights (MKL), float16 widened per call (``ops.lin``'s path here),
torch's float16 GEMM, bfloat16 weights (oneDNN), the same pre-packed in oneDNN's blocked layout, and the
packed FFN's fused up+gate ``[2·n_ff, d_model]`` and down ``[d_model, n_ff]`` GEMMs.

``weights``: ``prefill_dtype="weights"``, the artifact's own dtype — on CPUs without a native float16 GEMM
(``picompile.ir.ops.native_half_gemm``: AMD EPYC, Intel without AMX) ``ops.lin`` widens each float16 weight to
float32 for a call with a transposed weight or ``WIDEN_ROWS``+ rows of x. ``float16``: the same session with
torch's float16 GEMM for every call (very slow on those CPUs). ``bfloat16``: ``prefill_dtype="bfloat16"``
(bfloat16 copies; hybrid FFN layers as one packed ``PrefillFFN``, ``runtime/prefill_gemm.py``).
``bfloat16-stream``: the same GEMMs without copies, each weight converted per call (``runtime/prefill_stream.py``). ``auto``: the
default load (``runtime/compute_dtype.choose``; it prints which dtype it chose). ``dense-ffn``: the default load
with ``sparse_prefill=False`` (a ReLU FFN's up and down rows all computed, not only where the gate fired:
``runtime/prefill_sparse.py``). On an int8 / int4 artifact
``weights`` dequantizes each weight to float32 per call (``ops.deq``) and ``auto`` takes the bfloat16 copies
where this CPU has a fast bfloat16 GEMM and the copy fits. Each prefill computes every position's logits
(``session.logits``); generation computes only the last one's (``Decoder.feed(ids, last_only=True)``):
``--last-only`` times that. Each round runs one prefill of
each setting (interleaved; medians), from an empty KV cache, the same seeded prompt; prompt logits are compared
with the first setting's. Sessions of one process share the machine's memory: run the settings of a 1B model
in processes of their own (``--settings auto``, then ``--settings weights``). Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import time

import picompile  # first: it sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (picompile/__init__.py)
import torch
from picompile.ir import ops

SETTINGS = ("auto", "dense-ffn", "weights", "float16", "bfloat16", "bfloat16-stream")


def gemm_table(rows_list: list[int], d_model: int, n_ff: int, rounds: int) -> None:
    """Print GFLOP/s per GEMM path and row count (interleaved rounds, medians)."""
    gen = torch.Generator().manual_seed(0)
    w16 = (torch.randn(n_ff, d_model, generator=gen) * 0.02).half()  # [n_ff, d_model]
    w32, wbf = w16.float(), w16.bfloat16()
    upgate = torch.cat([wbf, wbf])  # [2·n_ff, d_model]
    down = (torch.randn(d_model, n_ff, generator=gen) * 0.02).bfloat16()  # [d_model, n_ff]
    lin = torch.nn.functional.linear
    mk = torch.ops.mkldnn
    for rows in rows_list:
        x = torch.randn(rows, d_model, generator=gen)  # [rows, d_model]
        h = torch.randn(rows, n_ff, generator=gen).bfloat16()  # [rows, n_ff]
        flop = 2 * rows * d_model * n_ff
        paths = {"float32 weights (MKL)": (lambda: lin(x, w32), flop),
                 "float16 widened per call": (lambda: lin(x, w16.float()), flop),
                 "float16 GEMM (torch)": (lambda: lin(x.half(), w16).float(), flop),
                 "bfloat16 weights (oneDNN)": (lambda: lin(x.bfloat16(), wbf).float(), flop),
                 "bfloat16 fused up+gate": (lambda: lin(x.bfloat16(), upgate), 2 * flop),
                 "bfloat16 down [d, n_ff]": (lambda: lin(h, down), flop)}
        try:
            packed = mk._reorder_linear_weight(wbf, rows)
            paths["bfloat16 oneDNN-packed"] = (lambda: mk._linear_pointwise(x.bfloat16(), packed, None, "none", [], "").float(), flop)
        except (RuntimeError, AttributeError) as e:
            print(f"oneDNN packing unavailable: {e}")
        times: dict[str, list[float]] = {k: [] for k in paths}
        for f, _ in paths.values():
            f()  # warm
        for _ in range(rounds):
            for k, (f, _) in paths.items():
                start = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - start)
        for k, (_, fl) in paths.items():
            med = statistics.median(times[k])
            print(f"rows {rows:4d}  {k:28s} {med * 1e3:8.2f} ms  {fl / med / 1e9:7.1f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--gemm", action="store_true", help="the GEMM paths alone (no artifact)")
    ap.add_argument("--shape", default="2048,5632", help="--gemm: d_model,n_ff (default the 1B's)")
    ap.add_argument("--prompt-len", default="64,512", help="comma-separated prompt lengths (default 64,512)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settings", default="auto,weights", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--last-only", action="store_true", help="the last position's logits only, as generation")
    args = ap.parse_args()
    if args.gemm:
        d_model, n_ff = (int(v) for v in args.shape.split(","))
        print(f"torch threads {torch.get_num_threads()}; native float16 GEMM: {ops.native_half_gemm()}")
        gemm_table([int(v) for v in args.prompt_len.split(",")], d_model, n_ff, args.rounds)
        return
    if not args.artifact:
        raise SystemExit("an artifact, or --gemm")
    names = [v.strip() for v in args.settings.split(",") if v.strip()]
    unknown = set(names) - set(SETTINGS)
    if unknown or not names:
        raise SystemExit(f"--settings: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    loads = {"auto": None, "dense-ffn": "dense-ffn", "weights": "weights", "float16": "weights",
             "bfloat16": "bfloat16", "bfloat16-stream": "bfloat16-stream"}
    sessions: dict[str, picompile.Session] = {}
    for name in names:
        key = loads[name]
        if key not in {loads[n] for n in sessions}:
            start = time.perf_counter()
            dense_ffn = key == "dense-ffn"
            s = picompile.load(args.artifact, prefill_dtype=None if dense_ffn else key, sparse_prefill=not dense_ffn)
            print(f"{name}: prefill dtype {s.prefill_dtype or 'the weights'} ({s.prefill_reason}); "
                  f"{s.sparse_prefill_parts} FFN parts gate-sparse; load {time.perf_counter() - start:.1f} s")
            sessions[name] = s
        else:
            sessions[name] = next(sessions[n] for n in sessions if loads[n] == key)
    print(f"native float16 GEMM on this CPU: {ops.native_half_gemm()}; torch threads {torch.get_num_threads()}")
    any_session = next(iter(sessions.values()))
    for n in (int(v) for v in args.prompt_len.split(",")):
        ids = torch.randint(0, any_session.manifest.model["config"]["vocab_size"], (n,),
                            generator=torch.Generator().manual_seed(n)).tolist()
        times: dict[str, list[float]] = {name: [] for name in names}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for name in names:
                real = ops.native_half_gemm
                native = True if name == "float16" else real()
                ops.native_half_gemm = (lambda v=native: v)  # type: ignore[assignment]
                try:
                    start = time.perf_counter()
                    if args.last_only:
                        logits[name] = sessions[name].decoder().feed(ids, last_only=True)
                    else:
                        logits[name] = sessions[name].logits(ids)
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

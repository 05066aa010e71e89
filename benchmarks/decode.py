"""End-to-end decode benchmark on 1B-class SYNTHETIC activation-sparse models (picompile vs PyTorch eager).

    python benchmarks/decode.py [--shapes llama-1b-relu,opt-1.3b] [--tokens 32] [--prompt-len 64]
                                [--repeats 5] [--threads T] [--json-out FILE]

For each shape: make (or reuse) the seeded synthetic checkpoint (``picompile.tools.synthetic``: random
weights, ~10 % of FFN neurons active per token, ~26 % of neurons carrying 80 % of activations), build
(or reuse) its artifact for target ``cpu`` with trained predictors, then run ``picompile bench`` on it
(each build and each bench in a spawned process of its own, so that no model measured shares a process
with another one's residue): picompile, the same artifact dense, PyTorch eager (dense, the HF checkpoint), and
ONNX Runtime where installed and llama.cpp's own ``llama-bench`` with ``--llama-bench auto`` (built by
``benchmarks/build_llama_cpp.py``; the checkpoint as a GGUF at the artifact's precision), interleaved rounds,
medians. Checkpoints and artifacts are
cached outside the repository (``$PICOMPILE_CACHE_DIR`` or ``~/.cache/picompile``: ``synthetic/``,
``bench/``). Prints one table per model, then both side by side. Not a test.
"""
from __future__ import annotations

import os

import picompile  # first, before torch: it sets OMP_WAIT_POLICY=PASSIVE for its own runtime and records the
# user's value, which the peers (PyTorch, llama.cpp) then run under in their own processes; setting it here
# instead had made it theirs too (PASSIVE: every OpenMP region wakes parked threads)

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

from picompile.formats.provenance import resolve_source
from picompile.formats.artifact import is_artifact, read_manifest
from picompile.tools.bench import run_bench
from picompile.tools.bench_report import print_report
from picompile.tools.llama_bench import GGUF_TYPES
from picompile.config import default_cache_dir
from picompile.runtime.loader import stale_kernels
from picompile.tools.synthetic import make_synthetic, synthetic_params_of

SHAPES: tuple[str, ...] = ("llama-1b-relu", "opt-1.3b")


# predictors sized for speed on 1B-class models: at ~10 % active neurons a 20 % budget (the build default,
# chosen for accuracy on small models) would read twice the bytes of the sparse FFN itself
PREDICTOR_OPTIONS: dict[str, Any] = {"predictor_budget": 0.1, "recall_target": 0.99, "predictor_dtype": "float16"}


# artifact file name suffix per --weight-dtype (int8 / int4: blocks of 32, as llama.cpp's q8_0 / q4_0)
WEIGHT_SUFFIX: dict[str, str] = {"float32": "", "float16": "-f16", "int8": "-q8", "int4": "-q4"}
# llama.cpp's weight type matching an artifact's (--gguf-type's default, where the bench knows that type)


def artifact_for(checkpoint: Path, cache: Path, calibration_tokens: int, predictor: str, log: Any,
                 rebuild: bool = False, weight_dtype: str = "float32", recall_target: float | None = None,
                 predictor_kind: str = "linear") -> Path:
    """The cached artifact of ``checkpoint`` (rebuilt when its source or build options differ)."""
    options = {**PREDICTOR_OPTIONS, **({"recall_target": recall_target} if recall_target is not None else {})}
    suffix = WEIGHT_SUFFIX[weight_dtype] + (
        "" if options == PREDICTOR_OPTIONS else f"-r{options['recall_target']:g}") + (
        "" if predictor_kind == "linear" or predictor != "trained" else f"-{predictor_kind}")
    out = cache / f"{checkpoint.name}-cpu-{predictor}-c{calibration_tokens}{suffix}.pic"
    if is_artifact(out) and not rebuild:
        m = read_manifest(out, verify=False)
        same_weights = m.model.get("config", {}).get("picompile_synthetic") == synthetic_params_of(checkpoint)
        if (same_weights and resolve_source(m.model) == str(checkpoint.absolute()) and m.build.get("predictor") == predictor
                and (m.sections.get("profile") or {}).get("n_tokens") == calibration_tokens
                and m.weights.get("dtype", "float32") == weight_dtype
                and (predictor != "trained" or m.build.get("predictor_kind", "mlp") == predictor_kind)  # before: mlp
                and all(m.build.get(k) == v for k, v in options.items())):
            stale = stale_kernels(m.sections.get("kernels") or [])
            if not stale:
                log(f"reusing {out}")
                return out
            log(f"{out}: {len(stale)} kernels were built under another kernel ABI")
    log(f"building {out} (target cpu, predictor {predictor}, {calibration_tokens} calibration tokens, {weight_dtype})")
    t0 = time.perf_counter()
    # in a process of its own, as `picompile build` runs: the build's residue (its peak memory, kept by the
    # allocator, and what it left in the page cache) would share this process with the engines measured
    # (measured: the fp32 step at 10.7 tok/s after an in-process build against 14.9-16.1 without)
    child = multiprocessing.get_context("spawn").Process(target=_build, args=(dict(
        model=checkpoint, target="cpu", output=out, predictor=predictor, calibration_tokens=calibration_tokens,
        weight_dtype=weight_dtype, predictor_kind=predictor_kind, **options),))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"building {out} failed (exit code {child.exitcode}; its error is above)")
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return out


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _bench(options: dict[str, Any]) -> dict[str, Any]:
    """``picompile.tools.bench.run_bench(**options)`` (the target of a bench process)."""
    return run_bench(**options, emit=log)


def bench_in_child(options: dict[str, Any]) -> dict[str, Any]:
    """``run_bench`` in a spawned process: what an earlier shape's engines left behind (the allocator's peak,
    TVM and torch thread pools, compiled graphs) stays out of the next one's measurement."""
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(_bench, (options,))
    finally:
        pool.close()  # a clean exit (terminate() would leak the pool's semaphore)
        pool.join()


def _build(options: dict[str, Any]) -> None:
    """``picompile.build(**options)``, logging its passes (the target of the build process)."""
    picompile.build(**options, emit=lambda s: None, on_pass=lambda name, i, n: log(f"  pass {i}/{n} {name}"))


ROWS: list[tuple[str, str, str]] = [  # (label, key, format)
    ("decode tok/s, picompile", "decode_tokens_per_s", "{:.2f}"),
    ("  the same, eager step (--compile)", "eager_decode_tokens_per_s", "{:.2f}"),
    ("decode tok/s, picompile dense=True", "artifact_dense_decode_tokens_per_s", "{:.2f}"),
    ("decode tok/s, PyTorch eager", "dense_decode_tokens_per_s", "{:.2f}"),
    ("decode tok/s, ONNX Runtime", "ort_decode_tokens_per_s", "{:.2f}"),
    ("decode tok/s, llama.cpp (llama-bench tg)", "llama_cpp_decode_tokens_per_s", "{:.2f}"),
    ("decode speedup vs PyTorch", "decode_speedup", "{:.2f}x"),
    ("decode speedup vs llama.cpp", "decode_vs_llama_cpp", "{:.2f}x"),
    ("  best round vs best round", "best_decode_speedup", "{:.2f}x"),
    ("prefill tok/s, picompile", "prefill_tokens_per_s", "{:.1f}"),
    ("prefill tok/s, PyTorch eager", "dense_prefill_tokens_per_s", "{:.1f}"),
    ("prefill tok/s, llama.cpp (llama-bench pp)", "llama_cpp_prefill_tokens_per_s", "{:.1f}"),
    ("prefill speedup vs PyTorch", "prefill_speedup", "{:.2f}x"),
    ("prefill speedup vs llama.cpp", "prefill_vs_llama_cpp", "{:.2f}x"),
    ("  --prefill-dtype: prefill speedup", "low_prefill_speedup", "{:.2f}x"),
    ("FFN neurons computed / token", "ffn_active_fraction", "{:.1%}"),
    ("  predicted active (manifest)", "ffn_active_fraction_manifest", "{:.1%}"),
    ("bytes / token, picompile (GB)", "bytes_per_token", "gb"),
    ("bytes / token, dense (GB)", "dense_bytes_per_token", "gb"),
    ("bytes / token, llama.cpp GGUF (GB)", "llama_cpp_bytes_per_token", "gb"),
    ("read bandwidth (GB/s)", "bandwidth_gbs", "{:.2f}"),
    ("  copy bandwidth, read + write (GB/s)", "copy_bandwidth_gbs", "{:.2f}"),
    ("bound tok/s, picompile", "bound_tokens_per_s", "{:.2f}"),
    ("bound tok/s, dense", "dense_bound_tokens_per_s", "{:.2f}"),
    ("bound tok/s, llama.cpp", "llama_cpp_bound_tokens_per_s", "{:.2f}"),
    ("picompile decode / its bound", "bound_share", "{:.0%}"),
    ("llama.cpp tg / its bound", "llama_cpp_bound_share", "{:.0%}"),
    ("greedy tokens equal to PyTorch", "same_tokens_as_pytorch", "{}"),
    ("load average (start, end)", "load_average", "load"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "gb":
        return f"{value / 1e9:.3f}"
    if fmt == "load":
        return f"{value[0]:.1f}, {value[1]:.1f}"
    return fmt.format(value)


def side_by_side(results: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="End-to-end decode, target cpu (SYNTHETIC models: random weights, controlled sparsity)",
                  title_justify="left")
    table.add_column("")
    for shape in results:
        table.add_column(shape, justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *[_cell(r.get(key), fmt) for r in results.values()])
    Console(highlight=False).print(table)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated (default {','.join(SHAPES)})")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch and TVM threads (default: physical cores)")
    ap.add_argument("--calibration-tokens", type=int, default=8192)
    ap.add_argument("--weight-dtype", choices=list(WEIGHT_SUFFIX), default="float32",
                    help="the artifact's weights (float16: compare with --gguf-type f16; int8 / int4: q8_0 / q4_0)")
    ap.add_argument("--recall-target", type=float,
                    help=f"predictor recall target (default {PREDICTOR_OPTIONS['recall_target']}; the build's default for "
                         "ReLU models is 0.95)")
    ap.add_argument("--llama-bench", metavar="PATH|auto",
                    help="llama.cpp peer: its own llama-bench ('auto': the build of benchmarks/build_llama_cpp.py)")
    ap.add_argument("--gguf", help="the peer's weights: a GGUF file (default: the checkpoint converted at the artifact's "
                                   "precision)")
    ap.add_argument("--gguf-type", choices=GGUF_TYPES, help="default: the artifact's weight precision (f16, q8_0, ...)")
    ap.add_argument("--predictor", default="trained",
                    help="trained | oracle | none, or several comma-separated (e.g. trained,oracle: the oracle "
                         "column shows what exact masks would give)")
    ap.add_argument("--predictor-kind", default="linear", choices=["linear", "mlp"],
                    help="trained predictors: linear (default, closed-form fit) or mlp (PowerInfer's, BCE)")
    ap.add_argument("--compile", action="store_true",
                    help="also run picompile's step through torch.compile (the headline ratios are then its own)")
    ap.add_argument("--prefill-dtype", choices=["bfloat16"],
                    help="also run the step with the prompt's GEMMs in this dtype (picompile bench --prefill-dtype)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the artifacts even if cached")
    ap.add_argument("--no-extras", action="store_true", help="skip ONNX Runtime and llama.cpp")
    ap.add_argument("--cache-dir", type=Path, help="artifact cache (default: <picompile cache>/bench)")
    ap.add_argument("--json-out", type=Path, help="write all results to this JSON file")
    args = ap.parse_args()
    predictors = [p.strip() for p in args.predictor.split(",") if p.strip()]
    bad = [p for p in predictors if p not in ("trained", "oracle", "none")]
    if bad or not predictors:
        ap.error(f"--predictor takes trained, oracle or none (comma-separated), got {args.predictor!r}")
    cache = args.cache_dir or default_cache_dir() / "bench"
    results: dict[str, dict[str, Any]] = {}
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        log(f"{shape}: synthetic checkpoint")
        checkpoint = make_synthetic(shape, emit=log)
        for predictor in predictors:
            art = artifact_for(checkpoint, cache, args.calibration_tokens, predictor, log, args.rebuild,
                               args.weight_dtype, args.recall_target, args.predictor_kind)
            log(f"{shape} ({predictor}): benchmarking (load average {os.getloadavg()[0]:.1f})")
            result = bench_in_child(dict(
                artifact=art, tokens=args.tokens, prompt_len=args.prompt_len, repeats=args.repeats,
                threads=args.threads, extras=not args.no_extras, llama_bench=args.llama_bench, gguf=args.gguf,
                gguf_type=args.gguf_type,
                compile=args.compile, prefill_dtype=args.prefill_dtype))
            ort = result["engines"].get("onnxruntime")
            result["ort_decode_tokens_per_s"] = ort["decode_tokens_per_s"] if ort else None
            print_report(result)
            results[shape if len(predictors) == 1 else f"{shape} ({predictor})"] = result
    if len(results) > 1:
        side_by_side(results)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")
        log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

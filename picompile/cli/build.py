"""``picompile build [MODEL]``: compile a model into an artifact directory."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from picompile.cli.common import (console, finite_float, int_range, nonnegative_int, positive_int, seed_int,
                                  split_names)


def add_parser(sub: Any) -> None:
    from picompile.pipeline import PIPELINES
    from picompile.targets import TARGETS

    b = sub.add_parser("build", help="compile a model into an artifact directory")
    b.add_argument("model", nargs="?", help="HF checkpoint dir, hub id, llama2.c .bin, .onnx or .gguf (default: the embedded model)")
    b.add_argument("--target", default="cpu", help=f"target preset: {', '.join(TARGETS)} (default cpu)")
    b.add_argument("-o", "--output", help="artifact directory (default: MODEL_NAME.pic)")
    b.add_argument("--vram-budget", type=finite_float(0.0, 1e6), metavar="GIB", help="GPU memory budget in GiB (overrides the target)")
    b.add_argument("--pipeline", default="default", choices=list(PIPELINES))
    b.add_argument("--predictor", default="trained", choices=["trained", "oracle", "none"])
    b.add_argument("--max-seq-len", type=int_range(2, 1 << 22), help="context length of the artifact (default: the model's)")
    b.add_argument("--calibration", help="text or token file (.npy/.json ids) for activation profiling")
    b.add_argument("--calibration-source", choices=["auto", "sampled", "builtin"], default="auto",
                   help="without --calibration: ids sampled from the model itself (cached per model under the cache "
                        "dir), the built-in text, or auto = sampled for --input-sparsity builds (default auto)")
    b.add_argument("--calibration-tokens", type=int_range(16, 1 << 31), default=4096, metavar="N", help="tokens to profile (default 4096)")
    b.add_argument("--act-sparsity", type=finite_float(0.0, 1.0, hi_open=True), default=0.5, metavar="F",
                   help="non-ReLU FFNs: mean fraction of neurons counted inactive per layer (default 0.5)")
    b.add_argument("--cpu-mcpu", metavar="CPU",
                   help="LLVM CPU the CPU kernels are built for (default: this machine's; e.g. x86-64-v3 for an "
                        "artifact another x86-64 machine loads with --trust-kernels)")
    b.add_argument("--weight-dtype", choices=["float32", "float16", "int8", "int4"], default="float32",
                   help="format of the linear and FFN weights in the artifact (float16: half the bytes per token; "
                        "int8 / int4: blocks of --quant-block elements with one float16 scale, as llama.cpp's "
                        "q8_0 / q4_0; activations, norms, embeddings and the KV cache stay float32)")
    b.add_argument("--quant-block", type=int, choices=[32, 64, 128, 256], default=32, metavar="N",
                   help="int8/int4: elements per float16 scale (default 32, as llama.cpp)")
    b.add_argument("--predictor-dtype", choices=["auto", "float32", "float16", "int8"], default="auto",
                   help="dtype of the trained predictors' weights (the threshold is tuned on the rounded weights); "
                        "auto (default): int8 with per-row scales folded into the next matrix and the threshold in "
                        "int8/int4 builds, float16 otherwise (also in float32 builds: half the bytes)")
    b.add_argument("--act-criterion", choices=["gate", "product"], default="gate",
                   help="non-ReLU gated FFNs: a neuron is active when |act(gate x)| (gate, CATS; default) or "
                        "|act(gate x)·(up x)| (product: its real output) exceeds the layer's threshold")
    b.add_argument("--sparsity-allocation", choices=["greedy", "uniform"], default="uniform",
                   help="non-ReLU FFNs: the same sparsity in every layer (uniform, default) or per-layer sparsity "
                        "chosen greedily against the calibration loss (greedy)")
    b.add_argument("--allocation-tokens", type=int_range(16, 1 << 31), default=2048, metavar="N",
                   help="calibration tokens the greedy allocation measures the loss on (default 2048)")
    b.add_argument("--input-sparsity", choices=["off", "attention", "all"], default="off",
                   help="TEAL-style input sparsity: |x| thresholds on the inputs of q/k/v and o (attention), and of "
                        "gate/up and down of SiLU/GELU FFNs too (all; build those with --predictor none; ReLU FFNs "
                        "keep their neuron predictor); --act-sparsity is then the fraction of those weight bytes "
                        "skipped per token (default off)")
    b.add_argument("--input-allocation", choices=["greedy", "uniform"], default="greedy",
                   help="input sparsity per tensor: greedy by measured calibration loss per byte saved (default), "
                        "or the same channel sparsity everywhere")
    b.add_argument("--accuracy-budget", type=finite_float(0.0, 10.0, lo_open=True), default=None, metavar="F",
                   help="input sparsity: skip as many bytes as keep the held-out calibration perplexity within "
                        "+F (0.01 = +1 %%) instead of a fixed --act-sparsity")
    b.add_argument("--input-criterion", choices=["magnitude", "weighted"], default="magnitude",
                   help="input sparsity: keep channel i by |x_i| (TEAL; default) or |x_i|·‖W[:, i]‖₂ (WINA: the "
                        "norm of the weight column it multiplies, over every projection reading it)")
    b.add_argument("--input-loss-tokens", type=int_range(16, 1 << 31), default=512, metavar="N",
                   help="held-out calibration tokens the input-sparsity loss curves are measured on (default 512)")
    b.add_argument("--recall-target", type=finite_float(0.0, 1.0, lo_open=True), default=None, metavar="F",
                   help="predictor recall target (default 0.95 when every FFN is ReLU, else 0.99)")
    b.add_argument("--predictor-budget", type=finite_float(0.0, 1.0, lo_open=True), default=0.2, metavar="F",
                   help="predictor parameters as a fraction of FFN parameters (default 0.2)")
    b.add_argument("--predictor-kind", default="linear", choices=["linear", "mlp"],
                   help="linear: low-rank map fitted in closed form, rank chosen for the fewest bytes per token "
                        "(default); mlp: PowerInfer's fc2(relu(fc1 x)) trained with BCE")
    b.add_argument("--placement-batch", type=positive_int, default=64, metavar="N", help="neurons per placement decision")
    b.add_argument("--min-layer-neurons", type=nonnegative_int, default=0, metavar="N",
                   help="a layer on the GPU holds at least N hot neurons (default 0 = off)")
    b.add_argument("--max-memory", type=finite_float(0.0, 1e6, lo_open=True), metavar="GIB",
                   help="memory budget of the build: refused before loading when the estimate from the model's config "
                        "exceeds it (default: the memory this machine has available)")
    b.add_argument("--seed", type=seed_int, default=0)
    b.add_argument("--print-after", action="append", metavar="PASS", help="print the graph after PASS (repeatable; 'all')")
    b.add_argument("--dump-ir", metavar="DIR", help="write the graph after every pass to DIR/NNN_PASS.txt")
    b.add_argument("-q", "--quiet", action="store_true")
    b.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from picompile.builder import build_from_config, default_model
    from picompile.config import BuildConfig

    model = args.model or default_model()
    output = Path(args.output) if args.output else Path(Path(model.rstrip("/")).stem + ".pic")
    config = BuildConfig(
        model=model, output=output, target=args.target, vram_budget_gib=args.vram_budget, pipeline=args.pipeline,
        predictor=args.predictor, max_seq_len=args.max_seq_len, seed=args.seed,
        calibration=Path(args.calibration) if args.calibration else None,
        print_after=split_names(args.print_after), dump_ir=Path(args.dump_ir) if args.dump_ir else None,
        progress=not args.quiet, calibration_tokens=args.calibration_tokens, act_sparsity=args.act_sparsity,
        act_criterion=args.act_criterion, sparsity_allocation=args.sparsity_allocation, allocation_tokens=args.allocation_tokens, recall_target=args.recall_target, predictor_budget=args.predictor_budget,
        predictor_kind=args.predictor_kind,
        placement_batch=args.placement_batch, min_layer_neurons=args.min_layer_neurons, weight_dtype=args.weight_dtype, cpu_mcpu=args.cpu_mcpu,
        quant_block=args.quant_block,
        predictor_dtype=args.predictor_dtype, input_sparsity=args.input_sparsity,
        input_allocation=args.input_allocation, accuracy_budget=args.accuracy_budget,
        input_loss_tokens=args.input_loss_tokens, max_memory_gib=args.max_memory,
        calibration_source=args.calibration_source, input_criterion=args.input_criterion,
    )
    err = console()
    start = time.perf_counter()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, disable=args.quiet, transient=True) as progress:
        task = progress.add_task("loading model", total=None)

        def on_pass(name: str, i: int, n: int) -> None:
            progress.update(task, description=f"pass {name}", completed=i - 1, total=n)

        def emit(text: str) -> None:
            progress.stop()
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

        def track(items: Iterable[Any], description: str) -> Iterator[Any]:
            items = list(items)
            sub = progress.add_task(description, total=len(items))
            for item in items:
                yield item
                progress.advance(sub)
            progress.remove_task(sub)

        out = build_from_config(config, emit=emit, on_pass=on_pass, track=track)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if not args.quiet:
        from picompile.tools.report import measured_line, passes_line

        err.print(f"built [bold]{out}[/bold] for target {config.target} in {time.perf_counter() - start:.1f} s "
                  f"({size / 1e6:.2f} MB)")
        for line in (measured_line(out), passes_line(out)):
            if line:
                err.print(line)
    return 0

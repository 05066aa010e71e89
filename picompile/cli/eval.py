"""``picompile eval ART``: perplexity and zero-shot accuracy, sparse against dense (picompile.tools.evaluate)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from picompile.cli.common import positive_int
from picompile.errors import PicompileError
from picompile.tools import evaluate
from picompile.tools.eval_scoring import Advance
from picompile.tools.eval_sweep import ACT_SWEEP, RELU_SWEEP


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="perplexity and zero-shot accuracy, sparse vs the artifact's dense reference")
    e.add_argument("artifact")
    e.add_argument("--ppl", metavar="FILE", help="text file (needs the artifact's tokenizer) or token file (.npy/.json ids)")
    e.add_argument("--ppl-tokens", type=positive_int, metavar="N", help="score only the first N tokens of --ppl")
    e.add_argument("--stride", type=positive_int, metavar="N", help="sliding-window stride (default: half the context)")
    e.add_argument("--tasks", nargs="+", action="extend", metavar="FILE",
                   help="task jsonl files (piqa/arc/copa {query,choices,gold}; winogrande; rte)")
    e.add_argument("--limit", type=positive_int, metavar="N", help="the first N examples of each task")
    e.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    e.add_argument("--sweep", action="store_true",
                   help="rebuild the source model at several recall targets (ReLU) or act-sparsity values and "
                        "print ppl vs skipped fraction")
    e.add_argument("--sweep-values", metavar="V,V,…", help=f"values to sweep (default recall {RELU_SWEEP} for ReLU, "
                                                         f"act-sparsity {ACT_SWEEP} otherwise)")
    e.add_argument("--vs", choices=["ort"], help="also score the dense model in ONNX Runtime (CPU) as a reference")
    e.add_argument("--cats", action="store_true",
                   help="also rebuild CATS (|act(gate x)| thresholds) at the weight bytes this artifact skips and "
                        "score it on the same inputs (SiLU/GELU models; needs the source model)")
    e.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    e.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    e.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    values = None
    if args.sweep_values:
        try:
            values = [float(v) for v in args.sweep_values.replace(",", " ").split()]
        except ValueError:
            raise PicompileError(f"--sweep-values must be numbers separated by commas, got {args.sweep_values!r}") from None
    if args.sweep and args.ppl is None and not args.tasks:
        raise PicompileError("--sweep needs --ppl FILE (and/or --tasks) to measure each build")
    err = Console(stderr=True, highlight=False)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, disable=args.quiet, transient=True) as bar:
        current: list[Any] = []

        def progress(description: str, total: int) -> Advance:
            for t in current:
                bar.remove_task(t)
            current.clear()
            tid = bar.add_task(description, total=total or None)
            current.append(tid)
            return lambda n=1: bar.advance(tid, n)

        result = evaluate.evaluate(args.artifact, args.ppl, args.tasks or (), args.limit, stride=args.stride,
                          max_tokens=args.ppl_tokens, verify=not args.no_verify, do_sweep=args.sweep,
                          sweep_values=values, vs_ort=args.vs == "ort", cats=args.cats,
                          progress=progress)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        evaluate.render(result, Console(highlight=False))
    return 0

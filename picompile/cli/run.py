"""``picompile run ART``: generate text with an artifact."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from picompile.cli.common import console, finite_float, int_range, nonnegative_int, seed_int, split_names
from picompile.errors import PicompileError


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The load's options (``picompile.load``): how the runtime rewrites the graph, and how to watch it."""
    p.add_argument("--hybrid", choices=["auto", "inline", "thread", "cuda", "off"], default="auto",
                   help="how each FFN's hot (GPU) and cold (CPU) parts run: auto = cuda with a GPU, else inline")
    p.add_argument("--compile", action="store_true",
                   help="fuse the glue between the kernels with torch.compile (faster decode; the first call "
                        "compiles, about a minute for a 1B model, seconds once cached; needs a C++ compiler)")
    p.add_argument("--prefill-dtype", choices=["auto", "weights", "bfloat16"],
                   help="the prompt's GEMM dtype: bfloat16 on copies of the weights (CPUs with AMX or AVX512-BF16: "
                        "faster prefill, coarser logits, more memory), weights (the artifact's own), auto (default: "
                        "bfloat16 for float16 weights on CPUs with AVX512-BF16 but no native float16 GEMM, where "
                        "the copy fits in memory); decode is unchanged")
    p.add_argument("--trust-kernels", action="store_true",
                   help="load the artifact's own compiled kernel libraries (native code: only from a builder you "
                        "trust) instead of compiling them here from their specs (default; cached after the first load)")
    p.add_argument("--print-after", action="append", metavar="STEP",
                   help="print the graph after load step STEP (repeatable, comma-separated; 'all')")
    p.add_argument("--dump-ir", metavar="DIR", help="write the graph after every load step to DIR/NNN_STEP.txt")


def load_kwargs(args: argparse.Namespace, to_stderr: bool = False) -> dict[str, Any]:
    """``picompile.load``'s keyword arguments from ``add_load_arguments``' options (graphs printed to stdout,
    or stderr where stdout carries JSON)."""
    out = sys.stderr if to_stderr else sys.stdout

    def emit(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    return dict(hybrid=args.hybrid, compile=args.compile, prefill_dtype=args.prefill_dtype,
                print_after=split_names(args.print_after), dump_ir=Path(args.dump_ir) if args.dump_ir else None,
                emit=emit, kernels="artifact" if args.trust_kernels else "local")


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="generate text with an artifact")
    r.add_argument("artifact")
    r.add_argument("--prompt", help="prompt text")
    r.add_argument("--ids", help="prompt as token ids (comma or space separated)")
    r.add_argument("-n", type=int_range(0, 1 << 22), default=32, help="new tokens to generate (default 32)")
    r.add_argument("--temperature", type=finite_float(0.0, 1e4), default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=nonnegative_int, default=0)
    r.add_argument("--seed", type=seed_int)
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    add_load_arguments(r)
    r.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    import picompile

    session = picompile.load(args.artifact, verify=not args.no_verify, **load_kwargs(args, to_stderr=args.json))
    if args.ids is not None:
        try:
            prompt: Any = [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            raise PicompileError(f"--ids must be token ids separated by commas or spaces, got {args.ids!r}") from None
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        prompt = [session.eos_id if session.tokenizer is None or session.tokenizer.bos_id is None else session.tokenizer.bos_id]
        if prompt[0] is None:
            raise PicompileError("give --prompt TEXT or --ids (this artifact names no BOS token to start from)")
    start = time.perf_counter()
    new = session.generate(prompt, args.n, temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"prompt": prompt, "ids": new, "text": session.decode(new) if session.tokenizer else None,
                          "seconds": elapsed, "compiled": session.compiled, "load_steps": session.load_steps}))  # seconds include a compilation
        return 0
    if session.tokenizer is not None:
        print(args.prompt + session.decode(new) if isinstance(prompt, str) else session.decode(prompt + new))
    else:
        print(" ".join(str(i) for i in new))
    note = " (including the step's compilation)" if args.compile else ""
    console().print(f"[dim]{len(new)} tokens in {elapsed:.2f} s{note}[/dim]")
    return 0

"""``picompile`` command line: build, run, inspect."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from picompile.errors import PicompileError


def _console(stderr: bool = True) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _split_names(values: list[str] | None) -> list[str]:
    return [n.strip() for v in values or [] for n in v.split(",") if n.strip()]


def cmd_build(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from picompile.builder import build_from_config, default_model
    from picompile.config import BuildConfig

    model = args.model or default_model()
    output = Path(args.output) if args.output else Path(Path(model.rstrip("/")).stem + ".pic")
    config = BuildConfig(
        model=model, output=output, target=args.target, vram_budget_gib=args.vram_budget, pipeline=args.pipeline,
        predictor=args.predictor, max_seq_len=args.max_seq_len, seed=args.seed,
        calibration=Path(args.calibration) if args.calibration else None,
        print_after=_split_names(args.print_after), dump_ir=Path(args.dump_ir) if args.dump_ir else None,
        progress=not args.quiet, calibration_tokens=args.calibration_tokens, act_sparsity=args.act_sparsity,
        act_criterion=args.act_criterion, sparsity_allocation=args.sparsity_allocation, allocation_tokens=args.allocation_tokens, recall_target=args.recall_target, predictor_budget=args.predictor_budget,
        predictor_kind=args.predictor_kind,
        placement_batch=args.placement_batch, min_layer_neurons=args.min_layer_neurons, weight_dtype=args.weight_dtype,
        predictor_dtype=args.predictor_dtype,
    )
    err = _console()
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
        from picompile.artifact import read_manifest

        times = read_manifest(out, verify=False).build.get("pass_seconds", {})
        err.print(f"built [bold]{out}[/bold] for target {config.target} in {time.perf_counter() - start:.1f} s "
                  f"({size / 1e6:.2f} MB); passes: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import picompile

    session = picompile.load(args.artifact, verify=not args.no_verify, hybrid=args.hybrid, compile=args.compile,
                             prefill_dtype=args.prefill_dtype)
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
                          "seconds": elapsed, "compiled": session.compiled}))  # seconds include a compilation
        return 0
    if session.tokenizer is not None:
        print(args.prompt + session.decode(new) if isinstance(prompt, str) else session.decode(prompt + new))
    else:
        print(" ".join(str(i) for i in new))
    note = " (including the step's compilation)" if args.compile else ""
    _console().print(f"[dim]{len(new)} tokens in {elapsed:.2f} s{note}[/dim]")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from picompile.report import inspect_artifact

    return inspect_artifact(Path(args.artifact), as_json=args.json, graph=args.graph, verify=not args.no_verify,
                            profile=args.profile, plot=Path(args.plot) if args.plot else None,
                            export_onnx=Path(args.export_onnx) if args.export_onnx else None,
                            dot=Path(args.dot) if args.dot else None)


# modules that add a subcommand: each has ``add_subcommand(sub)``, which adds a parser whose
# ``fn`` default takes the parsed args and returns the exit code (raising PicompileError on user errors)
EXTRA_COMMANDS: list[str] = ["picompile.evaluate", "picompile.plan", "picompile.bench"]


def parser() -> argparse.ArgumentParser:
    from picompile import __version__
    from picompile.pipeline import PIPELINES
    from picompile.targets import TARGETS

    p = argparse.ArgumentParser(prog="picompile", description="Ahead-of-time compiler for activation-sparse LLM inference.")
    p.add_argument("--version", action="version", version=f"picompile {__version__}")
    p.add_argument("--traceback", action="store_true", help="show the Python traceback of errors")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="compile a model into an artifact directory")
    b.add_argument("model", nargs="?", help="HF checkpoint dir, hub id or llama2.c .bin (default: the embedded model)")
    b.add_argument("--target", default="cpu", help=f"target preset: {', '.join(TARGETS)} (default cpu)")
    b.add_argument("-o", "--output", help="artifact directory (default: MODEL_NAME.pic)")
    b.add_argument("--vram-budget", type=float, metavar="GIB", help="GPU memory budget in GiB (overrides the target)")
    b.add_argument("--pipeline", default="default", choices=list(PIPELINES))
    b.add_argument("--predictor", default="trained", choices=["trained", "oracle", "none"])
    b.add_argument("--max-seq-len", type=int, help="context length of the artifact (default: the model's)")
    b.add_argument("--calibration", help="text or token file (.npy/.json ids) for activation profiling")
    b.add_argument("--calibration-tokens", type=int, default=4096, metavar="N", help="tokens to profile (default 4096)")
    b.add_argument("--act-sparsity", type=float, default=0.5, metavar="F",
                   help="non-ReLU FFNs: mean fraction of neurons counted inactive per layer (default 0.5)")
    b.add_argument("--weight-dtype", choices=["float32", "float16"], default="float32",
                   help="dtype of the linear and FFN weights in the artifact (float16: half the bytes per token; "
                        "activations, norms, embeddings and the KV cache stay float32)")
    b.add_argument("--predictor-dtype", choices=["float32", "float16"], default="float16",
                   help="dtype of the trained predictors' weights (default float16, also in float32 builds: the "
                        "threshold is tuned on the rounded weights, and the predictors cost half the bytes)")
    b.add_argument("--act-criterion", choices=["gate", "product"], default="gate",
                   help="non-ReLU gated FFNs: a neuron is active when |act(gate x)| (gate, CATS; default) or "
                        "|act(gate x)·(up x)| (product: its real output) exceeds the layer's threshold")
    b.add_argument("--sparsity-allocation", choices=["greedy", "uniform"], default="uniform",
                   help="non-ReLU FFNs: the same sparsity in every layer (uniform, default) or per-layer sparsity "
                        "chosen greedily against the calibration loss (greedy)")
    b.add_argument("--allocation-tokens", type=int, default=2048, metavar="N",
                   help="calibration tokens the greedy allocation measures the loss on (default 2048)")
    b.add_argument("--recall-target", type=float, default=None, metavar="F",
                   help="predictor recall target (default 0.95 when every FFN is ReLU, else 0.99)")
    b.add_argument("--predictor-budget", type=float, default=0.2, metavar="F",
                   help="predictor parameters as a fraction of FFN parameters (default 0.2)")
    b.add_argument("--predictor-kind", default="linear", choices=["linear", "mlp"],
                   help="linear: low-rank map fitted in closed form, rank chosen for the fewest bytes per token "
                        "(default); mlp: PowerInfer's fc2(relu(fc1 x)) trained with BCE")
    b.add_argument("--placement-batch", type=int, default=64, metavar="N", help="neurons per placement decision")
    b.add_argument("--min-layer-neurons", type=int, default=0, metavar="N",
                   help="a layer on the GPU holds at least N hot neurons (default 0 = off)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--print-after", action="append", metavar="PASS", help="print the graph after PASS (repeatable; 'all')")
    b.add_argument("--dump-ir", metavar="DIR", help="write the graph after every pass to DIR/NNN_PASS.txt")
    b.add_argument("-q", "--quiet", action="store_true")
    b.set_defaults(fn=cmd_build)

    r = sub.add_parser("run", help="generate text with an artifact")
    r.add_argument("artifact")
    r.add_argument("--prompt", help="prompt text")
    r.add_argument("--ids", help="prompt as token ids (comma or space separated)")
    r.add_argument("-n", type=int, default=32, help="new tokens to generate (default 32)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int)
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    r.add_argument("--hybrid", choices=["auto", "inline", "thread", "cuda", "off"], default="auto",
                   help="how each FFN's hot (GPU) and cold (CPU) parts run: auto = cuda with a GPU, else inline")
    r.add_argument("--compile", action="store_true",
                   help="fuse the glue between the kernels with torch.compile (faster decode; the first call "
                        "compiles, about a minute for a 1B model, seconds once cached; needs a C++ compiler)")
    r.add_argument("--prefill-dtype", choices=["bfloat16"],
                   help="compute the prompt's GEMMs in bfloat16 on copies of the weights (CPUs with AMX or "
                        "AVX512-BF16: faster prefill, coarser logits, more memory); decode is unchanged")
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("inspect", help="summarise an artifact")
    i.add_argument("artifact")
    i.add_argument("--graph", action="store_true", help="print the transformed graph")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.add_argument("--profile", action="store_true", help="per-layer activation sparsity and locality")
    i.add_argument("--plot", metavar="FILE.png", help="draw per-layer activation-frequency curves")
    i.add_argument("--export-onnx", metavar="FILE.onnx", help="write the transformed graph as ONNX (for Netron)")
    i.add_argument("--dot", metavar="FILE.dot", help="write the transformed graph as Graphviz DOT")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    i.set_defaults(fn=cmd_inspect)
    for module in EXTRA_COMMANDS:
        importlib.import_module(module).add_subcommand(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except PicompileError as e:
        if args.traceback:
            raise
        from rich.markup import escape

        _console().print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        return e.exit_code
    except BrokenPipeError:  # e.g. `picompile inspect A --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        _console().print("interrupted; nothing was written")
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The pass pipelines — one visible, named list each — and the runner that executes them.

The runner lints the graph after every pass, prints it after the passes named in
``--print-after``, writes one readable file per pass to ``--dump-ir DIR``, times each pass
and names the pass in any error.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError, PicompileError, named_step
from picompile.ir.graph import format_graph, lint

# PowerInfer's offline half: profile → predictors → placement → predictor nodes → hot/cold split
_SPARSE: list[str] = [
    "capture", "canonicalize-ffn", "fold-kv-repeat", "profile-activations", "allocate-sparsity", "train-predictors",
    "place-neurons", "insert-predictors", "split-ffn", "convert-weights", "fuse-projections",
]
PIPELINES: dict[str, list[str]] = {
    # the sparse hot/cold graph with its parts lowered to TVM kernels
    "default": [*_SPARSE, "lower-tvm", "sparsify-inputs", "package"],
    # the same graph on the reference torch ops (no TVM): what the kernels are checked against
    "reference": [*_SPARSE, "sparsify-inputs", "package"],
    # the model as captured, FFNs in canonical form: what every sparse build is checked against
    "dense": ["capture", "canonicalize-ffn", "fold-kv-repeat", "convert-weights", "package"],
}


def pass_names(pipeline: str) -> list[str]:
    try:
        return list(PIPELINES[pipeline])
    except KeyError:
        raise PicompileError(f"unknown pipeline {pipeline!r}; known: {', '.join(PIPELINES)}") from None


def check_print_after(names: list[str], wanted: list[str]) -> None:
    unknown = [w for w in wanted if w != "all" and w not in names]
    if unknown:
        raise PicompileError(f"--print-after names unknown pass(es) {', '.join(unknown)}; this pipeline runs: {', '.join(names)}")


def run_pipeline(
    ctx: BuildContext,
    names: list[str],
    emit: Callable[[str], None] = print,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
) -> fx.GraphModule:
    """Run the named passes in order on ``ctx``; return the final graph."""
    import picompile.passes  # noqa: F401  (registers every pass)
    from picompile.passes.registry import PASSES

    missing = [n for n in names if n not in PASSES]
    if missing:
        raise PicompileError(f"pipeline names unregistered pass(es): {', '.join(missing)}")
    check_print_after(names, ctx.config.print_after)
    dump: Optional[Path] = ctx.config.dump_ir
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    gm: Optional[fx.GraphModule] = None
    for i, name in enumerate(names, 1):
        if on_pass is not None:
            on_pass(name, i, len(names))
        start = time.perf_counter()
        with named_step("pass", name):
            gm = PASSES[name].fn(gm, ctx)
        ctx.pass_times[name] = time.perf_counter() - start
        if gm is None:
            raise PassError(f"pass {name} returned no graph")
        lint(gm, name)
        text: Optional[str] = None
        if dump is not None:
            text = format_graph(gm)
            (dump / f"{i:03d}_{name}.txt").write_text(f"# after pass {name} ({ctx.pass_times[name]:.2f} s)\n{text}")
        if name in ctx.config.print_after or "all" in ctx.config.print_after:
            emit(f"# ---- graph after pass {name} ----\n{text or format_graph(gm)}")
    assert gm is not None
    return gm

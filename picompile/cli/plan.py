"""``picompile plan MODEL``: predicted decode tokens/s per placement strategy (picompile.tools.plan)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from picompile.cli.common import finite_float, nonnegative_int, positive_int
from picompile.errors import PicompileError
from picompile.targets import TARGETS
from picompile.tools import plan as planner
from picompile.tools.costmodel import DTYPE_BYTES
from picompile.tools.model_shapes import BUILTIN_MODELS
from picompile.tools.plan_inputs import Assumptions


def add_parser(sub: Any) -> None:
    d = Assumptions()
    p = sub.add_parser("plan", help="predict decode tokens/s: hybrid vs llama.cpp layer offload vs CPU",
                       description="Predict decode tokens/s of a model on a target: PowerInfer hybrid, llama.cpp layer offload and CPU-only, side by side.")
    p.add_argument("model", metavar="MODEL_OR_CONFIG",
                   help=f"HF checkpoint dir or config.json, a picompile artifact, or one of: {', '.join(BUILTIN_MODELS)}")
    p.add_argument("--target", default="rtx4090", help=f"target preset: {', '.join(TARGETS)} (default rtx4090)")
    p.add_argument("--vram-budget", type=finite_float(0.0, 1e6), metavar="GIB", help="GPU memory budget in GiB (overrides the target)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), help="weight format (default float16; an artifact: its own)")
    p.add_argument("--sparsity", type=finite_float(0.0, 1.0), metavar="F", help="fraction of FFN neurons inactive per token (synthetic profile)")
    p.add_argument("--locality", type=finite_float(0.0, 1.0, lo_open=True), metavar="F", help="fraction of neurons carrying 80%% of activations (synthetic profile)")
    p.add_argument("--cpu-bandwidth", metavar="GBS", help="host memory bandwidth in GB/s, 'host' (measured here), 'measure' (the read "
                   "bandwidth now: the bound) or 'kernel' (picompile's GEMV kernel now: what its decode reaches)")
    p.add_argument("--gpu-bandwidth", type=finite_float(0.0, 1e6, lo_open=True), metavar="GBS", help="GPU memory bandwidth in GB/s (overrides the target)")
    p.add_argument("--context", type=positive_int, default=d.context, metavar="N", help=f"tokens in the KV cache (default {d.context})")
    p.add_argument("--predictor-recall", type=finite_float(0.0, 1.0, lo_open=True), default=d.predictor_recall, metavar="F")
    p.add_argument("--predictor-overhead", type=finite_float(0.0, 1e3), default=d.predictor_overhead, metavar="F",
                   help=f"false positives / true actives (default {d.predictor_overhead})")
    p.add_argument("--predictor-fraction", type=finite_float(0.0, 1.0), default=d.predictor_fraction, metavar="F",
                   help=f"predictor params / FFN params per layer (default {d.predictor_fraction})")
    p.add_argument("--gpu-sparse", action="store_true", help="the GPU reads only predicted-active hot neurons")
    p.add_argument("--balance", action="store_true",
                   help="hybrid: keep a hot neuron on the GPU only while that shortens the layer (GPU reads all hot rows)")
    p.add_argument("--placement", choices=["auto", "ilp", "greedy"], default=d.placement)
    p.add_argument("--placement-batch", type=positive_int, default=d.placement_batch, metavar="N")
    p.add_argument("--min-layer-neurons", type=nonnegative_int, default=d.min_layer_neurons, metavar="N")
    p.add_argument("--glue", metavar="ART",
                   help="charge each CPU layer the time a built artifact's decode step spends outside its kernels, "
                        "per layer, measured now (norms, rotary, attention, dispatch; it grows with width and heads: "
                        "use an artifact of the model's width, e.g. a --layers 4 build of it)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    a = Assumptions(
        predictor_recall=args.predictor_recall, predictor_overhead=args.predictor_overhead,
        predictor_fraction=args.predictor_fraction, context=args.context, gpu_sparse=args.gpu_sparse, balance=args.balance,
        placement_batch=args.placement_batch, min_layer_neurons=args.min_layer_neurons, placement=args.placement,
    )
    if args.placement_batch < 1 or args.min_layer_neurons < 0:
        raise PicompileError("--placement-batch must be >= 1 and --min-layer-neurons >= 0")
    result = planner.plan(args.model, args.target, vram_budget_gib=args.vram_budget, dtype=args.dtype, sparsity=args.sparsity,
                  locality=args.locality, cpu_bandwidth=args.cpu_bandwidth, gpu_bandwidth=args.gpu_bandwidth, assumptions=a,
                  glue=args.glue)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        planner.print_plan(result)
    return 0

"""``picompile inspect ART``: summarise an artifact (manifest, graph, profile, ONNX/DOT export); with
``--print-after`` / ``--dump-ir``, the graph after the runtime's load steps."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from picompile.cli.run import add_load_arguments, load_kwargs


def add_parser(sub: Any) -> None:
    i = sub.add_parser("inspect", help="summarise an artifact")
    i.add_argument("artifact")
    i.add_argument("--graph", action="store_true", help="print the transformed graph (as built; with --print-after "
                   "STEP: as the runtime's load step STEP leaves it)")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.add_argument("--profile", action="store_true", help="per-layer activation sparsity and locality")
    i.add_argument("--plot", metavar="FILE.png", help="draw per-layer activation-frequency curves")
    i.add_argument("--export-onnx", metavar="FILE.onnx", help="write the transformed graph as ONNX (for Netron)")
    i.add_argument("--dot", metavar="FILE.dot", help="write the transformed graph as Graphviz DOT")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    add_load_arguments(i)  # with --print-after / --dump-ir: the artifact loaded as `picompile run` loads it
    i.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    from picompile.tools.report import inspect_artifact

    watch = bool(args.print_after or args.dump_ir)
    return inspect_artifact(Path(args.artifact), as_json=args.json, graph=args.graph, verify=not args.no_verify,
                            profile=args.profile, plot=Path(args.plot) if args.plot else None,
                            export_onnx=Path(args.export_onnx) if args.export_onnx else None,
                            dot=Path(args.dot) if args.dot else None,
                            load=load_kwargs(args, to_stderr=args.json) if watch else None)

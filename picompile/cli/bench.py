"""``picompile bench ART``: decode and prefill speed against dense PyTorch eager and the peers (picompile.tools.bench)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from picompile.cli.common import nonnegative_int, positive_int
from picompile.tools import bench
from picompile.tools.bench_report import print_report
from picompile.tools.engines import GGUF_TYPES


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="decode / prefill speed of an artifact vs dense PyTorch eager",
                       description=bench.__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--tokens", type=positive_int, default=32, metavar="N", help="decode steps per round (default 32)")
    p.add_argument("--prompt-len", type=positive_int, default=64, metavar="P", help="prompt tokens (default 64)")
    p.add_argument("--repeats", type=positive_int, default=5, metavar="R", help="timed interleaved rounds (default 5)")
    p.add_argument("--threads", type=positive_int, metavar="T", help="torch and TVM threads (default: physical cores)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-dense-artifact", action="store_true", help="skip the load(dense=True) column")
    p.add_argument("--no-extras", action="store_true", help="skip ONNX Runtime and llama.cpp")
    p.add_argument("--gguf", metavar="FILE|auto",
                   help="GGUF of the same weights for the llama.cpp column; 'auto' converts the artifact's source "
                        "checkpoint (cached under <cache>/gguf; needs picompile[bench])")
    p.add_argument("--gguf-type", choices=GGUF_TYPES,
                   help="weight type of --gguf auto's conversion and llama.cpp's KV cache (default: the artifact's, "
                        "f16 for --weight-dtype float16 builds, else f32)")
    p.add_argument("--copy-mib", type=positive_int, default=256, metavar="MIB", help="bandwidth copy buffer (default 256)")
    p.add_argument("--compile", action="store_true",
                   help="also run the step through torch.compile (load(compile=True)); the ratios are then the "
                        "compiled step's, the eager one stays beside it")
    p.add_argument("--prefill-dtype", choices=["weights", "bfloat16"],
                   help="add a column: the step with the prompt's GEMMs in this dtype (load(prefill_dtype=...); "
                        "weights: the artifact's own, beside the default's auto choice), "
                        "and how its prompt logits compare with the default's")
    p.add_argument("--mask-tokens", type=nonnegative_int, default=8, metavar="N",
                   help="decode steps whose masks are counted for bytes/token (0: use the manifest)")
    p.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True, highlight=False)
    with err.status("benchmarking") as status:
        result = bench.run_bench(args.artifact, args.tokens, args.prompt_len, args.repeats, args.threads,
                           dense_artifact=not args.no_dense_artifact, extras=not args.no_extras,
                           gguf=args.gguf, gguf_type=args.gguf_type, copy_mib=args.copy_mib,
                           mask_tokens=args.mask_tokens, compile=args.compile, prefill_dtype=args.prefill_dtype,
                           emit=lambda s: status.update(s))
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print_report(result)
    return 0

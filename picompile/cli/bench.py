"""``picompile bench ART``: decode and prefill speed against dense PyTorch eager and the peers (picompile.tools.bench)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from picompile.cli.common import nonnegative_int, positive_int
from picompile.tools import bench
from picompile.tools.bench_report import print_report
from picompile.tools.llama_bench import BUILD_COMMAND, GGUF_TYPES


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
    p.add_argument("--no-onnxruntime", action="store_true", help="skip ONNX Runtime (keep the other extras)")
    p.add_argument("--no-pytorch", action="store_true",
                   help="skip the PyTorch eager baseline (skipped anyway, with the reason, when its checkpoint and the "
                        "artifact's weights together exceed the memory available)")
    p.add_argument("--warm-each-round", action="store_true",
                   help="for engines whose files together exceed the memory (a 7B beside its GGUF): the artifact's "
                        "weights mapped, not copied (the page cache shared with llama.cpp's mmap, as when each runs "
                        "alone), and an untimed prefill before each timed round of the picompile engines (their "
                        "weights back in the page cache)")
    p.add_argument("--llama-bench", metavar="PATH|auto",
                   help="time llama.cpp with its own llama-bench (tg and pp, -t = --threads), interleaved with the "
                        f"other engines; 'auto': the pinned build in the cache ({BUILD_COMMAND})")
    p.add_argument("--llama-cpp-python", action="store_true",
                   help="also run llama.cpp through llama-cpp-python once, for its greedy tokens (not timed)")
    p.add_argument("--gguf", metavar="FILE|auto",
                   help="the llama.cpp engines' weights (default auto: the artifact's source checkpoint converted "
                        "at --gguf-type, cached under <cache>/gguf; needs the gguf package)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES,
                   help="precision of the auto GGUF (default the artifact's: float32 f32, float16 f16, int8 q8_0, "
                        "int4 q4_0; q8_0/q4_0 made from the f16 file by the build's llama-quantize)")
    p.add_argument("--copy-mib", type=positive_int, default=256, metavar="MIB", help="bandwidth copy buffer (default 256)")
    p.add_argument("--read-mib", type=positive_int, default=512, metavar="MIB",
                   help="read-bandwidth buffer (default 512); its bandwidth gives the bounds")
    p.add_argument("--compile", action="store_true",
                   help="also run the step through torch.compile (load(compile=True)); the ratios are then the "
                        "compiled step's, the eager one stays beside it")
    p.add_argument("--prefill-dtype", choices=["weights", "bfloat16", "bfloat16-stream", "float32"],
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
                           llama_bench=args.llama_bench, llama_cpp_python=args.llama_cpp_python,
                           gguf=args.gguf, gguf_type=args.gguf_type, copy_mib=args.copy_mib, read_mib=args.read_mib,
                           onnxruntime=not args.no_onnxruntime, mask_tokens=args.mask_tokens, compile=args.compile,
                           prefill_dtype=args.prefill_dtype, pytorch=not args.no_pytorch,
                           warm_each_round=args.warm_each_round,
                           emit=lambda s: status.update(s))
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print_report(result)
    return 0

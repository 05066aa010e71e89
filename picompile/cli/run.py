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
                        "compiles, about a minute for a 1B model, half that once cached; needs a C++ compiler)")
    p.add_argument("--prefill-dtype", choices=["auto", "weights", "bfloat16", "bfloat16-stream", "float32"],
                   help="the prompt's GEMM dtype: bfloat16 on copies of the weights made at load (CPUs with AMX or "
                        "AVX512-BF16: faster prefill, coarser logits, the memory of a bfloat16 model), "
                        "bfloat16-stream (the same GEMMs, each weight converted per call: no copy, ~6-20%% slower), "
                        "weights (the artifact's own), auto (default: bfloat16 for float16 weights on CPUs with "
                        "AVX512-BF16 but no native float16 GEMM and for int8/int4 weights, as copies where they "
                        "cost at most an eighth of the memory, streamed otherwise; on CPUs without either: "
                        "float32, copies made once where they cost at most a quarter of the memory); "
                        "decode is unchanged")
    p.add_argument("--dense-prefill-ffn", action="store_true",
                   help="compute every up / down row of a ReLU FFN in prefill (default: only the neurons whose gate "
                        "fired, for int8 / int4 weights; the same maths)")
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
                sparse_prefill=not args.dense_prefill_ffn,
                print_after=split_names(args.print_after), dump_ir=Path(args.dump_ir) if args.dump_ir else None,
                emit=emit, kernels="artifact" if args.trust_kernels else "local")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """How tokens are picked (``runtime.sampling.SamplingParams``), shared by ``run`` and ``chat``."""
    p.add_argument("--temperature", type=finite_float(0.0, 1e4), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens whose probability reaches P (1 = off)")
    p.add_argument("--min-p", type=finite_float(0.0, 1.0), default=0.0,
                   help="drop tokens less likely than P × the most likely one (0 = off)")
    p.add_argument("--repetition-penalty", type=finite_float(1e-3, 1e3), default=1.0,
                   help="divide the positive logits of tokens already seen by this (and multiply negative ones; 1 = off)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this text (repeatable; \\n is a newline)")
    p.add_argument("--seed", type=seed_int)


def sampling_params(args: argparse.Namespace) -> Any:
    from picompile.runtime.sampling import SamplingParams

    stops = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop)  # typed escapes
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, stop=stops).check()


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="generate text with an artifact (streamed as it is produced)")
    r.add_argument("artifact")
    r.add_argument("--prompt", help="prompt text")
    r.add_argument("--ids", help="prompt as token ids (comma or space separated)")
    r.add_argument("-n", type=int_range(0, 1 << 22), default=None,
                   help="new tokens to generate (default 32; more than the context holds is an error)")
    r.add_argument("--max-tokens", type=int_range(0, 1 << 22), default=None,
                   help="new tokens to generate, at most what the context holds (clamped, with a warning)")
    add_sampling_arguments(r)
    r.add_argument("--json", action="store_true", help="one JSON object at the end instead of streamed text")
    r.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    add_load_arguments(r)
    r.set_defaults(fn=cmd)


def _prompt(args: argparse.Namespace, session: Any) -> Any:
    if args.ids is not None:
        try:
            return [int(t) for t in args.ids.replace(",", " ").split()]
        except ValueError:
            raise PicompileError(f"--ids must be token ids separated by commas or spaces, got {args.ids!r}") from None
    if args.prompt is not None:
        return args.prompt
    prompt = [session.eos_id if session.tokenizer is None or session.tokenizer.bos_id is None else session.tokenizer.bos_id]
    if prompt[0] is None:
        raise PicompileError("give --prompt TEXT or --ids (this artifact names no BOS token to start from)")
    return prompt


def _new_tokens(args: argparse.Namespace, session: Any, n_prompt: int) -> int:
    if args.max_tokens is None:
        return 32 if args.n is None else args.n
    room = max(0, session.max_seq_len - n_prompt)
    if args.max_tokens > room:
        console().print(f"[yellow]warning:[/yellow] --max-tokens {args.max_tokens} clamped to {room}: the prompt has "
                        f"{n_prompt} tokens of this artifact's {session.max_seq_len}-token context", highlight=False)
        return room
    return args.max_tokens


def cmd(args: argparse.Namespace) -> int:
    import picompile

    if args.n is not None and args.max_tokens is not None:
        raise PicompileError("give -n or --max-tokens, not both")
    params = sampling_params(args)
    session = picompile.load(args.artifact, verify=not args.no_verify, **load_kwargs(args, to_stderr=args.json))
    prompt = _prompt(args, session)
    n_prompt = len(session._ids(prompt))
    run = session.stream(prompt, _new_tokens(args, session, n_prompt), params)
    out = sys.stdout
    text_mode = session.tokenizer is not None and not args.json
    if text_mode:  # the prompt first, then each token's text as soon as it is chosen
        out.write(args.prompt if isinstance(prompt, str) else session.decode(prompt))
        out.flush()
    start = time.perf_counter()
    gen = run.generation
    for gen in run:
        if args.json:
            continue
        if text_mode:
            if gen.delta:
                out.write(gen.delta)
                out.flush()
        else:
            out.write(f"{gen.tokens[-1]}{'' if gen.done else ' '}")
            out.flush()
    elapsed = time.perf_counter() - start
    new, st = list(gen.tokens), run.stats
    if args.json:
        print(json.dumps({"prompt": prompt, "ids": new, "text": gen.text if session.tokenizer else None,
                          "finish_reason": st.finish_reason, "prompt_tokens": st.prompt_tokens,
                          "prefill_tokens_per_s": st.prefill_tps, "decode_tokens_per_s": st.decode_tps,
                          "seconds": elapsed, "compiled": session.compiled, "load_steps": session.load_steps}))  # seconds include a compilation
        return 0
    out.write("\n")
    out.flush()
    note = " (including the step's compilation)" if args.compile else ""
    console().print(f"[dim]{len(new)} tokens in {elapsed:.2f} s{note}: prefill {st.prompt_tokens} tokens at "
                    f"{st.prefill_tps:.1f} tok/s, decode {st.decode_tps:.1f} tok/s ({st.finish_reason})[/dim]",
                    highlight=False)
    return 0

"""``picompile chat ART``: an interactive conversation in the model's chat template, streamed."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from picompile.cli.common import console, int_range
from picompile.cli.run import add_load_arguments, add_sampling_arguments, load_kwargs, sampling_params
from picompile.errors import InputError

HELP = "type a message; /reset starts over, /exit (or end of input) leaves"


def add_parser(sub: Any) -> None:
    c = sub.add_parser("chat", help="chat with an artifact in its chat template (KV cache kept between turns)")
    c.add_argument("artifact")
    c.add_argument("--template", metavar="FILE",
                   help="a Jinja chat template to use instead of the tokenizer's own (needed when it has none)")
    c.add_argument("--system", metavar="TEXT", help="a system message to start the conversation with")
    c.add_argument("--max-tokens", type=int_range(1, 1 << 22), default=256,
                   help="new tokens per reply at most (default 256; less when the context is fuller)")
    add_sampling_arguments(c)
    c.add_argument("--no-verify", action="store_true", help="skip the checksum check")
    add_load_arguments(c)
    c.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    import picompile
    from picompile.serve.chat import Conversation, read_template

    params = sampling_params(args)
    template = read_template(args.template)
    session = picompile.load(args.artifact, verify=not args.no_verify, **load_kwargs(args, to_stderr=True))
    chat = Conversation(session, template, args.system)
    tty = sys.stdin.isatty()
    err, out = console(), sys.stdout
    if tty:
        err.print(f"[dim]{HELP}[/dim]")
    while True:
        if tty:
            err.print("[bold]>[/bold] ", end="")
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            chat.reset()
            err.print("[dim](conversation reset)[/dim]")
            continue
        try:
            for gen in chat.say(text, args.max_tokens, params):
                if gen.delta:
                    out.write(gen.delta)
                    out.flush()
        except InputError as e:
            err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
            continue
        out.write("\n")
        out.flush()
        st = chat.last_stats
        if tty and st is not None:
            err.print(f"[dim]{st.new_tokens} tokens, prefill {st.prompt_tokens - st.cached_tokens} "
                      f"({st.cached_tokens} cached), decode {st.decode_tps:.1f} tok/s[/dim]", highlight=False)
    return 0

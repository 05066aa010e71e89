"""``picompile`` command line: one module per subcommand, each with ``add_parser(sub)`` and ``cmd(args)``."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from picompile.cli import bench, build, chat, eval, inspect, plan, run, serve
from picompile.cli.common import Parser, console
from picompile.errors import PicompileError

SUBCOMMANDS = (build, run, chat, serve, inspect, eval, plan, bench)


def parser() -> argparse.ArgumentParser:
    from picompile import __version__

    p = Parser(prog="picompile", description="Ahead-of-time compiler for activation-sparse LLM inference.")
    p.add_argument("--version", action="version", version=f"picompile {__version__}")
    p.add_argument("--traceback", action="store_true", help="show the Python traceback of errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = None
    try:
        args = parser().parse_args(argv)
        return int(args.fn(args))
    except PicompileError as e:
        if args is not None and args.traceback:
            raise
        from rich.markup import escape

        console().print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        return e.exit_code
    except BrokenPipeError:  # e.g. `picompile inspect A --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        console().print("interrupted; nothing was written")
        return 130


if __name__ == "__main__":
    sys.exit(main())

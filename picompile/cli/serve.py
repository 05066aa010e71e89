"""``picompile serve ART``: an OpenAI-compatible HTTP server (placeholder until the server lands)."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API")
    s.add_argument("artifact")
    s.set_defaults(fn=cmd)


def cmd(args: argparse.Namespace) -> int:
    from picompile.errors import PicompileError

    raise PicompileError("picompile serve is not available yet")

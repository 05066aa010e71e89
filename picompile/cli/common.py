"""What the subcommands share: the stderr console, comma-separated option lists and numeric option types."""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from picompile.errors import PicompileError


def console(stderr: bool = True) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def split_names(values: list[str] | None) -> list[str]:
    return [n.strip() for v in values or [] for n in v.split(",") if n.strip()]


# ----------------------------------------------------------------------------- numeric option types
# argparse ``type=`` functions: a bad value is an argparse error naming the option (exit 2, one line),
# never a traceback later or a value that silently means something else (nan, inf, negatives).

def _integer(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def int_range(lo: int | None = None, hi: int | None = None) -> Any:
    """An argparse type: an integer in [lo, hi] (either bound may be open)."""
    def parse(text: str) -> int:
        v = _integer(text)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range (must be {_bounds(lo, hi)})")
        return v

    parse.__name__ = "integer"
    return parse


def finite_float(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False) -> Any:
    """An argparse type: a finite float in the range [lo, hi] (``lo_open``/``hi_open``: the bound excluded)."""
    import math

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (
                hi is not None and (v > hi or (hi_open and v == hi))):
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"{v:g} is out of range (must be in {left}{lo if lo is not None else '-inf'}, "
                                             f"{hi if hi is not None else 'inf'}{right})")
        return v

    parse.__name__ = "number"
    return parse


def _bounds(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in {lo}..{hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


positive_int = int_range(1)
nonnegative_int = int_range(0)
SEED_MAX: int = 2**63 - 1
seed_int = int_range(0, SEED_MAX)


class UsageError(PicompileError):
    """A command line argparse rejects (unknown option, bad choice, a value out of range): exit 2, one line."""


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are UsageErrors (printed by ``picompile.cli.main`` like every other
    user error) instead of an exit from inside argparse, so ``main`` returns 2 for them."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: {message}")

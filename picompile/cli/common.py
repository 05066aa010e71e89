"""What the subcommands share: the stderr console and comma-separated option lists."""
from __future__ import annotations

from typing import Any


def console(stderr: bool = True) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def split_names(values: list[str] | None) -> list[str]:
    return [n.strip() for v in values or [] for n in v.split(",") if n.strip()]

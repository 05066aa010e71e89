"""The pass registry: every pass is a named function ``(graph, BuildContext) -> graph``."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

from torch import fx

from picompile.context import BuildContext

PassFn = Callable[[Optional[fx.GraphModule], BuildContext], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn

    @property
    def summary(self) -> str:
        """The pass module's "before → after" docstring."""
        return (sys.modules[self.fn.__module__].__doc__ or "").strip()


PASSES: dict[str, Pass] = {}


def register_pass(name: str) -> Callable[[PassFn], PassFn]:
    def deco(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise ValueError(f"pass {name!r} registered twice")
        PASSES[name] = Pass(name, fn)
        return fn

    return deco

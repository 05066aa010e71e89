"""Running a graph whose weights are stored narrower than it computes (a bfloat16 checkpoint's linear weights,
bound by capture): each weight is widened to float32 as the graph reads it, one tensor at a time, and dropped
after its last use, so the results are exactly those of the float32 model and memory holds one widened weight.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from picompile.ir.patterns import Decider, decider_of


def widened(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in float32 when it is a narrower floating tensor, else ``t`` itself."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float32:
        return t
    return t.float()


class WideningInterpreter(fx.Interpreter):
    """An fx.Interpreter whose get_attr values are widened to float32 (freed after their last use)."""

    def get_attr(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return widened(value) if isinstance(value, torch.Tensor) else value


def float32_decider(gm: fx.GraphModule, node: fx.Node, criterion: str = "gate") -> Decider:
    """:func:`decider_of` with its tensors in float32 (copies only where they are stored narrower)."""
    d = decider_of(gm, node, criterion)
    return dataclasses.replace(d, w=widened(d.w), b=widened(d.b), w_mul=widened(d.w_mul))


def stored_narrow(gm: fx.GraphModule) -> bool:
    """Whether any weight of ``gm`` is stored narrower than float32."""
    return any(t.is_floating_point() and t.dtype != torch.float32 for t in (*gm.parameters(), *gm.buffers()))

"""Running a graph whose weights are stored narrower than it computes (a bfloat16 checkpoint's linear weights,
bound by capture): each weight is widened to float32 as the graph reads it, one tensor at a time, and dropped
after its last use, so the results are exactly those of the float32 model and memory holds one widened weight.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from picompile.formats.tensorfile import release_pages
from picompile.ir.patterns import Decider, decider_of


def widened(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in float32 when it is a narrower floating tensor, else ``t`` itself."""
    if t is None or not t.is_floating_point() or t.dtype == torch.float32:
        return t
    return t.float()


class WideningInterpreter(fx.Interpreter):
    """An fx.Interpreter that widens narrow floating tensor arguments to float32 for each call (the graph computes
    in float32, so only stored weights are narrow): one widened copy at a time, freed when the call returns; the
    resident pages of the mapped weights a call read are released after it (float32 ones too)."""

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stored = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if any(a.dtype != torch.float32 for a in stored):
            args, kwargs = pytree.tree_map_only(torch.Tensor, widened, (args, kwargs))
        out = super().call_function(target, args, kwargs)
        # a mapped weight's pages (narrow or float32) leave this process's memory until it is read again: a run
        # holds one layer's weights, not the checkpoint (tensors that are not mapped are left alone)
        release_pages(stored)
        return out


def float32_decider(gm: fx.GraphModule, node: fx.Node, criterion: str = "gate") -> Decider:
    """:func:`decider_of` with its tensors in float32 (copies only where they are stored narrower)."""
    d = decider_of(gm, node, criterion)
    return dataclasses.replace(d, w=widened(d.w), b=widened(d.b), w_mul=widened(d.w_mul),
                               b_mul=widened(d.b_mul))


def stored_narrow(gm: fx.GraphModule) -> bool:
    """Whether any weight of ``gm`` is stored narrower than float32."""
    return any(t.is_floating_point() and t.dtype != torch.float32 for t in (*gm.parameters(), *gm.buffers()))


def release_stored(gm: fx.GraphModule | None = None) -> int:
    """Drop the resident pages of mapped checkpoint tensors (all of them: ``gm`` is for the reader) after a pass
    has read them: they stay in the page cache, out of this process's memory, until read again."""
    return release_pages()

"""Prefill's logits for the last prompt position only, when the caller needs no others: ``last_logits``.

A prompt's step computes lm_head for every position (``[T, d_model] × [vocab, d_model]ᵀ``: 8.4 GFLOP for 64
tokens of the 1B model, ~6 % of its prefill), but generation reads only the last row: the next token is chosen
from it. ``last_logits(gm)`` puts a ``LogitRows`` selector on lm_head's input in the prefill graph; it passes
every row through (``logits()``, ``eval``, anything that reads every position: unchanged) until its caller
asks for the last row only (``with rows.last_only(): …``, as ``Decoder.feed(ids, last_only=True)`` does), and
then lm_head runs on ``x[..., -1:, :]`` and the step returns ``[1, vocab]`` logits. The KV cache is written the
same either way: only lm_head's input is cut.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor, fx

from picompile.ir.schema import arg, node_op
from picompile.runtime.prefill_stream import StreamedLinear

_LINEARS = ("linear", "tvm_linear")


class LogitRows:
    """lm_head's input rows: all of them, or (inside ``last_only()``) only the last position's."""

    def __init__(self) -> None:
        self.last = False
        self.__name__ = "logit_rows"  # fx's code generation names the call after it

    def __call__(self, x: Tensor) -> Tensor:  # x [..., T, d_model] → [..., T | 1, d_model]
        if not self.last or x.dim() < 2:
            return x
        # a copy with standard strides: the slice's batch stride (T·d) makes torch's matmul give a [1, 1, d]
        # input the bmm path, which copies a transposed bfloat16 weight per call (2 s for a 32000-row lm_head)
        return x[..., -1:, :].clone(memory_format=torch.contiguous_format)

    @contextlib.contextmanager
    def last_only(self) -> Iterator[None]:
        """Within this block steps compute lm_head for the last position only."""
        before, self.last = self.last, True
        try:
            yield
        finally:
            self.last = before

    def __repr__(self) -> str:
        return f"LogitRows(last={self.last})"


def _linear_input(node: object) -> Optional[object]:
    """The input x of a linear node (aten.linear, picompile's linear / tvm_linear, a streamed prefill's
    ``StreamedLinear``); None for any other node."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is torch.ops.aten.linear.default or isinstance(node.target, StreamedLinear):
        return node.args[0]
    if node_op(node) in _LINEARS:
        return arg(node, "x")
    return None


def last_logits(gm: fx.GraphModule) -> tuple[Optional[LogitRows], str]:
    """Insert a ``LogitRows`` before the linear that makes ``gm``'s first output (the logits), in place; returns
    it (None where the logits are not one linear's output: nothing changed) and why not."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None or not isinstance(out.args[0], (tuple, list)) or not out.args[0]:
        return None, "the graph has no logits output"
    lm = out.args[0][0]
    x = _linear_input(lm)
    if x is None or len(lm.users) != 1:
        return None, f"the logits are not one linear layer's own output ({getattr(lm, 'name', lm)})"
    if not isinstance(x, fx.Node):
        return None, f"lm_head {lm.name} takes no graph value as its input"
    rows = LogitRows()
    with gm.graph.inserting_before(lm):
        cut = gm.graph.call_function(rows, (x,))
    lm.replace_input_with(x, cut)
    gm.recompile()
    return rows, ""

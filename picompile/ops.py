"""picompile's graph operators (torch custom ops under ``picompile::``).

Each op has a reference implementation in plain torch (the oracle in tests) and a fake
(meta) implementation so graphs holding it can be exported and re-traced.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

ACTIVATIONS: dict[str, object] = {
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


def apply_act(x: Tensor, act: str) -> Tensor:
    fn = ACTIVATIONS.get(act)
    if fn is None:
        raise ValueError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    return fn(x)  # type: ignore[operator]


@torch.library.custom_op("picompile::ffn", mutates_args=())
def ffn(
    x: Tensor,  # [..., d_model]
    w_up: Tensor,  # [n_neurons, d_model]
    b_up: Optional[Tensor],  # [n_neurons]
    w_gate: Optional[Tensor],  # [n_neurons, d_model]; None for a plain (OPT-style) MLP
    w_down: Tensor,  # [d_model, n_neurons] (nn.Linear layout)
    b_down: Optional[Tensor],  # [d_model]
    act: str,
    layer: int,
) -> Tensor:
    """The canonical FFN: ``down(act(up x))`` or, gated, ``down(act(gate x) * up x)``."""
    up = torch.nn.functional.linear(x, w_up, b_up)  # [..., n_neurons]
    h = apply_act(up, act) if w_gate is None else apply_act(torch.nn.functional.linear(x, w_gate), act) * up
    return torch.nn.functional.linear(h, w_down, b_down)  # [..., d_model]


@ffn.register_fake
def _ffn_fake(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], w_down: Tensor,
              b_down: Optional[Tensor], act: str, layer: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


def is_picompile_op(target: object, name: str | None = None) -> bool:
    """True for a call target of one of our ops (optionally the one named, e.g. "ffn")."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    ns, _, op = target.name().partition("::")
    return ns == "picompile" and (name is None or op.split(".")[0] == name)

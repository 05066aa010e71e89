"""The picompile ops' arguments by name: the one place that knows their positions.

Each op's positions come from its own torch schema (``torch.ops.picompile.<op>.default._schema``, made from
the typed signature in :mod:`picompile.ir.ops`), so a pass, the runtime or a tool asks ``arg(node, "mask")``
and never counts. Graphs written by older builds (fewer trailing arguments) read the schema's defaults.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

import picompile.ir.ops  # noqa: F401  (registers the picompile:: ops whose schemas these are)
from picompile.ir.ops import DirectCall

_MISSING = object()


def op_name(target: object) -> str | None:
    """The picompile op a call target stands for ("ffn", "tvm_linear", …), or None for any other target."""
    if isinstance(target, DirectCall):
        target = target.overload
    if not isinstance(target, torch._ops.OpOverload):
        return None
    ns, _, op = target.name().partition("::")
    return op.split(".")[0] if ns == "picompile" else None


def node_op(node: fx.Node) -> str | None:
    """The picompile op a graph node calls, or None."""
    return op_name(node.target) if node.op == "call_function" else None


@functools.cache
def _arguments(op: str) -> tuple[tuple[str, Any], ...]:
    """(name, default or _MISSING) of each argument of picompile::op, in schema order."""
    schema = getattr(torch.ops.picompile, op).default._schema
    return tuple((a.name, a.default_value if a.has_default_value() else _MISSING) for a in schema.arguments)


def arg_names(op: str) -> tuple[str, ...]:
    """The argument names of picompile::op, in call order."""
    return tuple(name for name, _ in _arguments(op))


def position(op: str, name: str) -> int:
    """Where argument ``name`` of picompile::op stands in a positional call (KeyError naming it when absent)."""
    names = arg_names(op)
    if name not in names:
        raise KeyError(f"picompile::{op} has no argument {name!r}; it takes {', '.join(names)}")
    return names.index(name)


def bind(op: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every argument of a call of picompile::op by name, defaults filled in (for interpreters and kernels)."""
    kwargs = kwargs or {}
    out: dict[str, Any] = {}
    for i, (name, default) in enumerate(_arguments(op)):
        if i < len(args):
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        elif default is not _MISSING:
            out[name] = default
        else:
            raise TypeError(f"picompile::{op} call lacks its argument {name!r}")
    return out


def args_of(node: fx.Node) -> dict[str, Any]:
    """Every argument of a picompile op node by name (defaults filled in)."""
    op = node_op(node)
    if op is None:
        raise TypeError(f"{node.name} is not a picompile op call")
    return bind(op, node.args, node.kwargs)


def arg(node: fx.Node, name: str) -> Any:
    """One argument of a picompile op node by name (its schema default when the call omits it)."""
    return args_of(node)[name]


def call_args(op: str, values: Mapping[str, Any]) -> tuple[Any, ...]:
    """A positional argument tuple for picompile::op from named values: trailing defaults left out (and trailing
    None values whose default is None, so a graph written before an optional argument existed reads the same)."""
    names = arg_names(op)
    unknown = set(values) - set(names)
    if unknown:
        raise KeyError(f"picompile::{op} has no argument {', '.join(sorted(unknown))}; it takes {', '.join(names)}")
    last = max((i for i, (n, default) in enumerate(_arguments(op)) if n in values
                and not (values[n] is None and default is None)), default=-1)
    out: list[Any] = []
    for i, (name, default) in enumerate(_arguments(op)[: last + 1]):
        if name in values:
            out.append(values[name])
        elif default is not _MISSING:
            out.append(default)
        else:
            raise TypeError(f"picompile::{op} call lacks its argument {name!r}")
    return tuple(out)


def set_args(node: fx.Node, **values: Any) -> None:
    """Rewrite some arguments of a picompile op node by name (the call becomes positional)."""
    op = node_op(node)
    if op is None:
        raise TypeError(f"{node.name} is not a picompile op call")
    node.args, node.kwargs = call_args(op, {**args_of(node), **values}), {}


def retarget(node: fx.Node, target: Any, **values: Any) -> None:
    """Point ``node`` at another picompile op, carrying over the arguments the two share by name, plus ``values``."""
    op = op_name(target)
    if op is None:
        raise TypeError(f"{target} is not a picompile op")
    keep = {k: v for k, v in args_of(node).items() if k in arg_names(op)}
    node.target, node.args, node.kwargs = target, call_args(op, {**keep, **values}), {}

"""Reading the ONNX protobuf: nodes with their attributes and source-module scope, ``Constant`` nodes
folded into constants, and the shapes / descriptions of graph inputs and outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from picompile.frontend.onnx.values import attr_value, constant_value, to_numpy


@dataclass
class Node:
    """One ONNX node to run: op type, inputs / outputs (value names), attributes, source-module path."""

    op: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any]
    scope: str


def scope_of(node: Any) -> str:
    """Source-module path of an ONNX node: torch.onnx's ``namespace`` metadata, else ``/a/b/Op`` names."""
    meta = {p.key: p.value for p in node.metadata_props}
    ns = meta.get("namespace")
    if ns:
        segments = [seg.split(": ")[0].strip() for seg in ns.split("/")]
        mods = [s for s in segments[:-1] if s and not s.startswith("_empty_nn_module_stack")]
        return mods[-1] if mods else ""
    if node.name.startswith("/"):
        return ".".join(p for p in node.name.strip("/").split("/")[:-1] if p)
    return ""


def read_nodes(graph: Any) -> tuple[list[Node], dict[str, np.ndarray]]:
    """(the nodes to run, in order; the constants: initializers and ``Constant`` node outputs by name)."""
    consts: dict[str, np.ndarray] = {t.name: to_numpy(t) for t in graph.initializer}
    nodes = []
    for n in graph.node:
        attrs = {a.name: attr_value(a) for a in n.attribute}
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            consts[n.output[0]] = constant_value(attrs)
            continue
        nodes.append(Node(n.op_type, n.name, list(n.input), list(n.output), attrs, scope_of(n)))
    return nodes, consts


def dims_of(vi: Any) -> list[Any]:
    """A value-info's dims: ints where fixed, the symbol name (or None) where not."""
    shape = vi.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim]


def desc(vi: Any) -> str:
    """A value-info as the error messages show it: ``int64 [1, 'seq']``."""
    from onnx import TensorProto

    t = vi.type.tensor_type.elem_type
    name = TensorProto.DataType.Name(t).lower() if t else "?"
    return f"{name} {dims_of(vi)}"

"""Running an ONNX graph node by node in torch: :class:`OnnxGraph`, a module hierarchy mirroring the
source model's (each node runs inside the module it came from, so torch.export records the path in
``nn_module_stack``), with the initializers as parameters under those paths.

Small integer constants stay :class:`~picompile.frontend.onnx.values.Known` (shape arithmetic); a 2-D
float initializer used only as the right operand of ``MatMul`` / ``Gemm`` without transB is stored
transposed (nn.Linear layout ``[d_out, d_in]``) and read as ``W.t()``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from picompile.errors import ModelLoadError
from picompile.frontend.onnx.ops import OPS
from picompile.frontend.onnx.ops_shape import op_split
from picompile.frontend.onnx.proto import Node, read_nodes
from picompile.frontend.onnx.values import KNOWN_MAX_ELEMS, Known, Value, cast_scalar, is_float_dtype, np_dtype

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)+$")

Uses = list[tuple[Node, int]]  # (node, input position) for each read of a value


def _sanitize(part: str) -> str:
    s = re.sub(r"\W", "_", part) or "_"
    return s


def _shared_root(paths: list[str]) -> str:
    """The first path component when every path is it or starts with it (and some path goes deeper)."""
    if not paths:
        return ""
    root = paths[0].split(".", 1)[0]
    if all(p == root or p.startswith(root + ".") for p in paths) and any(p != root for p in paths):
        return root
    return ""


def _uses(nodes: list[Node]) -> dict[str, Uses]:
    uses: dict[str, Uses] = {}
    for n in nodes:
        for i, name in enumerate(n.inputs):
            uses.setdefault(name, []).append((n, i))
    return uses


def _linear_weight(arr: np.ndarray, dtype: torch.dtype, uses: Uses) -> bool:
    """Whether a constant is only ever ``x @ W`` (``W [d_in, d_out]``): stored transposed, as nn.Linear."""
    return (is_float_dtype(dtype) and arr.ndim == 2 and bool(uses) and all(
        i == 1 and (n.op == "MatMul" or (n.op == "Gemm" and not int(n.attrs.get("transB", 0))))
        for n, i in uses))


class _Scope(torch.nn.Module):
    """A module of the source model's hierarchy: holds its parameters and runs the ONNX nodes that
    belonged to it, so torch.export records the module path in ``nn_module_stack``."""

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


@dataclass
class _Param:
    module: torch.nn.Module
    attr: str
    transposed: bool  # stored as Wᵀ (nn.Linear layout); the ONNX value is param.t()


class OnnxGraph(torch.nn.Module):
    """An ONNX graph as a torch module: ``run(feeds)`` evaluates it.

    Built in two steps, so a subclass can set its own attributes first (module names never shadow
    them): ``__init__(opset)``, then ``_load(graph, keep)`` with ``keep`` the graph outputs to return.
    """

    def __init__(self, opset: int) -> None:
        super().__init__()
        self.opset = opset

    def _load(self, graph: Any, keep: set[str]) -> None:
        self._scopes: dict[str, torch.nn.Module] = {"": self}
        self._params: dict[str, _Param] = {}
        self._known: dict[str, Known] = {}
        self._nodes: list[Node] = []
        self._node_scope: list[torch.nn.Module] = []

        nodes, consts = read_nodes(graph)
        # a root every module path shares (the export wrapper's attribute, e.g. FlatDecoder's "model")
        # is dropped, so paths read as in the source model: model.layers.0.mlp.up_proj.weight
        self._root = _shared_root([n.scope for n in nodes if n.scope] + [k for k in consts if _DOTTED.match(k)])
        for n in nodes:
            n.scope = self._strip(n.scope)
        uses = _uses(nodes)
        for name, arr in consts.items():
            self._add_const(name, arr, uses.get(name, []))
        self._nodes = nodes
        self._node_scope = [self._scope(n.scope) for n in nodes]
        self._free = self._free_lists(nodes, keep)

    def _free_lists(self, nodes: list[Node], keep: set[str]) -> list[list[str]]:
        """Per node, the values to drop after it runs: their last use (graph outputs are kept)."""
        last: dict[str, int] = {}
        for i, n in enumerate(nodes):
            for name in n.inputs:
                last[name] = i
        free: list[list[str]] = [[] for _ in nodes]
        for name, i in last.items():
            if name not in keep and name not in self._params and name not in self._known:
                free[i].append(name)
        return free

    # -- construction helpers
    def _scope(self, path: str) -> torch.nn.Module:
        if path in self._scopes:
            return self._scopes[path]
        parent_path, _, last = path.rpartition(".")
        parent = self._scope(parent_path)
        name = _sanitize(last)
        while name in parent._parameters or name in parent._buffers or (
                hasattr(parent, name) and name not in parent._modules):
            name += "_"
        if name not in parent._modules:
            parent.add_module(name, _Scope())
        self._scopes[path] = parent._modules[name]  # type: ignore[assignment]
        return self._scopes[path]

    def _add_const(self, name: str, arr: np.ndarray, uses: Uses) -> None:
        dtype = np_dtype(arr)
        small = arr.size <= KNOWN_MAX_ELEMS and arr.ndim <= 1
        if small and (not is_float_dtype(dtype) or arr.size == 1):
            self._known[name] = Known([cast_scalar(v, dtype) for v in arr.reshape(-1).tolist()], arr.shape, dtype)
            return
        tensor = torch.from_numpy(arr).to(dtype)
        transposed = _linear_weight(arr, dtype, uses)
        if transposed:
            tensor = tensor.t().contiguous()  # nn.Linear layout [d_out, d_in]
        module, attr = self._param_slot(self._param_path(name, uses))
        if is_float_dtype(dtype):
            module.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            module.register_buffer(attr, tensor)
        self._params[name] = _Param(module, attr, transposed)

    def _param_slot(self, path: str) -> tuple[torch.nn.Module, str]:
        """(module, free attribute name) for a parameter path ``a.b.weight``."""
        mod_path, _, attr = path.rpartition(".")
        module = self._scope(mod_path)
        attr = _sanitize(attr)
        base, k = attr, 0
        while attr in module._parameters or attr in module._buffers or hasattr(module, attr):
            k += 1
            attr = f"{base}_{k}"
        return module, attr

    def _strip(self, path: str) -> str:
        if not self._root:
            return path
        return "" if path == self._root else path[len(self._root) + 1:] if path.startswith(self._root + ".") else path

    def _param_path(self, name: str, uses: Uses) -> str:
        if _DOTTED.match(name) and not name.startswith("onnx::"):
            return self._strip(name)
        scopes = {n.scope for n, _ in uses}
        if len(scopes) == 1 and "" not in scopes:
            (scope,) = scopes
            if all((n.op in ("MatMul", "Gemm") and i == 1) for n, i in uses):
                return f"{scope}.weight"
            if all((n.op == "Add" or (n.op == "Gemm" and i == 2)) for n, i in uses):
                return f"{scope}.bias"
            return f"{scope}.{_sanitize(name)}"
        return f"onnx_constants.{_sanitize(name)}"

    # -- running
    def _value(self, name: str, env: dict[str, Value]) -> Optional[Value]:
        if not name:
            return None
        if name in env:
            return env[name]
        if name in self._known:
            return self._known[name]
        p = self._params.get(name)
        if p is None:
            raise ModelLoadError(f"ONNX graph reads undefined value {name!r}")
        t = getattr(p.module, p.attr)
        return t.t() if p.transposed else t

    def _exec(self, i: int, env: dict[str, Value]) -> None:
        node = self._nodes[i]
        ins = [self._value(n, env) for n in node.inputs]
        fn = OPS[node.op]
        if node.op == "Split":
            outs = op_split(ins, node.attrs, self.opset, n_out=len(node.outputs))
        else:
            outs = fn(ins, node.attrs, self.opset)
        for name, v in zip(node.outputs, outs):
            if name:
                env[name] = v

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, Value]:
        """Evaluate the graph on ``feeds``; returns the environment holding the graph outputs."""
        env: dict[str, Value] = dict(feeds)
        for i, scope in enumerate(self._node_scope):
            if scope is self:
                self._exec(i, env)
            else:
                scope(self._exec, i, env)
            for name in self._free[i]:
                env.pop(name, None)
        return env

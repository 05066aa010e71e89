"""A decode graph run from C++ (``graph_exec.cpp``, ``picompile_exec``): one Python call per step.

An eager step is the GraphModule's Python code: one interpreted line per node, each a torch call whose dispatch
costs a few µs at one token. When every node of the decode graph is a torch operator (aten or
``picompile_native``, as ``native-calls`` and ``native-glue`` leave a one-token step), an int operation on sizes
or a getitem, ``ExecStep`` lists them as instructions over a register file — each operator found by its schema
name, its arguments bound by the schema's names and defaults, registers freed after their last read — and a
C++ ``Program`` runs the list through the dispatcher's boxed calls. The operators, their arguments and their
order are the graph's: the same floats, bit for bit. A graph with any other node (a Python function, a hybrid
scheduler) stays a GraphModule and ``why_not`` says which node. Not a graph rewrite: how the decode form runs,
as ``torch.compile`` is (``Session.decode_exec``).
"""
from __future__ import annotations

import hashlib
import operator
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, fx

from picompile.ir.graph import is_view

SOURCE = Path(__file__).with_name("graph_exec.cpp")
_STATE: dict[str, Any] = {}  # "module": the built extension, "error": why it could not be built

INT_OPS = {operator.add: 0, operator.sub: 1, operator.mul: 2, operator.floordiv: 3}


class Unsupported(Exception):
    """A node the C++ program cannot run."""


def load_module() -> Any:
    """The built ``picompile_exec`` module (built once per source version), or a str: why not."""
    if "module" not in _STATE and "error" not in _STATE:
        try:
            from .extension import load_extension

            tag = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
            _STATE["module"] = load_extension(f"picompile_exec_{tag}", [str(SOURCE)], extra_cflags=["-O2"])
        except Exception as e:  # no compiler, no headers: the GraphModule runs
            _STATE["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return _STATE.get("module", _STATE.get("error"))


def _list_kind(arg_type: Any) -> str | None:
    """The instruction's list kind for a schema list type ("li" ints, "lt" tensors, "lot" optional tensors)."""
    if not isinstance(arg_type, torch.ListType):
        return None
    elem = arg_type.getElementType()
    if isinstance(elem, torch.IntType):
        return "li"
    if isinstance(elem, torch.TensorType):
        return "lt"
    if isinstance(elem, torch.OptionalType) and isinstance(elem.getElementType(), torch.TensorType):
        return "lot"
    return None


class _Builder:
    """The instruction list of one graph: registers, constants, inputs, outputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.reg: dict[fx.Node, int] = {}
        self.consts: list[tuple[int, Any]] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.instrs: list[tuple[Any, ...]] = []
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.late: list[str] = []  # attributes read at each call (the graph writes them: a caller may swap them)
        self.late_regs: list[int] = []

    def ref(self, node: fx.Node) -> int:
        if node not in self.reg:
            raise Unsupported(f"{node.name} is read before it is computed")
        return self.reg[node]

    def spec(self, value: Any, arg_type: Any = None) -> tuple[Any, ...]:
        if isinstance(value, fx.Node):
            return ("r", self.ref(value))
        if isinstance(value, (list, tuple)) and any(isinstance(v, fx.Node) for v in value):
            kind = _list_kind(arg_type)
            if kind is None:
                raise Unsupported(f"a list of values computed in the graph as {arg_type}")
            items = []
            for v in value:
                if isinstance(v, fx.Node):
                    items.append((self.ref(v), 0))
                elif v is None and kind == "lot":
                    items.append((-1, 0))
                elif isinstance(v, int) and kind == "li":
                    items.append((-1, int(v)))
                else:
                    raise Unsupported(f"{v!r} in a list of {arg_type}")
            return (kind, items)
        if isinstance(value, (fx.Node, slice)) or callable(value) and not isinstance(value, torch.dtype):
            raise Unsupported(f"argument {value!r}")
        return ("c", value)

    def op_args(self, node: fx.Node) -> list[tuple[Any, ...]]:
        schema = node.target._schema  # type: ignore[union-attr]
        args = list(node.args)
        specs = []
        for i, a in enumerate(schema.arguments):
            if i < len(args) and not a.kwarg_only:
                specs.append(self.spec(args[i], a.type))
            elif a.name in node.kwargs:
                specs.append(self.spec(node.kwargs[a.name], a.type))
            elif a.has_default_value():
                specs.append(("d",))
            else:
                raise Unsupported(f"{node.name}: no value for {schema.name}'s {a.name}")
        extra = set(node.kwargs) - {a.name for a in schema.arguments}
        if len(args) > sum(not a.kwarg_only for a in schema.arguments) or extra:
            raise Unsupported(f"{node.name}: arguments {schema.name} does not take")
        return specs

    def written(self) -> set[fx.Node]:
        """The get_attr nodes whose tensor the graph writes in place (through views): the KV arenas."""
        out: set[fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            for i, a in enumerate(node.target._schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write or i >= len(node.args):
                    continue
                v = node.args[i]
                while isinstance(v, fx.Node) and v.op == "call_function" and is_view(v):
                    v = v.args[0]
                if isinstance(v, fx.Node) and v.op == "get_attr":
                    out.add(v)
        return out

    def build(self) -> None:
        written = self.written()
        last: dict[fx.Node, int] = {}
        for node in self.gm.graph.nodes:
            for a in node.all_input_nodes:
                last[a] = self.order[node]
        frees_at: dict[int, list[fx.Node]] = {}
        for n, i in last.items():
            frees_at.setdefault(i, []).append(n)
        for node in self.gm.graph.nodes:
            if node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
                if not all(isinstance(o, fx.Node) for o in outs):
                    raise Unsupported("an output that is not a computed value")
                self.outputs = [self.ref(o) for o in outs]
                self.single = not isinstance(node.args[0], (list, tuple))
                continue
            r = self.reg[node] = len(self.reg)
            if node.op == "placeholder":
                self.inputs.append(r)
                continue
            if node.op == "get_attr" and node in written:
                self.late.append(str(node.target))
                self.late_regs.append(r)
                continue
            if node.op == "get_attr":
                obj = self.gm
                for part in str(node.target).split("."):
                    obj = getattr(obj, part)
                if not isinstance(obj, Tensor):
                    raise Unsupported(f"{node.name}: attribute {node.target} is not a tensor")
                self.consts.append((r, obj))
                continue
            if node.op != "call_function":
                raise Unsupported(f"{node.name}: a {node.op} node")
            frees = [self.reg[n] for n in frees_at.get(self.order[node], []) if self._freeable(n)]
            frees += [r] if not node.users else []
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                s = target._schema
                self.instrs.append(("op", (s.name, s.overload_name), self.op_args(node), [r], frees))
            elif target in INT_OPS and len(node.args) == 2 and not node.kwargs:
                specs = [self.spec(a) for a in node.args]
                if any(s[0] == "c" and not isinstance(s[1], int) for s in specs):
                    raise Unsupported(f"{node.name}: {target.__name__} of non-ints")
                self.instrs.append(("int", INT_OPS[target], specs, [r], frees))
            elif target is operator.getitem and isinstance(node.args[1], int):
                self.instrs.append(("getitem", node.args[1], [self.spec(node.args[0])], [r], frees))
            else:
                raise Unsupported(f"{node.name} calls {getattr(target, '__name__', target)}, not a torch operator")

    def _freeable(self, node: fx.Node) -> bool:
        return node.op == "call_function" or node.op == "placeholder"


class ExecStep:
    """``gm``'s step run by a C++ ``Program``: called as the GraphModule is (``*inputs`` → its outputs)."""

    def __init__(self, gm: fx.GraphModule, module: Any) -> None:
        b = _Builder(gm)
        b.build()
        self.graph_module = gm  # what it runs (print it, inspect it)
        self.n_instructions = len(b.instrs)
        self._single = b.single
        self._late = [operator.attrgetter(name) for name in b.late]  # read at each call: the tensors it writes
        # (a batch's prefill swaps the KV arenas)
        self._program = module.Program(len(b.reg), b.consts, b.inputs + b.late_regs, b.outputs, b.instrs)

    def __call__(self, *inputs: Tensor) -> Any:
        gm = self.graph_module
        out = self._program.run([*inputs, *(get(gm) for get in self._late)])
        return out[0] if self._single else out


def why_not(gm: fx.GraphModule) -> str:
    """Why ``gm`` cannot run as a C++ program ("" when it can)."""
    try:
        _Builder(gm).build()
    except Unsupported as e:
        return str(e)
    return ""


def exec_step(gm: fx.GraphModule) -> tuple[ExecStep | None, str]:
    """(the C++ program running ``gm``, "") or (None, why not)."""
    why = why_not(gm)
    if why:
        return None, why
    module = load_module()
    if isinstance(module, str):
        return None, module
    try:
        return ExecStep(gm, module), ""
    except RuntimeError as e:  # an operator or argument the C++ side refuses: the GraphModule runs
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


__all__: Sequence[str] = ["ExecStep", "exec_step", "load_module", "why_not"]

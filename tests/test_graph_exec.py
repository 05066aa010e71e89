"""runtime/graph_exec.py: a graph of torch operators run by the C++ program gives the GraphModule's outputs bit
for bit (numbers read as Python passes them, sizes computed as ints, multi-output ops), reads the tensors it
writes from the module at each call, and refuses a graph with any other node, naming it."""
from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from picompile.runtime import graph_exec
from picompile.runtime.graph_exec import exec_step, why_not


@pytest.fixture(scope="module", autouse=True)
def module() -> None:
    if isinstance(graph_exec.load_module(), str):
        pytest.skip(f"picompile_exec could not be built here: {graph_exec.load_module()}")


def _f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a = x * 0.5 + y.unsqueeze(0) + 3  # [n, 3]: float and int numbers as wrapped tensors
    n = a.shape[0]
    b = a.reshape(n * 3 // 3, -1)  # sizes as ints
    c = torch.cat([b, b * 2], -1)  # [n, 6]
    v, i = c.max(-1)  # two outputs
    pos = torch.arange(n) + n  # an int added to a tensor
    return torch.softmax(c, -1), v, i, pos


def test_program_gives_the_graphs_outputs() -> None:
    x, y = torch.randn(4, 3), torch.randn(3)
    gm = make_fx(_f, tracing_mode="symbolic")(x, y)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.sym_size.int" in targets and any("getitem" in t for t in targets)  # the paths under test
    step, why = exec_step(gm)
    assert why == "" and step is not None and step.n_instructions > 8
    for n in (4, 7):  # another length: the sizes are read at run time
        x = torch.randn(n, 3)
        want, got = gm(x, y), step(x, y)
        assert len(got) == len(want) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


def test_written_tensors_are_read_at_each_call() -> None:
    aten = torch.ops.aten
    root = torch.nn.Module()
    root.register_buffer("arena", torch.zeros(8, 2))
    graph = fx.Graph()
    x = graph.placeholder("x")
    arena = graph.get_attr("arena")
    n = graph.call_function(aten.sym_size.int, (x, 0))
    graph.call_function(aten.copy_.default, (graph.call_function(aten.slice.Tensor, (arena, 0, 0, n)), x))
    graph.output(graph.call_function(aten.sum.dim_IntList, (arena, [0])))
    gm = fx.GraphModule(root, graph)
    step, why = exec_step(gm)
    assert why == "" and step is not None
    x = torch.randn(3, 2)
    assert torch.equal(step(x), x.sum(0)) and torch.equal(gm.arena[:3], x)
    other = torch.zeros(8, 2)
    gm.arena = other  # swapped, as a batch's prefill swaps the KV arenas: the program writes the new one
    step(2 * x)
    assert torch.equal(other[:3], 2 * x)


def _python(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_a_python_call_is_refused_by_name() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(_python, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert "_python" in why_not(gm)
    step, why = exec_step(gm)
    assert step is None and "not a torch operator" in why

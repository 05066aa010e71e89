"""Compile a loaded step graph with ``torch.compile`` (TorchInductor's CPU C++ backend).

graph of ~1,400 aten glue nodes around picompile's kernels → a few dozen fused C++ loops around the same
kernels. The glue (RMSNorm, rotary embedding, attention, residual adds, KV-cache writes) costs ~20 ms
of an ~80 ms 1B decode step when every node is a separate eager dispatch; compiled, the step is 13–15 %
faster (measured, llama-1b-relu f16). picompile ops stay opaque calls (their fake implementations give
inductor the shapes), except the trivial ones: ``merge`` becomes its adds and an FFN part without rows its
zeros, which inductor folds into the residual add; a prefill linear on a bfloat16 copy becomes its casts
and ``aten.linear``, so its activation casts fuse into the loops around the GEMM (4–7 % faster prefill, 1B
int4). Hybrid-scheduled FFN layers stay opaque too (``HybridFFN``: a graph break each, so their threads,
streams and events never enter a traced graph); with ``hybrid="auto"`` on a machine where that means
"inline", the unscheduled graph is compiled instead.

The decode graph's kernel calls become C++ ops (``runtime/native.py``: mask → rows, output allocation and
the TVM call in C++) and its wrapper is inductor's generated C++, so a decode step runs no Python between
its kernels except the hybrid schedulers' (1B f16: 58.3 against 65.4 ms per step with the Python ops).
Its attention becomes two small matmuls and a softmax instead of torch's flash-attention call
(``runtime/decode_attention.py``; 49.8 against 52.4 ms per 1B f16 step, one process, 8 interleaved rounds).

These rewrites are load steps (``runtime/load_steps.py``: opaque-calls, inline-trivial, native-calls,
decode-attention), run by the session on its prefill and decode forms; :func:`compile_step` compiles the result.

Shapes are dynamic (the KV length grows every step): one graph for prefill, one for decode, compiled at
their first calls (1B int4 on 2 cores, AMD Zen 4: 74 s the first time; 33 s in a later process, once
inductor's on-disk cache holds both graphs: dynamo still traces them). The native decode graph names its
kernels by stable ids, not addresses, so its code, and the cache key, are the same in every process. Needs a
C++ compiler at load time, as inductor does.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor, fx

from picompile.errors import InputError, PicompileError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import DirectCall
from picompile.ir.schema import args_of, node_op
from picompile.runtime.hybrid import PART_OPS, HybridFFN, resolve_mode

StepFn = Callable[..., tuple[Tensor, ...]]  # (ids [1, seq], *past) -> (logits, *presents), or (logits,) in place


def _opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a call torch.compile runs eagerly (a graph break), keeping fx's name for it."""

    @torch._dynamo.disable  # type: ignore[misc]
    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = getattr(fn, "__name__", "opaque")
    return call


def transparent_mode(hybrid: str, target_has_gpu: bool) -> str:
    """The hybrid mode to compile: "auto" that would resolve to "inline" becomes "off" — the graph as built
    computes the same (hot, then cold, then merge) and the compiler sees through it, where an inline
    scheduler is an opaque call. Other modes stay as asked."""
    return "off" if hybrid == "auto" and resolve_mode(hybrid, target_has_gpu) == "inline" else hybrid


def check_compiler() -> None:
    """Fail early, with the reason, where inductor cannot build C++ (no compiler on PATH)."""
    import shutil

    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise InputError("compile=True needs a C++ compiler (g++ or clang++) on PATH for TorchInductor; "
                         "none was found (load without compile)")


def _inline_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Rewrite ``node`` into aten ops inductor can fuse when it is trivial: ``merge(hot, cold, bias, layer)`` is
    ``hot + cold (+ bias)``, and an FFN part with no rows (every neuron on the other device) is zeros — so an
    empty hot part and its merge fold away instead of costing two opaque calls per layer; a linear on a bfloat16
    weight (prefill) is its casts and GEMM. True if it was."""
    graph, op = gm.graph, node_op(node)
    if op not in ("merge", "linear", *PART_OPS):
        return False
    a = args_of(node)
    if op == "merge":
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.aten.add.Tensor, (a["hot"], a["cold"]))
            if a["bias"] is not None:
                out = graph.call_function(torch.ops.aten.add.Tensor, (out, a["bias"]))
    elif op in PART_OPS and get_tensor(gm, a["w_up"]).shape[0] == 0:
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.aten.zeros_like.default, (a["x"],))
    elif op == "linear" and _bf16_linear(gm, a):
        out = _aten_bf16_linear(graph, node, a)
    else:
        return False
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


def _bf16_linear(gm: fx.GraphModule, a: dict[str, Any]) -> bool:
    """A ``picompile::linear`` on a bfloat16 weight (prefill's ``compute-dtype`` copies), no quantization scales."""
    w, x = a["w"], a["x"]
    x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (a.get("s") is None and isinstance(w, fx.Node) and w.op == "get_attr"
            and get_tensor(gm, w).dtype == torch.bfloat16
            and isinstance(x_val, Tensor) and x_val.dtype == torch.float32)


def _aten_bf16_linear(graph: fx.Graph, node: fx.Node, a: dict[str, Any]) -> fx.Node:
    """``lin(x, w) (+ b)`` for a bfloat16 ``w`` as the aten ops it runs — x rounded to bfloat16, the bfloat16 GEMM,
    the result widened back, then b — so that inductor fuses the two casts into the loops around the GEMM instead
    of copying each activation twice per call (the same floats: ``ir.ops.lin``)."""
    cast = torch.ops.prims.convert_element_type.default
    with graph.inserting_before(node):
        xb = graph.call_function(cast, (a["x"], torch.bfloat16))
        yb = graph.call_function(torch.ops.aten.linear.default, (xb, a["w"]))
        out = graph.call_function(cast, (yb, torch.float32))
        if a["b"] is not None:
            out = graph.call_function(torch.ops.aten.add.Tensor, (out, a["b"]))
    return out


def inline_trivial(gm: fx.GraphModule) -> int:
    """Every trivial picompile op of ``gm`` (merges, FFN parts without rows, linears on bfloat16 copies) as aten
    ops, in place; how many."""
    count = sum(_inline_node(gm, node) for node in list(gm.graph.nodes) if node.op == "call_function")
    gm.recompile()
    return count


def opaque_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its weights, where picompile ops are their torch op overloads again
    (inductor calls them through their fake implementations' shapes, where a ``DirectCall`` would be
    traced into) and hybrid schedulers are opaque calls (graph breaks)."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, DirectCall):
            node.target = node.target.overload
        elif isinstance(node.target, HybridFFN):
            node.target = _opaque(node.target)
    return fx.GraphModule(gm, graph)  # its buffers are gm's tensors


def _opaque_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """What the compiler gets of ``gm``: :func:`opaque_calls`, then :func:`inline_trivial` (load steps
    ``opaque-calls`` and ``inline-trivial``)."""
    out = opaque_calls(gm)
    inline_trivial(out)
    return out


def compile_step(decode_gm: fx.GraphModule, prefill_gm: fx.GraphModule) -> StepFn:
    """The compiled step: one token runs ``decode_gm``, several ``prefill_gm`` — each the load steps' compiler
    form of the session's graph (``opaque-calls``, ``inline-trivial``; decode also ``native-calls`` and
    ``decode-attention``), two distinct modules (each with its own compiled graphs)."""
    check_compiler()
    # two copies, each with its own generated code (so its own compiled graphs): prefill's fused loops use
    # every thread, decode's run on one — a decode step's glue is tiny, and waking OpenMP workers for each
    # loop costs more than it saves (measured: 53.9 against 55.5 ms per 1B f16 step, while one-thread
    # loops slowed prefill from 74 to 67 tok/s); the kernels and torch's GEMMs keep every thread
    prefill = torch.compile(prefill_gm, dynamic=True)
    # no C++ wrapper (it measured ~4 % faster per step): torch 2.13's wrapper calls a fallback op through
    # callBoxed with the node's arguments minus trailing defaults, which the dispatcher then reads past —
    # heap corruption for every picompile op called without its trailing optional arguments (the int8/int4
    # scale arguments s_up, s_gate, s_down of float artifacts); the Python wrapper fills defaults in
    decode = torch.compile(decode_gm, dynamic=True, options={"cpp.threads": 1})

    def step(ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        for t in past:  # the KV length varies: one decode graph for every length (no recompile at +1)
            if t.dim() == 4 and t.shape[2] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 2)
        try:
            out = (decode if ids.shape[-1] == 1 else prefill)(ids, *past)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # inductor could not build the step
            why = (str(e.inner_exception).splitlines() or [""])[0]
            raise PicompileError(f"torch.compile could not compile this artifact's step "
                                 f"({type(e.inner_exception).__name__}: {why}); load it without compile") from e
        # inductor may return a present as a strided view (prefill: cat with the empty past elided); the
        # next step's graph is guarded on strides, so every present is handed on contiguous
        return tuple(o if o.is_contiguous() else o.contiguous() for o in out)

    return step

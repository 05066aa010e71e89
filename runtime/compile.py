"""Compile a loaded step graph with ``torch.compile`` (TorchInductor's CPU C++ backend).

graph of ~1,400 aten glue nodes around picompile's kernels → a few dozen fused C++ loops around the same
kernels. The glue (RMSNorm, rotary embedding, attention, residual adds, KV-cache writes) costs ~20 ms
of an ~80 ms 1B decode step when every node is a separate eager dispatch; compiled, the step is 13–15 %
faster (measured, llama-1b-relu f16). picompile ops stay opaque calls (their fake implementations give
inductor the shapes), except the trivial ones: ``merge`` becomes its adds and an FFN part without rows its
zeros, which inductor folds into the residual add. Hybrid-scheduled FFN layers stay opaque too
(``HybridFFN``: a graph break each, so their threads, streams and events never enter a traced graph);
with ``hybrid="auto"`` on a machine where that means "inline", the unscheduled graph is compiled instead.

The decode graph's kernel calls become C++ ops (``runtime/native.py``: mask → rows, output allocation and
the TVM call in C++) and its wrapper is inductor's generated C++, so a decode step runs no Python between
its kernels except the hybrid schedulers' (1B f16: 58.3 against 65.4 ms per step with the Python ops).
Its attention becomes two small matmuls and a softmax instead of torch's flash-attention call
(``runtime/decode_attention.py``; 49.8 against 52.4 ms per 1B f16 step, one process, 8 interleaved rounds).

Shapes are dynamic (the KV length grows every step): one graph for prefill, one for decode, compiled at
their first calls (about a minute for a 1B model on 2 cores the first time, seconds once inductor's
on-disk cache holds them). Needs a C++ compiler at load time, as inductor does.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor, fx

from picompile.errors import InputError, PicompileError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import DirectCall, is_picompile_op
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


def _inline_trivial(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node) -> None:
    """Rewrite ``node`` into aten ops inductor can fuse when it is trivial: ``merge(hot, cold, b, layer)`` is
    ``hot + cold (+ b)``, and an FFN part with no rows (every neuron on the other device) is zeros — so an
    empty hot part and its merge fold away instead of costing two opaque calls per layer."""
    if is_picompile_op(node.target, "merge"):
        hot, cold, bias = node.args[:3]
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.aten.add.Tensor, (hot, cold))
            if bias is not None:
                out = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
    elif any(is_picompile_op(node.target, op) for op in PART_OPS) and get_tensor(gm, node.args[1]).shape[0] == 0:
        with graph.inserting_before(node):
            out = graph.call_function(torch.ops.aten.zeros_like.default, (node.args[0],))
    else:
        return
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _opaque_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its weights, where picompile ops are their torch op overloads again
    (inductor calls them through their fake implementations' shapes, where a ``DirectCall`` would be
    traced into), trivial ones are aten ops (``_inline_trivial``) and hybrid schedulers are opaque calls."""
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if isinstance(node.target, DirectCall):
            node.target = node.target.overload
        if isinstance(node.target, HybridFFN):
            node.target = _opaque(node.target)
        else:
            _inline_trivial(gm, graph, node)
    return fx.GraphModule(gm, graph)  # its buffers are gm's tensors


def compile_step(gm: fx.GraphModule, prefill_gm: fx.GraphModule | None = None, native: bool = True,
                 matmul_attention: bool = True) -> StepFn:
    """The compiled step of a loaded graph ``gm`` (several tokens: of ``prefill_gm`` when given, e.g. the same
    graph without neuron masks), which is left as it is (the graph to inspect and interpret); the compiled
    copies share its weights."""
    check_compiler()
    # two copies, each with its own generated code (so its own compiled graphs): prefill's fused loops use
    # every thread, decode's run on one — a decode step's glue is tiny, and waking OpenMP workers for each
    # loop costs more than it saves (measured: 53.9 against 55.5 ms per 1B f16 step, while one-thread
    # loops slowed prefill from 74 to 67 tok/s); the kernels and torch's GEMMs keep every thread
    # decode's graph also gets inductor's C++ wrapper: the step's ~90 kernel calls and fused loops are
    # launched from generated C++ instead of a generated Python function (measured: 61.2 against 63.8 ms
    # per 1B f16 step, one process, 8 interleaved rounds, faster in every round); prefill's wrapper time is
    # nothing next to its GEMMs, so it keeps the Python wrapper, which compiles faster
    prefill = torch.compile(_opaque_copy(prefill_gm if prefill_gm is not None else gm), dynamic=True)
    decode_gm = _opaque_copy(gm)
    native_calls, native_reason, attention_rewrites = 0, "native=False", 0
    if native:  # the kernel calls as C++ ops (runtime/native.py): with the C++ wrapper, no Python per call
        from picompile.runtime.native import load_library, to_native

        native_reason = load_library()
        if not native_reason:
            native_calls = to_native(decode_gm)
    if matmul_attention:  # torch's flash-attention call costs more than the two tiny GEMMs (runtime/decode_attention.py)
        from picompile.runtime.decode_attention import rewrite_attention

        attention_rewrites = rewrite_attention(decode_gm)
    decode = torch.compile(decode_gm, dynamic=True, options={"cpp.threads": 1, "cpp_wrapper": True})

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

    step.native_calls = native_calls  # type: ignore[attr-defined]  # kernel calls per decode step made C++ ops
    step.native_reason = native_reason  # type: ignore[attr-defined]  # why none were ("" when the library loaded)
    step.attention_rewrites = attention_rewrites  # type: ignore[attr-defined]  # sdpa calls made matmuls (decode)
    return step

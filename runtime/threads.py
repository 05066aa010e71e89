"""torch's intra-op threads during a decode step: one, when every weight the step reads goes through a TVM kernel.

A decode step whose linear layers, predictors and FFNs are TVM kernels (TVM's own thread pool) leaves torch only
activation-sized work: norms, rotary embedding, the attention's two small matmuls over the KV cache. On two
threads every such matmul wakes torch's OpenMP worker, which picompile parks (``OMP_WAIT_POLICY=PASSIVE``, see
``picompile/__init__.py``): measured here, a [4, 8, 64] x [4, 64, 80] ``bmm`` takes 97 µs on two threads and
3.7 µs on one, and a 1B decode step makes 44 of them. So such a step runs with one torch thread (prefill, whose
GEMMs use every thread, keeps them). A step where torch itself still reads a weight matrix (a graph built
without kernels, an activation without a TVM kernel) keeps every thread.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from picompile.ir.graph import get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.schema import args_of

aten = torch.ops.aten
_ROW_LOOKUPS = (aten.embedding.default,)  # read one row of their weight, not all of it
KERNEL_OPS = ("tvm_linear", "tvm_predict", "tvm_sparse_ffn")  # picompile ops calling TVM kernels (lower-tvm)


def _calls_kernels(node: fx.Node) -> bool:
    """A TVM kernel call, or a hybrid FFN scheduler whose CPU partitions are TVM kernel calls, or an input-sparse
    linear that names its one-token kernel (``sparsify-inputs``; "" means torch computes it for every token count)."""
    from picompile.runtime.hybrid import CudaPartition, HybridFFN

    target = node.target
    if isinstance(target, HybridFFN):
        parts = [getattr(p, "part", None) for p in (target.hot, target.cold) if not isinstance(p, CudaPartition)]
        return all(part is None or is_picompile_op(part.op, "tvm_sparse_ffn") for part in parts)
    if is_picompile_op(target, "input_sparse_linear"):
        return bool(args_of(node).get("kernel"))
    return any(is_picompile_op(target, op) for op in KERNEL_OPS)


def torch_weight_reads(gm: fx.GraphModule) -> list[str]:
    """Names of the nodes where torch, not a TVM kernel (``picompile::tvm_*``), reads a weight matrix."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _ROW_LOOKUPS or getattr(node.target, "is_view", False):
            continue  # a view (a slice of the rotary table) reads nothing
        if _calls_kernels(node):
            continue
        args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and a.op == "get_attr"]
        if any(get_tensor(gm, a).dim() >= 2 for a in args):  # a matrix, not a bias, a norm's scale or a threshold
            found.append(node.name)
    return found


def with_decode_threads(step: Callable[..., Any], threads: int | None) -> Callable[..., Any]:
    """``step(ids, *past)`` running one-token calls with ``threads`` torch threads (None: ``step`` itself)."""
    if threads is None:
        return step

    def run(ids: torch.Tensor, *past: torch.Tensor) -> Any:
        if ids.shape[-1] != 1:
            return step(ids, *past)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return step(ids, *past)
        finally:
            torch.set_num_threads(before)

    return functools.update_wrapper(run, step)  # keeps what the step carries (compile_step's native_calls, …)

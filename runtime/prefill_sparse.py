"""Prefill's ReLU FFNs computed only where their gates fired: ``sparse_prefill_ffn`` (load step ``sparse-prefill-ffn``).

A mask-free ReLU FFN node of the prefill graph (its parts on the CPU) → one ``SparsePrefillFFN`` call per part:
the gate (non-gated: up) rows as one dense GEMM — on a copy in the prefill dtype (``prefill_gemm.gemm_layout``),
or on the stored float rows where prefill makes no copies (``ops.lin``) — then the up and down rows of the
artifact itself only for the (token, neuron) pairs whose gate is positive (``kernels/cpu_prefill.py``: kinds
``prefill_up``, ``prefill_down``). A ReLU output of 0 contributes nothing, so this is the dense FFN's maths, no
predictor involved: float16 / float32 rows in float32; int8 / int4 rows with up's dot products integer (x
quantized to int8 per block, as decode's kernels and llama.cpp's q4_0 × q8_0 do: ~4e-3 relative error per output
against float x).

AMD Zen 2, 2 threads, the 1B int4 (d 2048, 5632 neurons, 64 tokens, ~10.6 % of the pairs active): per layer
the dense prefill FFN (two float32 GEMMs on packed copies, 11.3 ms each) 33.7 ms, this 11.3 (gate GEMM) + 4.4
(up) + 0.6 (runs) + 5.1 (down) ms; the whole prefill 1.36× the dense one at 64 tokens, 1.37× at 512
(``benchmarks/prefill.py --settings auto,dense-ffn``; benchmarks/README.md). The copies it makes are the gate's
alone.

Applies where every condition holds, else the node is left to the dense GEMMs (``compute-dtype``; the reason kept
in ``session.sparse_prefill_skipped``): act ``relu`` (gated: on the gate; else on up), no gate bias, the down
rows neuron-major, a kernel for the rows (float16 / float32: any CPU, ``d_model`` a multiple of 16; int8 / int4:
the integer dot products of ``cpu_qdot``, AVX2 and up, for a gated FFN's up), prefill dtype ``float32`` /
``bfloat16`` copies or the weights' own (int8 / int4 rows need a copy for the gate), not ``bfloat16-stream``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
from torch import Tensor, fx

from picompile.ir.graph import get_tensor
from picompile.ir.ops import lin

COPY_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SparsePrefillFFN:
    """One ReLU FFN part for several tokens (module docstring): ``y = Σ_j relu(g_j) · (up_j · x) · down_j``."""

    def __init__(self, layer: int, gated: bool, up: Any, down: Any) -> None:
        self.layer = layer
        self.gated = gated
        self.up = up  # the prefill_up SparseKernel (gated), else None
        self.down = down  # the prefill_down SparseKernel
        from picompile.kernels.cpu import build_cores

        self.parts = build_cores()  # prefill_down's row parts (its y is [parts, t, d_model])
        self.__name__ = f"sparse_prefill_ffn_{layer}"  # fx's code generation names the call after it

    def __call__(
        self,
        x: Tensor,  # [..., d_model] float32
        w_in: Tensor,  # [n, d_model] gate rows (non-gated: up rows): a copy in GEMM layout, or the stored float rows
        b_up: Optional[Tensor],  # [n] float32
        w_up: Optional[Tensor],  # [n, d_model | d_model / 2] (gated): float rows or int8 / int4 quants
        s_up: Optional[Tensor],  # [n, d_model / block] float16 (quantized)
        w_down_t: Tensor,  # [n, d_model | d_model / 2]
        s_down: Optional[Tensor],  # [n, d_model / block] float16 (quantized)
    ) -> Tensor:
        from picompile.kernels import aligned_empty, as_aligned
        from picompile.kernels.cpu_prefill import prefill_runs

        d = x.shape[-1]
        x2 = as_aligned(x.reshape(-1, d).float().contiguous())  # [t, d_model]
        t, n = x2.shape[0], w_down_t.shape[0]
        g = lin(x2, w_in).contiguous()  # [t, n] float32
        if self.gated:
            h = torch.empty((t, n), dtype=torch.float32)  # [t, n]
            self.up.unchecked(x2, w_up, *(() if s_up is None else (s_up,)), g, h)
            if b_up is not None:
                h += torch.relu(g) * b_up
        else:
            h = torch.relu(g if b_up is None else g + b_up).contiguous()  # [t, n]
        tokptr, rows = prefill_runs(h)
        y = aligned_empty((self.parts, t, d))  # [parts, t, d_model]: each thread's rows' sums
        self.down.unchecked(h, tokptr, rows, w_down_t, *(() if s_down is None else (s_down,)), y)
        return y.sum(0).reshape(x.shape).to(x.dtype)

    def __repr__(self) -> str:
        return f"SparsePrefillFFN(layer={self.layer}, gated={self.gated})"


def prefill_kernels(weight_dtype: str, d_model: int, block: int, gated: bool) -> tuple[Any, Any]:
    """The (prefill_up or None, prefill_down) kernels for this weight format, compiled here (or taken from the
    kernel cache); raises ValueError where this CPU has none (``cpu_prefill.applies``)."""
    from picompile.kernels.spec import KernelSpec
    from picompile.runtime.loader import local_kernel

    down = KernelSpec(kind="prefill_down", act="none", d_model=d_model, n_rows=1, weight_dtype=weight_dtype,  # type: ignore[arg-type]
                      has_bias=False, target="llvm", block=block)
    up = local_kernel(dataclasses.replace(down, kind="prefill_up")) if gated else None
    return up, local_kernel(down)


def _why_not(part: dict[str, Any], act: str, copies: bool) -> str:
    if act != "relu":
        return f"act {act!r} (only a ReLU's zeros can be skipped exactly)"
    if "w_down_t" not in part:
        return "the down projection is not stored neuron-major"
    if not copies and part.get("s_down") is not None:
        return "int8 / int4 rows with prefill dtype 'weights' (no copy for the gate GEMM)"
    return ""


def sparse_prefill_ffn(gm: fx.GraphModule, prefill_dtype: str) -> tuple[int, list[str]]:
    """Rewrite ``gm``'s eligible FFN nodes in place (module docstring): the number of parts rewritten, and why
    each FFN left as it was was left."""
    from picompile.ir.ops import deq
    from picompile.kernels.qformat import format_of
    from picompile.runtime.prefill_gemm import gemm_layout, node_parts

    if prefill_dtype not in (None, *COPY_DTYPES):
        return 0, [f"prefill dtype {prefill_dtype!r} converts weights per call (no copy for the gate GEMM)"]
    dtype = COPY_DTYPES.get(prefill_dtype) if prefill_dtype else None  # None: the stored float rows as they are
    skipped: list[str] = []
    done = 0
    for node in list(gm.graph.nodes):
        found = node_parts(node)
        if found is None:
            continue
        parts, x, bias, act, layer = found
        reasons = [_why_not(p, act, dtype is not None) for p in parts]
        if any(reasons):
            skipped.append(f"layer {layer}: {next(r for r in reasons if r)}")
            continue
        calls: list[tuple[SparsePrefillFFN, list[Any]]] = []
        try:
            for p in parts:
                q_down = get_tensor(gm, p["w_down_t"])
                if q_down.shape[0] == 0:
                    continue
                gated = p["w_gate"] is not None
                if p.get("s_down") is None:  # float rows
                    wdt, d, block = str(q_down.dtype).removeprefix("torch."), int(q_down.shape[1]), 32
                else:
                    fmt = format_of(q_down, get_tensor(gm, p["s_down"]))
                    wdt, d, block = fmt.name, int(q_down.shape[1]) * (2 if fmt.name == "int4" else 1), fmt.block
                up, down = prefill_kernels(wdt, d, block, gated)
                src, scales = ("w_gate", "s_gate") if gated else ("w_up", "s_up")
                if dtype is None:  # the stored float rows: no copy (lin widens float16 per call where it must)
                    w_in: Any = p[src]
                else:
                    s_in = None if p.get(scales) is None else get_tensor(gm, p[scales])
                    w_in = gemm_layout(deq(get_tensor(gm, p[src]), s_in), dtype)
                b_up = None if p["b_up"] is None else get_tensor(gm, p["b_up"]).float()
                weights = [w_in, b_up, p["w_up"] if gated else None, p.get("s_up") if gated else None,
                           p["w_down_t"], p.get("s_down")]
                calls.append((SparsePrefillFFN(layer, gated, up, down), weights))
        except Exception as e:  # noqa: BLE001 - no kernel for this CPU or shape, no TVM compiler: the dense GEMMs stay
            skipped.append(f"layer {layer}: {(str(e).splitlines() or [''])[0]}")
            continue
        _replace(gm, node, x, bias, calls)
        done += len(calls)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return done, skipped


def _replace(gm: fx.GraphModule, node: fx.Node, x: fx.Node, bias: Optional[fx.Node],
             calls: list[tuple[SparsePrefillFFN, list[Any]]]) -> None:
    """``node`` → the sum of ``calls`` (hot + cold, as ``merge`` adds them), then the down bias. A call's
    weights are new tensors (registered as buffers of ``gm``) or the graph's own weight nodes."""
    names = ("w_in", "b_up", "w_up", "s_up", "w_down_t", "s_down")
    out: Optional[fx.Node] = None
    with gm.graph.inserting_before(node):
        for i, (fn, weights) in enumerate(calls):
            args: list[Any] = [x]
            for key, w in zip(names, weights):
                if not isinstance(w, Tensor):  # None, or the artifact's own rows (a node of the graph)
                    args.append(w)
                    continue
                attr = f"sparse_prefill_{fn.layer}_{i}_{key}"
                while hasattr(gm, attr):
                    attr += "_"
                gm.register_buffer(attr, w, persistent=False)
                args.append(gm.graph.get_attr(attr))
            y = gm.graph.call_function(fn, tuple(args))
            out = y if out is None else gm.graph.call_function(operator.add, (out, y))
        if out is None:
            out = gm.graph.call_function(torch.zeros_like, (x,))
        if bias is not None:
            out = gm.graph.call_function(operator.add, (out, bias))
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)

"""Several sequences' decode steps as one graph call: decode graph (one token of one sequence) → one graph for B
sequences, their per-token work stacked where it can be and every weight-streaming kernel called once.

graph: forward(ids [1, 1], *past) with kv_arena buffers → forward(ids_0, *past_0, *arena_0, …, ids_B-1, …) →
(logits [B, 1, vocab],):
  - the aten glue (embedding, norms, head views, rotary, residual adds) runs once on the B tokens stacked along
    dim 0 (``runtime/batch_glue.py``: the ops that are pointwise along it); only attention over each sequence's
    own KV arena, the arena writes, the causal mask and the positions run once per sequence (``Lanes``);
  - each ``tvm_linear`` (q/k/v, o, lm_head) runs once on the B tokens: float weights by the ``gemv`` kernel
    (``kernels/batch_gemv.py``: each row loaded and widened once per tile of 4 tokens; a lone float16 token by
    the linear's one-token kernel, whose sums are gemv's bit for bit), int8 / int4 by the linear kernel's
    ``<key>_batch`` form;
  - each sparse FFN partition (a ``HybridFFN`` layer's hot and cold parts run inline, or a quantized
    ``tvm_sparse_ffn``) runs once on the **union** of the B tokens' predicted neurons, each token masked by its own
    mask (``runtime/batch_ffn.py``: float weights by ``gemv`` for gate / up and ``gemv_down``, each selected row
    read once for the batch; int8 / int4 by the split ``up*`` / ``down`` kernels' batched forms);
  - each ``tvm_predict`` runs as two batched GEMVs (``runtime/batch_predict.py``).
A sequence's result never depends on the others: the per-sequence nodes compute what they compute alone, the
stacked glue computes each row as alone, the batched kernels form each (row, token) sum the same way whatever B
is, and the union FFN's extra rows add exact zeros to a token's sums, in ascending row order. The union FFN and
the batched predictors also form every sum as the one-token fused kernels that a lone sequence runs (the same
accumulators per dot product, the FFN's down sums cut into the fused kernel's row parts: ``runtime/batch_ffn.py``,
``batch_predict.py``), so a request's floats are the same alone and beside any others, at every B
(``tests/test_serve_batch.py`` checks bit for bit and greedy outputs token for token). Its sums run in another
order than ``Session.generate``'s only in float32 linears (``gemv`` against the one-token linear kernel;
float16's are equal, and int8 / int4 ones where the CPU has integer dot products: their ``_batch`` form runs
the one-token kernel's sums per token, ``cpu_qdot.describe_up_batched``), so ``serve``'s text can differ from
``run``'s there where two logits are near-tied.

``union_ffn=None`` (``serve --batch-ffn auto``, the default) takes the union FFN where it is exact
(``batch_ffn.exact_union``: float weights, a ReLU / dReLU FFN) and runs the others per sequence with the
one-token fused kernels (int8 / int4, whose split kernels' batched forms are also compute-bound; SiLU, whose
activation torch and the kernel compute differently), the predictors batched; ``union_ffn=False``
(``--batch-ffn per-request``) runs every FFN and predictor per sequence (exact; B times the FFN's bytes);
``union_ffn=True`` (``--batch-ffn union``) takes the union FFN for every dtype and activation, exact only where
``auto`` would take it. A step of one sequence runs the fused one-token kernels in every mode. A node whose
batched kernels cannot be had (no TVM compiler to build them, a part on the GPU) runs per sequence in every mode.

``BatchRunner`` holds the KV cache of each slot (one arena per past input, ``max_seq_len`` positions), prefills a
slot (or a chunk of its prompt) with the session's prefill graph on that slot's arenas, and decodes any set of
slots in one call (graphs are built per batch size on first use).
"""
from __future__ import annotations

import operator
import re
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, fx

from picompile.ir.schema import args_of, node_op
from picompile.runtime.batch_ffn import batched_hybrid, batched_part, exact_union, split_kernels
from picompile.runtime.batch_glue import batched_kwargs, stackable, varies, varying_symbols
from picompile.runtime.batch_predict import batched_predict, gemv_kernel, multi_gemv_kernel
from picompile.runtime.frame_room import call_with_room
from picompile.runtime.hybrid import HYBRID_MASKS, HybridFFN, hybrid_args
from picompile.runtime.partitions import PART_WEIGHTS, EmptyPartition, InlinePartition, ThreadPartition

_ARENA = re.compile(r"^kv_arena(\d+)$")


def batched_linear(xs: Sequence[Tensor], w: Tensor, b: Tensor | None, kernel: str,
                   s: Tensor | None = None) -> list[Tensor]:
    """``tvm_linear`` for several tokens at once: xs (B tensors [..., d_in], one token each) → B outputs [..., d_out],
    by the kernel's batched form (one pass over the weight rows for all B; int8 / int4: w's quants, s its scales)."""
    from picompile.kernels import as_aligned
    from picompile.kernels.table import find_kernel

    kern = find_kernel(kernel)
    if kern is None:
        raise RuntimeError(f"TVM kernel {kernel} (linear) is not loaded")
    x = as_aligned(torch.cat([t.reshape(1, -1) for t in xs]))  # [B, d_in]
    y = _linear_rows(x, w, b, kern, s)  # [B, d_out]
    return [y[i].reshape(*t.shape[:-1], w.shape[0]) for i, t in enumerate(xs)]


def _linear_rows(x: Tensor, w: Tensor, b: Tensor | None, kern: Any, s: Tensor | None) -> Tensor:
    """x [B, d_in] (aligned) → [B, d_out]: float weights by the ``gemv`` kernel (each row read once for all B,
    ``kernels/batch_gemv.py``), else the linear kernel's batched form (int8 / int4: s the scales)."""
    from picompile.kernels import aligned_empty

    y = aligned_empty((x.shape[0], w.shape[0]))  # [B, d_out]
    multi = multi_gemv_kernel(w.shape[0], w.shape[1], w.dtype) if s is None else None
    if multi is not None and x.shape[0] == 1 and w.dtype == torch.float16:
        # one token: the linear's own one-token kernel, which forms every sum as ``gemv`` does for float16 (32
        # lanes, the same halving tree: equal bit for bit, tests/test_batch_gemv.py) and is what ``run`` decodes with
        kern.unchecked(x.reshape(-1), w, None, None, _rows(w.shape[0]), y.reshape(-1))  # type: ignore[attr-defined]
    elif multi is not None:
        multi.unchecked(x, w, _rows(w.shape[0]), y)
    elif s is None:
        kern.unchecked(x, w, None, None, _rows(w.shape[0]), y)  # type: ignore[attr-defined]
    else:
        kern.unchecked(x, w, s, None, None, None, _rows(w.shape[0]), y)  # type: ignore[attr-defined]
    if b is not None:
        y += b
    return y


_ROWS: dict[int, Tensor] = {}


def _rows(n: int) -> Tensor:
    if n not in _ROWS:
        _ROWS[n] = torch.arange(n, dtype=torch.int32)
    return _ROWS[n]


def _batchable(node: fx.Node) -> bool:
    """A node whose B copies become one call: a TVM linear with a stored weight and a loaded CPU kernel."""
    if node.op != "call_function" or node_op(node) != "tvm_linear":
        return False
    a = args_of(node)
    return isinstance(a.get("kernel"), str) and bool(a["kernel"]) and not isinstance(a.get("x"), (list, tuple))


class Lanes:
    """Where each node of the one-sequence graph lives in the B-sequence graph being built: ``shared`` (one node
    for all sequences: weights, constants), ``batched`` (one node, the B sequences' values stacked along dim 0,
    ``runtime/batch_glue.py``) or ``perseq`` (B nodes). Converts between them on demand (one ``split`` into B
    views of a stacked value, one ``cat`` into one), each conversion made once."""

    def __init__(self, new: fx.Graph, batch: int, syms: set[Any]) -> None:
        self.new, self.batch, self.syms = new, batch, syms
        self.lane: dict[fx.Node, str] = {}
        self.one: dict[fx.Node, fx.Node] = {}  # shared / batched: the node
        self.seqs: dict[fx.Node, list[fx.Node]] = {}  # perseq: one node per sequence
        self._split: dict[fx.Node, fx.Node] = {}  # stacked node -> its split into B views [1, ...]
        self._views: dict[tuple[fx.Node, int], fx.Node] = {}
        self._cat: dict[fx.Node, fx.Node] = {}

    def set(self, node: fx.Node, lane: str, value: Any) -> None:
        self.lane[node] = lane
        if lane == "perseq":
            self.seqs[node] = list(value)
        else:
            self.one[node] = value

    def seq(self, a: fx.Node, b: int) -> fx.Node:
        """Sequence b's value of ``a``."""
        lane = self.lane[a]
        if lane == "perseq":
            return self.seqs[a][b]
        if lane == "shared":
            return self.one[a]
        if self.batch == 1:  # the stacked value is the lone sequence's own
            return self.one[a]
        if (a, b) not in self._views:
            # one split call for all B views (a narrow per sequence cost ~20 µs each, 532 a 4-token 1B step)
            if a not in self._split:
                self._split[a] = self.new.call_function(torch.split, (self.one[a], 1, 0))
            self._views[(a, b)] = self.new.call_function(operator.getitem, (self._split[a], b))
        return self._views[(a, b)]

    def can_stack(self, a: fx.Node) -> bool:
        lane = self.lane[a]
        return lane == "batched" or (lane == "perseq" and stackable(a.meta.get("val"), self.syms))

    def stacked(self, a: fx.Node) -> fx.Node | None:
        """The B values of ``a`` stacked along dim 0, or None when they do not stack."""
        if not self.can_stack(a):
            return None
        if self.lane[a] == "batched":
            return self.one[a]
        if a not in self._cat:
            self._cat[a] = self.new.call_function(torch.cat, ([self.seqs[a][b] for b in range(self.batch)], 0))
        return self._cat[a]

    def forget_stack(self, a: fx.Node) -> None:
        """Drop the stacked copy of the per-sequence ``a`` (a node wrote to it: a later use stacks it anew)."""
        self._cat.pop(a, None)

    def common(self, a: fx.Node) -> fx.Node | None:
        """The one value of ``a`` every sequence has (shared, or a per-sequence int / SymInt that names no varying
        symbol: the token count), or None."""
        if self.lane[a] == "shared":
            return self.one[a]
        val = a.meta.get("val")
        if self.lane[a] == "perseq" and isinstance(val, (int, torch.SymInt)) and not varies(val, self.syms):
            return self.seqs[a][0]
        return None


def _mutates(node: fx.Node) -> bool:
    """Whether an aten node writes to one of its arguments (``copy_``, ``add_``, …)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _node_arg(lanes: Lanes, value: Any, stacked: bool) -> Any:
    """An argument of a batched call: a node stacked (``stacked``) or common, None when absent."""
    if not isinstance(value, fx.Node):
        return value
    return lanes.stacked(value) if stacked else lanes.common(value)


def batched_linear_stacked(x: Tensor, w: Tensor, b: Tensor | None, kernel: str, s: Tensor | None = None) -> Tensor:
    """``tvm_linear`` on x [B, ..., d_in] (the B tokens stacked) → [B, ..., d_out] by the kernel's batched form."""
    from picompile.kernels import as_aligned
    from picompile.kernels.table import find_kernel

    kern = find_kernel(kernel)
    if kern is None:
        raise RuntimeError(f"TVM kernel {kernel} (linear) is not loaded")
    y = _linear_rows(as_aligned(x.reshape(x.shape[0], -1)), w, b, kern, s)  # [B, d_out]
    return y.reshape(*x.shape[:-1], w.shape[0])


def _ffn_call(node: fx.Node, lanes: Lanes, exact_only: bool = False) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    """The union-masked call of a sparse FFN node or predictor for the B tokens (``runtime/batch_ffn.py``,
    ``batch_predict.py``), its x and masks stacked where they stack (else lists), or None (per sequence).
    ``exact_only``: an FFN whose union sums are not its one-token kernel's bit for bit (``batch_ffn.exact_union``:
    int8 / int4 weights, whose split kernels' batched forms are also compute-bound; SiLU) stays per sequence."""
    if node.op != "call_function":
        return None

    def xs_of(v: Any) -> Any:
        if not isinstance(v, fx.Node):
            return [None] * lanes.batch
        st = lanes.stacked(v)
        return st if st is not None else [lanes.seq(v, b) for b in range(lanes.batch)]

    def w(v: Any) -> Any:
        return lanes.one[v] if isinstance(v, fx.Node) else v

    if isinstance(node.target, HybridFFN):
        keys = (_part_kernel(node.target.hot), _part_kernel(node.target.cold))
        if None in keys or (exact_only and not all(exact_union(k) for k in keys if k is not None)):
            return None
        a = hybrid_args(node)
        weights = {n: w(a[n]) for n in a if n not in ("x", *HYBRID_MASKS)}
        hot = tuple(weights[n + "_h"] for n in PART_WEIGHTS)
        cold = tuple(weights[n + "_c"] for n in PART_WEIGHTS)
        return batched_hybrid, (xs_of(a["x"]), hot, xs_of(a["mask_h"]), cold, xs_of(a["mask_c"]), weights["bias"],
                                keys[0], keys[1])
    if node_op(node) == "tvm_predict":
        if not _predict_ok(node):
            return None
        a = args_of(node)
        return batched_predict, (xs_of(a["x"]), w(a["fc1"]), w(a["fc2"]), float(a["threshold"]), str(a["act"]),
                                 w(a.get("offset")))
    if node_op(node) != "tvm_sparse_ffn":
        return None
    a = args_of(node)
    if isinstance(a.get("x"), (list, tuple)) or not (a.get("kernel") == "" or _splittable(a.get("kernel"))):
        return None
    if exact_only and not exact_union(a["kernel"]):
        return None
    ws = {n: w(a.get(n)) for n in (*PART_WEIGHTS, "s_up", "s_gate", "s_down")}
    return batched_part, (xs_of(a["x"]), ws["w_up"], ws["b_up"], ws["w_gate"], ws["w_down_t"], xs_of(a.get("mask")),
                          a["kernel"], ws["s_up"], ws["s_gate"], ws["s_down"])


_UNBATCHED: dict[str, str] = {}  # fused kernel key (or "predictor N") -> why it runs per sequence ("" = batched)


def _splittable(key: Any) -> bool:
    """Whether the fused CPU FFN kernel ``key``'s split kernels (``batch_ffn.split_kernels``) can be had."""
    if not isinstance(key, str) or not key:
        return False
    if key not in _UNBATCHED:
        try:
            split_kernels(key)
            _UNBATCHED[key] = ""
        except Exception as e:  # no TVM compiler (source="artifact"), a CUDA kernel, …: per-sequence FFN
            _UNBATCHED[key] = f"{type(e).__name__}: {e}"
    return not _UNBATCHED[key]


def _part_kernel(part: Any) -> str | None:
    """A HybridFFN partition's fused CPU kernel key ("" for no rows), or None when it cannot be batched."""
    if isinstance(part, EmptyPartition):
        return ""
    if isinstance(part, (InlinePartition, ThreadPartition)):
        key = part.part.consts.get("kernel", "")
        return key if key == "" or _splittable(key) else None
    return None  # on the GPU: per sequence


def _predict_ok(node: fx.Node) -> bool:
    """Whether a ``tvm_predict`` node's B copies can be one ``batched_predict`` call (its GEMV kernels built)."""
    a = args_of(node)
    fc1, fc2 = a.get("fc1"), a.get("fc2")
    shapes = [getattr(t, "meta", {}).get("val") for t in (fc1, fc2)]
    if isinstance(a.get("x"), (list, tuple)) or a.get("act") not in ("relu", "none") or None in shapes:
        return False
    try:  # both kernels compile (or come from the cache) here, once per shape
        gemv_kernel(shapes[0].shape[0], shapes[0].shape[1], shapes[0].dtype, str(a["act"]))
        gemv_kernel(shapes[1].shape[0], shapes[1].shape[1], shapes[1].dtype, "none")
    except Exception as e:
        _UNBATCHED[f"predictor {a.get('layer')}"] = f"{type(e).__name__}: {e}"
        return False
    return True


def batch_graph(gm: fx.GraphModule, n_past: int, batch: int,
                union_ffn: bool | None = None) -> tuple[fx.GraphModule, int]:
    """The B-sequence form of the arena decode graph ``gm`` (see the module docstring). Its inputs, per sequence
    in order: ids [1, 1], n_past past views (read only for their length), n_past arenas; it returns the B logits
    stacked, [B, 1, vocab]. Also returns how many linear calls are shared. ``union_ffn``: True / False, or None
    (auto) for the union FFN where its weights are float (the ``gemv`` kernels) and per sequence where they are
    int8 / int4; the predictors are batched in both True and None. One sequence (``batch`` 1) takes the one-token
    fused FFN kernels in every mode: the union of one token's neurons is its own, and the split union kernels
    stream them slower (1 client 12.3 against 17.8 tok/s)."""
    if batch == 1:
        union_ffn = False
    src = gm.graph
    new = fx.Graph()
    placeholders = [n for n in src.nodes if n.op == "placeholder"]
    lanes = Lanes(new, batch, varying_symbols(src, placeholders[1:1 + n_past]))
    arenas = sorted((int(m.group(1)), n) for n in src.nodes if n.op == "get_attr" and (m := _ARENA.match(str(n.target))))
    made: dict[fx.Node, list[fx.Node]] = {n: [] for n in placeholders + [n for _, n in arenas]}
    for b in range(batch):
        for n in placeholders:
            made[n].append(new.placeholder(f"{n.name}_s{b}"))
            made[n][-1].meta.update(n.meta)
        for i, n in arenas:
            made[n].append(new.placeholder(f"arena{i}_s{b}"))
    for n, nodes in made.items():
        lanes.set(n, "perseq", nodes)
    n_shared = n_ffn = n_batched = n_perseq = 0
    for node in src.nodes:
        if node in lanes.lane:
            continue
        if node.op == "get_attr":
            g = new.get_attr(node.target)
            g.meta.update(node.meta)
            lanes.set(node, "shared", g)
            continue
        if node.op == "output":
            (returned,) = node.args  # the arena graph returns (logits,)
            logits = returned[0]
            st = lanes.stacked(logits)
            if st is None:
                st = new.call_function(torch.cat, ([lanes.seq(logits, b) for b in range(batch)], 0))
            new.output((st,))
            continue
        inputs = node.all_input_nodes
        if inputs and all(lanes.lane[a] == "shared" for a in inputs) and node.op == "call_function":
            c = new.node_copy(node, lambda a: lanes.one[a])
            lanes.set(node, "shared", c)
            continue
        if _batchable(node):
            a = args_of(node)
            x = lanes.stacked(a["x"])
            args = (lanes.one[a["w"]], lanes.one[a["b"]] if a.get("b") is not None else None, a["kernel"],
                    lanes.one[a["s"]] if a.get("s") is not None else None)
            if x is not None:
                lanes.set(node, "batched", new.call_function(batched_linear_stacked, (x, *args)))
            else:
                call = new.call_function(batched_linear, ([lanes.seq(a["x"], b) for b in range(batch)], *args))
                lanes.set(node, "perseq", [new.call_function(operator.getitem, (call, b)) for b in range(batch)])
            n_shared += 1
            continue
        ffn = _ffn_call(node, lanes, union_ffn is None) if union_ffn is not False else None  # FFN parts, predictors
        if ffn is not None:
            call = new.call_function(*ffn)
            if isinstance(ffn[1][0], fx.Node):  # x stacked: the result is stacked
                lanes.set(node, "batched", call)
            else:
                lanes.set(node, "perseq", [new.call_function(operator.getitem, (call, b)) for b in range(batch)])
            n_ffn += 1
            continue
        if node.op == "call_function":
            stacked = {a for a in inputs if lanes.can_stack(a)}
            kwargs = batched_kwargs(node, batch, stacked, lanes.syms)
            if kwargs is not None and all(a in stacked or lanes.common(a) is not None for a in inputs):
                mapped = fx.map_arg(kwargs, lambda a: _node_arg(lanes, a, a in stacked))
                lanes.set(node, "batched", new.call_function(node.target, (), mapped))
                n_batched += 1
                continue
        lanes.set(node, "perseq", [new.node_copy(node, lambda a, b=b: lanes.seq(a, b)) for b in range(batch)])
        if _mutates(node):  # a stacked copy of what it writes would be stale from here on
            for a in inputs:
                lanes.forget_stack(a)
        n_perseq += 1
    module = fx.GraphModule(gm, new)
    module.graph.lint()
    module.meta["batched_ffns"] = n_ffn
    module.meta["batched_nodes"] = n_batched  # aten nodes run once on the stacked tokens
    module.meta["perseq_nodes"] = n_perseq  # nodes run once per sequence (attention, KV writes, positions)
    return module, n_shared


class BatchRunner:
    """KV-cache slots over one session and the batched decode step.

    ``prefill(slot, ids, start)`` runs the session's prefill (several tokens) or decode form (one token) on the
    slot's arenas after its first ``start`` positions; ``decode([(slot, token, position), …])`` runs one token of
    each listed slot in one call of the B-sequence graph and returns their logits [B, vocab]."""

    def __init__(self, session: Any, slots: int, union_ffn: bool | None = None) -> None:
        if session.kv is None:
            raise RuntimeError(f"batched decoding needs the in-place KV cache ({session.kv_reason})")
        if session.compiled:
            raise RuntimeError("batched decoding runs the eager graph; load the artifact without compile=True")
        self.session = session
        self.n_past = session.n_past
        shapes = [(tuple(a.shape), a.dtype) for a in session.kv.arenas]
        self.slots: list[list[Tensor]] = [[torch.zeros(s, dtype=d) for s, d in shapes] for _ in range(slots)]
        self._graphs: dict[int, tuple[fx.GraphModule, Callable[..., Any]]] = {}
        self.shared_linears = 0
        self.union_ffn = union_ffn  # the FFN on the union of the batch's neurons (None: float weights), batch_graph

    @property
    def max_seq_len(self) -> int:
        return int(self.session.max_seq_len)

    def _graph(self, batch: int) -> Callable[..., Any]:
        if batch not in self._graphs:
            gm, self.shared_linears = batch_graph(self.session.decode_graph, self.n_past, batch, self.union_ffn)
            room = call_with_room(gm.forward)  # a forward of thousands of locals: runtime/frame_room.py
            fn: Callable[..., Any] = room
            if self.session.decode_torch_threads is not None:
                from picompile.runtime.threads import with_decode_threads

                fn = with_decode_threads(lambda *a: room(*a), self.session.decode_torch_threads)
            self._graphs[batch] = (gm, fn)
        return self._graphs[batch][1]

    def prefill(self, slot: int, ids: Sequence[int], start: int = 0) -> Tensor:
        """Tokens ``ids`` at positions start.. of ``slot`` → their logits [T, vocab] (the prompt: the dense prefill)."""
        s = self.session
        s._check_room(start, len(ids))
        arenas = self.slots[slot]
        graphs = s.step_graphs  # a one-token prompt runs the decode form
        saved = [[getattr(g, f"kv_arena{i}") for i in range(self.n_past)] for g in graphs]
        try:
            for g in graphs:
                for i, a in enumerate(arenas):
                    setattr(g, f"kv_arena{i}", a)
            with torch.inference_mode():
                out = s.step_fn(torch.tensor([list(ids)]), *(a[:, :, :start] for a in arenas))
        finally:
            for g, old in zip(graphs, saved):
                for i, a in enumerate(old):
                    setattr(g, f"kv_arena{i}", a)
        s._kv_version += 1  # the session's own decoders must not trust what they left
        return out[0][0]

    def decode(self, steps: Sequence[tuple[int, int, int]]) -> Tensor:
        """One token for each (slot, token id, position) — position = tokens the slot holds before it — in one
        call; returns logits [B, vocab] in the order given."""
        args: list[Tensor] = []
        for slot, tid, pos in steps:
            self.session._check_room(pos, 1)
            arenas = self.slots[slot]
            args.append(torch.tensor([[int(tid)]]))
            args += [a[:, :, :pos] for a in arenas]
            args += arenas
        with torch.inference_mode():
            (logits,) = self._graph(len(steps))(*args)  # [B, 1, vocab]
        return logits.reshape(len(steps), -1, logits.shape[-1])[:, -1]

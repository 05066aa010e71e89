"""The hybrid scheduler (runtime side): per FFN layer, the hot partition runs asynchronously (on the GPU,
or on a worker thread standing in for it) while the calling thread computes the cold partition on the
CPU; then the hot result is waited for and merged (hot + cold + b_down) where the residual stream
lives (the CPU in this runtime).

:func:`schedule_hybrid` rewrites, at load time, every triple ::

    hot  = picompile.tvm_sparse_ffn(x, hot rows…,  mask_h, act, layer, "hot",  "gpu", kernel, gpu_kernel)
    cold = picompile.tvm_sparse_ffn(x, cold rows…, mask_c, act, layer, "cold", "cpu", kernel, gpu_kernel)
    y    = picompile.merge(hot, cold, b_down, layer)

(or the same on ``picompile.sparse_ffn``, without the kernel keys) into one call of a
:class:`HybridFFN` object, whose weights stay ``get_attr`` inputs of the node::

    y = hybrid_ffn_<layer>(x, w_up_h, b_up_h, w_gate_h, w_down_t_h, mask_h,
                              w_up_c, b_up_c, w_gate_c, w_down_t_c, mask_c, b_down)

Partition backends (``runtime/partitions.py``) share one interface, ``Partition.launch(x, weights, mask) ->
Pending`` and ``Pending.wait() -> Tensor`` (``[..., d_model]``):

* ``inline``: computes at launch on the calling thread (hot, then cold), no concurrency. The fastest on
  a CPU-only machine, where either part alone already uses every core.
* ``thread``: one long-lived worker thread per loaded graph (``ThreadPoolExecutor(max_workers=1)``)
  computes the hot part with the graph's own op: the GPU's asynchrony emulated on the CPU (tests).
* ``cuda``: the hot weights are moved to the GPU once, here. Per call, x and the active rows (prefill:
  the mask) go host→device on a dedicated stream, the CUDA TVM kernel (or the torch reference math)
  runs there, the result comes back into pinned host memory, and ``wait`` blocks on a
  ``blocking_sync`` event (the thread sleeps, it does not spin).

A part with no rows launches nothing: its result is zeros. A triple that does not match the pattern is
left as it was; the reasons are kept in ``gm.meta["hybrid_skipped"]`` and logged at debug level.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, fx

import picompile.ir.ops  # noqa: F401  (registers picompile:: ops)
from picompile.errors import InputError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.schema import args_of
from picompile.kernels.table import find_kernel
from picompile.runtime.partitions import (  # noqa: F401  (the partition backends, re-exported)
    PART_OPS,
    PART_VARYING,
    PART_WEIGHTS,
    CudaPartition,
    Done,
    EmptyPartition,
    FuturePending,
    InlinePartition,
    PartOp,
    Partition,
    Pending,
    ThreadPartition,
    Weights,
    part_op,
    part_weights,
)

log = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("auto", "inline", "thread", "cuda", "off")
SKIPPED_KEY: str = "hybrid_skipped"  # gm.meta key: why triples were left unscheduled


# -- modes ------------------------------------------------------------------------------------------
def check_mode(mode: str) -> None:
    """Reject an unknown mode, or "cuda" on a machine without CUDA (cheap: before anything is loaded)."""
    if mode not in MODES:
        raise InputError(f"unknown hybrid mode {mode!r}; known: {', '.join(MODES)}")
    if mode == "cuda" and not torch.cuda.is_available():
        raise InputError("hybrid mode 'cuda' needs a CUDA device, and torch sees none here "
                         "(use hybrid='auto', 'inline' or 'thread')")


def resolve_mode(mode: str, target_has_gpu: bool) -> str:
    """The concrete mode ("off" | "inline" | "thread" | "cuda"): "auto" is cuda where CUDA is available
    and the artifact's target has a GPU, else inline."""
    check_mode(mode)
    if mode != "auto":
        return mode
    return "cuda" if target_has_gpu and torch.cuda.is_available() else "inline"


# -- the per-layer scheduler ------------------------------------------------------------------------
def merge_parts(hot: Tensor, cold: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``picompile.merge``'s arithmetic, in the same order: hot + cold (+ b_down)."""
    out = hot + cold  # [..., d_model]
    if bias is not None:
        out += bias
    return out


class HybridFFN:
    """One FFN layer's scheduler: the fx call target replacing a (hot, cold, merge) triple."""

    def __init__(self, layer: int, mode: str, hot: Partition, cold: Partition) -> None:
        self.layer = layer
        self.mode = mode
        self.hot = hot
        self.cold = cold
        self.__name__ = f"hybrid_ffn_{layer}"  # fx's code generation names the call after it

    def __call__(
        self,
        x: Tensor,  # [..., d_model]
        w_up_h: Tensor, b_up_h: Optional[Tensor], w_gate_h: Optional[Tensor], w_down_t_h: Tensor,  # [k_hot, …]
        mask_h: Optional[Tensor],  # [..., k_hot] bool
        w_up_c: Tensor, b_up_c: Optional[Tensor], w_gate_c: Optional[Tensor], w_down_t_c: Tensor,  # [k_cold, …]
        mask_c: Optional[Tensor],  # [..., k_cold] bool
        bias: Optional[Tensor],  # [d_model]
    ) -> Tensor:
        pending = self.hot.launch(x, (w_up_h, b_up_h, w_gate_h, w_down_t_h), mask_h)
        try:
            cold = self.cold.launch(x, (w_up_c, b_up_c, w_gate_c, w_down_t_c), mask_c).wait()  # [..., d_model]
        except BaseException:
            with contextlib.suppress(Exception):  # never leave the hot part running behind an error
                pending.wait()
            raise
        return merge_parts(pending.wait(), cold, bias)  # [..., d_model]

    def __repr__(self) -> str:
        return f"HybridFFN(layer={self.layer}, mode={self.mode}, hot={self.hot!r}, cold={self.cold!r})"


# a HybridFFN call's arguments by name (it is a Python callable, not a picompile op: its own layout, the one
# place that knows it): x, the hot part's weights and mask (``_h``), the cold part's (``_c``), the down bias
HYBRID_ARGS: tuple[str, ...] = tuple(inspect.signature(HybridFFN.__call__).parameters)[1:]
HYBRID_MASKS: tuple[str, ...] = ("mask_h", "mask_c")


def hybrid_args(node: fx.Node) -> dict[str, Any]:
    """A HybridFFN node's arguments by name (``HYBRID_ARGS``)."""
    return dict(zip(HYBRID_ARGS, node.args), **node.kwargs)


def hybrid_call_args(values: Mapping[str, Any]) -> tuple[Any, ...]:
    """A HybridFFN node's positional arguments from every one of ``HYBRID_ARGS`` by name."""
    return tuple(values[name] for name in HYBRID_ARGS)


def set_hybrid_args(node: fx.Node, **values: Any) -> None:
    """Rewrite some arguments of a HybridFFN node by name."""
    node.args, node.kwargs = hybrid_call_args({**hybrid_args(node), **values}), {}


# -- matching ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Triple:
    hot: fx.Node
    cold: fx.Node
    merge: fx.Node
    layer: int


def _is_op(node: Any, names: tuple[str, ...]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and any(is_picompile_op(node.target, n) for n in names)


def _part_problem(node: Any, merge: fx.Node, name: str) -> str | None:
    """Why ``node`` is not the ``name`` ("hot" / "cold") part feeding only ``merge``; None if it is."""
    if not _is_op(node, PART_OPS):
        return f"its {name} input is {getattr(node, 'target', node)}, not a sparse_ffn / tvm_sparse_ffn part"
    try:
        part = args_of(node)["part"]
    except TypeError:
        return f"its {name} part {node.name} has an unexpected argument list"
    if part != name:
        return f"its {name} input {node.name} is the {part!r} part"
    if set(node.users) != {merge}:
        return f"its {name} part {node.name} is also used by {', '.join(u.name for u in node.users if u is not merge)}"
    if any(args_of(node).get(s) is not None for s in ("s_up", "s_gate", "s_down")):
        return f"its {name} part {node.name} has quantized weights (int8 / int4), which run unscheduled (inline)"
    if args_of(node).get("b_gate") is not None:
        return f"its {name} part {node.name} has a gate bias (b_gate), which runs unscheduled (inline)"
    weights = part_weights(node)  # w_up, w_down_t required; b_up, w_gate optional
    if weights[0] is None or any(w is not None and not (isinstance(w, fx.Node) and w.op == "get_attr") for w in weights):
        return f"the weights of its {name} part {node.name} are not graph attributes"
    return None


def match_triple(merge: fx.Node) -> Triple | str:
    """The (hot, cold, merge) triple a merge node closes, or why it is not one."""
    where = f"merge {merge.name}"
    try:
        m = args_of(merge)
    except TypeError:
        return f"{where}: unexpected argument list"
    hot, cold, layer = m["hot"], m["cold"], m["layer"]
    for node, name in ((hot, "hot"), (cold, "cold")):
        problem = _part_problem(node, merge, name)
        if problem is not None:
            return f"{where} (layer {layer}): {problem}"
    assert isinstance(hot, fx.Node) and isinstance(cold, fx.Node)
    h, c = args_of(hot), args_of(cold)
    if h["x"] is not c["x"]:
        return f"{where} (layer {layer}): the hot and cold parts read different inputs"
    if not h["layer"] == c["layer"] == layer:
        return f"{where}: layers disagree (merge {layer}, hot {h['layer']}, cold {c['layer']})"
    return Triple(hot, cold, merge, int(layer))  # type: ignore[arg-type]


def _shared_hot_weight(triple: Triple) -> str | None:
    """cuda moves the hot weights to the GPU: each must be read by the hot part alone."""
    for w in part_weights(triple.hot):
        if isinstance(w, fx.Node) and set(w.users) != {triple.hot}:
            return f"layer {triple.layer}: hot weight {w.target} is also read elsewhere, so it cannot move to the GPU"
    return None


def _triple_or_reason(merge: fx.Node, mode: str) -> Triple | str:
    found = match_triple(merge)
    if isinstance(found, Triple) and mode == "cuda":
        return _shared_hot_weight(found) or found
    return found


# -- backends per mode ------------------------------------------------------------------------------
def _set_attr(gm: fx.GraphModule, target: str, value: Tensor) -> None:
    *path, name = target.split(".")
    owner: Any = gm
    for part in path:
        owner = getattr(owner, part)
    if name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)


def _device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclass
class Backends:
    """What the partitions of one graph share: the mode, and its worker thread or CUDA stream."""

    mode: str  # "inline" | "thread" | "cuda"
    worker: ThreadPoolExecutor | None = None
    stream: Any = None  # torch.cuda.Stream
    device: torch.device | None = None

    @classmethod
    def create(cls, mode: str) -> "Backends":
        if mode == "thread":  # the thread starts at the first launch and ends with the executor
            return cls(mode, worker=ThreadPoolExecutor(max_workers=1, thread_name_prefix="picompile-hot"))
        if mode == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
            return cls(mode, stream=torch.cuda.Stream(device), device=device)
        return cls(mode)

    def cold(self, gm: fx.GraphModule, node: fx.Node) -> Partition:
        part = part_op(gm, node)
        return EmptyPartition() if part.n_rows == 0 else InlinePartition(part)

    def hot(self, gm: fx.GraphModule, node: fx.Node) -> Partition:
        part = part_op(gm, node)
        if part.n_rows == 0:
            return EmptyPartition()
        if self.mode == "thread":
            assert self.worker is not None
            return ThreadPartition(part, self.worker)
        if self.mode == "cuda":
            return self._cuda(gm, node, part)
        return InlinePartition(part)

    def _cuda(self, gm: fx.GraphModule, node: fx.Node, part: PartOp) -> Partition:
        assert self.device is not None
        for w in part_weights(node):  # hot weights → GPU, once; the graph reads them there
            if isinstance(w, fx.Node):
                _set_attr(gm, str(w.target), get_tensor(gm, w).to(self.device))
        kernel = find_kernel(part.gpu_kernel) if part.gpu_kernel else None
        spec = getattr(kernel, "spec", None)
        if kernel is not None and (spec is None or str(spec.cuda_arch).rstrip("a") != _device_arch(self.device)):
            log.debug("hybrid: layer %s: CUDA kernel %s is for %s, this GPU is %s; using the torch reference",
                      part.consts["layer"], part.gpu_kernel, getattr(spec, "cuda_arch", "?"), _device_arch(self.device))
            kernel = None
        all_rows = torch.arange(part.n_rows, dtype=torch.int32, device=self.device)  # [k]
        return CudaPartition(part, self.stream, self.device, kernel, all_rows)


# -- the transform ----------------------------------------------------------------------------------
def _rewrite(gm: fx.GraphModule, triple: Triple, scheduler: HybridFFN) -> fx.Node:
    g = gm.graph
    hot, cold = args_of(triple.hot), args_of(triple.cold)
    per_part = (*PART_WEIGHTS, "mask")
    values = {"x": hot["x"], **{f"{n}_h": hot[n] for n in per_part}, **{f"{n}_c": cold[n] for n in per_part},
              "bias": args_of(triple.merge)["bias"]}
    with g.inserting_before(triple.merge):
        node = g.call_function(scheduler, hybrid_call_args(values))
    node.meta.update({k: v for k, v in triple.merge.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
    triple.merge.replace_all_uses_with(node)
    for old in (triple.merge, triple.hot, triple.cold):
        g.erase_node(old)
    return node


def schedule_hybrid(gm: fx.GraphModule, mode: str = "auto", *, target_has_gpu: bool = True) -> fx.GraphModule:
    """Rewrite every (hot part, cold part, merge) triple of ``gm`` into one :class:`HybridFFN` call (in place).

    ``mode``: "auto" | "inline" | "thread" | "cuda" | "off" ("off" returns ``gm`` untouched; "auto"
    picks cuda when CUDA is available and ``target_has_gpu``, else inline). Triples that do not match
    are left alone; ``gm.meta["hybrid_skipped"]`` says why.
    """
    mode = resolve_mode(mode, target_has_gpu)
    if mode == "off":
        return gm
    backends = Backends.create(mode)
    skipped: list[str] = []
    for merge in [n for n in gm.graph.nodes if _is_op(n, ("merge",))]:
        found = _triple_or_reason(merge, mode)
        if isinstance(found, str):
            skipped.append(found)
            log.debug("hybrid: left unscheduled: %s", found)
            continue
        scheduler = HybridFFN(found.layer, mode, backends.hot(gm, found.hot), backends.cold(gm, found.cold))
        _rewrite(gm, found, scheduler)
    if mode == "cuda":
        torch.cuda.synchronize(backends.device)  # the weights are on the GPU before the side stream reads them
    gm.meta[SKIPPED_KEY] = skipped
    gm.graph.lint()
    gm.recompile()
    return gm


def schedulers(gm: fx.GraphModule) -> list[HybridFFN]:
    """The HybridFFN call targets of ``gm``, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, HybridFFN)]


def hybrid_mode_of(gm: fx.GraphModule) -> str:
    """The mode ``gm``'s FFN layers run in: "off" when none is scheduled ("mixed" should two modes meet)."""
    modes = {s.mode for s in schedulers(gm)}
    return modes.pop() if len(modes) == 1 else ("off" if not modes else "mixed")

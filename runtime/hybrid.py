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

Partition backends share one interface, ``Partition.launch(x, weights, mask) -> Pending`` and
``Pending.wait() -> Tensor`` (``[..., d_model]``):

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, fx

import picompile.ir.ops  # noqa: F401  (registers picompile:: ops)
from picompile.errors import InputError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import DirectCall, is_picompile_op
from picompile.ir.schema import args_of, call_args, node_op, position
from picompile.kernels.table import find_kernel

log = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("auto", "inline", "thread", "cuda", "off")
PART_OPS: tuple[str, ...] = ("sparse_ffn", "tvm_sparse_ffn")
PART_WEIGHTS: tuple[str, ...] = ("w_up", "b_up", "w_gate", "w_down_t")  # a part op's weights, in ``Weights`` order
PART_VARYING: tuple[str, ...] = ("x", *PART_WEIGHTS, "mask")  # a part op's per-call arguments; the rest are constants
SKIPPED_KEY: str = "hybrid_skipped"  # gm.meta key: why triples were left unscheduled

Weights = tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]  # w_up [k, d], b_up [k], w_gate [k, d], w_down_t [k, d]


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


# -- one partition's op -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PartOp:
    """One partition's op and constant arguments, exactly as the graph had them."""

    op: Callable[..., Tensor]  # picompile's sparse_ffn | tvm_sparse_ffn (a DirectCall, or the torch overload)
    name: str  # "sparse_ffn" | "tvm_sparse_ffn": the op's schema (``picompile.ir.schema``)
    consts: Mapping[str, Any]  # every argument but PART_VARYING: act, layer, part, device[, kernel, gpu_kernel]
    n_rows: int  # k: rows of this part's weights
    # the positional call, made once by name: constants in place, PART_VARYING's slots filled per call
    _template: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    _slots: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_template", call_args(self.name, {**dict.fromkeys(PART_VARYING), **self.consts}))
        object.__setattr__(self, "_slots", tuple(position(self.name, n) for n in PART_VARYING))

    @property
    def gpu_kernel(self) -> str:
        return str(self.consts.get("gpu_kernel", ""))

    def __call__(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Tensor:
        args = list(self._template)
        for pos, value in zip(self._slots, (x, *weights, mask)):
            args[pos] = value
        return self.op(*args)  # [..., d_model]


def part_op(gm: fx.GraphModule, node: fx.Node) -> PartOp:
    """The PartOp of a sparse_ffn / tvm_sparse_ffn node (its weights stay in the graph)."""
    a = args_of(node)
    w_up = get_tensor(gm, a["w_up"])  # [k, d_model]
    op = DirectCall(node.target) if isinstance(node.target, torch._ops.OpOverload) else node.target
    consts = {k: v for k, v in a.items() if k not in PART_VARYING}
    return PartOp(op, str(node_op(node)), consts, int(w_up.shape[0]))  # type: ignore[arg-type]


def part_weights(node: fx.Node) -> list[Any]:
    """A part op node's weight arguments (``PART_WEIGHTS``: w_up, b_up, w_gate, w_down_t), by name."""
    a = args_of(node)
    return [a[w] for w in PART_WEIGHTS]


# -- pending results ----------------------------------------------------------------------------------
class Pending(Protocol):
    """A partition's result, maybe still being computed."""

    def wait(self) -> Tensor: ...  # [..., d_model], on the host


class Partition(Protocol):
    """Where and how one partition runs."""

    def launch(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Pending: ...


@dataclass
class Done:
    """A result computed at launch."""

    value: Tensor  # [..., d_model]

    def wait(self) -> Tensor:
        return self.value


@dataclass
class FuturePending:
    """A result the worker thread computes."""

    future: Future[Tensor]

    def wait(self) -> Tensor:
        return self.future.result()  # blocks on a condition variable; re-raises the worker's exception


@dataclass
class CudaPending:
    """A result on its way into pinned host memory; ``done`` is recorded after the device→host copy."""

    done: Any  # torch.cuda.Event(blocking_sync=True)
    out: Tensor  # [..., d_model], pinned host memory

    def wait(self) -> Tensor:
        self.done.synchronize()  # the thread sleeps until the event (blocking_sync), no busy-wait
        return self.out


# -- backends -------------------------------------------------------------------------------------
@dataclass
class EmptyPartition:
    """A part with no rows (k = 0): launches nothing, its result is zeros."""

    def launch(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Pending:
        return Done(torch.zeros_like(x))  # [..., d_model]


@dataclass
class InlinePartition:
    """Computes the part at launch on the calling thread."""

    part: PartOp

    def launch(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Pending:
        return Done(self.part(x, weights, mask))


def _run_in_modes(part: PartOp, inference: bool, grad: bool, x: Tensor, weights: Weights,
                  mask: Optional[Tensor]) -> Tensor:
    """``part(x, …)`` on the worker thread under the caller's grad / inference mode (both thread-local)."""
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return part(x, weights, mask)


@dataclass
class ThreadPartition:
    """Computes the part on the shared worker thread: the GPU's asynchrony, emulated on the CPU."""

    part: PartOp
    worker: ThreadPoolExecutor  # max_workers=1, shared by every layer of one graph

    def launch(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Pending:
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        return FuturePending(self.worker.submit(_run_in_modes, self.part, inference, grad, x, weights, mask))


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host → device through pinned memory, so the copy is asynchronous (on the current stream)."""
    return t.pin_memory().to(device, non_blocking=True)


def _active_rows(mask: Tensor) -> Tensor:
    """Indices of the true entries of a one-token mask, on the host: [k_active] int32."""
    return mask.reshape(-1).nonzero().squeeze(1).to(torch.int32)


@dataclass
class CudaPartition:
    """The hot part on the GPU: its weights (graph buffers) were moved there once, at load."""

    part: PartOp
    stream: Any  # torch.cuda.Stream, shared by every layer of one graph
    device: torch.device
    kernel: Any  # the CUDA SparseKernel for this device, or None: the torch reference math
    all_rows: Tensor  # [k] int32 on the device: the rows a mask-less (dense) call computes

    def launch(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Pending:
        with torch.cuda.stream(self.stream):
            y = self._compute(_to_device(x, self.device), weights, mask)  # [..., d_model] on the device
            out = torch.empty(x.shape, dtype=y.dtype, pin_memory=True)  # [..., d_model] on the host
            out.copy_(y, non_blocking=True)
            done = torch.cuda.Event(blocking_sync=True)
            done.record(self.stream)
        return CudaPending(done, out)

    def _compute(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Tensor:
        d = x.shape[-1]
        if x.numel() != d or (mask is None and self.kernel is None):  # prefill, or every row: dense
            dev_mask = None if mask is None else _to_device(mask, self.device)  # [..., k]
            return self._reference(x, weights, dev_mask)  # the mask applied, as the reference op does
        # one token: the active rows are found on the host (no device sync) and sent as indices
        idx = self.all_rows if mask is None else _to_device(_active_rows(mask), self.device)  # [k_active]
        if self.kernel is not None:
            return self._run_kernel(x.reshape(d), weights, idx).reshape(x.shape)
        rows = tuple(None if w is None else w.index_select(0, idx) for w in weights)  # [k_active, …]
        return self._reference(x, rows, None)  # type: ignore[arg-type]

    def _reference(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Tensor:
        consts = {k: self.part.consts[k] for k in ("act", "layer", "part", "device")}
        values = {"x": x, **dict(zip(PART_WEIGHTS, weights)), "mask": mask, **consts}
        return picompile.ir.ops.sparse_ffn(*call_args("sparse_ffn", values))  # [..., d_model]

    def _run_kernel(self, x: Tensor, weights: Weights, idx: Tensor) -> Tensor:
        import tvm_ffi

        w_up, b_up, w_gate, w_down_t = weights
        y = torch.empty(x.shape[-1], dtype=torch.float32, device=self.device)  # [d_model]
        with tvm_ffi.use_torch_stream(torch.cuda.stream(self.stream)):  # TVM launches on our stream too
            self.kernel.unchecked(x, w_up, w_gate, b_up, w_down_t, idx, y)
        return y


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

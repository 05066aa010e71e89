"""The hybrid scheduler's partition backends: how one FFN partition (hot or cold) runs, and its pending result.

``PartOp`` is a partition's op with its constant arguments (by name, ``picompile.ir.schema``);
``Partition.launch(x, weights, mask) -> Pending`` and ``Pending.wait() -> Tensor`` (``[..., d_model]``) are
the interface every backend shares: ``EmptyPartition`` (no rows: zeros), ``InlinePartition`` (computes at
launch), ``ThreadPartition`` (on the graph's worker thread), ``CudaPartition`` (on the GPU, asynchronously).
``runtime/hybrid.py`` picks them per mode and schedules the two parts of each layer.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, fx

import picompile.ir.ops
from picompile.ir.graph import get_tensor
from picompile.ir.ops import DirectCall
from picompile.ir.schema import args_of, call_args, op_name, position

PART_OPS: tuple[str, ...] = ("sparse_ffn", "tvm_sparse_ffn")
PART_WEIGHTS: tuple[str, ...] = ("w_up", "b_up", "w_gate", "w_down_t")  # a part op's weights, in ``Weights`` order
PART_VARYING: tuple[str, ...] = ("x", *PART_WEIGHTS, "mask")  # a part op's per-call arguments; the rest are constants

Weights = tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]  # w_up [k, d], b_up [k], w_gate [k, d], w_down_t [k, d]


# -- one partition's op -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PartOp:
    """One partition's op and constant arguments, exactly as the graph had them."""

    op: Callable[..., Tensor]  # picompile's sparse_ffn | tvm_sparse_ffn (a DirectCall, or the torch overload)
    consts: Mapping[str, Any]  # every argument but PART_VARYING: act, layer, part, device[, kernel, gpu_kernel]
    n_rows: int  # k: rows of this part's weights
    # the positional call, made once by name: constants in place, PART_VARYING's slots filled per call
    _template: tuple[Any, ...] = field(init=False, repr=False, compare=False)
    _slots: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _tail: Optional[tuple[Any, ...]] = field(init=False, repr=False, compare=False)  # the constants, when they follow

    def __post_init__(self) -> None:
        name = self.name
        template = call_args(name, {**dict.fromkeys(PART_VARYING), **self.consts})
        slots = tuple(position(name, n) for n in PART_VARYING)
        leading = slots == tuple(range(len(slots)))  # the schema puts the per-call arguments first (both ops do)
        object.__setattr__(self, "_template", template)
        object.__setattr__(self, "_slots", slots)
        object.__setattr__(self, "_tail", template[len(slots):] if leading else None)

    @property
    def name(self) -> str:
        """"sparse_ffn" | "tvm_sparse_ffn": the op whose schema (``picompile.ir.schema``) names the arguments."""
        name = op_name(self.op)
        assert name in PART_OPS, f"{self.op} is not a partition op"
        return name

    @property
    def gpu_kernel(self) -> str:
        return str(self.consts.get("gpu_kernel", ""))

    def __call__(self, x: Tensor, weights: Weights, mask: Optional[Tensor]) -> Tensor:
        if self._tail is not None:  # the decode hot path: no argument list to fill
            return self.op(x, *weights, mask, *self._tail)  # [..., d_model]
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
    return PartOp(op, consts, int(w_up.shape[0]))  # type: ignore[arg-type]


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

"""picompile's graph operators (torch custom ops under ``picompile::``).

Each op has a reference implementation in plain torch (the oracle in tests) and a fake
(meta) implementation so graphs holding it can be exported and re-traced.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from picompile.kernels.qformat import dequantize
from picompile.kernels.table import find_kernel, threshold_tensor

ACTIVATIONS: dict[str, object] = {
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "drelu": torch.relu,  # dReLU (TurboSparse): relu on the gate branch here, and on the up branch (up_act)
}
# FFN activations that also apply to the up branch of a gated FFN: dReLU's ``relu(gate x) * relu(up x)``
UP_ACTS: dict[str, object] = {"drelu": torch.relu}
# activations whose neurons are exactly zero when inactive (threshold 0, no --act-sparsity): ReLU and dReLU
RELU_FAMILY: tuple[str, ...] = ("relu", "drelu")


def up_act(x: Tensor, act: str) -> Tensor:
    """The up branch of a gated FFN after its activation: ``x`` itself, or relu(x) for dReLU."""
    fn = UP_ACTS.get(act)
    return x if fn is None else fn(x)  # type: ignore[operator]


# Rows of x from which a narrow weight is widened to x's dtype rather than multiplied in its own, on CPUs
# without a native float16 GEMM: widening costs ~3 ns per weight, once per call; torch's float16 GEMM there
# costs ~1 ms per row of x for a [2048, 5632] weight against ~0.3 ms in float32 (AMD EPYC, 2 threads).
WIDEN_ROWS = 32


@functools.cache
def native_half_gemm() -> bool:
    """Whether this CPU multiplies float16 matrices natively (Intel with AMX, hence AVX512-FP16: oneDNN's fast
    path, any weight layout). Elsewhere (AMD EPYC, older Intel) torch's float16 GEMM is ~3x slower than its
    float32 one, and ~100x slower on a transposed weight (measured: 4.7 s against 47 ms for 64 rows)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_amx_fp16_supported())


def gemm(x: Tensor, w: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, w, b)`` with ``w`` [d_out, d_in] in x's dtype, stored as prefill's copies store it
    (``runtime/prefill_gemm.gemm_layout``): dense (any strides) or oneDNN's packed float32 layout."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, b, "none", [], "")
    return torch.nn.functional.linear(x, w, b)


def lin(x: Tensor, w: Tensor, b: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` for weights stored narrower than ``x`` (float16 artifacts), returned in x's dtype.

    Computed in the weights' dtype where that is fast (as llama.cpp does for f16 weights: CPUs with a native
    float16 GEMM, or a contiguous weight and few rows of x); otherwise the weight is widened to x's dtype
    for this call, which never hands torch a transposed float16 weight on a CPU without its fast path."""
    if w.dtype == x.dtype:
        return gemm(x, w, b)
    rows = x.numel() // max(x.shape[-1], 1)
    if w.dtype != torch.float16 or native_half_gemm() or (w.is_contiguous() and rows < WIDEN_ROWS):  # bfloat16: AMX/AVX512-BF16
        return torch.nn.functional.linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype)).to(x.dtype)
    return torch.nn.functional.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def deq(w: Tensor, s: Optional[Tensor]) -> Tensor:
    """A stored weight as the float maths reads it: quants ``w`` + float16 scales ``s`` (int8 / int4 blocks,
    ``picompile.kernels.qformat``) dequantized to float32, else ``w`` itself (``s`` None: a float weight).

    Equal to ``qformat.dequantize`` bit for bit (the same float32 products, tested), in two passes over the
    output instead of five or six: ~1.6x (int8) and ~1.8x (int4) faster on a [5632, 2048] weight, which
    prefill dequantizes per call (still ~1.5x / 2.6x the cost of widening a float16 weight)."""
    if s is None:
        return w
    rows, n_blocks = s.shape
    if w.dim() != 2 or rows != w.shape[0] or n_blocks == 0 or w.shape[1] % n_blocks or w.dtype not in (
            torch.int8, torch.uint8) or s.dtype != torch.float16:
        return dequantize(w, s)  # qformat names what is wrong
    scale = s.to(torch.float32)
    if w.dtype == torch.int8:
        out = w.to(torch.float32)  # [rows, cols]
        out.view(rows, n_blocks, w.shape[1] // n_blocks).mul_(scale.unsqueeze(-1))
        return out
    half = w.shape[1] // n_blocks  # bytes per block: its low nibbles are its first half, the high its second
    b = w.view(rows, n_blocks, half)
    nib = torch.empty(rows, n_blocks, 2, half)
    nib[:, :, 0] = b & 0x0F
    nib[:, :, 1] = b >> 4
    nib.sub_(8.0).mul_(scale[:, :, None, None])
    return nib.view(rows, 2 * w.shape[1])  # [rows, cols]


def _rows(w: Optional[Tensor], s: Optional[Tensor], idx: Tensor) -> Optional[Tensor]:
    """Rows ``idx`` of a stored weight (quantized: of its quants and scales), dequantized: [k, d]."""
    return None if w is None else deq(w[idx], None if s is None else s[idx])


def apply_act(x: Tensor, act: str) -> Tensor:
    fn = ACTIVATIONS.get(act)
    if fn is None:
        raise ValueError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}")
    return fn(x)  # type: ignore[operator]


@torch.library.custom_op("picompile::ffn", mutates_args=())
def ffn(
    x: Tensor,  # [..., d_model]
    w_up: Tensor,  # [n_neurons, d_model]
    b_up: Optional[Tensor],  # [n_neurons]
    w_gate: Optional[Tensor],  # [n_neurons, d_model]; None for a plain (OPT-style) MLP
    w_down: Tensor,  # [d_model, n_neurons] (nn.Linear layout)
    b_down: Optional[Tensor],  # [d_model]
    act: str,
    layer: int,
    mask: Optional[Tensor] = None,  # [..., n_neurons] bool: neurons to compute (None = all)
    s_up: Optional[Tensor] = None,  # [n_neurons, d_model / block] float16: w_up is quantized (its quants)
    s_gate: Optional[Tensor] = None,  # [n_neurons, d_model / block]
    s_down: Optional[Tensor] = None,  # [d_model, n_neurons / block]
    b_gate: Optional[Tensor] = None,  # [n_neurons]: the gate projection's bias (Llama mlp_bias)
) -> Tensor:
    """The canonical FFN: ``down(act(up x + b_up) + b_down)`` or, gated, ``down(act(gate x + b_gate) * (up x + b_up))
    + b_down``; act ``drelu`` (dReLU, TurboSparse): ``down(relu(gate x + b_gate) * relu(up x + b_up))``.

    With a mask, neurons outside it count as inactive (their output is zero). A weight with scales is
    quantized (``convert-weights``, int8 / int4): dequantized for the call.
    """
    h = _hidden(x, deq(w_up, s_up), b_up, None if w_gate is None else deq(w_gate, s_gate), act, b_gate)  # [..., n_neurons]
    if mask is not None:
        h = h * mask
    return lin(h, deq(w_down, s_down), b_down)  # [..., d_model]


@ffn.register_fake
def _ffn_fake(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], w_down: Tensor,
              b_down: Optional[Tensor], act: str, layer: int, mask: Optional[Tensor] = None,
              s_up: Optional[Tensor] = None, s_gate: Optional[Tensor] = None,
              s_down: Optional[Tensor] = None, b_gate: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w_down.shape[0]))


def _hidden(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], act: str,
            b_gate: Optional[Tensor] = None) -> Tensor:
    """Neuron outputs before the down projection: act(up x + b_up), or act(gate x + b_gate) * up_act(up x + b_up)."""
    up = lin(x, w_up, b_up)
    if w_gate is None:
        return apply_act(up, act)
    return apply_act(lin(x, w_gate, b_gate), act) * up_act(up, act)


@torch.library.custom_op("picompile::predict", mutates_args=())
def predict(
    x: Tensor,  # [..., d_model]
    fc1: Tensor,  # [rank, d_model]
    fc2: Tensor,  # [n_neurons, rank]
    threshold: float,
    layer: int,
    act: str = "relu",  # "relu": PowerInfer's MLP predictor; "none": a low-rank linear map (Deja Vu)
    offset: Optional[Tensor] = None,  # [n_neurons] float32, added to the scores
) -> Tensor:
    """An activation predictor: ``fc2(act(fc1 x)) + offset > threshold`` → [..., n_neurons] bool mask. Computed
    in x's dtype whatever the weights' (as the predict kernel does, and as the threshold was tuned: a score
    rounded to float16 would flip the neurons near the threshold)."""
    h = torch.nn.functional.linear(x, fc1.to(x.dtype))  # [..., rank]
    scores = torch.nn.functional.linear(torch.relu(h) if act == "relu" else h, fc2.to(x.dtype))  # [..., n_neurons]
    if offset is not None:
        scores = scores.float() + offset
    return scores > threshold


@predict.register_fake
def _predict_fake(x: Tensor, fc1: Tensor, fc2: Tensor, threshold: float, layer: int, act: str = "relu",
                  offset: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], fc2.shape[0]), dtype=torch.bool)


def activation_score(x: Tensor, w: Tensor, b: Optional[Tensor], act: str, w_mul: Optional[Tensor] = None,
                     b_mul: Optional[Tensor] = None) -> Tensor:
    """How strongly each neuron fires: ``|act(w x + b)|``, or ``|act(w x + b) · up_act(w_mul x + b_mul)|`` (the
    neuron's actual output in a gated FFN, w = gate and w_mul = up: the "product" criterion; dReLU's always).
    [..., n_neurons]"""
    a = apply_act(lin(x, w, b), act)
    return (a if w_mul is None else a * up_act(lin(x, w_mul, b_mul), act)).abs()


@torch.library.custom_op("picompile::oracle_mask", mutates_args=())
def oracle_mask(
    x: Tensor,  # [..., d_model]
    w: Tensor,  # [n_neurons, d_model]: the rows whose activation decides (gate for gated FFNs, else up)
    b: Optional[Tensor],  # [n_neurons]
    act: str,
    threshold: float,
    layer: int,
    w_mul: Optional[Tensor] = None,  # [n_neurons, d_model]: up rows for the product criterion, else None
    b_mul: Optional[Tensor] = None,  # [n_neurons]: the up bias with w_mul
) -> Tensor:
    """The true activation mask, ``activation_score(x, w, b, act, w_mul, b_mul) > threshold`` (exact; computes
    every neuron's decider: the gate — CATS — or, with w_mul, gate and up)."""
    return activation_score(x, w, b, act, w_mul, b_mul) > threshold


@oracle_mask.register_fake
def _oracle_fake(x: Tensor, w: Tensor, b: Optional[Tensor], act: str, threshold: float, layer: int,
                 w_mul: Optional[Tensor] = None, b_mul: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.bool)


@torch.library.custom_op("picompile::sparse_ffn", mutates_args=())
def sparse_ffn(
    x: Tensor,  # [..., d_model]
    w_up: Tensor,  # [k, d_model]  this part's neuron rows, contiguous
    b_up: Optional[Tensor],  # [k]
    w_gate: Optional[Tensor],  # [k, d_model]
    w_down_t: Tensor,  # [k, d_model]  down projection transposed: neuron-major
    mask: Optional[Tensor],  # [..., k] bool; None = compute every row
    act: str,
    layer: int,
    part: str,  # "hot" | "cold"
    device: str,  # "gpu" | "cpu": where the placement put this part
    s_up: Optional[Tensor] = None,  # [k, d_model / block] float16: w_up holds int8 / int4 quants
    s_gate: Optional[Tensor] = None,  # [k, d_model / block]
    s_down: Optional[Tensor] = None,  # [k, d_model / block]: w_down_t's blocks run along d_model
    b_gate: Optional[Tensor] = None,  # [k]: the gate bias of this part's rows
) -> Tensor:
    """One part (hot or cold) of a split FFN: Σ_j h_j · w_down_t[j] over the active rows j (no down bias).

    Reference implementation: one token gathers only the active rows (of quantized weights: their quants and
    scales, then dequantizes those); several tokens (prefill) run dense with the mask applied, which is
    faster than gathering per token.
    """
    d = x.shape[-1]
    if mask is not None and x.numel() == d and w_up.shape[0] > 0:
        idx = mask.reshape(-1).nonzero().squeeze(1)  # [n_active]
        xr = x.reshape(1, d)
        h = _hidden(xr, _rows(w_up, s_up, idx), None if b_up is None else b_up[idx],  # type: ignore[arg-type]
                    _rows(w_gate, s_gate, idx), act, None if b_gate is None else b_gate[idx])
        return lin(h, _rows(w_down_t, s_down, idx).t()).reshape(x.shape)  # type: ignore[union-attr]  # [..., d_model]
    h = _hidden(x, deq(w_up, s_up), b_up, None if w_gate is None else deq(w_gate, s_gate), act, b_gate)  # [..., k]
    if mask is not None:
        h = h * mask
    return lin(h, deq(w_down_t, s_down).t())  # h @ w_down_t


@sparse_ffn.register_fake
def _sparse_ffn_fake(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], w_down_t: Tensor,
                     mask: Optional[Tensor], act: str, layer: int, part: str, device: str,
                     s_up: Optional[Tensor] = None, s_gate: Optional[Tensor] = None,
                     s_down: Optional[Tensor] = None, b_gate: Optional[Tensor] = None) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("picompile::merge", mutates_args=())
def merge(hot: Tensor, cold: Tensor, bias: Optional[Tensor], layer: int) -> Tensor:
    """Sum of the hot and cold partial FFN outputs (+ the down bias): [..., d_model]."""
    out = hot + cold
    return out if bias is None else out + bias


@merge.register_fake
def _merge_fake(hot: Tensor, cold: Tensor, bias: Optional[Tensor], layer: int) -> Tensor:
    return torch.empty_like(hot)


class DirectCall:
    """A picompile op called straight through its Python implementation, past torch's dispatcher.

    The dispatcher costs ~15–40 µs per custom-op call (measured); a decode step calls picompile ops a few
    hundred times. The runtime swaps graph targets for these once the graph is final
    (:func:`call_directly`); ``name()`` and :func:`is_picompile_op` see the op they stand for.
    """

    def __init__(self, overload: torch._ops.OpOverload) -> None:
        self.overload = overload
        _, _, op = overload.name().partition("::")
        self.fn = globals()[op.split(".")[0]]._init_fn  # the CustomOpDef's original function
        self.__name__ = op.split(".")[0]

    def name(self) -> str:
        return self.overload.name()

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"picompile.{self.__name__}"


def call_directly(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """Every picompile op of ``gm`` called as a :class:`DirectCall` (the graph is only run after this)."""
    calls: dict[object, DirectCall] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and is_picompile_op(node.target):
            node.target = calls.setdefault(node.target, DirectCall(node.target))
    gm.recompile()
    return gm


def is_picompile_op(target: object, name: str | None = None) -> bool:
    """True for a call target of one of our ops (optionally the one named, e.g. "ffn")."""
    if isinstance(target, DirectCall):
        target = target.overload
    if not isinstance(target, torch._ops.OpOverload):
        return False
    ns, _, op = target.name().partition("::")
    return ns == "picompile" and (name is None or op.split(".")[0] == name)


_ALL_ROWS: dict[int, Tensor] = {}
_ALL_CHANNELS: dict[int, Tensor] = {}


def _loaded(key: str, what: str) -> object:
    """The loaded TVM kernel ``key`` (``picompile.kernels.table``, filled by the runtime's kernel loader), or a
    RuntimeError naming what needed it."""
    kern = find_kernel(key)
    if kern is None:
        raise RuntimeError(f"TVM kernel {key} ({what}) is not loaded")
    return kern


def _all_channels(n: int) -> Tensor:
    """An all-ones int8 [n] mask (an input-sparse linear whose input stays dense), made once per n."""
    if n not in _ALL_CHANNELS:
        _ALL_CHANNELS[n] = torch.ones(n, dtype=torch.int8)
    return _ALL_CHANNELS[n]


def _all_rows(n: int) -> Tensor:
    if n not in _ALL_ROWS:
        _ALL_ROWS[n] = torch.arange(n, dtype=torch.int32)
    return _ALL_ROWS[n]


@torch.library.custom_op("picompile::tvm_sparse_ffn", mutates_args=())
def tvm_sparse_ffn(
    x: Tensor,  # [..., d_model]
    w_up: Tensor,  # [k, d_model]
    b_up: Optional[Tensor],  # [k]
    w_gate: Optional[Tensor],  # [k, d_model]
    w_down_t: Tensor,  # [k, d_model]
    mask: Optional[Tensor],  # [..., k] bool
    act: str,
    layer: int,
    part: str,
    device: str,
    kernel: str,  # key of the CPU (llvm) kernel (picompile.kernels.table); "" = no rows in this part
    gpu_kernel: str,  # key of the CUDA kernel for the target's GPU, "" if none
    s_up: Optional[Tensor] = None,  # [k, d_model / block] float16 scales of quantized w_up (as sparse_ffn)
    s_gate: Optional[Tensor] = None,  # [k, d_model / block]
    s_down: Optional[Tensor] = None,  # [k, d_model / block]
    b_gate: Optional[Tensor] = None,  # [k] gate bias (the kernel's spec has gate_bias; passed after b_up)
) -> Tensor:
    """sparse_ffn lowered to a TVM kernel: one token runs the kernel over the active rows; several
    tokens (prefill) take the dense masked path, which is faster than gathering per token. A quantized
    kernel takes each weight as its quants then its scales."""
    d = x.shape[-1]
    if w_up.shape[0] == 0:  # an empty part (all neurons on the other device): nothing to launch
        return torch.zeros_like(x)
    if x.numel() != d or not kernel:
        return sparse_ffn(x, w_up, b_up, w_gate, w_down_t, mask, act, layer, part, device, s_up, s_gate, s_down, b_gate)
    kern = _loaded(kernel, f"layer {layer}, {part} part")
    idx = _all_rows(w_up.shape[0]) if mask is None else mask.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    from picompile.kernels import as_aligned

    xv = as_aligned(x.reshape(d))  # x itself when contiguous and 64-byte aligned (the usual case)
    y = _out(d)  # [d_model]
    gb = () if b_gate is None else (b_gate,)  # a gate-bias kernel takes it last (kernels.loader.call_args)
    if s_up is None:
        kern.unchecked(xv, w_up, w_gate, b_up, w_down_t, idx, y, *gb)  # type: ignore[attr-defined]
    else:
        kern.unchecked(xv, w_up, s_up, w_gate, s_gate, b_up, w_down_t, s_down, idx, y, *gb)  # type: ignore[attr-defined]
    return y.reshape(x.shape)


@tvm_sparse_ffn.register_fake
def _tvm_sparse_ffn_fake(x: Tensor, w_up: Tensor, b_up: Optional[Tensor], w_gate: Optional[Tensor], w_down_t: Tensor,
                         mask: Optional[Tensor], act: str, layer: int, part: str, device: str, kernel: str,
                         gpu_kernel: str, s_up: Optional[Tensor] = None, s_gate: Optional[Tensor] = None,
                         s_down: Optional[Tensor] = None, b_gate: Optional[Tensor] = None) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("picompile::linear", mutates_args=())
def linear(
    x: Tensor,  # [..., d_in] float32
    w: Tensor,  # [d_out, d_in] in the artifact's weight dtype (float16)
    b: Optional[Tensor],  # [d_out] float32
    s: Optional[Tensor] = None,  # [d_out, d_in / block] float16: w holds int8 / int4 quants (qformat)
) -> Tensor:
    """A linear layer whose weights are stored in a narrower dtype than its activations (``convert-weights``):
    float16, or int8 / int4 blocks (dequantized for the call)."""
    w = deq(w, s)
    return lin(x, w, None) if b is None else lin(x, w, None) + b  # [..., d_out]


@linear.register_fake
def _linear_fake(x: Tensor, w: Tensor, b: Optional[Tensor], s: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _out(n: int) -> Tensor:
    """An uninitialised float32 [n], 64-byte aligned (what the TVM kernels require)."""
    y = torch.empty(n, dtype=torch.float32)  # torch's CPU allocator aligns to 64 bytes …
    if y.data_ptr() % 64:
        from picompile.kernels import aligned_empty

        y = aligned_empty(n)  # … and this is the fallback should it not
    return y


def _gemv(kernel: str, x: Tensor, w: Tensor, what: str, s: Optional[Tensor] = None) -> Tensor:
    """``w @ x`` for one token through the TVM kernel ``kernel`` (kind ``up``: every row of w; quantized: w's
    quants and scales ``s``). [d_out]"""
    kern = _loaded(kernel, what)
    from picompile.kernels import as_aligned

    y = _out(w.shape[0])
    if s is None:
        kern.unchecked(as_aligned(x.reshape(-1)), w, None, None, _all_rows(w.shape[0]), y)  # type: ignore[attr-defined]
    else:
        kern.unchecked(as_aligned(x.reshape(-1)), w, s, None, None, None, _all_rows(w.shape[0]), y)  # type: ignore[attr-defined]
    return y


@torch.library.custom_op("picompile::tvm_linear", mutates_args=())
def tvm_linear(
    x: Tensor,  # [..., d_in] float32
    w: Tensor,  # [d_out, d_in] in the artifact's weight dtype (float16 or float32), 64-byte aligned
    b: Optional[Tensor],  # [d_out] float32
    kernel: str,  # key of the llvm GEMV kernel (kind "up", act "none"; picompile.kernels.table)
    s: Optional[Tensor] = None,  # [d_out, d_in / block] float16: w holds int8 / int4 quants
) -> Tensor:
    """``linear`` lowered: one token runs the TVM GEMV (fp16 weights widened in registers, int8 / int4 blocks
    scaled in registers; fp32 accumulation); several tokens (prefill) take torch's GEMM (``linear``)."""
    if x.numel() != x.shape[-1]:
        return linear(x, w, b, s)
    y = _gemv(kernel, x, w, "linear", s)
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[0])


@tvm_linear.register_fake
def _tvm_linear_fake(x: Tensor, w: Tensor, b: Optional[Tensor], kernel: str, s: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("picompile::tvm_predict", mutates_args=())
def tvm_predict(
    x: Tensor,  # [..., d_model]
    fc1: Tensor,  # [rank, d_model]
    fc2: Tensor,  # [n_neurons, rank]
    threshold: float,
    layer: int,
    kernel1: str,  # llvm kernel: the whole predictor (kind "predict"), or act(fc1 x) (kind "up") when kernel2 is set
    kernel2: str,  # "" (kernel1 is the whole predictor), or fc2 h (kind "up", act "none": artifacts built before it)
    act: str = "relu",
    offset: Optional[Tensor] = None,  # [n_neurons] float32
) -> Tensor:
    """``predict`` lowered to TVM for one token: one kernel call (fc1, act, fc2, offset and the threshold
    test), or two GEMVs and the test in torch; several tokens take ``predict``."""
    if x.numel() != x.shape[-1]:
        return predict(x, fc1, fc2, threshold, layer, act, offset)
    if not kernel2:
        kern = _loaded(kernel1, f"layer {layer} predictor")
        from picompile.kernels import as_aligned

        mask = torch.empty(fc2.shape[0], dtype=torch.int8)  # [n_neurons], written 0/1
        kern.unchecked(as_aligned(x.reshape(-1)), fc1, fc2, offset, threshold_tensor(threshold), mask)  # type: ignore[attr-defined]
        return mask.view(torch.bool).reshape(*x.shape[:-1], fc2.shape[0])
    h = _gemv(kernel1, x, fc1, f"layer {layer} predictor fc1")  # [rank]
    scores = _gemv(kernel2, h, fc2, f"layer {layer} predictor fc2")  # [n_neurons]
    if offset is not None:
        scores += offset
    return (scores > threshold).reshape(*x.shape[:-1], fc2.shape[0])


@tvm_predict.register_fake
def _tvm_predict_fake(x: Tensor, fc1: Tensor, fc2: Tensor, threshold: float, layer: int, kernel1: str,
                      kernel2: str, act: str = "relu", offset: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], fc2.shape[0]), dtype=torch.bool)


# ----------------------------------------------------------------------------- input sparsity (TEAL-style)


@torch.library.custom_op("picompile::input_mask", mutates_args=())
def input_mask(
    x: Tensor,  # [..., d_in] the input of one or more input-sparse linears
    threshold: float,  # |x_i| above this: channel i is active
    layer: int,
    group: str,  # "qkv" | "o" | "gate_up" | "down": which projections read these channels
    thresholds: Optional[Tensor] = None,  # [d_in] float32 per-channel thresholds, used instead of ``threshold``
) -> Tensor:
    """Which input channels an input-sparse linear reads: ``|x| > threshold`` → [..., d_in] bool (TEAL's
    magnitude criterion, one threshold per tensor set from calibration quantiles); with ``thresholds``,
    ``|x_i| > thresholds[i]`` (the weighted criterion ``|x_i|·‖W[:, i]‖ > t`` folded into ``t / ‖W[:, i]‖``)."""
    return x.abs() > (threshold if thresholds is None else thresholds)


@input_mask.register_fake
def _input_mask_fake(x: Tensor, threshold: float, layer: int, group: str,
                     thresholds: Optional[Tensor] = None) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.bool)


@torch.library.custom_op("picompile::input_sparse_linear", mutates_args=())
def input_sparse_linear(
    x: Tensor,  # [..., d_in] float32
    w_t: Tensor,  # [d_in, d_out] the weight input-major (nn.Linear's transposed), float32 or float16
    b: Optional[Tensor],  # [d_out] float32
    mask: Optional[Tensor],  # [..., d_in] bool: the input channels read (None = every channel)
    kernel: str = "",  # key of the llvm kernel for one token (kind "input_sparse"; "down" before it); "" = torch
) -> Tensor:
    """``y = Σ_{i active} x_i · w_t[i] (+ b)``: only the weight rows (nn.Linear columns) of active input channels
    are read. One token with a kernel: kind ``input_sparse`` reads the mask itself (compacts it in the kernel,
    threads splitting d_out; ``kernels/input_sparse.py``); an artifact built before it names a ``down`` kernel, run
    over the gathered channels. Otherwise torch computes ``(x · mask) @ w_t``."""
    d_in = x.shape[-1]
    if kernel and x.numel() == d_in:
        from picompile.kernels import as_aligned

        kern = _loaded(kernel, "input-sparse linear")
        xv = x.reshape(d_in)
        y = _out(w_t.shape[1])  # [d_out]
        if kern.spec.kind == "input_sparse":  # type: ignore[attr-defined]
            m = _all_channels(d_in) if mask is None else mask.reshape(d_in).view(torch.int8)  # [d_in]
            kern.unchecked(as_aligned(xv), m, w_t, y)  # type: ignore[attr-defined]
        else:
            idx = (_all_rows(d_in) if mask is None else mask.reshape(d_in).nonzero().squeeze(1).to(torch.int32))
            h = as_aligned(xv.index_select(0, idx) if mask is not None else xv)  # [k] float32
            kern.unchecked(h, w_t, idx, y)  # type: ignore[attr-defined]
        if b is not None:
            y += b
        return y.reshape(*x.shape[:-1], w_t.shape[1])
    xm = x if mask is None else x * mask
    y = lin(xm, w_t.t())  # [..., d_out]
    return y if b is None else y + b


@input_sparse_linear.register_fake
def _input_sparse_linear_fake(x: Tensor, w_t: Tensor, b: Optional[Tensor], mask: Optional[Tensor],
                              kernel: str = "") -> Tensor:
    return x.new_empty((*x.shape[:-1], w_t.shape[1]))

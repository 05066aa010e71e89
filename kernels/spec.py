"""What a sparse FFN kernel computes: the ``KernelSpec`` value type and its stable key.

Nothing here imports TVM: specs are built and hashed by the planner without the compiler.

Operator contract (PowerInfer's, decode = one token), weights neuron-major:

* ``w_up``     ``[n_rows, d_model]``  fc1 / up_proj rows;   optional ``b_up`` ``[n_rows]``
* ``w_gate``   ``[n_rows, d_model]``  gate_proj rows (gated FFN only)
* ``w_down_t`` ``[n_rows, d_model]``  the down projection transposed: neuron j's output column is row j
* ``idx``      int32 ``[k]``          the active neuron list, any k >= 0 (k is symbolic in the kernel)

``h[j] = act(w_up[idx[j]] . x + b_up[idx[j]])``                      (kind ``ffn_relu`` / ``up``)
``h[j] = act(w_gate[idx[j]] . x + b_gate[idx[j]]) * (w_up[idx[j]] . x + b_up[idx[j]])`` (kind ``ffn_gated`` / ``up_gated``)
``h[j] = relu(w_gate[idx[j]] . x + b_gate[idx[j]]) * relu(w_up[idx[j]] . x + b_up[idx[j]])`` (gated, act ``drelu``)
``y    = sum_j h[j] * w_down_t[idx[j]]``                               (kind ``ffn_*`` / ``down``)

``b_gate`` ``[n_rows]`` (gated kinds, ``gate_bias=True``) is stored as ``b_up`` is; the kernel takes it after
``b_up`` and it is the last argument of a call (``loader.call_args``).

Weights (``b_up`` included) are stored in ``weight_dtype``; ``x``, ``h`` and ``y`` are always float32
and all accumulation is in float32. ``b_down`` is added by the caller, never by the kernel.
Quantized ``weight_dtype`` (``int8``, ``int4``; ``block`` elements per scale): every weight is its quants
array then its float16 scales (``kernels/qformat.py``; ``w_down_t`` quantized along d_model too), ``b_up``
is float32, and the maths is that of the dequantized weights (``qformat.dequantize``).

Kind ``input_sparse`` (CPU only, float32/float16, one token; ``kernels/input_sparse.py``): an input-sparse
linear, ``w_t`` ``[n_rows, d_model]`` a weight input-major, ``x`` ``[n_rows]``, ``mask`` int8 ``[n_rows]``:
``y = sum_{i: mask[i] != 0} x[i] * w_t[i]`` (``y`` ``[d_model]``, written).

Kind ``gemv`` (CPU only, float32/float16; ``kernels/batch_gemv.py``): a few tokens' dot products with selected
rows, each row read once for all: ``x`` ``[t, d_model]``, ``w_up`` ``[n_rows, d_model]``, ``idx`` ``[k]``,
``h[t, j] = w_up[idx[j]] . x[t]`` (``h`` ``[t, k]``); the batched linear layers and the union FFN's up part.
``lanes`` (gemv only; 0 = 32) is the float32 accumulators of one dot product, so that its sums can be those of
another kernel's dot products bit for bit (the fused FFN's and the predictor's 64 lanes, ``runtime/batch_ffn.py``).
Kind ``gemv_down`` (same file): ``down`` for several tokens, each selected row read once for all:
``y[t] = sum_j h[t, j] * w_down_t[idx[j]]`` (``h`` ``[t, k]``, ``y`` ``[t, d_model]``).

Kind ``dequant`` (CPU only, float16/int8/int4; ``kernels/dequant.py``): a stored weight's bfloat16 values for
prefill's GEMMs, ``out[r] = bf16(w[r])`` (``w_up`` its quants / float16 array, ``s_up`` its scales, ``out``
bfloat16 ``[rows, d_model]``); rows are symbolic, so ``n_rows`` is 1 (one kernel per format, width and block).

Kind ``predict`` (CPU only) is a whole activation predictor in one call, for one token:
``fc1`` ``[rank, d_model]``, ``fc2`` ``[n_rows, rank]`` (``weight_dtype``: float32, float16 or int8 with no
scales), optional ``offset`` ``[n_rows]`` float32 (``has_bias``), ``thr`` float32 ``[1]``; it writes the int8 mask
``mask[j] = fc2[j] . act(fc1 x) + offset[j] > thr[0]``.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Literal

KernelKind = Literal["ffn_relu", "ffn_gated", "up", "up_gated", "down", "predict", "input_sparse", "gemv", "gemv_down",
                     "dequant", "prefill_up", "prefill_down"]
Activation = Literal["relu", "silu", "drelu", "none"]
WeightDType = Literal["float32", "float16", "int8", "int4"]

KINDS: tuple[str, ...] = ("ffn_relu", "ffn_gated", "up", "up_gated", "down", "predict", "input_sparse", "gemv", "gemv_down",
                          "dequant", "prefill_up", "prefill_down")
ACTS: tuple[str, ...] = ("relu", "silu", "drelu", "none")
WEIGHT_DTYPES: tuple[str, ...] = ("float32", "float16")  # float weights (every kind, CPU and CUDA)
QUANT_DTYPES: tuple[str, ...] = ("int8", "int4")  # quantized weights, layout: kernels/qformat.py
QUANT_BLOCKS: tuple[int, ...] = (32, 64, 128, 256)  # = qformat.BLOCKS (spec stays torch-free)
CUDA_ARCHS: tuple[str, ...] = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def skips_inactive(kind: str, act: str, gate_bias: bool = False) -> bool:
    """Whether the one-token CPU kernel of ``kind`` reads only the deciding row (gate; ``ffn_relu``: up and
    b_up) of a selected neuron whose ReLU output is 0 (``cpu.py``, schedule parameter ``skip_inactive``, on by
    default): such a neuron then costs one row instead of two or three. The bench's byte count and the
    predictors' rank choice read it here. dReLU skips on its gate too; a gate with a bias does not skip (the
    skip tests the gate's bare dot product)."""
    if kind == "ffn_gated":
        return act in ("relu", "drelu") and not gate_bias
    return act == "relu" and kind == "ffn_relu"


# What a byte of a selected (scattered) FFN row costs a decode step against a byte of a predictor's rows, read in
# order: on the 2-thread AMD Zen 4 machine kind the sparse FFN kernel reads its rows at ~21 GB/s, a plain gather of
# random 1,152-byte rows at 17-21 GB/s, while the predictor and GEMV kernels stream ~35 (benchmarks/README.md,
# "int8 predictors"). The predictors' rank choice weighs the rows it saves by it.
SCATTERED_ROW_COST: float = 1.7


def dot_lanes(length: int, weight_dtype: str) -> int:
    """Float32 accumulators of a CPU kernel's dot product over ``length`` elements of float weights: the largest
    of 32 (float16: one cache line of a row per step; float32: 64), 16, …, 2 that divides it, else 1 — for every
    kind (``cpu.default_params``, the predictor's two GEMVs). The ``gemv`` kernel takes the same count
    (``lanes``), so the serving batch's dot products are a lone token's bit for bit (``runtime/batch_ffn.py``)."""
    for lanes in (32, 16, 8, 4, 2) if weight_dtype == "float16" else (64, 32, 16, 8, 4, 2):
        if length % lanes == 0:
            return lanes
    return 1


# Bump whenever the generated code changes (compute description, schedule, argument order):
# it is part of every key, so stale cached libraries are never reused.
KERNEL_ABI_VERSION: int = 9

_TARGET_RE = re.compile(r"^(llvm|cuda:sm_\d+a?)$")


class KernelSpecError(ValueError):
    """A ``KernelSpec`` field is out of range or inconsistent with the others."""


@dataclass(frozen=True)
class KernelSpec:
    """One compiled kernel: operator kind, activation, shapes, weight dtype, bias and target.

    ``kind``: ``ffn_relu`` (up -> act -> down, fused), ``ffn_gated`` (act(gate) * up -> down, fused),
    ``up`` / ``up_gated`` (only the sparse up/gate part, writes ``h[k]``), ``down`` (row-axpy, writes ``y[d]``),
    ``predict`` (an activation predictor: ``fc2 act(fc1 x) + offset > thr``, writes ``mask[n_rows]``; ``rank``
    is fc1's row count, 0 for every other kind).
    ``target``: ``"llvm"`` (the host CPU; the exact CPU is named when compiling) or ``"cuda:sm_89"`` etc.
    """

    kind: KernelKind
    act: Activation
    d_model: int
    n_rows: int
    weight_dtype: WeightDType
    has_bias: bool
    target: str
    rank: int = 0  # kind "predict" only: the predictor's hidden width
    block: int = 32  # quantized weight_dtype only: elements per float16 scale, along d_model (qformat.py)
    gate_bias: bool = False  # gated kinds: a b_gate [n_rows] argument (Llama mlp_bias)
    lanes: int = 0  # kind "gemv" only: accumulators per dot product, a power of two 2..64 dividing d_model (0: 32)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KernelSpecError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.act not in ACTS:
            raise KernelSpecError(f"act must be one of {ACTS}, got {self.act!r}")
        if self.kind == "down" and self.act != "none":
            raise KernelSpecError("kind 'down' applies no activation: use act='none'")
        if self.kind == "down" and self.has_bias:
            raise KernelSpecError("kind 'down' has no bias (b_down is added by the caller)")
        if self.weight_dtype not in WEIGHT_DTYPES + QUANT_DTYPES:
            raise KernelSpecError(f"weight_dtype must be one of {WEIGHT_DTYPES + QUANT_DTYPES}, got {self.weight_dtype!r}")
        for name in ("d_model", "n_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KernelSpecError(f"{name} must be a positive int, got {value!r}")
        if self.n_rows >= 2**31 or self.n_rows * self.d_model >= 2**31:
            raise KernelSpecError("n_rows * d_model must stay below 2**31 (int32 indexing)")
        if not isinstance(self.has_bias, bool):
            raise KernelSpecError(f"has_bias must be a bool, got {self.has_bias!r}")
        if not isinstance(self.gate_bias, bool):
            raise KernelSpecError(f"gate_bias must be a bool, got {self.gate_bias!r}")
        if self.gate_bias and not self.gated:
            raise KernelSpecError(f"gate_bias is for gated kinds only, not {self.kind!r}")
        if self.act == "drelu" and self.kind not in ("ffn_gated", "up_gated"):
            raise KernelSpecError(f"act 'drelu' (relu on gate and up) is for gated kinds only, not {self.kind!r}")
        if not isinstance(self.target, str) or not _TARGET_RE.match(self.target):
            raise KernelSpecError(f"target must be 'llvm' or 'cuda:sm_XX', got {self.target!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise KernelSpecError(f"rank must be an int >= 0, got {self.rank!r}")
        if self.kind == "predict":
            if self.rank == 0:
                raise KernelSpecError("kind 'predict' needs rank > 0 (fc1's row count)")
            if self.is_cuda:
                raise KernelSpecError("kind 'predict' has a CPU (llvm) schedule only")
            if self.act not in ("relu", "none"):
                raise KernelSpecError(f"kind 'predict' applies relu or none between fc1 and fc2, not {self.act!r}")
            if self.weight_dtype not in ("float32", "float16", "int8"):
                raise KernelSpecError(f"kind 'predict' takes float32, float16 or int8 (scales folded away) weights, "
                                      f"not {self.weight_dtype!r}")
        elif self.rank:
            raise KernelSpecError(f"rank is for kind 'predict' only, got rank={self.rank} for {self.kind!r}")
        if self.kind == "input_sparse":  # kernels/input_sparse.py
            if self.is_cuda or self.quantized or self.has_bias or self.act != "none":
                raise KernelSpecError("kind 'input_sparse' is CPU (llvm), float32/float16, act 'none', no bias")
        if self.kind in ("gemv", "gemv_down"):  # kernels/batch_gemv.py
            if self.is_cuda or self.quantized or self.has_bias or self.act != "none":
                raise KernelSpecError(f"kind {self.kind!r} is CPU (llvm), float32/float16, act 'none', no bias")
        if self.kind in ("prefill_up", "prefill_down"):  # kernels/cpu_prefill.py
            if self.is_cuda or self.has_bias or self.act != "none" or self.n_rows != 1:
                raise KernelSpecError(f"kind {self.kind!r} is CPU (llvm), act 'none', no bias, n_rows 1 "
                                      "(its rows are symbolic)")
        if self.lanes:
            if self.kind != "gemv":
                raise KernelSpecError(f"lanes is for kind 'gemv' only, got lanes={self.lanes} for {self.kind!r}")
            if self.lanes not in (2, 4, 8, 16, 32, 64) or self.d_model % self.lanes:
                raise KernelSpecError(f"lanes must be a power of two 2..64 dividing d_model, got {self.lanes!r}")
        if self.kind == "dequant":  # kernels/dequant.py
            if self.is_cuda or self.weight_dtype == "float32" or self.has_bias or self.act != "none" or self.n_rows != 1:
                raise KernelSpecError("kind 'dequant' is CPU (llvm), float16/int8/int4, act 'none', no bias, n_rows 1 "
                                      "(its rows are symbolic)")
        if self.quantized:
            if self.block not in QUANT_BLOCKS:
                raise KernelSpecError(f"block must be one of {QUANT_BLOCKS}, got {self.block!r}")
            if self.d_model % self.block:
                raise KernelSpecError(f"d_model {self.d_model} is not a whole number of {self.block}-element blocks")

    # -- derived facts ---------------------------------------------------------------------------
    @property
    def is_cuda(self) -> bool:
        return self.target.startswith("cuda:")

    @property
    def cuda_arch(self) -> str | None:
        """``"sm_89"`` for ``"cuda:sm_89"``; None for the CPU."""
        return self.target.split(":", 1)[1] if self.is_cuda else None

    @property
    def quantized(self) -> bool:
        """int8 / int4 weights: each weight is a quants array followed by its float16 scales (``qformat.py``).
        Not kind ``predict``: its int8 weights have no scales (folded into the next matrix and the offset)."""
        return self.weight_dtype in QUANT_DTYPES and self.kind != "predict"

    @property
    def gated(self) -> bool:
        return self.kind in ("ffn_gated", "up_gated")

    @property
    def has_up(self) -> bool:
        return self.kind not in ("down", "predict", "input_sparse", "gemv", "gemv_down", "dequant", "prefill_down")

    @property
    def has_down(self) -> bool:
        return self.kind in ("ffn_relu", "ffn_gated", "down", "gemv_down")

    def key(self) -> str:
        """Stable hash of every field plus ``KERNEL_ABI_VERSION``: cache file stem and kernel name.

        Always starts with a letter (it is also a C symbol name). Independent of the Python process,
        machine and dict order. The host CPU model is *not* part of it: the cache directory belongs to
        one machine (``build_kernel`` records the CPU it compiled for and rebuilds on a mismatch).
        """
        payload = json.dumps({"abi": KERNEL_ABI_VERSION, **self.to_json()}, sort_keys=True)
        digest = hashlib.sha256(payload.encode()).hexdigest()[:20]
        return f"pi_{self.kind}_{digest}"

    def to_json(self) -> dict[str, object]:
        """The fields; ``rank``, ``gate_bias`` and ``lanes`` only where they are set and ``block`` only for
        quantized weights, so specs written before they existed keep their keys."""
        data = asdict(self)
        if not self.rank:
            del data["rank"]
        if not self.gate_bias:
            del data["gate_bias"]
        if not self.lanes:
            del data["lanes"]
        if not self.quantized:
            del data["block"]
        return data

    @staticmethod
    def from_json(data: dict[str, object]) -> "KernelSpec":
        return KernelSpec(**data)  # type: ignore[arg-type]

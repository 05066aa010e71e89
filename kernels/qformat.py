"""Block-quantized weight formats: the one layout the quantized kernels, the quantize pass and the GGUF importer share.

Symmetric blocks of ``block`` consecutive elements along a stored row (the input dimension of a linear; for
``w_down_t``, neuron-major, along d_model), one float16 scale each (llama.cpp's q8_0 / q4_0 maths), quants and
scales in two separate arrays (not llama.cpp's interleaved 18-/34-byte block structs): rows of quants stay
64-byte aligned and a vector load never straddles a scale.

* ``int8``: ``q`` int8 ``[rows, cols]``; ``w[r, c] = q[r, c] * s[r, c // block]``
* ``int4``: ``q`` uint8 ``[rows, cols // 2]``; within block ``b`` of a row, byte ``b*block/2 + j``
  (0 <= j < block/2) holds element ``b*block + j`` in its low nibble and element ``b*block + j + block/2`` in its
  high nibble (llama.cpp's Q4_0 order: one 16-byte load gives 16 + 16 consecutive elements with a mask and a
  shift, no shuffle); ``w = (nibble - 8) * s``
* ``s`` float16 ``[rows, cols // block]``

Nothing here imports TVM: this is plain torch, the reference every kernel is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

QUANT_DTYPES: tuple[str, ...] = ("int8", "int4")
DEFAULT_BLOCK: int = 32
BLOCKS: tuple[int, ...] = (32, 64, 128, 256)  # block sizes a build may choose (--quant-block)
# torch dtype of the quants array -> format name (a quantized weight says its format by its dtype)
_FORMAT_OF_DTYPE: dict[torch.dtype, str] = {torch.int8: "int8", torch.uint8: "int4"}


@dataclass(frozen=True)
class QFormat:
    """A quantized format: ``name`` in QUANT_DTYPES, ``block`` elements per float16 scale."""

    name: str
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.name not in QUANT_DTYPES:
            raise ValueError(f"quantized format must be one of {QUANT_DTYPES}, got {self.name!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"quantization block must be one of {BLOCKS}, got {self.block!r}")

    def check_cols(self, cols: int) -> None:
        if cols % self.block:
            raise ValueError(f"a row of {cols} elements is not a whole number of {self.block}-element blocks")

    def bytes_per_row(self, cols: int) -> int:
        """Bytes one stored row of ``cols`` elements reads: quants + scales."""
        return (cols if self.name == "int8" else cols // 2) + 2 * (cols // self.block)


def is_quantized(q: Tensor) -> bool:
    """Whether a stored weight is the quants array of a quantized format (int8 or packed uint8)."""
    return q.dtype in _FORMAT_OF_DTYPE


def format_of(q: Tensor, s: Tensor) -> QFormat:
    """The format of a quantized weight ``(q, s)``, from q's dtype and the two shapes."""
    name = _FORMAT_OF_DTYPE.get(q.dtype)
    if name is None or s.dtype != torch.float16 or q.dim() != 2 or s.dim() != 2 or q.shape[0] != s.shape[0]:
        raise ValueError(f"not a quantized weight: q {q.dtype} {tuple(q.shape)}, s {s.dtype} {tuple(s.shape)}")
    cols = q.shape[1] * (2 if name == "int4" else 1)
    if s.shape[1] == 0 or cols % s.shape[1]:
        raise ValueError(f"scales {tuple(s.shape)} do not divide rows of {cols} elements into blocks")
    return QFormat(name, cols // s.shape[1])


def quantize(w: Tensor, fmt: QFormat) -> tuple[Tensor, Tensor]:
    """``w`` [rows, cols] (any float dtype) → (q, s) in ``fmt``, rounded as llama.cpp's quantize_row_q8_0 /
    quantize_row_q4_0 do (scale from the block's largest magnitude; q4_0 keeps its sign: d = max / -8)."""
    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    fmt.check_cols(cols)
    x = w.detach().float().reshape(rows, cols // fmt.block, fmt.block)  # [rows, n_blocks, block]
    if fmt.name == "int8":
        d = x.abs().amax(-1) / 127.0  # [rows, n_blocks]
        inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
        v = x * inv[..., None]
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8).reshape(rows, cols)  # roundf: ties away from 0
        return q.contiguous(), d.to(torch.float16).contiguous()
    idx = x.abs().argmax(-1, keepdim=True)
    d = torch.gather(x, -1, idx).squeeze(-1) / -8.0  # [rows, n_blocks]
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    nib = torch.clamp((x * inv[..., None] + 8.5).to(torch.int32), max=15).to(torch.uint8)  # trunc, as (int8_t)
    return pack_int4(nib.reshape(rows, cols), fmt.block), d.to(torch.float16).contiguous()


def pack_int4(nibbles: Tensor, block: int) -> Tensor:
    """uint8 values 0..15 [rows, cols] → the packed int4 quants [rows, cols // 2] (module docstring order)."""
    rows, cols = nibbles.shape
    n = nibbles.reshape(rows, cols // block, 2, block // 2)  # [rows, n_blocks, lo|hi, block/2]
    return (n[:, :, 0] | (n[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_int4(q: Tensor, block: int) -> Tensor:
    """The packed int4 quants [rows, cols // 2] → their nibbles 0..15 as uint8 [rows, cols]."""
    rows, half = q.shape
    b = q.reshape(rows, half // (block // 2), 1, block // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(rows, 2 * half)


def dequantize(q: Tensor, s: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(q, s) → the weight [rows, cols] in ``dtype`` (computed in float32: q * s exactly as the kernels do)."""
    fmt = format_of(q, s)
    vals = q.float() if fmt.name == "int8" else unpack_int4(q, fmt.block).float() - 8.0  # [rows, cols]
    rows, cols = vals.shape
    w = vals.reshape(rows, cols // fmt.block, fmt.block) * s.float()[..., None]
    return w.reshape(rows, cols).to(dtype)


def quantize_x(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """An activation ``x`` [d] → (int8 quants [d], float32 scales [d / block]) as the integer dot-product kernels
    quantize it (``cpu_qdot.py``): ``dx = max|x| / 127`` per block, ``xq = round_half_even(x * (1 / dx))``."""
    xb = x.float().reshape(-1, block)  # [n_blocks, block]
    dx = xb.abs().amax(-1) / 127.0  # [n_blocks]
    inv = torch.where(dx != 0, 1.0 / torch.where(dx != 0, dx, 1.0), 0.0)
    return torch.round(xb * inv[:, None]).to(torch.int8).reshape(-1), dx


def qdot_reference(x: Tensor, q: Tensor, s: Tensor) -> Tensor:
    """``(q, s) · x`` [rows] in float64 with ``x`` quantized as ``quantize_x`` does (the maths of the integer
    kernels): per block the exact integer dot of the weight's and x's quants, times ``s * dx``."""
    fmt = format_of(q, s)
    xq, dx = quantize_x(x, fmt.block)
    ints = q.long() if fmt.name == "int8" else unpack_int4(q, fmt.block).long() - 8  # [rows, cols]
    rows, cols = ints.shape
    blk = (ints.reshape(rows, cols // fmt.block, fmt.block) * xq.long().reshape(1, -1, fmt.block)).sum(-1)
    return (blk.double() * s.double() * dx.double()[None]).sum(-1)


def qdown_reference(h: Tensor, q: Tensor, s: Tensor, group: int = 4) -> Tensor:
    """``Σ_j h[j] · (q, s)[j]`` [cols] as the integer down rows of the gated FFN kernels compute it
    (``cpu_qdot._down_int_macro``): the rows ``group`` at a time in the order given (the last group padded with
    h = 0); per group and block ``b`` the rows' ``c_i = h_i · s_i[b]`` (float32) quantized together
    (``dc = max_i |c_i| / 127``, ``cq_i = round_half_even(c_i · (1 / dc))``, float32 as the kernel), then the exact
    integer sums ``Σ_i cq_i · quant_i`` (int4: nibble − 8) times ``dc``, summed over the groups in float64."""
    fmt = format_of(q, s)
    ints = q.long() if fmt.name == "int8" else unpack_int4(q, fmt.block).long() - 8  # [rows, cols]
    rows, cols = ints.shape
    nb = cols // fmt.block
    pad = (-rows) % group
    c = torch.cat([h.float()[:, None] * s.float(), torch.zeros(pad, nb)])  # [rows + pad, nb] float32
    ints = torch.cat([ints, torch.zeros(pad, cols, dtype=torch.long)]).reshape(-1, group, nb, fmt.block)
    c = c.reshape(-1, group, nb)  # [groups, group, nb]
    dc = c.abs().amax(1) / 127.0  # [groups, nb]
    inv = torch.where(dc != 0, 1.0 / torch.where(dc != 0, dc, 1.0), 0.0)
    cq = torch.round(c * inv[:, None]).long()  # [groups, group, nb]
    blk = (cq[..., None] * ints).sum(1)  # [groups, nb, block]: exact integer sums over the group's rows
    return (blk.double() * dc.double()[..., None]).sum(0).reshape(cols)

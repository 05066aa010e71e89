"""safetensors files read by memory mapping and written tensor by tensor (no copy of the whole file in memory).

``map_safetensors(path)`` returns the tensors of a file as views of one private (copy-on-write) mapping of it:
nothing is read until a tensor's pages are touched, and pages the kernel reclaims are read back from the file.
``write_safetensors(path, tensors)`` writes the header computed from the tensors' shapes and dtypes, then each
tensor's bytes in turn: the same bytes as ``safetensors.torch.save_file`` (same order, same header padding),
with one tensor at a time held as a contiguous copy (none when it already is contiguous).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import weakref
from pathlib import Path
from typing import Mapping

import torch

from picompile.errors import PicompileError

# safetensors dtype names, in the order of safetensors' Dtype enum (save_file sorts tensors by it, descending)
DTYPE_ORDER: tuple[tuple[str, torch.dtype], ...] = (
    ("BOOL", torch.bool), ("U8", torch.uint8), ("I8", torch.int8), ("F8_E5M2", torch.float8_e5m2),
    ("F8_E4M3", torch.float8_e4m3fn), ("I16", torch.int16), ("U16", torch.uint16), ("F16", torch.float16),
    ("BF16", torch.bfloat16), ("I32", torch.int32), ("U32", torch.uint32), ("F32", torch.float32),
    ("F64", torch.float64), ("I64", torch.int64), ("U64", torch.uint64),
)
NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPE_ORDER}
DTYPE_OF: dict[str, torch.dtype] = {name: dt for name, dt in DTYPE_ORDER}
RANK_OF: dict[torch.dtype, int] = {dt: i for i, (_, dt) in enumerate(DTYPE_ORDER)}
MAX_HEADER_BYTES: int = 100 << 20  # safetensors' own limit
PAGE: int = mmap.PAGESIZE
# the live mappings map_safetensors made: (start address, length, the mapping)
_MAPPINGS: list[tuple[int, int, "weakref.ref[mmap.mmap]"]] = []


class TensorFileError(PicompileError):
    """A safetensors file that cannot be read: the message names the file and the problem."""


def read_header(path: Path) -> tuple[int, dict[str, dict[str, object]]]:
    """(data start offset, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file, checked against
    its size; ``__metadata__`` is dropped."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise TensorFileError(f"corrupt or truncated weights file {path}: header length {n}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TensorFileError(f"corrupt weights file {path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"corrupt weights file {path}: header is not a JSON object")
    header.pop("__metadata__", None)
    for name, meta in header.items():
        try:
            dtype, shape, (lo, hi) = DTYPE_OF[meta["dtype"]], [int(s) for s in meta["shape"]], meta["data_offsets"]
            numel = 1
            for s in shape:
                numel *= s
            ok = 0 <= int(lo) <= int(hi) and int(hi) - int(lo) == numel * dtype.itemsize and min(shape, default=0) >= 0
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise TensorFileError(f"corrupt weights file {path}: bad entry for tensor {name!r}")
    end = max((int(m["data_offsets"][1]) for m in header.values()), default=0)
    if size < 8 + n + end:
        raise TensorFileError(f"corrupt or truncated weights file {path}: {size} bytes, header needs {8 + n + end}")
    return 8 + n, header


def map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, in its stored dtype, as a view of one private mapping of the file.

    The mapping lives as long as any of the tensors; writing to a tensor copies only the pages written (and
    :func:`release_pages` would revert them: treat mapped tensors as read-only).
    """
    start, header = read_header(Path(path))
    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            return {}
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    _MAPPINGS[:] = [m for m in _MAPPINGS if m[2]() is not None]
    _MAPPINGS.append((base, len(mm), weakref.ref(mm)))
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name.startswith(PAD_PREFIX):
            continue
        dtype, shape = DTYPE_OF[str(meta["dtype"])], [int(s) for s in meta["shape"]]  # type: ignore[union-attr]
        lo, hi = (int(v) for v in meta["data_offsets"])  # type: ignore[union-attr]
        if hi == lo:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        if (start + lo) % dtype.itemsize:  # not aligned for its dtype: a copy (safetensors files are aligned)
            flat = flat.clone()
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def release_pages(tensors: "list[torch.Tensor] | None" = None) -> int:
    """Drop the resident pages of mapped tensors (``None``: of every mapping) from this process's memory; the
    data stays in the page cache and is read back from the file if used again. Returns the bytes of the ranges
    released; tensors that are not mapped are left alone.

    The mappings are private: a page written to in place is this process's copy, and releasing it reverts it to
    the file's content. Mapped weights are only read (no pass writes to a weight in place: they make new
    tensors), which is what makes releasing them safe."""
    released = 0
    for base, length, ref in list(_MAPPINGS):
        mm = ref()
        if mm is None:
            continue
        ranges = [(0, length)] if tensors is None else [
            (t.data_ptr() - base, t.numel() * t.element_size()) for t in tensors
            if base <= t.data_ptr() < base + length and t.numel() > 0]
        for off, n in ranges:
            lo, hi = -(-off // PAGE) * PAGE, min(length, off + n) // PAGE * PAGE  # whole pages inside the range
            if hi > lo:
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                released += hi - lo
    return released


def _order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """save_file's order: dtype descending (by safetensors' enum), then name."""
    for name, t in tensors.items():
        if t.dtype not in RANK_OF:
            raise TensorFileError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
    return sorted(tensors, key=lambda k: (-RANK_OF[tensors[k].dtype], k))


PAD_PREFIX: str = "__picompile_pad_"  # uint8 filler tensors that put the next tensor on its alignment


def header_bytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
                 align: int = 0) -> tuple[bytes, list[tuple[str, int]]]:
    """The safetensors header (length prefix included) and the data layout [(tensor name or "", bytes)].

    ``align`` 0: save_file's header exactly (padded with spaces to 8 bytes). ``align`` N: the data starts on an
    N-byte boundary of the file and every tensor too; a gap before one is a uint8 tensor ``PAD_PREFIX<i>`` (the
    format has no holes), which readers of the file see as one more tensor and ``map_safetensors`` drops.
    """
    order = _order(tensors)
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    layout: list[tuple[str, int]] = []
    offset = 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        gap = -offset % align if align and n else 0
        if gap:
            entries[f"{PAD_PREFIX}{len(layout)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            layout.append(("", gap))
            offset += gap
        entries[name] = {"dtype": NAME_OF[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        layout.append((name, n))
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * ((-(len(text) + 8) % align) if align else (-len(text) % 8))
    return len(text).to_bytes(8, "little") + text, layout


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None,
                      align: int = 0) -> int:
    """Write ``tensors`` as a safetensors file, one tensor at a time (``align``: see :func:`header_bytes`);
    returns the bytes written."""
    head, layout = header_bytes(tensors, metadata, align)
    written = 0
    with open(path, "wb") as f:
        f.write(head)
        written += len(head)
        for name, n in layout:
            if not name:
                f.write(bytes(n))
                written += n
                continue
            t = tensors[name].detach()
            if t.numel() == 0:
                continue
            data = t.contiguous().reshape(-1).view(torch.uint8)  # [bytes]
            f.write(memoryview(data.numpy()))
            written += data.numel()
            del data
    return written

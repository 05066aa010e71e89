"""Load a compiled kernel library with the TVM *runtime* only, and call it on torch tensors.

How the runtime-only load works (checked by ``tests/test_kernels.py::test_loader_is_runtime_only``):

1. ``libtvm_runtime.so`` (3 MB, shipped in the ``tvm`` wheel's ``lib/`` folder) is opened with
   ``ctypes.CDLL(..., RTLD_GLOBAL)``; the folder is found with ``importlib.util.find_spec("tvm")``,
   which locates the package **without executing** ``tvm/__init__.py`` (that import would open the
   260 MB ``libtvm_compiler.so`` and take 4-6 s). The exported ``.so`` calls back into it for the
   thread pool (``TVMBackendParallelLaunch``) and workspace allocation. For CUDA kernels
   ``libtvm_runtime_cuda.so`` is opened too (it registers the loader of the embedded cubin).
2. ``tvm_ffi.load_module(path)`` (the small ``apache-tvm-ffi`` package) dlopens the library; its
   functions are ``tvm_ffi.Function`` objects that accept torch tensors zero-copy through DLPack.

Nothing in this module imports ``tvm``. The library holds two functions: ``<key>`` (one token,
``x`` ``[d_model]``) and ``<key>_batch`` (``x`` ``[t, d_model]``, one ``idx`` for all t tokens).
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .spec import KernelSpec

ALIGNMENT: int = 64  # bytes; the compiled kernels assume every buffer starts on this boundary

_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
_runtime_lock = threading.Lock()
_runtime_loaded: dict[str, ctypes.CDLL] = {}


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong type, dtype, shape, device, layout or alignment."""


class IndexValidationError(ValueError):
    """An active-neuron index list is malformed or refers to rows that do not exist."""


class KernelLoadError(RuntimeError):
    """The compiled library is missing, not loadable, or was built for another spec."""


# -- runtime bootstrap ----------------------------------------------------------------------------
def _tvm_lib_dir() -> Path:
    """``<site-packages>/tvm/lib``, located without importing ``tvm``."""
    found = importlib.util.find_spec("tvm")
    if found is None or not found.submodule_search_locations:
        raise KernelLoadError("the 'tvm' package (apache-tvm) is not installed")
    for location in found.submodule_search_locations:
        lib_dir = Path(location) / "lib"
        if (lib_dir / "libtvm_runtime.so").exists():
            return lib_dir
    raise KernelLoadError("libtvm_runtime.so not found in the tvm package")


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


SPIN_COUNT = 2000  # yields of an idle TVM worker before it sleeps (see ensure_runtime)


def ensure_runtime(cuda: bool = False) -> None:
    """Open the TVM runtime library (and its CUDA part) once per process, RTLD_GLOBAL.

    Also sets, unless the user did (both are read when the thread pool starts, at the first call):
    ``TVM_NUM_THREADS`` to the number of physical cores (TVM assumes 2-way hyper-threading on x86
    and would use half the cores: 1 thread on a 2-core VM), and ``TVM_THREAD_POOL_SPIN_COUNT`` to
    2000: idle workers yield 2000 times (about a millisecond) before they sleep, instead of 300 000
    times, which on a machine shared with other busy processes made the next call wait for a
    descheduled spinning worker (measured: 1 % rows 2.6 ms -> 0.8 ms). A decode step's ~90 kernel
    calls come microseconds apart, so its workers stay awake through the step and no call pays a
    futex wake-up (1B f16 compiled step, 5 process pairs: 49.0 against 50.8 ms, faster in every pair
    than with 0, which sleeps at once).
    """
    import tvm_ffi  # noqa: F401  (opens libtvm_ffi.so, which libtvm_runtime.so links against)

    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SPIN_COUNT))
    names = ["libtvm_runtime.so"] + (["libtvm_runtime_cuda.so"] if cuda else [])
    with _runtime_lock:
        for name in names:
            if name in _runtime_loaded:
                continue
            path = _tvm_lib_dir() / name
            try:
                _runtime_loaded[name] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as err:  # e.g. libcuda.so.1 missing on a machine without the driver
                raise KernelLoadError(f"cannot open {path}: {err}") from err


def set_num_threads(n: int) -> None:
    """Use ``n`` threads of the TVM runtime's CPU pool (at most its size: ``TVM_NUM_THREADS``, which
    ``ensure_runtime`` defaults to the physical core count; the pool is sized at its first use)."""
    import tvm_ffi

    ensure_runtime()
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, int(n))  # 1 = kBig: all cores alike on x86


def num_threads() -> int:
    import tvm_ffi

    ensure_runtime()
    return int(tvm_ffi.get_global_func("runtime.NumThreads")())


# -- aligned tensors and index validation ---------------------------------------------------------
def is_aligned(t: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    return t.data_ptr() % alignment == 0


HUGE_PAGE: int = 2 << 20  # bytes; x86-64 transparent huge page
HUGE_PAGE_MIN_BYTES: int = 8 << 20  # CPU tensors from this size on are backed by huge pages


def _thp_available() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping advised MADV_HUGEPAGE, and the offset in it where ``nbytes`` start 2 MiB aligned."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-ctypes.addressof(ctypes.c_char.from_buffer(mm))) % HUGE_PAGE
    mm.madvise(mmap.MADV_HUGEPAGE)
    return mm, start


def _huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor on its own huge-page mapping (``_huge_page_mapping``); the tensor keeps the mapping alive."""
    mm, start = _huge_page_mapping(numel * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=start)


def aligned_empty(
    shape: Sequence[int] | int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    huge_pages: bool | None = None,
) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data pointer is ``ALIGNMENT``-byte aligned.

    CPU tensors of ``HUGE_PAGE_MIN_BYTES`` or more (``huge_pages=None``; force with True/False) are
    backed by transparent huge pages (2 MiB, ``madvise``): a sparse kernel reads rows scattered over
    the weight matrix, and with 4 KiB pages every row costs TLB misses (measured: +12 % bandwidth
    for 10 % of a 4096 x 16384 fp32 FFN). Otherwise torch's allocator (64-byte aligned on x86) is
    used; views/slices and numpy-backed tensors are not aligned, hence this helper.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    is_cpu = torch.device(device).type == "cpu"
    if huge_pages is None:
        huge_pages = numel * itemsize >= HUGE_PAGE_MIN_BYTES
    if is_cpu and huge_pages and numel > 0 and _thp_available():
        return _huge_page_empty(numel, dtype).view(shape)
    t = torch.empty(shape, dtype=dtype, device=device)
    if is_aligned(t):
        return t
    raw = torch.empty(numel * itemsize + ALIGNMENT, dtype=torch.uint8, device=device)
    offset = (-raw.data_ptr()) % ALIGNMENT
    out = raw[offset : offset + numel * itemsize].view(dtype).view(shape)
    assert is_aligned(out)
    return out


def as_aligned(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``t`` itself when contiguous and aligned (and not ``copy``), else an aligned contiguous copy (for load
    time; large ones on huge pages, see :func:`aligned_empty`)."""
    if t.is_contiguous() and is_aligned(t) and not copy:
        return t
    out = aligned_empty(t.shape, t.dtype, t.device)
    out.copy_(t)
    return out


def aligned_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Aligned contiguous copies of ``tensors`` (same keys and order), all on huge pages where THP is
    available: each tensor of ``HUGE_PAGE_MIN_BYTES`` or more in a mapping of its own (``as_aligned``),
    the smaller CPU ones side by side in one shared mapping, each in a storage of its own (no aliasing
    for torch to see). A small tensor on its own lives on 4 KiB pages, and a decode step that has just
    streamed a gigabyte finds none of them in the TLB: a 1B model's predictor (fc1 0.5 MB and fc2 1.4 MB,
    float16) measured 249 µs per layer on 4 KiB pages against 120 µs packed on huge pages."""
    offsets: dict[str, int] = {}  # small CPU tensors -> byte offset in the shared mapping
    total = 0
    for k, t in tensors.items():
        if t.device.type == "cpu" and 0 < t.nbytes < HUGE_PAGE_MIN_BYTES:
            offsets[k] = total
            total += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    if not offsets or not _thp_available():
        return {k: as_aligned(t, copy=True) for k, t in tensors.items()}
    mm, start = _huge_page_mapping(total)
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if k in offsets:
            c = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=start + offsets[k]).view(t.shape)
            c.copy_(t)
            out[k] = c
        else:
            out[k] = as_aligned(t, copy=True)
    return out


def validate_indices(idx: torch.Tensor, n_rows: int, *, allow_duplicates: bool = False) -> None:
    """Check an active-row list once (at load time, never per call): an out-of-range index would make
    the kernel read outside the weight matrix (a segfault or garbage), a duplicate counts a row twice.

    Requires int32, 1-D, contiguous, every value in ``[0, n_rows)``, no duplicates (unless allowed).
    """
    if not isinstance(idx, torch.Tensor):
        raise IndexValidationError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int32:
        raise IndexValidationError(f"idx must be int32, got {idx.dtype}")
    if idx.dim() != 1:
        raise IndexValidationError(f"idx must be 1-D, got shape {tuple(idx.shape)}")
    if not idx.is_contiguous():
        raise IndexValidationError("idx must be contiguous")
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n_rows:
        bad = idx[(idx < 0) | (idx >= n_rows)][:5].tolist()
        raise IndexValidationError(f"idx values must lie in [0, {n_rows}); out of range: {bad}")
    if not allow_duplicates and torch.unique(idx).numel() != idx.numel():
        raise IndexValidationError("idx contains duplicate rows (each active row must appear once)")


# -- the callable ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Arg:
    name: str
    dtype: torch.dtype
    shape: tuple[str | int, ...]  # symbolic dims by name: "k", "t"


def _signature(spec: KernelSpec, batched: bool) -> list[_Arg]:
    """Argument list of the compiled function (PrimFunc order), with dtypes and symbolic shapes."""
    d, n = spec.d_model, spec.n_rows
    w = _TORCH_DTYPES.get(spec.weight_dtype, torch.float32)
    if spec.kind == "predict":  # one token only (no batched variant); int8: plain int8, no scales
        w = torch.int8 if spec.weight_dtype == "int8" else w
        return [_Arg("x", torch.float32, (d,)), _Arg("fc1", w, (spec.rank, d)), _Arg("fc2", w, (n, spec.rank)),
                *([_Arg("offset", torch.float32, (n,))] if spec.has_bias else []),
                _Arg("thr", torch.float32, (1,)), _Arg("mask", torch.int8, (n,))]
    if spec.kind == "input_sparse":  # one token only (kernels/input_sparse.py)
        return [_Arg("x", torch.float32, (n,)), _Arg("mask", torch.int8, (n,)), _Arg("w_t", w, (n, d)),
                _Arg("y", torch.float32, (d,))]
    if spec.kind == "dequant":  # rows symbolic (kernels/dequant.py)
        q = {"int8": _Arg("w_up", torch.int8, ("r", d)), "int4": _Arg("w_up", torch.uint8, ("r", d // 2))}.get(
            spec.weight_dtype, _Arg("w_up", w, ("r", d)))
        scales = [_Arg("s_up", torch.float16, ("r", d // spec.block))] if spec.quantized else []
        return [q, *scales, _Arg("out", torch.bfloat16, ("r", d))]
    if spec.kind in ("prefill_up", "prefill_down"):  # rows "r" symbolic, several tokens (kernels/cpu_prefill.py)
        weight = _weight_args(spec, "w_up" if spec.kind == "prefill_up" else "w_down_t", rows="r")
        if spec.kind == "prefill_up":
            return [_Arg("x", torch.float32, ("t", d)), *weight, _Arg("g", torch.float32, ("t", "r")),
                    _Arg("h", torch.float32, ("t", "r"))]
        return [_Arg("h", torch.float32, ("t", "r")), _Arg("tokptr", torch.int32, ("t1",)),
                _Arg("rows", torch.int32, ("nr",)), *weight, _Arg("y", torch.float32, ("p", "t", d))]
    if spec.kind == "gemv":  # several tokens in both forms (kernels/batch_gemv.py)
        return [_Arg("x", torch.float32, ("t", d)), _Arg("w_up", w, (n, d)), _Arg("idx", torch.int32, ("k",)),
                _Arg("h", torch.float32, ("t", "k"))]
    if spec.kind == "gemv_down":
        return [_Arg("h", torch.float32, ("t", "k")), _Arg("w_down_t", w, (n, d)), _Arg("idx", torch.int32, ("k",)),
                _Arg("y", torch.float32, ("t", d))]
    tok: tuple[str, ...] = ("t",) if batched else ()
    args: list[_Arg] = []
    if spec.has_up:
        args.append(_Arg("x", torch.float32, (*tok, d)))
        args += _weight_args(spec, "w_up")
        if spec.gated:
            args += _weight_args(spec, "w_gate")
        if spec.has_bias:
            args.append(_Arg("b_up", torch.float32 if spec.quantized else w, (n,)))
        if spec.gate_bias:
            args.append(_Arg("b_gate", torch.float32 if spec.quantized else w, (n,)))
    else:
        args.append(_Arg("h", torch.float32, (*tok, "k")))
    if spec.has_down:
        args += _weight_args(spec, "w_down_t")
    args.append(_Arg("idx", torch.int32, ("k",)))
    if spec.has_down:
        args.append(_Arg("y", torch.float32, (*tok, d)))
    else:
        args.append(_Arg("h", torch.float32, (*tok, "k")))
    return args


_SCALES: dict[str, str] = {"w_up": "s_up", "w_gate": "s_gate", "w_down_t": "s_down"}  # = compute.SCALE_NAMES


def _weight_args(spec: KernelSpec, name: str, rows: str | None = None) -> list[_Arg]:
    """A weight's arguments: the float array, or a quantized weight's quants then its float16 scales
    (``qformat.py``: int8 ``[n, d]``, int4 packed uint8 ``[n, d/2]``; scales ``[n, d/block]``); ``rows``: a
    symbolic row count's name instead of ``spec.n_rows``."""
    n: str | int = spec.n_rows if rows is None else rows
    d = spec.d_model
    if not spec.quantized:
        return [_Arg(name, _TORCH_DTYPES[spec.weight_dtype], (n, d))]
    q = _Arg(name, torch.int8, (n, d)) if spec.weight_dtype == "int8" else _Arg(name, torch.uint8, (n, d // 2))
    return [q, _Arg(_SCALES[name], torch.float16, (n, d // spec.block))]


def call_args(spec: KernelSpec) -> tuple[str, ...]:
    """``SparseKernel.__call__``'s argument order for ``spec``: ``CALL_ARGS[kind]``, each quantized weight
    followed by its scales (``ffn_*``: ``x, w_up, s_up, w_gate, s_gate, b_up, w_down_t, s_down, idx, y``)."""
    names = CALL_ARGS[spec.kind] + (("b_gate",) if spec.gate_bias else ())  # a gate bias: the last argument
    if not spec.quantized:
        return names
    return tuple(a for nm in names for a in ((nm, _SCALES[nm]) if nm in _SCALES else (nm,)))


# Python-level argument order of ``SparseKernel.__call__`` per kind (None where the spec has none);
# quantized weights add their scales: ``call_args(spec)``.
CALL_ARGS: dict[str, tuple[str, ...]] = {
    "ffn_relu": ("x", "w_up", "w_gate", "b_up", "w_down_t", "idx", "y"),
    "ffn_gated": ("x", "w_up", "w_gate", "b_up", "w_down_t", "idx", "y"),
    "up": ("x", "w_up", "w_gate", "b_up", "idx", "h"),
    "up_gated": ("x", "w_up", "w_gate", "b_up", "idx", "h"),
    "down": ("h", "w_down_t", "idx", "y"),
    "predict": ("x", "fc1", "fc2", "offset", "thr", "mask"),
    "input_sparse": ("x", "mask", "w_t", "y"),
    "gemv": ("x", "w_up", "idx", "h"),
    "gemv_down": ("h", "w_down_t", "idx", "y"),
    "dequant": ("w_up", "out"),
    "prefill_up": ("x", "w_up", "g", "h"),
    "prefill_down": ("h", "tokptr", "rows", "w_down_t", "y"),
}


@dataclass
class SparseKernel:
    """A loaded kernel. Call it with torch tensors; the output (last argument) is overwritten.

    Argument order (``None`` where the spec has no such tensor — ``w_gate`` unless gated,
    ``b_up`` unless ``has_bias``)::

        ffn_relu / ffn_gated:  k(x, w_up, w_gate, b_up, w_down_t, idx, y)
        up / up_gated:         k(x, w_up, w_gate, b_up, idx, h)
        down:                  k(h, w_down_t, idx, y)
        predict:               k(x, fc1, fc2, offset, thr, mask)   (offset None unless has_bias)
        input_sparse:          k(x, mask, w_t, y)                  (mask int8 [n_rows], w_t [n_rows, d_model])

    Shapes: ``x`` ``[d_model]`` float32 (or ``[t, d_model]`` for the batched variant: one ``idx``
    for all t tokens), ``w_*`` ``[n_rows, d_model]`` and ``b_up`` ``[n_rows]`` in ``weight_dtype``,
    ``idx`` int32 ``[k]`` (k >= 0, validated once with ``validate_indices``), ``h`` float32 ``[k]``
    (``[t, k]``), ``y`` float32 ``[d_model]`` (``[t, d_model]``). All tensors contiguous, on the
    spec's device, 64-byte aligned (``aligned_empty`` / ``as_aligned``). ``y = sum_j h[j] w_down_t[idx[j]]``
    is written, not accumulated: the caller adds ``b_down`` and the other device's partial sum.

    ``__call__`` checks every argument (a few microseconds); ``unchecked`` takes the same arguments
    and skips the checks for a hot loop whose tensors were checked once.
    """

    spec: KernelSpec
    path: Path
    module: Any  # tvm_ffi.Module (keeps the library loaded)
    decode_fn: Callable[..., None]
    batch_fn: Callable[..., None] | None
    partitions: int | None = None  # fused FFN kinds (CPU): the row parts whose partial sums it adds (cache.py)
    _sigs: dict[bool, list[_Arg]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._sigs = {False: _signature(self.spec, False), True: _signature(self.spec, True)}
        self._call_args = call_args(self.spec)
        self._device_type = "cuda" if self.spec.is_cuda else "cpu"

    # the public entry point
    def __call__(self, *args: torch.Tensor | None) -> None:
        named = self._bind(args)
        batched = self._is_batched(named)
        ordered = self._check(named, batched)
        self._launch(ordered, batched)

    def unchecked(self, *args: torch.Tensor | None) -> None:
        """Same as ``__call__`` without argument checks (wrong input can crash the process)."""
        named = dict(zip(self._call_args, args))
        batched = self._is_batched(named)
        self._launch([named[a.name] for a in self._sigs[batched]], batched)

    # -- internals -------------------------------------------------------------------------------
    def _bind(self, args: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        names = self._call_args
        if len(args) != len(names):
            raise KernelArgumentError(
                f"{self.spec.kind} kernel takes {len(names)} arguments ({', '.join(names)}), got {len(args)}"
            )
        named = dict(zip(names, args))
        expected = {a.name for a in self._sigs[False]}
        for name, value in named.items():
            if name not in expected and value is not None:
                why = "not gated" if name in ("w_gate", "s_gate") else "has_bias=False"  # b_up, or a predictor's offset
                raise KernelArgumentError(f"{name} must be None for this kernel ({why})")
        return named

    def _is_batched(self, named: dict[str, torch.Tensor | None]) -> bool:
        if self.spec.kind in ("dequant", "prefill_up", "prefill_down"):  # one form
            return False
        first = named["h"] if self.spec.kind in ("down", "gemv_down") else named["x"]
        return isinstance(first, torch.Tensor) and first.dim() == 2

    def _check(self, named: dict[str, torch.Tensor | None], batched: bool) -> list[torch.Tensor]:
        sig = self._sigs[batched]
        dims: dict[str, int] = {}
        ordered: list[torch.Tensor] = []
        for a in sig:
            t = named[a.name]
            if not isinstance(t, torch.Tensor):
                raise KernelArgumentError(f"{a.name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != self._device_type:
                raise KernelArgumentError(f"{a.name} is on {t.device}, the kernel runs on {self._device_type}")
            if t.dtype != a.dtype:
                raise KernelArgumentError(f"{a.name} must be {a.dtype}, got {t.dtype}")
            if t.dim() != len(a.shape):
                raise KernelArgumentError(f"{a.name} must have shape {a.shape}, got {tuple(t.shape)}")
            for want, got in zip(a.shape, t.shape):
                if isinstance(want, str):
                    if dims.setdefault(want, got) != got:
                        raise KernelArgumentError(
                            f"{a.name}: dimension {want}={got} disagrees with {want}={dims[want]} of another argument"
                        )
                elif want != got:
                    raise KernelArgumentError(f"{a.name} must have shape {a.shape}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise KernelArgumentError(f"{a.name} must be contiguous")
            if t.numel() and not is_aligned(t):
                raise KernelArgumentError(
                    f"{a.name} is not {ALIGNMENT}-byte aligned (data_ptr % {ALIGNMENT} = "
                    f"{t.data_ptr() % ALIGNMENT}); allocate with aligned_empty() or copy with as_aligned()"
                )
            if t.requires_grad:
                raise KernelArgumentError(f"{a.name} requires grad; call under torch.no_grad() or detach()")
            ordered.append(t)
        return ordered

    def _launch(self, ordered: list[torch.Tensor], batched: bool) -> None:
        if self.spec.kind not in ("predict", "input_sparse", "dequant", "prefill_up", "prefill_down") and ordered[-2].numel() == 0:  # ordered[-2] is idx: k = 0, no active row
            # y = 0 and h is empty. The compiled functions handle k = 0 themselves (one code path for
            # every k), but TVM rejects the strides torch gives an empty [t, 0] tensor and a CUDA grid
            # of 0 blocks is an invalid launch, so the trivial result is written here.
            if self.spec.has_down:
                ordered[-1].zero_()
            return
        fn = self.batch_fn if batched else self.decode_fn
        if fn is None:
            raise KernelArgumentError(
                "this library has no batched variant; use picompile.kernels.dense_ffn for prefill"
            )
        fn(*ordered)


def read_metadata(path: Path) -> dict[str, Any]:
    meta_path = Path(path).with_suffix(".json")
    if not meta_path.exists():
        raise KernelLoadError(f"kernel metadata {meta_path} is missing")
    return json.loads(meta_path.read_text())


def load_kernel(path: Path, spec: KernelSpec) -> SparseKernel:
    """Load a library produced by ``build_kernel`` (runtime only: no ``import tvm``).

    Checks that the library's sidecar metadata (``<key>.json``) was written for ``spec``.
    """
    import tvm_ffi

    path = Path(path)
    if not path.exists():
        raise KernelLoadError(f"kernel library {path} does not exist")
    meta = read_metadata(path)
    if meta.get("key") != spec.key():
        raise KernelLoadError(f"{path} was built for key {meta.get('key')}, not {spec.key()}")
    expected_args = [a.name for a in _signature(spec, False)]
    if meta.get("arg_names") != expected_args:
        raise KernelLoadError(f"{path} takes {meta.get('arg_names')}, this loader passes {expected_args}")
    ensure_runtime(cuda=spec.is_cuda)
    try:
        module = tvm_ffi.load_module(str(path))
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise KernelLoadError(f"cannot load {path}: {err}") from err
    name = spec.key()
    decode_fn = module[name]
    batch_fn = module[name + "_batch"] if meta.get("batched", False) else None
    parts = meta.get("partitions")
    return SparseKernel(spec=spec, path=path, module=module, decode_fn=decode_fn, batch_fn=batch_fn,
                        partitions=parts if isinstance(parts, int) and not isinstance(parts, bool) and parts > 0 else None)

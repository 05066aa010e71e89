"""CUDA schedules for the kernel descriptions of ``compute.py``, and the nvcc build.

Up/gate part: one thread block per active row (``blockIdx.x = j``, k blocks); ``threads_per_row``
threads stride over the row with 16-byte vector loads (4 fp32 / 8 fp16 weights), each accumulating
``vec`` float32 lanes in registers (two ``rfactor`` steps: lanes → per-thread sum → a cross-thread
warp-shuffle/shared-memory reduction that TVM lowers). The activation (and gate product) is the
epilogue of the same block.

Down part (row-axpy): the k selected rows are cut into ``down_slices`` slices (``blockIdx.y``);
a block covers ``threads * vec`` columns of y (``blockIdx.x``), each thread accumulates ``vec``
columns over its slice's rows in registers (coalesced vector loads along the row), writes a partial
``y_rf[slice, :]``; a second small kernel sums the slices. No atomics, deterministic results.

Build: TVM generates the CUDA source; our ``tvm_callback_cuda_compile`` hook hands it to ``nvcc``
(``-cubin -arch=sm_XX``); the cubin is embedded in the exported host ``.so`` (loaded with
``libtvm_runtime_cuda.so``), and the source and cubin are also kept next to it for inspection.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm import s_tir

from .compute import KernelDesc, describe
from .spec import KernelSpec


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed on TVM's generated source."""


@dataclass(frozen=True)
class CudaScheduleParams:
    up_vec: int  # weights per vector load in the up part (16 bytes)
    up_threads: int  # threads per active row
    down_vec: int  # y columns per thread
    down_threads: int  # threads per block in the down part
    down_slices: int  # row slices of the down part (blockIdx.y); partial sums reduced afterwards


def _vec_threads(d: int) -> tuple[int, int]:
    """Widest vector width (4 lanes: x is float32, 16-byte loads) and most threads that divide d."""
    for vec in (4, 2, 1):
        found = [t for t in (128, 64, 32) if d % (t * vec) == 0]
        if found:
            return vec, found[0]
    return 1, 32


def default_params(spec: KernelSpec) -> CudaScheduleParams:
    vec, threads = _vec_threads(spec.d_model)  # the up and the down part split d_model alike
    return CudaScheduleParams(vec, threads, vec, threads, down_slices=32)


def cuda_target(spec: KernelSpec) -> tvm.target.Target:
    arch = spec.cuda_arch
    assert arch is not None
    return tvm.target.Target(
        {
            "kind": "cuda",
            "arch": arch,
            "max_threads_per_block": 1024,
            "max_shared_memory_per_block": 49152,
            "thread_warp_size": 32,
        },
        host={"kind": "llvm"},
    )


def cuda_target_str(spec: KernelSpec) -> str:
    return f"cuda -arch={spec.cuda_arch} (host llvm)"


def _schedule_up(sch: s_tir.Schedule, spec: KernelSpec, p: CudaScheduleParams) -> None:
    names = ("gate", "up") if spec.gated else ("up",)
    tr_n, vec = p.up_threads, p.up_vec
    rfs: dict[str, tuple[s_tir.SBlockRV, s_tir.SBlockRV]] = {}
    for name in names:  # rfactor twice, at the root (before any compute_at)
        blk = sch.get_sblock(name)
        _, r = sch.get_loops(blk)
        _, tr, vc = sch.split(r, [None, tr_n, vec])
        rf = sch.rfactor(sch.fuse(tr, vc), 0)  # rf[tr*vec+vc, j]: per-lane partial sums
        _, trvc = sch.get_loops(blk)
        tr_b, _ = sch.split(trvc, [tr_n, vec])
        rf2 = sch.rfactor(tr_b, 0)  # rf2[tr, j]: per-thread sums; <name>[j]: cross-thread sum
        sch.set_scope(rf, 0, "local")
        sch.set_scope(rf2, 0, "local")
        rfs[name] = (rf, rf2)
    h_block = sch.get_sblock("h")
    (j,) = sch.get_loops(h_block)
    for name in names:
        blk = sch.get_sblock(name)
        rf, rf2 = rfs[name]
        sch.compute_at(blk, j)
        sch.set_scope(blk, 0, "local")
        sch.compute_at(rf2, j)
        sch.compute_at(rf, j)
    sch.bind(j, "blockIdx.x")
    for name in names:
        rf, rf2 = rfs[name]
        # compute_at dropped unit loops: [trvc, ro] below j, or [trvc] when d == threads * vec
        trvc, *ro = sch.get_loops(rf)[1:]
        tr, vc = sch.split(trvc, [tr_n, vec])
        if ro:
            sch.reorder(tr, ro[0], vc)
        sch.bind(tr, "threadIdx.x")
        sch.vectorize(vc)
        if ro:
            sch.decompose_reduction(rf, ro[0])
        tr2, *vc2 = sch.get_loops(rf2)[1:]
        sch.bind(tr2, "threadIdx.x")
        if vc2:
            sch.unroll(vc2[0])
        (tr3,) = sch.get_loops(sch.get_sblock(name))[1:]
        sch.bind(tr3, "threadIdx.x")


def _schedule_down(sch: s_tir.Schedule, spec: KernelSpec, p: CudaScheduleParams) -> None:
    y_block = sch.get_sblock("y")
    i, rj = sch.get_loops(y_block)
    s, _ = sch.split(rj, [p.down_slices, None])
    rf = sch.rfactor(s, 0)  # y_rf[slice, i] partial sums over one slice of the k rows
    # partial-sum kernel: blockIdx.y = slice, blockIdx.x/threadIdx.x/vector over columns
    i_l, s_l, rj_l = sch.get_loops(rf)  # rfactor keeps the spatial column loop outermost
    bx, tx, vc = sch.split(i_l, [None, p.down_threads, p.down_vec])
    sch.reorder(s_l, bx, tx, rj_l, vc)
    sch.bind(s_l, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    acc = sch.cache_write(rf, 0, "local")  # the thread's vec accumulators live in registers
    sch.reverse_compute_at(acc, tx)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.vectorize(vc)
    sch.decompose_reduction(rf, rj_l)
    # final kernel: y[i] = sum over slices
    i2, s2 = sch.get_loops(y_block)
    bx2, tx2 = sch.split(i2, [None, p.down_threads])
    sch.bind(bx2, "blockIdx.x")
    sch.bind(tx2, "threadIdx.x")
    sch.unroll(s2)
    acc2 = sch.cache_write(y_block, 0, "local")  # sum the slices in a register, store y once
    sch.reverse_compute_at(acc2, tx2)


def schedule(desc: KernelDesc, spec: KernelSpec, params: CudaScheduleParams | None = None) -> tvm.IRModule:
    if desc.batched:
        raise NotImplementedError("CUDA kernels are one-token only; prefill uses kernels.dense_ffn")
    p = params or default_params(spec)
    sch = s_tir.Schedule(desc.func)
    if spec.has_up:
        _schedule_up(sch, spec, p)
    if spec.has_down:
        _schedule_down(sch, spec, p)
    return sch.mod


# -- nvcc -----------------------------------------------------------------------------------------
def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def nvcc_compile(source: str, arch: str, out_cubin: Path) -> bytes:
    """``nvcc -cubin -arch=<arch> -O3`` on a CUDA source string; returns the cubin bytes."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    with tempfile.TemporaryDirectory(prefix="picompile_nvcc_") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-o", str(out_cubin), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
    return out_cubin.read_bytes()


def _u64(b: bytes, off: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", b, off)[0], off + 8


def _str_at(b: bytes, off: int) -> tuple[bytes, int]:
    n, off = _u64(b, off)
    return b[off : off + n], off + n


def _pack_str(v: bytes) -> bytes:
    return struct.pack("<Q", len(v)) + v


def patch_library_blob(blob: bytes, cubin: bytes) -> bytes:
    """Swap the CUDA source in a packed import tree (``__tvm_ffi__library_bin``) for a cubin.

    Without a CUDA driver on the build machine, TVM 0.27 stores the device module as CUDA *source*
    (``fmt="cuda"``), which the runtime could only JIT with the compiler's Python nvcc/nvrtc hook.
    The serialized layout is fixed: ``u64 nbytes | u64[] import-tree row ptr | u64[] child indices |
    per module: str kind [, bytes payload]``; a ``cuda`` payload is ``str fmt | fmap | bytes code``
    (``CUDAModuleNode::SaveToBytes``). We rewrite ``fmt`` to ``"cubin"`` and ``code`` to nvcc's cubin,
    which the runtime hands to ``cuModuleLoadData``.
    """
    off = 8  # total size, recomputed below
    n, off = _u64(blob, off)
    off += 8 * n  # import tree row pointers
    n, off = _u64(blob, off)
    off += 8 * n  # child indices
    out = bytearray(blob[8:off])
    patched = 0
    while off < len(blob):
        kind, off = _str_at(blob, off)
        out += _pack_str(kind)
        if kind == b"_lib":  # the host library itself: no payload
            continue
        payload, off = _str_at(blob, off)
        if kind == b"cuda":
            fmt, p = _str_at(payload, 0)  # "cuda" (source) normally; any format is replaced
            source_len = len(payload) - p  # fmap then code: find the code by its length prefix
            code_start = None
            q = p
            while q + 8 <= len(payload):
                n_code = struct.unpack_from("<Q", payload, q)[0]
                if q + 8 + n_code == len(payload):
                    code_start = q
                    break
                q += 1
            if code_start is None or source_len <= 0:
                raise CudaBuildError("could not locate the CUDA source in the packed module")
            fmap = payload[p:code_start]
            payload = _pack_str(b"cubin") + fmap + _pack_str(cubin)
            patched += 1
        out += _pack_str(payload)
    if patched != 1:
        raise CudaBuildError(f"expected exactly one CUDA module in the library, found {patched}")
    return struct.pack("<Q", len(out)) + bytes(out)


_ARRAY_RE = re.compile(r"(const unsigned char (\w+)\[)(\d+)(\] = \{)(.*?)(\};)", re.S)


def _pack_imports_with_cubin(cubin: bytes) -> Callable[..., str]:
    """An ``fpack_imports`` for ``export_library``: TVM's C packing, with the cubin patched in."""
    from tvm.runtime import _ffi_api

    def pack(mod: Any, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        c_src = _ffi_api.ModulePackImportsToC(mod, is_system_lib, prefix)
        m = _ARRAY_RE.search(c_src)
        if m is None:
            raise CudaBuildError("unexpected output of ModulePackImportsToC")
        blob = bytes(int(x, 16) for x in re.findall(r"0x[0-9a-fA-F]{2}", m.group(5)))
        new = patch_library_blob(blob, cubin)
        lines = ",\n".join(",".join(f"0x{x:02x}" for x in new[i : i + 20]) for i in range(0, len(new), 20))
        c_new = c_src[: m.start()] + f"{m.group(1)}{len(new)}{m.group(4)}\n{lines}\n{m.group(6)}" + c_src[m.end() :]
        path = os.path.join(workspace_dir, f"{prefix}devc_cubin.c")
        with open(path, "w") as fh:
            fh.write(c_new)
        return path

    return pack


def compile_cuda(spec: KernelSpec, out: Path, cache_dir: Path) -> dict[str, Any]:
    """Schedule for CUDA, generate source, nvcc → cubin, export the host ``.so`` with it embedded.

    Also writes ``<key>.cu`` (TVM's generated source) and ``<key>.cubin`` next to the library.
    """
    arch = spec.cuda_arch
    assert arch is not None
    key = spec.key()
    mod = schedule(describe(spec, batched=False), spec)
    func = mod["main"].with_attr("global_symbol", key)
    # Keep the device code as source even where a CUDA driver is present (there TVM would JIT it
    # through its own Python nvrtc/nvcc hook): we compile it with nvcc for the requested arch.
    previous = os.environ.get("TVM_COMPILE_FORCE_FALLBACK")
    os.environ["TVM_COMPILE_FORCE_FALLBACK"] = "1"
    try:
        lib = tvm.compile(tvm.IRModule({key: func}), target=cuda_target(spec))
    finally:
        if previous is None:
            os.environ.pop("TVM_COMPILE_FORCE_FALLBACK", None)
        else:
            os.environ["TVM_COMPILE_FORCE_FALLBACK"] = previous
    device_mods = [m for m in lib.mod.imports if m.kind == "cuda"]
    if len(device_mods) != 1:
        raise CudaBuildError(f"expected one CUDA device module, got {[m.kind for m in lib.mod.imports]}")
    source = device_mods[0].inspect_source("cuda")
    if not source:
        raise CudaBuildError("TVM produced no CUDA source")
    cubin_tmp = cache_dir / f".{key}.{os.getpid()}.cubin"
    cubin = nvcc_compile(source, arch, cubin_tmp)
    lib.export_library(str(out), fpack_imports=_pack_imports_with_cubin(cubin))
    (cache_dir / f"{key}.cu").write_text(source)
    os.replace(cubin_tmp, cache_dir / f"{key}.cubin")
    return {
        "batched": False,
        "arg_names": describe(spec).arg_names,
        "functions": [key],
        "cuda_arch": arch,
        "cubin_bytes": len(cubin),
    }

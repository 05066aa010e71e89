"""``build_kernel``: compile a ``KernelSpec`` with TVM, or reuse the library already in the cache.

Cache layout (one flat directory, one machine): ``<key>.so`` (the exported library) and
``<key>.json`` (spec, ABI version, TVM version, compile target incl. host CPU, the code generator's
fingerprint, build time),
plus for CUDA ``<key>.cu`` (TVM's generated source) and ``<key>.cubin`` (nvcc's output, also
embedded in the ``.so``). A cached entry is reused when its metadata matches; it is rebuilt when the
metadata is missing or names another ABI version, TVM version, host CPU or code generator (a schedule changed
in this package's sources: the key names what a kernel computes, not how it is scheduled). Writes go to temporary
files renamed into place, under an ``flock`` per key, so concurrent builders never see half a file.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .spec import KERNEL_ABI_VERSION, KernelSpec

_build_count: int = 0  # compilations done by this process (tests check cache hits with it)
# the modules whose code decides a compiled kernel's instructions (kernels/*.py that import TVM)
CODEGEN_MODULES: tuple[str, ...] = ("compute.py", "cpu.py", "cpu_rewrite.py", "cpu_qdot.py", "cuda.py", "input_sparse.py",
                                     "batch_gemv.py", "dequant.py", "cpu_prefill.py", "cpu_qpredict.py")


def codegen_fingerprint() -> str:
    """sha256 (16 hex digits) of the code generator's sources: a cached library from other sources is rebuilt."""
    import hashlib

    h = hashlib.sha256()
    for name in CODEGEN_MODULES:
        path = Path(__file__).with_name(name)
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b""))
    return h.hexdigest()[:16]


def build_count() -> int:
    """How many kernels this process has actually compiled (cache hits do not count)."""
    return _build_count


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _expected_meta(spec: KernelSpec, mcpu: str | None = None, integer_dot: bool = True) -> dict[str, Any]:
    """Fields a cached entry must match (computed with TVM imported: the build path only)."""
    import tvm

    meta: dict[str, Any] = {
        "key": spec.key(),
        "abi": KERNEL_ABI_VERSION,
        "spec": spec.to_json(),
        "tvm_version": str(tvm.__version__),
        "codegen": codegen_fingerprint(),
    }
    if spec.is_cuda:
        from .cuda import cuda_target_str

        meta["compile_target"] = cuda_target_str(spec)
    else:
        from .cpu import build_cores, host_target

        meta["compile_target"] = str(host_target(mcpu))
        meta["cores"] = build_cores()  # the y-chunking is sized for this many cores
        if spec.quantized or (spec.kind == "predict" and spec.weight_dtype == "int8"):
            meta["qdot"] = _qdot_isa(spec, host_target(mcpu), integer_dot)
    return meta


def _qdot_isa(spec: KernelSpec, target: Any, integer_dot: bool = True) -> str | None:
    """The integer dot-product instructions ``spec``'s one-token kernel is built with on the LLVM ``target``
    (``cpu_qdot.isa_for``): quantized kinds where ``cpu_qdot.applies``, int8 predictors where
    ``cpu_qpredict.applies``; None for the float kernels (or ``integer_dot=False``)."""
    from . import cpu_qdot, cpu_qpredict

    isa = cpu_qdot.isa_for(target) if integer_dot else None
    fits = cpu_qpredict.applies if spec.kind == "predict" else cpu_qdot.applies
    return isa if fits(spec, isa) else None


def _cache_hit(lib_path: Path, meta_path: Path, expected: dict[str, Any]) -> bool:
    if not (lib_path.exists() and meta_path.exists()):
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(meta.get(k) == v for k, v in expected.items())


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def build_kernel(spec: KernelSpec, cache_dir: Path, mcpu: str | None = None, integer_dot: bool = True) -> Path:
    """Compile ``spec`` (or reuse ``cache_dir/<key>.so``) and return the library path.

    ``mcpu``: the LLVM CPU a CPU kernel is built for (default: this machine's); an entry built for another
    CPU is rebuilt (the cache holds one build per key: keep other CPUs' builds in a cache of their own).
    ``integer_dot=False``: quantized kernels keep the float path even where ``cpu_qdot`` applies (for A/Bs; the
    same key, so keep such builds in a cache of their own too).

    The library exports ``<key>`` (decode, x ``[d_model]``) and, on the CPU, ``<key>_batch``
    (x ``[t, d_model]``). Load it with ``load_kernel(path, spec)``.
    """
    global _build_count
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = spec.key()
    lib_path = cache_dir / f"{key}.so"
    meta_path = cache_dir / f"{key}.json"
    expected = _expected_meta(spec, mcpu, integer_dot)
    if _cache_hit(lib_path, meta_path, expected):
        return lib_path
    with _locked(cache_dir / f"{key}.lock"):
        if _cache_hit(lib_path, meta_path, expected):  # another process built it meanwhile
            return lib_path
        t0 = time.perf_counter()
        tmp_lib = cache_dir / f".{key}.{os.getpid()}.so"
        if spec.is_cuda:
            from .cuda import compile_cuda

            extra = compile_cuda(spec, tmp_lib, cache_dir)
        else:
            extra = _compile_cpu(spec, tmp_lib, mcpu, integer_dot)
        os.replace(tmp_lib, lib_path)
        meta = {**expected, **extra, "build_seconds": round(time.perf_counter() - t0, 3), "built_at": time.time()}
        _atomic_write_text(meta_path, json.dumps(meta, indent=1, sort_keys=True))
        _build_count += 1
    return lib_path


def _compile_cpu(spec: KernelSpec, out: Path, mcpu: str | None = None, integer_dot: bool = True) -> dict[str, Any]:
    """Decode (+ batched, except kind ``predict``: one token only) PrimFuncs → one LLVM module → ``out`` (.so)."""
    import tvm

    from . import cpu, cpu_qdot, cpu_qpredict
    from .compute import describe, describe_partitioned, describe_predict

    key = spec.key()
    if spec.kind == "input_sparse":  # one token only: several tokens take torch (ops.input_sparse_linear)
        from . import input_sparse

        mod = tvm.IRModule({key: input_sparse.describe(spec, cpu.build_cores()).with_attr("global_symbol", key)})
        lib = tvm.compile(mod, target=cpu.host_target(mcpu))
        lib.export_library(str(out))
        return {"batched": False, "arg_names": ["x", "mask", "w_t", "y"], "functions": [key]}
    if spec.kind == "dequant":  # rows symbolic, one form (kernels/dequant.py)
        from . import dequant

        if not dequant.supports(spec):
            raise ValueError("kind 'dequant' needs float16 / int8 / int4 weights and d_model a multiple of 32")
        target = cpu.host_target(mcpu)
        mod = tvm.IRModule({key: dequant.describe(spec, cpu.build_cores(), target).with_attr("global_symbol", key)})
        tvm.compile(mod, target=target).export_library(str(out))
        names = ["w_up", "s_up", "out"] if spec.quantized else ["w_up", "out"]
        return {"batched": False, "arg_names": names, "functions": [key]}
    if spec.kind in ("prefill_up", "prefill_down"):  # several tokens, rows symbolic, one form (kernels/cpu_prefill.py)
        from . import cpu_prefill

        target = cpu.host_target(mcpu)
        isa = cpu_qdot.isa_for(target) if integer_dot else None
        if not cpu_prefill.applies(spec, isa):
            raise ValueError(f"no {spec.kind} kernel for this spec on {target} (cpu_prefill.applies)")
        mod = tvm.IRModule({key: cpu_prefill.describe(spec, isa, cpu.build_cores()).with_attr("global_symbol", key)})
        tvm.compile(mod, target=target).export_library(str(out))
        names = (["x", "w_up", "s_up", "g", "h"] if spec.kind == "prefill_up"
                 else ["h", "tokptr", "rows", "w_down_t", "s_down", "y"])  # = loader._signature's order
        names = [a for a in names if spec.quantized or a not in ("s_up", "s_down")]
        return {"batched": False, "arg_names": names, "functions": [key]}
    if spec.kind in ("gemv", "gemv_down"):  # several tokens, one form (kernels/batch_gemv.py), under both names
        from . import batch_gemv

        if not batch_gemv.supports(spec):
            raise ValueError(f"kind {spec.kind!r} needs float weights and d_model a multiple of 32 (gemv_down: 64)")
        make = batch_gemv.describe if spec.kind == "gemv" else batch_gemv.describe_down
        funcs = {name: make(spec, cpu.build_cores()).with_attr("global_symbol", name) for name in (key, key + "_batch")}
        lib = tvm.compile(tvm.IRModule(funcs), target=cpu.host_target(mcpu))
        lib.export_library(str(out))
        args = ["x", "w_up", "idx", "h"] if spec.kind == "gemv" else ["h", "w_down_t", "idx", "y"]
        return {"batched": True, "arg_names": args, "functions": sorted(funcs)}
    batched_too = spec.kind != "predict"  # several tokens take the torch reference (ops.predict)
    isa = _qdot_isa(spec, cpu.host_target(mcpu), integer_dot)  # None: the float kernels
    funcs = {}
    for batched in (False, True) if batched_too else (False,):
        if spec.kind == "predict":
            desc = describe_predict(spec)
        elif spec.kind in ("ffn_relu", "ffn_gated"):
            desc = describe_partitioned(spec, cpu.build_cores(), batched=batched)
        else:
            desc = describe(spec, batched=batched)
        if not batched:
            arg_names = desc.arg_names
        name = key + ("_batch" if batched else "")
        qdot = isa is not None
        if qdot and spec.kind == "predict":  # int8 predictor: integer dot products
            funcs[name] = cpu_qpredict.describe(spec, isa).with_attr("global_symbol", name)
        elif qdot and not batched:  # one token: integer dot products (VNNI / AVX512-BW / AVX2)
            funcs[name] = cpu_qdot.describe(spec, isa, cpu.build_cores()).with_attr("global_symbol", name)
        elif qdot and spec.kind == "up":  # several tokens: the same sums per token
            funcs[name] = cpu_qdot.describe_up_batched(spec, isa).with_attr("global_symbol", name)
        else:
            funcs[name] = cpu.as_named(cpu.schedule(desc, spec), name)
    mod = tvm.IRModule(funcs)
    lib = tvm.compile(mod, target=cpu.host_target(mcpu))
    lib.export_library(str(out))
    extra: dict[str, Any] = {"batched": batched_too, "arg_names": arg_names, "functions": sorted(funcs)}
    if spec.kind in ("ffn_relu", "ffn_gated") and not spec.quantized:
        extra["partitions"] = cpu.build_cores()  # its row parts, whose sums the union FFN repeats (batch_ffn.py)
    return extra

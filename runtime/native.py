"""A decode graph's TVM kernel calls as C++ ops (``native_ops.cpp``, ``picompile_native::``).

tvm_linear / tvm_sparse_ffn / tvm_predict (Python bodies: mask → row indices, output allocation, the call
through tvm_ffi's Python binding) → ``picompile_native::gemv`` / ``sparse_ffn`` / ``predict`` doing the same
in C++ (int8 / int4 weights: ``qgemv`` / ``qsparse_ffn``, each weight's quants then its float16 scales; an
input-sparse linear with an ``input_sparse`` kernel: ``input_sparse``) and calling the kernel through the TVM-FFI C ABI, by the loaded function's handle registered under a stable id. With inductor's
C++ wrapper the compiled decode step then calls its kernels without entering Python.

Eager and compiled decode steps both take them (load step ``native-calls``): eager, each kernel call is then
one dispatch into C++ instead of a Python function (1B int4, AMD Zen 4, 2 threads: 17.8 → 15.9 ms per step).

The library is built with torch's C++ extension loader at the first load that has CPU kernels (~13 s on two
cores; cached by torch after that, per source version). Where it cannot be built or loaded, the step keeps
the Python ops and says why (``native_reason``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import fx

from picompile.ir.graph import get_tensor
from picompile.ir.schema import args_of, node_op
from picompile.kernels.table import find_kernel, threshold_tensor

SOURCE = Path(__file__).with_name("native_ops.cpp")
KERNEL_OPS = ("tvm_linear", "tvm_sparse_ffn", "tvm_predict", "input_sparse_linear")  # the ops with a C++ form
_STATE: dict[str, str] = {}  # "error": why the library is unavailable ("" once loaded)


def load_library() -> str:
    """Build (once per source version) and load ``picompile_native``; "" when loaded, else the reason."""
    if "error" in _STATE:
        return _STATE["error"]
    try:
        import tvm_ffi.libinfo as info
        from .extension import load_extension

        lib_dir = str(Path(info.find_libtvm_ffi()).parent)
        tag = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
        load_extension(f"picompile_native_{tag}", [str(SOURCE)],
                       extra_include_paths=[info.find_include_path(), info.find_dlpack_include_path()],
                       extra_cflags=["-O3"], extra_ldflags=[f"-L{lib_dir}", "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"],
                       is_python_module=False)
        _register_fakes()
        launch = _tvm_parallel_launch()
        if launch is not None:
            torch.ops.picompile_native.set_parallel_launch(launch)  # type: ignore[attr-defined]
        _STATE["error"] = ""
    except Exception as e:  # no compiler, no headers, a link error: the Python ops stay
        _STATE["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return _STATE["error"]


def _register_fakes() -> None:
    lib = "picompile_native::"

    @torch.library.register_fake(lib + "gemv")
    def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kernel: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake(lib + "sparse_ffn")
    def _ffn(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_gate: torch.Tensor | None,
             w_down_t: torch.Tensor, mask: torch.Tensor | None, kernel: int) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "qgemv")
    def _qgemv(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, kernel: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake(lib + "qsparse_ffn")
    def _qffn(x: torch.Tensor, w_up: torch.Tensor, s_up: torch.Tensor, b_up: torch.Tensor | None,
              w_gate: torch.Tensor | None, s_gate: torch.Tensor | None, w_down_t: torch.Tensor, s_down: torch.Tensor,
              mask: torch.Tensor | None, kernel: int) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "predict")
    def _predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, offset: torch.Tensor | None,
                 thr: torch.Tensor, kernel: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], fc2.shape[0]), dtype=torch.bool)

    @torch.library.register_fake(lib + "input_sparse")
    def _input_sparse(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None, mask: torch.Tensor | None,
                      kernel: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w_t.shape[1]))

    @torch.library.register_fake(lib + "rms_norm")
    def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty(torch.broadcast_shapes(x.shape, w.shape), dtype=x.dtype)

    @torch.library.register_fake(lib + "rotary")
    def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
        return torch.empty(torch.broadcast_shapes(x.shape, cos.shape, sin.shape), dtype=x.dtype)

    @torch.library.register_fake(lib + "grouped_attention")
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "heads")
    def _heads(x: torch.Tensor, offset: int, n: int, e: int, cos: torch.Tensor | None, sin: torch.Tensor | None,
               half: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], n, x.shape[1], e))

    @torch.library.register_fake(lib + "cached_attention")
    def _cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                k_start: int, v_start: int, mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1] * q.shape[3]))


def _tvm_parallel_launch() -> int | None:
    """The address of ``TVMBackendParallelLaunch`` in the libtvm_runtime this process loaded (the kernels' thread
    pool, which the C++ attention also runs on), or None where none is loaded or it cannot be found."""
    import ctypes
    import os

    try:
        import tvm  # noqa: F401  (loads libtvm_runtime where the kernels have not yet)

        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if line.rstrip().endswith("/libtvm_runtime.so")}
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the loaded one, not a second copy
        return ctypes.cast(lib.TVMBackendParallelLaunch, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


def _cpu_kernel(key: str) -> object | None:
    """The loaded kernel ``key`` when it is a CPU one (the C++ ops call only those), else None."""
    kern = find_kernel(key)
    return None if kern is None or getattr(kern.spec, "is_cuda", True) else kern  # type: ignore[attr-defined]


def _kernel_id(key: str) -> int | None:
    """The id the C++ ops know the loaded CPU kernel ``key``'s one-token function by (None: not a loaded CPU
    kernel). Its handle is registered under it (``set_kernel``); the id is the key's hash, so the rewritten graph
    is the same code in every process and inductor's on-disk cache finds it (a handle, an address, would differ
    in each process: the decode step was compiled anew at every load)."""
    kern = _cpu_kernel(key)
    if kern is None:
        return None
    kid = int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)  # < 2**60: an int64 in the op's schema
    torch.ops.picompile_native.set_kernel(kid, int(kern.decode_fn.__chandle__()))  # type: ignore[attr-defined]
    return kid


class _Thresholds:
    """One float32 [1] buffer per predictor threshold value (as ``threshold_tensor`` keeps), read by get_attr."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.nodes: dict[float, fx.Node] = {}

    def node(self, value: float) -> fx.Node:
        if value not in self.nodes:
            attr = f"native_threshold_{len(self.nodes)}"
            self.gm.register_buffer(attr, threshold_tensor(value), persistent=False)
            with self.gm.graph.inserting_before(next(n for n in self.gm.graph.nodes if n.op != "placeholder")):
                self.nodes[value] = self.gm.graph.get_attr(attr)
        return self.nodes[value]


def _native_call(gm: fx.GraphModule, node: fx.Node, thresholds: _Thresholds) -> tuple[object, tuple[object, ...]] | None:
    """The picompile_native (target, args) a kernel call node becomes, or None (not a loaded CPU kernel call)."""
    native = torch.ops.picompile_native
    op = node_op(node)
    if op not in KERNEL_OPS:
        return None
    a = args_of(node)
    if op == "input_sparse_linear":  # kind "input_sparse" (an older artifact's "down" kernel: the Python op)
        kern = _cpu_kernel(str(a["kernel"])) if a["kernel"] else None
        kid = _kernel_id(str(a["kernel"])) if kern is not None and kern.spec.kind == "input_sparse" else None  # type: ignore[attr-defined]
        return None if kid is None else (native.input_sparse.default, (a["x"], a["w_t"], a["b"], a["mask"], kid))
    if op == "tvm_linear":
        kid = _kernel_id(str(a["kernel"]))
        if kid is None:
            return None
        if a.get("s") is not None:  # int8 / int4 quants and their scales
            return native.qgemv.default, (a["x"], a["w"], a["s"], a["b"], kid)
        return native.gemv.default, (a["x"], a["w"], a["b"], kid)
    if op == "tvm_sparse_ffn":
        kid = _kernel_id(str(a["kernel"]))
        if kid is None or get_tensor(gm, a["w_up"]).shape[0] == 0:  # an empty part stays (zeros, no launch)
            return None
        if a.get("b_gate") is not None:  # a gate bias: the Python op passes it (the C++ op has no slot for it)
            return None
        if a.get("s_up") is not None:
            return native.qsparse_ffn.default, (a["x"], a["w_up"], a["s_up"], a["b_up"], a["w_gate"], a["s_gate"],
                                                a["w_down_t"], a["s_down"], a["mask"], kid)
        return native.sparse_ffn.default, (a["x"], a["w_up"], a["b_up"], a["w_gate"], a["w_down_t"], a["mask"], kid)
    kid = _kernel_id(str(a["kernel1"]))
    if kid is None or a["kernel2"]:  # two GEMVs (older artifacts): the Python op
        return None
    thr = thresholds.node(float(a["threshold"]))
    return native.predict.default, (a["x"], a["fc1"], a["fc2"], a["offset"], thr, kid)


def has_native_calls(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls a loaded CPU kernel that ``to_native`` would rewrite (else the library is not needed)."""
    for node in gm.graph.nodes:
        if node_op(node) in KERNEL_OPS:
            a = args_of(node)
            key = a.get("kernel", a.get("kernel1"))
            if key and _cpu_kernel(str(key)) is not None:
                return True
    return False


def to_native(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (a one-token decode graph; its picompile ops their torch overloads or ``DirectCall`` calls) in
    place: every CPU kernel call becomes its ``picompile_native`` op. Returns how many nodes were rewritten."""
    count = 0
    thresholds = _Thresholds(gm)
    for node in list(gm.graph.nodes):
        new = _native_call(gm, node, thresholds)
        if new is None:
            continue
        node.target, node.args, node.kwargs = new[0], new[1], {}
        count += 1
    gm.recompile()
    return count

"""A compiled decode graph's TVM kernel calls as C++ ops (``native_ops.cpp``, ``picompile_native::``).

tvm_linear / tvm_sparse_ffn / tvm_predict (Python bodies: mask → row indices, output allocation, the call
through tvm_ffi's Python binding) → ``picompile_native::gemv`` / ``sparse_ffn`` / ``predict`` doing the same
in C++ and calling the kernel through the TVM-FFI C ABI, given the loaded function's handle. With inductor's
C++ wrapper the compiled decode step then calls its kernels without entering Python.

The library is built with torch's C++ extension loader at the first compiled load (tens of seconds; cached
by torch after that). Where it cannot be built or loaded, the compiled step keeps the Python ops and says
why (``native_reason``).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import fx

from picompile.ir.graph import get_tensor
from picompile.ir.ops import KERNEL_TABLE, _threshold, is_picompile_op

SOURCE = Path(__file__).with_name("native_ops.cpp")
_STATE: dict[str, str] = {}  # "error": why the library is unavailable ("" once loaded)


def load_library() -> str:
    """Build (once per source version) and load ``picompile_native``; "" when loaded, else the reason."""
    if "error" in _STATE:
        return _STATE["error"]
    try:
        import hashlib

        import tvm_ffi.libinfo as info
        from torch.utils.cpp_extension import load

        lib_dir = str(Path(info.find_libtvm_ffi()).parent)
        tag = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
        load(name=f"picompile_native_{tag}", sources=[str(SOURCE)],
             extra_include_paths=[info.find_include_path(), info.find_dlpack_include_path()],
             extra_cflags=["-O2"], extra_ldflags=[f"-L{lib_dir}", "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}"],
             is_python_module=False, verbose=False)
        _register_fakes()
        _STATE["error"] = ""
    except Exception as e:  # no compiler, no headers, a link error: the Python ops stay
        _STATE["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return _STATE["error"]


def _register_fakes() -> None:
    lib = "picompile_native::"

    @torch.library.register_fake(lib + "gemv")
    def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, fn: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], w.shape[0]))

    @torch.library.register_fake(lib + "sparse_ffn")
    def _ffn(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor | None, w_gate: torch.Tensor | None,
             w_down_t: torch.Tensor, mask: torch.Tensor | None, fn: int) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "predict")
    def _predict(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, offset: torch.Tensor | None,
                 thr: torch.Tensor, fn: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], fc2.shape[0]), dtype=torch.bool)


def _handle(key: str) -> int | None:
    """The C handle of the loaded CPU kernel ``key``'s one-token function (None: not a loaded CPU kernel)."""
    kern = KERNEL_TABLE.get(key)
    if kern is None or getattr(kern.spec, "is_cuda", True):  # type: ignore[attr-defined]
        return None
    return int(kern.decode_fn.__chandle__())  # type: ignore[attr-defined]


def _bound(node: fx.Node, op: object) -> dict[str, object]:
    """The node's arguments by name (positional and keyword alike, defaults filled in)."""
    sig = inspect.signature(op._init_fn)  # type: ignore[attr-defined]
    bound = sig.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def to_native(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (a one-token decode graph whose picompile ops are their torch overloads) in place: every
    CPU kernel call becomes its ``picompile_native`` op. Returns how many nodes were rewritten."""
    from picompile.ir import ops

    native = torch.ops.picompile_native
    count = 0
    thresholds: dict[float, fx.Node] = {}  # one float32 [1] buffer per threshold value, as ops._threshold keeps
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        new: tuple[object, tuple[object, ...]] | None = None
        if is_picompile_op(node.target, "tvm_linear"):
            a = _bound(node, ops.tvm_linear)
            fn = _handle(str(a["kernel"]))
            if fn is not None:
                new = (native.gemv.default, (a["x"], a["w"], a["b"], fn))
        elif is_picompile_op(node.target, "tvm_sparse_ffn"):
            a = _bound(node, ops.tvm_sparse_ffn)
            fn = _handle(str(a["kernel"]))
            if fn is not None and get_tensor(gm, a["w_up"]).shape[0] > 0:  # type: ignore[arg-type]
                new = (native.sparse_ffn.default, (a["x"], a["w_up"], a["b_up"], a["w_gate"], a["w_down_t"],
                                                   a["mask"], fn))
        elif is_picompile_op(node.target, "tvm_predict"):
            a = _bound(node, ops.tvm_predict)
            fn = _handle(str(a["kernel1"]))
            if fn is not None and not a["kernel2"]:  # one kernel for the whole predictor
                value = float(a["threshold"])  # type: ignore[arg-type]
                if value not in thresholds:
                    attr = f"native_threshold_{len(thresholds)}"
                    gm.register_buffer(attr, _threshold(value), persistent=False)
                    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
                        thresholds[value] = gm.graph.get_attr(attr)
                new = (native.predict.default, (a["x"], a["fc1"], a["fc2"], a["offset"], thresholds[value], fn))
        if new is None:
            continue
        node.target, node.args, node.kwargs = new[0], new[1], {}
        count += 1
    gm.recompile()
    return count

"""Calling a generated ``forward`` with thousands of locals without CPython 3.11's frame-chunk churn.

CPython 3.11 keeps Python frames in chunks of its data stack: a frame that does not fit the current chunk gets
a new one (``mmap``, 16 KiB or the next power of two above its size), freed again (``munmap``) when that frame
returns. A GraphModule's ``forward`` has a local per node (the 1B model's batched step at one sequence: 1,826
locals, a 14.8 KB frame); where its frame nearly fills its chunk, every Python function it calls (a batched
linear, an attention, a predictor: ~300 a step) gets a chunk of its own, mapped and unmapped per call, and with
two threads each unmap is a TLB shootdown of the other CPU. Measured on the 1B f16 batched step at B = 1 (Zen 2
VM): 312 ``munmap`` calls a step, none with ``call_with_room``. ``call_with_room`` calls ``fn`` from a wrapper
whose own frame just passes a power of two, so it starts a chunk with room for ``fn``'s frame and the calls
below it. Not a graph rewrite: how a graph is called (as ``with_decode_threads``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

SLOT: int = 8  # bytes per frame slot (a PyObject pointer)
ROOM: int = 64 << 10  # bytes left for the frames below fn's, beyond fn's own
_OVERHEAD: int = 64  # slots: a frame's header and the wrapper's own stack, generously


def frame_bytes(fn: Callable[..., Any]) -> int:
    """An upper estimate of the data-stack bytes a call of the Python function ``fn`` takes (0: not Python)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return 0
    return SLOT * (code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize + _OVERHEAD)


@functools.lru_cache(maxsize=None)
def _wrapper(slots: int) -> Callable[..., Any]:
    """``run(fn, args) -> fn(*args)`` with a frame of ``slots`` locals (never assigned but by an unreachable line)."""
    names = [f"_s{i}" for i in range(slots)]
    src = ("def run(fn, args):\n"
           "    if fn is None:  # never: the locals only size the frame\n"
           f"        {' = '.join(names)} = None\n"
           "    return fn(*args)\n")
    scope: dict[str, Any] = {}
    exec(compile(src, f"<frame_room {slots}>", "exec"), scope)
    return scope["run"]


def chunk_bytes(frame: int) -> int:
    """The data-stack chunk CPython 3.11 maps for a frame of ``frame`` bytes that starts one: 16 KiB, doubled
    until it holds the frame."""
    size = 16 << 10
    while size < frame:
        size *= 2
    return size


def room_wrapper(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """The wrapper ``run(fn, args)`` whose frame starts a chunk with ``ROOM`` bytes free beyond ``fn``'s frame
    (None where ``fn`` is not a Python function or its frame is small)."""
    need = frame_bytes(fn)
    if need < 4096:
        return None
    size = chunk_bytes(need + ROOM)
    return _wrapper(size // SLOT + 1)  # a frame just past ``size``: its chunk is 2 · size, half of it free


def call_with_room(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called from ``room_wrapper(fn)``'s frame (module docstring); ``fn`` itself where that is None."""
    run = room_wrapper(fn)
    if run is None:
        return fn

    def call(*args: Any) -> Any:
        return run(fn, args)

    return functools.update_wrapper(call, fn)

"""runtime/frame_room.py: a forward with thousands of locals called from a frame that leaves its callees room."""
from __future__ import annotations

import torch

from picompile.runtime import frame_room


def _big(n_locals: int):  # -> a function of n_locals locals that calls a small Python function
    names = [f"v{i}" for i in range(n_locals)]
    src = f"def big(x, f):\n    {' = '.join(names)} = x\n    return f({names[-1]}) + v0\n"
    scope: dict = {}
    exec(src, scope)
    return scope["big"]


def test_call_with_room_returns_what_fn_returns_and_leaves_its_callees_room() -> None:
    big = _big(1900)  # ~15 KB: just under a 16 KiB data-stack chunk, as the 1B batched step's forward at B = 1
    need = frame_room.frame_bytes(big)
    assert 1900 * frame_room.SLOT < need < 1900 * frame_room.SLOT + 4096
    assert frame_room.chunk_bytes(need) - need < 2048  # alone, its callees would each map a chunk of their own
    run = frame_room.room_wrapper(big)
    own = frame_room.frame_bytes(run)
    assert frame_room.chunk_bytes(own) - own >= need + frame_room.ROOM  # the wrapper's chunk holds big and more
    wrapped = frame_room.call_with_room(big)
    assert wrapped is not big and wrapped.__wrapped__ is big
    x = torch.arange(4.0)
    assert torch.equal(wrapped(x, lambda t: t * 2), big(x, lambda t: t * 2))
    assert frame_room.room_wrapper(big) is run  # one wrapper per size, compiled once


def test_small_or_native_functions_are_called_as_they_are() -> None:
    def small(a: int) -> int:
        return a + 1

    assert frame_room.call_with_room(small) is small
    assert frame_room.call_with_room(torch.add) is torch.add  # no Python frame at all

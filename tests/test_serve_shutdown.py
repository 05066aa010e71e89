"""Shutdown of the serve scheduler (``picompile/serve/scheduler.py``) when the engine is stuck inside a step: the
clients' streams still end with an error event soon after the grace period, without waiting for the engine."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from picompile.runtime.sampling import SamplingParams


def test_close_ends_streams_while_the_engine_is_stuck(default_artifact: Path) -> None:
    import picompile
    from picompile.serve.scheduler import STALL_MARGIN, Scheduler

    session = picompile.load(default_artifact)
    sched = Scheduler(session, max_batch=1, prefill_chunk=64).start()
    entered, release = threading.Event(), threading.Event()
    decode = sched.runner.decode

    def stuck(steps: list[Any]) -> Any:  # the first decode step blocks until the test releases it
        entered.set()
        release.wait(30)
        return decode(steps)

    sched.runner.decode = stuck

    async def run() -> tuple[list[Any], list[Any], float]:
        loop = asyncio.get_running_loop()
        first = sched.submit([5, 6, 7], 50, SamplingParams(), loop, stop_at_eos=False)
        queued = sched.submit([8, 9], 50, SamplingParams(), loop, stop_at_eos=False)  # no free slot: waits
        ev = await asyncio.wait_for(first.events.get(), 30)  # the prefill's first token
        assert ev.error is None and ev.completion_tokens == 1
        await loop.run_in_executor(None, entered.wait, 30)
        t0 = time.monotonic()
        sched.close(0.2)
        ends = [await asyncio.wait_for(r.events.get(), 10) for r in (first, queued)]
        return ends, [first, queued], time.monotonic() - t0

    try:
        (a, b), (first, queued), took = asyncio.run(run())
    finally:
        release.set()
        sched.join(30)
    assert not sched.thread.is_alive()  # released, the engine sees the cancelled requests and stops
    assert "shut down before this request finished" in a.error and a.completion_tokens == 1
    assert "shut down before this request started" in b.error
    assert 0.2 <= took < 0.2 + STALL_MARGIN + 2.0  # without the engine, which was still blocked
    assert first.cancelled and queued.cancelled and sched.stats()["free_slots"] == 1

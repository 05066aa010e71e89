"""Chunked prefill in the serve scheduler (``picompile/serve/scheduler.py``): a prompt prefilled in chunks gives the
text one-shot prefill gives, and a long prompt arriving does not hold back another stream's tokens until its
prefill ends (the engine's trace shows the other stream's tokens between the long prompt's chunks)."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from picompile.runtime.sampling import SamplingParams

LONG = [random.Random(3).randrange(5, 200) for _ in range(90)]


async def _run(sched: Any, ids: list[int], max_tokens: int, started: asyncio.Event | None = None) -> list[int]:
    """Submit ``ids`` (greedy, no EOS stop) and wait for the request's end; its generated token ids."""
    req = sched.submit(ids, max_tokens, SamplingParams(), asyncio.get_running_loop(), stop_at_eos=False)
    while True:
        ev = await req.events.get()
        assert ev.error is None, ev.error
        if started is not None:
            started.set()
        if ev.finish_reason is not None:
            return list(req.gen.tokens)


def _alone(session: Any, ids: list[int], chunk: int, max_tokens: int = 12) -> tuple[list[int], list[Any]]:
    from picompile.serve.scheduler import Scheduler

    sched = Scheduler(session, max_batch=2, prefill_chunk=chunk, trace=True).start()
    try:
        tokens = asyncio.run(_run(sched, ids, max_tokens))
    finally:
        sched.close(0.0)
        sched.join(30)
    return tokens, list(sched.trace or [])


def test_chunked_prefill_same_text(default_artifact: Path) -> None:
    import picompile

    session = picompile.load(default_artifact)
    one_shot, trace1 = _alone(session, LONG, chunk=512)
    chunked, trace2 = _alone(session, LONG, chunk=16)
    assert chunked == one_shot and len(chunked) == 12
    assert [e[2:] for e in trace1 if e[0] == "prefill"] == [(0, 90)]
    assert [e[2:] for e in trace2 if e[0] == "prefill"] == [(s, min(16, 90 - s)) for s in range(0, 90, 16)]


def test_long_prompt_does_not_stall_other_stream(default_artifact: Path) -> None:
    import picompile
    from picompile.serve.scheduler import Scheduler

    session = picompile.load(default_artifact)
    sched = Scheduler(session, max_batch=2, prefill_chunk=8, trace=True).start()

    async def both() -> tuple[list[int], list[int]]:
        started = asyncio.Event()
        short = asyncio.create_task(_run(sched, [5, 6, 7], 60, started))
        await started.wait()  # the short stream is decoding
        long = asyncio.create_task(_run(sched, LONG, 4))
        return await short, await long

    try:
        short_tokens, long_tokens = asyncio.run(both())
    finally:
        sched.close(0.0)
        sched.join(30)
    trace = list(sched.trace or [])
    short_rid, long_rid = 1, 2
    chunks = [i for i, e in enumerate(trace) if e[0] == "prefill" and e[1] == long_rid]
    assert len(chunks) == 12  # 90 tokens in chunks of 8
    between = [e for e in trace[chunks[0]:chunks[-1]] if e[0] == "token" and e[1] == short_rid]
    assert len(between) >= len(chunks) - 1  # one decode step of the short stream after every chunk
    assert len(short_tokens) == 60 and len(long_tokens) == 4
    alone, _ = _alone(session, [5, 6, 7], chunk=8, max_tokens=60)
    assert short_tokens == alone  # and its text is what it is alone

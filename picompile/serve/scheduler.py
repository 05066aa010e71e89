"""Requests in flight decoded together: one engine thread owns the session; each request has a KV slot of its
own, its own sampler (seeded generator, penalties) and stop state; every step decodes one token of every active
request in one batched graph call (``runtime/batch.py``).

A new request waits in a bounded queue (``QueueFull`` past ``max_queue``: the server's 503) until a slot is
free, then its prompt is prefilled on its slot in chunks of ``prefill_chunk`` tokens (positions 0..C-1, C..2C-1,
…: the boundaries depend on the prompt alone, so a request's floats never depend on what else is in flight),
interleaved with the running requests' decode steps: each engine iteration runs prefill chunks worth at most
``prefill_chunk`` tokens (at least one chunk; short prompts of several requests share an iteration), then one
decode step of every active request. A long prompt therefore delays the others' next token by one chunk's
prefill, not by its whole prefill. The last chunk's logits give the request's first token, and it joins that
iteration's decode step. A cancelled request (a client gone mid-stream) leaves at the next iteration and its
slot is free for the next one. ``close(grace)`` admits nothing more, lets the requests in flight run for
``grace`` seconds and cancels what is left, each with an error event, so no client is left waiting (should the
engine be inside a long step then, a timer sends those events half a second later without it).

``trace=True`` records what the engine did, in order (``("prefill", rid, start, n)`` per chunk, ``("token",
rid, n_tokens)`` per token released): the tests read the interleaving from it.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from picompile.runtime.batch import BatchRunner
from picompile.runtime.sampling import Generation, SamplingParams


STALL_MARGIN = 0.5  # seconds past the shutdown deadline after which streams are ended without the engine
SHUT_DOWN = "the server shut down before this request finished"
NOT_STARTED = "the server shut down before this request started"


class QueueFull(Exception):
    """The wait queue is full: try again later (HTTP 503)."""


class ShuttingDown(Exception):
    """The server is shutting down and admits no new request (HTTP 503)."""


@dataclass
class Event:
    """What a request's client receives: text released by a step, and how it ended."""

    delta: str = ""
    finish_reason: str | None = None  # "stop" | "length" once finished
    completion_tokens: int = 0
    error: str | None = None  # set when the request was cancelled by the server or failed


@dataclass
class Request:
    ids: list[int]
    max_tokens: int
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: int = 0
    slot: int = -1
    gen: Generation | None = None
    cancelled: bool = False
    stop_at_eos: bool = True
    submitted: float = field(default_factory=time.perf_counter)
    prefilled: int = 0  # prompt tokens already in the slot's cache

    def cancel(self) -> None:
        self.cancelled = True


class Scheduler:
    """The engine: ``submit`` from any thread (the server's event loop), events delivered on the request's loop."""

    def __init__(self, session: Any, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 128,
                 trace: bool = False, union_ffn: bool | None = None) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.session = session
        self.runner = BatchRunner(session, max_batch, union_ffn)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted (a slot each), prompt not yet all in the cache
        self.active: list[Request] = []
        self.trace: deque[tuple[Any, ...]] | None = deque(maxlen=100_000) if trace else None
        self.free = list(range(max_batch))[::-1]
        self.cond = threading.Condition()
        self.closing = False
        self.deadline = float("inf")
        self.steps = 0  # batched decode steps run
        self.max_seen_batch = 0
        self._ids = itertools.count(1)
        self.eos: set[int] = {session.eos_id} if session.eos_id is not None else set()
        self.thread = threading.Thread(target=self._loop, name="picompile-engine", daemon=True)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    # -- any thread ------------------------------------------------------------------------------
    def submit(self, ids: list[int], max_tokens: int, params: SamplingParams,
               loop: asyncio.AbstractEventLoop, stop_at_eos: bool = True) -> Request:
        req = Request(ids, max_tokens, params, loop, asyncio.Queue(), next(self._ids), stop_at_eos=stop_at_eos)
        with self.cond:
            if self.closing:
                raise ShuttingDown("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.active)} requests in flight and {len(self.waiting)} waiting: "
                                f"the queue is full, try again later")
            self.waiting.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        with self.cond:
            req.cancel()
            self.cond.notify()

    def close(self, grace: float) -> None:
        """Admit nothing more; cancel what is still running after ``grace`` seconds. The engine cancels at its
        next iteration; should it still be inside a step ``STALL_MARGIN`` seconds past the deadline (a step
        slowed down by a loaded machine), a timer ends the clients' streams from outside the engine, so a
        shutdown never waits on the engine."""
        with self.cond:
            self.closing = True
            self.deadline = min(self.deadline, time.monotonic() + grace)
            self.cond.notify()
            wait = max(0.0, self.deadline - time.monotonic()) + STALL_MARGIN
        timer = threading.Timer(wait, self._end_stalled_streams)
        timer.daemon = True
        timer.start()

    def _end_stalled_streams(self) -> None:
        """Past the deadline and its margin: an error event to every request the engine has not ended yet (each
        client stops at its first final event; what the engine sends later goes to a queue nobody reads)."""
        with self.cond:
            for r in [*self.waiting, *self.prefilling, *self.active]:
                if not r.cancelled:
                    r.cancel()
                    n = len(r.gen.tokens) if r.gen is not None else 0
                    self._emit(r, Event(finish_reason=None, completion_tokens=n,
                                        error=SHUT_DOWN if r.slot >= 0 else NOT_STARTED))
            self.cond.notify()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def stats(self) -> dict[str, int]:
        with self.cond:
            return {"active": len(self.active), "prefilling": len(self.prefilling), "waiting": len(self.waiting),
                    "slots": self.max_batch,
                    "free_slots": len(self.free), "steps": self.steps, "max_batch_seen": self.max_seen_batch}

    # -- the engine thread -----------------------------------------------------------------------
    def _emit(self, req: Request, ev: Event) -> None:
        try:
            req.loop.call_soon_threadsafe(req.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _finish(self, req: Request, error: str | None = None) -> None:
        if req.slot >= 0:
            self.free.append(req.slot)
            req.slot = -1
        if error is not None:
            n = len(req.gen.tokens) if req.gen is not None else 0
            self._emit(req, Event(finish_reason=None, completion_tokens=n, error=error))

    def _sweep(self) -> list[Request]:
        """Under the lock: drop cancelled requests (freeing their slots), cancel all at the deadline, and take
        the waiting requests that fit in the free slots."""
        expired = self.closing and time.monotonic() >= self.deadline
        for r in list(self.active):
            if r.cancelled or expired:
                self.active.remove(r)
                self._finish(r, SHUT_DOWN if expired and not r.cancelled else None)
        for r in list(self.prefilling):
            if r.cancelled or expired:
                self.prefilling.remove(r)
                self._finish(r, SHUT_DOWN if expired and not r.cancelled else None)
        for r in list(self.waiting):
            if r.cancelled or expired:
                self.waiting.remove(r)
                self._finish(r, NOT_STARTED if expired and not r.cancelled else None)
        admit = []
        while self.waiting and self.free:
            r = self.waiting.popleft()
            r.slot = self.free.pop()
            admit.append(r)
        self.prefilling += admit
        return admit

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not (self.waiting or self.prefilling or self.active or self.closing):
                    self.cond.wait()
                self._sweep()
                if self.closing and not (self.active or self.waiting or self.prefilling):
                    return
                if not (self.prefilling or self.active):
                    self.cond.wait(0.05)  # closing with nothing to do yet
                    continue
                chunks = self._plan_chunks()
            for r, start, n in chunks:
                self._prefill(r, start, n)
            with self.cond:
                self._sweep_cancelled_only()
                batch = [r for r in self.active if not r.cancelled]
            if batch:
                self._step(batch)

    def _plan_chunks(self) -> list[tuple[Request, int, int]]:
        """Under the lock: this iteration's prefill chunks, (request, start, tokens), oldest request first, whole
        chunks (boundaries at multiples of ``prefill_chunk``) worth at most ``prefill_chunk`` tokens, at least one."""
        plan: list[tuple[Request, int, int]] = []
        budget = self.prefill_chunk
        for r in self.prefilling:
            if not r.ids:  # nothing to prefill: the runner's error ends the request
                plan.append((r, 0, 0))
                continue
            start = r.prefilled
            while start < len(r.ids):
                n = min(self.prefill_chunk - start % self.prefill_chunk, len(r.ids) - start)
                if plan and n > budget:
                    return plan
                plan.append((r, start, n))
                budget -= n
                start += n
                if budget <= 0:
                    return plan
        return plan

    def _sweep_cancelled_only(self) -> None:
        for r in list(self.active):
            if r.cancelled:
                self.active.remove(r)
                self._finish(r)

    def _record(self, *event: Any) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def _prefill(self, r: Request, start: int, n: int) -> None:
        """Prompt tokens start..start+n-1 of ``r`` into its slot; after the last chunk, its first token."""
        if r.cancelled or r.slot < 0:
            return
        try:
            if r.gen is None:
                r.gen = Generation(self.session.tokenizer, r.ids, r.max_tokens, r.params,
                                   self.eos if r.stop_at_eos else set())
            logits = self.runner.prefill(r.slot, r.ids[start:start + n], start)[-1]
            r.prefilled = start + n
            self._record("prefill", r.rid, start, n)
            if r.prefilled < len(r.ids):
                return
            self._advance(r, logits)
        except Exception as e:  # a request that cannot run fails alone
            with self.cond:
                if r in self.prefilling:
                    self.prefilling.remove(r)
                self._finish(r, f"{type(e).__name__}: {e}")
            return
        with self.cond:
            if r in self.prefilling:
                self.prefilling.remove(r)
            if r.gen.done:
                self._finish(r)
            else:
                self.active.append(r)

    def _advance(self, r: Request, logits: Any) -> None:
        assert r.gen is not None
        r.gen.advance(logits)
        g = r.gen
        self._record("token", r.rid, len(g.tokens))
        self._emit(r, Event(g.delta, g.finish_reason, len(g.tokens)))

    def _step(self, batch: list[Request]) -> None:
        steps = []
        for r in batch:
            assert r.gen is not None
            steps.append((r.slot, r.gen.tokens[-1], len(r.ids) + len(r.gen.tokens) - 1))
        try:
            logits = self.runner.decode(steps)
        except Exception as e:
            with self.cond:
                for r in batch:
                    if r in self.active:
                        self.active.remove(r)
                    self._finish(r, f"{type(e).__name__}: {e}")
            return
        self.steps += 1
        self.max_seen_batch = max(self.max_seen_batch, len(batch))
        done = []
        for r, row in zip(batch, logits):
            self._advance(r, row)
            if r.gen is not None and r.gen.done:
                done.append(r)
        with self.cond:
            for r in done:
                if r in self.active:
                    self.active.remove(r)
                self._finish(r)

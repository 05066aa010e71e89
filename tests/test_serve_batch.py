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


@pytest.mark.parametrize("union", [False, True, None])
def test_batched_decode_equals_alone(default_artifact: Path, union: bool | None) -> None:
    import picompile
    from picompile.runtime.batch import BatchRunner, batch_graph

    session = picompile.load(default_artifact)
    runner = BatchRunner(session, len(PROMPTS), union_ffn=union)
    alone = {sl: _greedy(runner, [sl], 12)[sl] for sl in range(len(PROMPTS))}
    together = _greedy(runner, list(range(len(PROMPTS))), 12)
    assert together == alone  # token for token (alone: one sequence, the one-token fused FFN in every mode)
    import torch

    steps = [(sl, 3 + sl, len(p)) for sl, p in enumerate(PROMPTS)]
    for sl, p in enumerate(PROMPTS):
        runner.prefill(sl, p)
    lone = [runner.decode([st])[0].clone() for st in steps]  # each rewrites its own position: same caches after
    for sl, row in enumerate(runner.decode(steps)):
        assert torch.equal(row, lone[sl]), sl  # bit for bit: the union sums are the fused kernels' (float, ReLU)
    assert runner._graphs[1][0].meta["batched_ffns"] == 0
    gm, shared = batch_graph(session.decode_graph, session.n_past, 3, union)
    n_layers = sum(1 for n in session.decode_graph.graph.nodes if "predict" in str(n.target))
    assert gm.meta["batched_ffns"] == (0 if union is False else 2 * n_layers)  # each layer's FFN and predictor
    assert runner._graphs[len(PROMPTS)][0].meta["batched_ffns"] == gm.meta["batched_ffns"]
    # the glue runs once on the stacked tokens; per sequence only attention, its KV writes, positions (and FFNs)
    assert gm.meta["batched_nodes"] > 2 * gm.meta["perseq_nodes"] > 0
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


@pytest.mark.parametrize("dtype", ["float16", "float32", "int4"])
def test_union_ffn_equals_each_alone(dtype: str, tmp_path: Path) -> None:
    """One union-masked call for 4 tokens (overlapping masks, one empty, one full) gives each token bit for bit
    its output with its own mask alone, and that output is the masked FFN's (float64 reference); for float
    weights it is also bit for bit the fused one-token kernel's (what a lone request decodes with)."""
    import torch

    from picompile.kernels import KernelSpec, aligned_copies, build_kernel, load_kernel
    from picompile.kernels.qformat import QFormat, dequantize, quantize
    from picompile.kernels.table import add_kernel, find_kernel
    from picompile.runtime.batch_ffn import batched_part

    d, n = 64, 96
    spec = KernelSpec(kind="ffn_gated", act="relu", d_model=d, n_rows=n, weight_dtype=dtype,  # type: ignore[arg-type]
                      has_bias=False, target="llvm")
    add_kernel(spec.key(), load_kernel(build_kernel(spec, tmp_path), spec))
    g = torch.Generator().manual_seed(0)
    dense = {k: torch.randn(n, d, generator=g) * 0.2 for k in ("w_up", "w_gate", "w_down_t")}
    stored: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}  # the weights' values as the kernel reads them, float64
    for k, w in dense.items():
        if dtype == "int4":
            q, s = quantize(w, QFormat("int4"))
            stored[k], stored["s" + k[1:].split("_t")[0]] = q, s
            ref[k] = dequantize(q, s).double()
        else:
            stored[k] = w.to(getattr(torch, dtype))
            ref[k] = stored[k].double()
    stored = aligned_copies(stored)
    xs = [torch.randn(1, 1, d, generator=g) for _ in range(4)]
    masks = [torch.rand(1, 1, n, generator=g) < p for p in (0.3, 0.5, 0.0, 1.0)]
    masks[1][..., :20] = masks[0][..., :20]  # overlapping selections

    def run(idx: list[int]) -> list[torch.Tensor]:
        return batched_part([xs[i] for i in idx], stored["w_up"], None, stored["w_gate"], stored["w_down_t"],
                            [masks[i] for i in idx], spec.key(), stored.get("s_up"), stored.get("s_gate"),
                            stored.get("s_down"))

    together = run([0, 1, 2, 3])
    for i in range(4):
        (alone,) = run([i])
        assert torch.equal(together[i], alone), i  # exact: the union's extra rows add zeros, in the same order
        x = xs[i].reshape(d).double()
        h = torch.relu(ref["w_gate"] @ x) * (ref["w_up"] @ x) * masks[i].reshape(n)
        expect = h @ ref["w_down_t"]
        assert torch.allclose(alone.reshape(d).double(), expect, rtol=1e-4, atol=1e-5), i
        if dtype != "int4":
            fused = aligned_copies({"y": torch.empty(d)})["y"]
            idx = masks[i].reshape(n).nonzero().squeeze(1).to(torch.int32)
            find_kernel(spec.key())(xs[i].reshape(d), stored["w_up"], stored["w_gate"], None, stored["w_down_t"],
                                    idx, fused)
            assert torch.equal(together[i].reshape(d), fused), i  # the same sums, in the same order
    assert torch.count_nonzero(together[2]) == 0  # an empty mask: no neuron, y = 0

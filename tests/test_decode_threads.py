"""Decode steps run on one torch thread exactly where TVM kernels read every weight (runtime/threads.py),
and give the same logits as on every thread."""
from __future__ import annotations

from pathlib import Path

import torch

import picompile
from picompile.runtime.threads import torch_weight_reads, with_decode_threads


def test_kernel_artifact_decodes_on_one_torch_thread(f16_cpu_artifact: Path) -> None:
    s = picompile.load(f16_cpu_artifact)
    assert s.torch_weight_reads == [] and s.decode_torch_threads == 1
    ids = [5, 9, 2, 7, 1]
    dec = s.decoder()
    dec.feed(ids[:3])
    threads = torch.get_num_threads()
    one = dec.feed(ids[3:4])  # one token: one torch thread
    assert torch.get_num_threads() == threads  # restored after the step
    past = s.step(torch.tensor([ids[:3]]), s.empty_past())[1]
    with torch.inference_mode():  # the same step through the loaded graph, on the caller's threads
        ref = s.graph(torch.tensor([ids[3:4]]), *past)[0][0]
    assert torch.allclose(one, ref, atol=1e-5, rtol=0)


def test_reference_graph_keeps_every_thread(artifacts: dict) -> None:
    s = picompile.load(artifacts[("llama", "relu")])  # the dense pipeline: no kernels, torch reads the weights
    assert s.decode_torch_threads is None
    lin = [n for n in s.graph.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]
    assert lin and set(n.name for n in lin) <= set(torch_weight_reads(s.graph)) | set(s.torch_weight_reads)
    assert not any("embedding" in name for name in s.torch_weight_reads)  # a row lookup is not a weight read


def test_with_decode_threads_only_wraps_one_token_calls() -> None:
    seen: list[int] = []

    def step(ids: torch.Tensor) -> None:
        seen.append(torch.get_num_threads())

    step.native_calls = 3  # type: ignore[attr-defined]  # what compile_step hangs on its step
    before = torch.get_num_threads()
    run = with_decode_threads(step, 1)
    assert run.native_calls == 3  # type: ignore[attr-defined]
    run(torch.zeros(1, 4, dtype=torch.long))
    run(torch.zeros(1, 1, dtype=torch.long))
    assert seen == [before, 1] and torch.get_num_threads() == before
    assert with_decode_threads(step, None) is step

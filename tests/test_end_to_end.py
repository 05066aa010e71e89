"""build → load → generate: greedy tokens identical to transformers' generate, logits within 1e-4."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import picompile
from conftest import FAMILIES

PROMPT = [5, 17, 33, 4, 99, 120, 7]


@pytest.mark.parametrize("key", FAMILIES, ids=[f"{f}-{a}" for f, a in FAMILIES])
def test_generate_matches_transformers(key: tuple[str, str], checkpoints: dict, artifacts: dict) -> None:
    session = picompile.load(artifacts[key])
    model = AutoModelForCausalLM.from_pretrained(checkpoints[key], dtype=torch.float32).eval()
    new = session.generate(PROMPT, 16, stop_at_eos=False)
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    assert new == ref.sequences[0, len(PROMPT):].tolist()
    ref_logits = torch.cat(ref.logits)  # [16, vocab]: prefill's last position, then 15 decode steps
    assert session.last_logits is not None and session.last_logits.shape == ref_logits.shape
    assert (session.last_logits - ref_logits).abs().max().item() < 1e-4
    # logits of a whole sequence (prefill) against the dense model
    full = PROMPT + new
    with torch.no_grad():
        dense = model(torch.tensor([full])).logits[0]
    assert (session.logits(full) - dense).abs().max().item() < 1e-4


def test_decode_steps_match_dense_forward(checkpoints: dict, artifacts: dict) -> None:
    """16 decode steps one token at a time on the KV cache, each against a full dense forward."""
    key = ("llama", "relu")
    session = picompile.load(artifacts[key])
    model = AutoModelForCausalLM.from_pretrained(checkpoints[key], dtype=torch.float32).eval()
    tokens = list(PROMPT)
    logits, past = session.step(torch.tensor([tokens]), session.empty_past())
    for step in range(16):
        nxt = int(logits[-1].argmax())
        tokens.append(nxt)
        logits, past = session.step(torch.tensor([[nxt]]), past)
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0, -1]
        assert (logits[-1] - ref).abs().max().item() < 1e-4, f"decode step {step}"
    assert past[0].shape[2] == len(tokens)


def test_artifact_is_self_contained(artifacts: dict, tmp_path: Path) -> None:
    """The runtime needs nothing but the artifact: move it elsewhere and it still runs."""
    import shutil

    moved = tmp_path / "moved.pic"
    shutil.copytree(artifacts[("opt", "relu")], moved)
    a = picompile.load(artifacts[("opt", "relu")]).generate(PROMPT, 4, stop_at_eos=False)
    b = picompile.load(moved).generate(PROMPT, 4, stop_at_eos=False)
    assert a == b and len(a) == 4


def test_sampling_is_seeded(artifacts: dict) -> None:
    s = picompile.load(artifacts[("llama", "silu")])
    a = s.generate(PROMPT, 8, temperature=1.0, top_k=20, seed=3, stop_at_eos=False)
    b = s.generate(PROMPT, 8, temperature=1.0, top_k=20, seed=3, stop_at_eos=False)
    assert a == b and len(a) == 8


def test_session_calls_ops_directly(checkpoints: dict, tmp_path: Path) -> None:
    """A loaded session calls picompile ops past torch's dispatcher, with the same results and op names."""
    from picompile.formats.artifact import read_manifest
    from picompile.ir.graph import count_ops
    from picompile.ir.ops import DirectCall, is_picompile_op
    from picompile.runtime.loader import load_graph

    art = picompile.build(checkpoints[("llama", "relu")], output=tmp_path / "s.pic", calibration_tokens=256,
                          emit=lambda s: None)
    session = picompile.load(art, hybrid="off")
    dispatched = load_graph(art, read_manifest(art))
    ours = [n.target for n in session.graph.graph.nodes if n.op == "call_function" and is_picompile_op(n.target)]
    assert ours and all(isinstance(t, DirectCall) for t in ours)
    assert not any(isinstance(n.target, DirectCall) for n in dispatched.graph.nodes)
    ran, built = count_ops(session.graph), count_ops(dispatched)
    assert built.pop("aten::_assert_tensor_metadata") > 0 and "aten::_assert_tensor_metadata" not in ran
    # drop-noop-ops: casts to the dtype a tensor has (HF's norms: float32 → float32) and unread constant copies
    # are gone, nothing else
    assert built.pop("aten::to.dtype") > ran.pop("aten::to.dtype", 0)
    for name in ("aten::detach_", "aten::lift_fresh_copy"):
        assert built.pop(name, 0) >= ran.pop(name, 0)
    assert ran == built
    ids = torch.tensor([[5, 17, 33, 4, 99]])
    with torch.inference_mode():
        a, b = session.graph(ids, *session.empty_past()), dispatched(ids, *session.empty_past())
        assert torch.equal(a[0], b[0])
        step = torch.tensor([[7]])
        assert torch.equal(session.graph(step, *a[1:])[0], dispatched(step, *b[1:])[0])

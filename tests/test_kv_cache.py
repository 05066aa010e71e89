"""The in-place KV cache (runtime/kv_cache.py, Session.decoder): the arena graph writes each step's keys and
values into preallocated buffers instead of concatenating the past, gives the functional graph's logits
(the prompt's exactly, each step's to float32 rounding: its attention is matmuls), keeps ``Session.step`` functional (branching from an older past, interleaving ``logits``), and
fails clearly where the cache would overflow or a decoder's cache was reused."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from torch import fx

import picompile
from picompile.errors import InputError
from picompile.ir.graph import placeholders
from picompile.runtime import Session
from picompile.runtime.kv_cache import ArenaPatternError, arena_step

aten = torch.ops.aten
PROMPT = [5, 17, 33, 4, 99, 120, 7]


def _functional(session: Session, ids: list[int], past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple]:
    """The artifact's graph run as loaded (cat of the past): the reference."""
    with torch.inference_mode():
        out = session.graph(torch.tensor([ids]), *past)
    return out[0][0], tuple(out[1:])


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_arena_graph_structure_and_logits(artifacts: dict, family: str) -> None:
    session = picompile.load(artifacts[(family, "relu")])
    kv = arena_step(session.graph, session.n_past, 32)
    nodes = list(kv.graph.graph.nodes)
    pasts = set(placeholders(kv.graph)[1:])
    # no past is concatenated any more; one in-place write per past input; only the logits are returned
    assert not [n for n in nodes if n.target is aten.cat.default and pasts & set(n.all_input_nodes)]
    assert sum(n.target is aten.copy_.default for n in nodes) == session.n_past
    assert len(next(n for n in nodes if n.op == "output").args[0]) == 1
    assert len(kv.arenas) == session.n_past and kv.capacity == 32
    assert all(a.shape == (1, session.kv_heads, 32, session.head_dim) for a in kv.arenas)
    # the functional graph is left as it was
    assert sum(n.target is aten.copy_.default for n in session.graph.graph.nodes) == 0
    # prefill then decode: exactly the functional graph's logits, the arenas holding its presents
    want, past = _functional(session, PROMPT, session.empty_past())
    with torch.inference_mode():
        (got,) = kv.graph(torch.tensor([PROMPT]), *kv.views(0))
    torch.testing.assert_close(got[0], want, atol=0, rtol=0)
    n = len(PROMPT)
    for tok in (3, 9, 11):
        want, past = _functional(session, [tok], past)
        with torch.inference_mode():
            (got,) = kv.graph(torch.tensor([[tok]]), *kv.views(n))
        n += 1
        torch.testing.assert_close(got[0], want, atol=0, rtol=0)
        for arena, p in zip(kv.arenas, past):
            assert torch.equal(arena[:, :, :n], p)


def test_arena_pattern_mismatch_says_why(artifacts: dict) -> None:
    session = picompile.load(artifacts[("llama", "relu")])
    gm = fx.GraphModule(session.graph, copy.deepcopy(session.graph.graph))  # first present → its past input
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    outs[1] = placeholders(gm)[1]
    output.args = (tuple(outs),)
    with pytest.raises(ArenaPatternError, match="present 0 .* not a cat"):
        arena_step(gm, session.n_past, 16)


def test_decoder_and_step_match_the_functional_graph(artifacts: dict) -> None:
    session = picompile.load(artifacts[("llama", "relu")])
    assert session.kv is not None and session.kv_reason == ""
    ref, past = _functional(session, PROMPT, session.empty_past())
    dec = session.decoder()
    torch.testing.assert_close(dec.feed(PROMPT), ref, atol=0, rtol=0)
    # one-token steps: the decode graph's attention is two matmuls and a softmax (load step decode-attention),
    # the functional graph's torch's SDPA, so they agree to float32 rounding (a wrong cache is off by O(1))
    close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)
    refs = []
    for tok in (3, 9, 11):
        ref, past = _functional(session, [tok], past)
        refs.append((ref, past))
        close(dec.feed([tok]), ref)
    assert dec.length == len(PROMPT) + 3
    dec.truncate(len(PROMPT) + 1)  # forget 9 and 11: feeding 9 again gives its logits again
    close(dec.feed([9]), refs[1][0])
    with pytest.raises(InputError, match="cannot truncate"):
        dec.truncate(dec.length + 1)
    # step() stays functional: branching from an older past, or another prompt in between, gives the
    # functional graph's logits and presents (the cache is refilled from the past it is given)
    logits, presents = session.step(torch.tensor([PROMPT]), session.empty_past())
    logits, p1 = session.step(torch.tensor([[3]]), presents)
    close(logits, refs[0][0])
    session.logits([8, 8, 8])  # overwrites the cache
    logits, p2 = session.step(torch.tensor([[9]]), p1)
    close(logits, refs[1][0])
    for a, b in zip(p2, refs[1][1]):
        close(a, b)
    alt, _ = session.step(torch.tensor([[42]]), p1)  # a branch: p2 must not change
    want_alt, _ = _functional(session, [42], refs[0][1])
    close(alt, want_alt)
    for a, b in zip(p2, refs[1][1]):
        close(a, b)
    # the decoder's cache was overwritten by those steps: it says so instead of computing garbage
    with pytest.raises(InputError, match="overwritten"):
        dec.feed([5])


def test_generate_equals_the_concatenating_session(artifacts: dict) -> None:
    session = picompile.load(artifacts[("opt", "relu")])
    concat = Session(session.root, session.manifest, session.graph, session.tokenizer, kv_in_place=False)
    assert concat.kv is None and session.kv is not None
    assert session.generate(PROMPT, 10) == concat.generate(PROMPT, 10)
    torch.testing.assert_close(session.last_logits, concat.last_logits, atol=0, rtol=0)


def test_cache_overflow_is_a_clear_error(checkpoints: dict, tmp_path: Path) -> None:
    art = picompile.build(checkpoints[("llama", "relu")], output=tmp_path / "short.pic", pipeline="dense",
                          max_seq_len=12, emit=lambda s: None, progress=False)
    session = picompile.load(art)
    assert session.kv is not None and session.kv.capacity == 12
    dec = session.decoder()
    dec.feed(PROMPT)
    for tok in range(5):
        dec.feed([tok])
    with pytest.raises(InputError, match="exceed this artifact's context of 12"):
        dec.feed([1])
    _, past = session.step(torch.tensor([PROMPT + [1, 2, 3, 4, 5]]), session.empty_past())
    with pytest.raises(InputError, match="exceed"):
        session.step(torch.tensor([[1]]), past)

"""The hybrid scheduler (runtime/hybrid.py): one scheduler call per FFN layer replaces the (hot, cold,
merge) triple; inline and thread modes give the unscheduled graph's logits, the oracle stays exact,
empty partitions launch nothing, and the CUDA backend (gpu-marked) matches too."""
from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import fx

import picompile
from picompile.errors import InputError
from picompile.ir.ops import is_picompile_op
from picompile.runtime import Session
from picompile.runtime.hybrid import (
    EmptyPartition,
    HybridFFN,
    InlinePartition,
    PartOp,
    ThreadPartition,
    schedule_hybrid,
    schedulers,
)
from picompile.runtime.loader import drop_masks

PROMPT = [5, 17, 33, 4, 99, 120, 7]
N_NEW = 12  # one prefill, then 11 decode steps
BUILD: dict[str, Any] = dict(predictor="oracle", placement_batch=8, calibration_tokens=256, max_seq_len=64,
                             emit=lambda s: None, progress=False)
PART_OPS = ("sparse_ffn", "tvm_sparse_ffn")


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_artifact(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-relu for rtx4090 with a tiny VRAM budget (both partitions in use), TVM kernels."""
    out = tmp_path_factory.mktemp("hybrid") / "split.pic"
    return picompile.build(checkpoints[("llama", "relu")], target="rtx4090", vram_budget_gib=0.0004, output=out, **BUILD)


@pytest.fixture(scope="module")
def off_session(split_artifact: Path) -> Session:
    session = picompile.load(split_artifact, hybrid="off")  # hybrid="off": the graph as built
    assert session.hybrid_mode == "off"
    return session


@pytest.fixture(scope="module", params=["all_hot", "all_cold"])
def edge_artifact(request: pytest.FixtureRequest, checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Every neuron hot (the target's full VRAM) or every neuron cold (target cpu); reference ops (no kernel builds)."""
    out = tmp_path_factory.mktemp("hybrid") / f"{request.param}.pic"
    options = dict(target="rtx4090" if request.param == "all_hot" else "cpu", pipeline="reference")
    return request.param, picompile.build(checkpoints[("llama", "relu")], output=out, **options, **BUILD)


# -- helpers --------------------------------------------------------------------------------------
def _scheduled_copy(session: Session, mode: str, **options: Any) -> Session:
    """The session's graph copied (sharing its weights) and scheduled in ``mode``."""
    gm = fx.GraphModule(session.graph, copy.deepcopy(session.graph.graph))
    return Session(session.root, session.manifest, schedule_hybrid(gm, mode, **options), session.tokenizer)


def _run(session: Session) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy tokens, the logits they were chosen from (prefill + decode steps), a prefill of everything."""
    new = session.generate(PROMPT, N_NEW, stop_at_eos=False)
    assert session.last_logits is not None
    return new, session.last_logits, session.logits(PROMPT + new)


def _close(a: tuple[list[int], torch.Tensor, torch.Tensor], b: tuple[list[int], torch.Tensor, torch.Tensor], tol: float) -> None:
    assert a[0] == b[0]
    assert (a[1] - b[1]).abs().max().item() < tol  # prefill's last position and the decode steps
    assert (a[2] - b[2]).abs().max().item() < tol  # a multi-token prefill


def _with_timeout(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Run ``fn`` on a daemon thread; fail (instead of hanging) if it does not finish in time."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout=seconds)
    assert not t.is_alive(), f"did not finish within {seconds} s (deadlock?)"
    if errors:
        raise errors[0]
    return result[0]


def _hot_workers() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("picompile-hot")}


def _count(gm: fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, name))


# -- end to end -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_modes_match_unscheduled_graph(mode: str, split_artifact: Path, off_session: Session) -> None:
    layers = off_session.manifest.layers
    assert all(0 < layer["n_hot"] < layer["n_neurons"] for layer in layers)  # both partitions in use
    assert off_session.manifest.sections["placement"]
    session = picompile.load(split_artifact, hybrid=mode)
    assert session.hybrid_mode == mode and session.hybrid_skipped == []
    hot_kind = ThreadPartition if mode == "thread" else InlinePartition
    assert all(isinstance(s.hot, hot_kind) and isinstance(s.cold, InlinePartition) for s in schedulers(session.graph))
    before = _hot_workers()
    _close(_with_timeout(lambda: _run(session)), _run(off_session), 1e-4)
    if mode == "thread":  # the hot parts ran on this session's worker thread, started at the first launch
        assert len(_hot_workers() - before) == 1


def test_oracle_equals_dense(split_artifact: Path, off_session: Session) -> None:
    """ReLU + oracle masks skip only neurons whose output is exactly zero: sparse = dense, scheduled too."""
    dense = picompile.load(split_artifact, dense=True)
    assert _count(dense.graph, "oracle_mask") == 0 and _count(off_session.graph, "oracle_mask") == 2
    threaded = _scheduled_copy(off_session, "thread")
    reference = _run(dense)
    _close(_with_timeout(lambda: _run(threaded)), reference, 1e-5)
    # dropping the masks of a scheduled graph (as bench's dense view does) gives the dense graph again
    unmasked = Session(threaded.root, threaded.manifest, drop_masks(threaded.graph), threaded.tokenizer)
    assert _count(unmasked.graph, "oracle_mask") == 0
    _close(_with_timeout(lambda: _run(unmasked)), reference, 1e-5)


def test_empty_partitions_never_block(edge_artifact: tuple[str, Path]) -> None:
    kind, path = edge_artifact
    off = picompile.load(path, hybrid="off")
    layers = off.manifest.layers
    if kind == "all_hot":
        assert all(layer["n_hot"] == layer["n_neurons"] for layer in layers)
    else:
        assert all(layer["n_hot"] == 0 for layer in layers)
    threaded = _scheduled_copy(off, "thread")
    assert threaded.hybrid_mode == "thread" and threaded.hybrid_skipped == []
    for s in schedulers(threaded.graph):
        empty, used = (s.cold, s.hot) if kind == "all_hot" else (s.hot, s.cold)
        assert isinstance(empty, EmptyPartition)  # launches nothing, returns zeros
        assert isinstance(used, ThreadPartition if kind == "all_hot" else InlinePartition)
    _close(_with_timeout(lambda: _run(threaded)), _run(off), 1e-4)


# -- structure ------------------------------------------------------------------------------------
def test_one_scheduler_per_layer(off_session: Session) -> None:
    gm = _scheduled_copy(off_session, "inline").graph
    n_layers = len(off_session.manifest.layers)
    assert _count(gm, "merge") == 0 and all(_count(gm, op) == 0 for op in PART_OPS)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, HybridFFN)]
    assert sorted(n.target.layer for n in nodes) == list(range(n_layers))
    for node in nodes:  # the weights stay graph attributes, read by the scheduler node
        hot_w, cold_w = node.args[1:5], node.args[6:10]
        assert all(w is None or w.op == "get_attr" for w in (*hot_w, *cold_w))
        assert hot_w[0] is not None and cold_w[0] is not None
    assert _count(off_session.graph, "merge") == n_layers  # the source graph is untouched


def test_unmatched_triple_is_left_alone(off_session: Session) -> None:
    gm = fx.GraphModule(off_session.graph, copy.deepcopy(off_session.graph.graph))
    merge0 = next(n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "merge"))
    hot0 = merge0.args[0]
    with gm.graph.inserting_after(hot0):  # a second reader of layer 0's hot part: not the pattern
        gm.graph.call_function(torch.ops.aten.neg.default, (hot0,))
    schedule_hybrid(gm, "thread")
    assert _count(gm, "merge") == 1 and [s.layer for s in schedulers(gm)] == [1]
    (reason,) = gm.meta["hybrid_skipped"]
    assert "layer 0" in reason and "also used by" in reason
    partial = Session(off_session.root, off_session.manifest, gm, off_session.tokenizer)
    _close(_with_timeout(lambda: _run(partial)), _run(off_session), 1e-4)


# -- modes and errors -----------------------------------------------------------------------------
def test_mode_errors(split_artifact: Path, off_session: Session) -> None:
    with pytest.raises(InputError, match="unknown hybrid mode 'fast'"):
        picompile.load(split_artifact, hybrid="fast")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="needs a CUDA device"):
            picompile.load(split_artifact, hybrid="cuda")
        assert _scheduled_copy(off_session, "auto", target_has_gpu=True).hybrid_mode == "inline"
    assert _scheduled_copy(off_session, "auto", target_has_gpu=False).hybrid_mode == "inline"
    assert _scheduled_copy(off_session, "off").hybrid_mode == "off"


# -- the scheduler on its own -------------------------------------------------------------------------
def _part(k: int, d: int, name: str, gen: torch.Generator) -> tuple[PartOp, tuple[torch.Tensor, ...]]:
    weights = (torch.randn(k, d, generator=gen), torch.randn(k, generator=gen), None, torch.randn(k, d, generator=gen))
    consts = dict(act="relu", layer=0, part=name, device="gpu" if name == "hot" else "cpu")
    return PartOp(torch.ops.picompile.sparse_ffn.default, consts, k), weights


def test_scheduler_unit_thread_and_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    d, k_hot, k_cold = 32, 24, 40
    (hot, hw), (cold, cw) = _part(k_hot, d, "hot", gen), _part(k_cold, d, "cold", gen)
    bias = torch.randn(d, generator=gen)
    worker = ThreadPoolExecutor(max_workers=1)
    sched = HybridFFN(0, "thread", ThreadPartition(hot, worker), InlinePartition(cold))
    for x, mh, mc in [
        (torch.randn(1, 1, d, generator=gen), torch.rand(1, 1, k_hot, generator=gen) > 0.5, torch.rand(1, 1, k_cold, generator=gen) > 0.5),
        (torch.randn(1, 5, d, generator=gen), torch.rand(1, 5, k_hot, generator=gen) > 0.5, torch.rand(1, 5, k_cold, generator=gen) > 0.5),
        (torch.randn(1, 1, d, generator=gen), torch.zeros(1, 1, k_hot, dtype=torch.bool), torch.zeros(1, 1, k_cold, dtype=torch.bool)),
    ]:
        want = torch.ops.picompile.merge(hot(x, hw, mh), cold(x, cw, mc), bias, 0)  # type: ignore[arg-type]
        got = _with_timeout(lambda: sched(x, *hw, mh, *cw, mc, bias), 30)
        assert torch.equal(got, want)
    # an error in the cold part propagates once the hot part is done; the worker stays usable
    bad_mask = torch.ones(1, 1, k_cold + 1, dtype=torch.bool)  # selects a row the cold part does not have
    with pytest.raises((IndexError, RuntimeError)):
        _with_timeout(lambda: sched(x, *hw, mh, *cw, bad_mask, bias), 30)
    assert torch.equal(_with_timeout(lambda: sched(x, *hw, mh, *cw, mc, bias), 30), want)
    empty = HybridFFN(0, "thread", EmptyPartition(), EmptyPartition())
    assert torch.equal(empty(x, *hw, mh, *cw, mc, bias), bias.expand_as(x))
    worker.shutdown()


# -- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_mode_matches_unscheduled_graph(split_artifact: Path, off_session: Session) -> None:
    session = picompile.load(split_artifact, hybrid="cuda")
    assert session.hybrid_mode == "cuda" and session.hybrid_skipped == []
    assert picompile.load(split_artifact, hybrid="auto").hybrid_mode == "cuda"  # rtx4090 target: has a GPU
    _close(_with_timeout(lambda: _run(session)), _run(off_session), 1e-4)

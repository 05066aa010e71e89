"""The load pipeline (runtime/load_pipeline.py, load_steps.py): each load path's named step list, print_after /
dump_ir after a load step (API and CLI), one-line errors for unknown step names, and the runner's lint and
error naming after every step."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx

import picompile
from picompile.errors import InputError, PassError, PicompileError
from picompile.ir.schema import node_op
from picompile.runtime import Session
from picompile.runtime.hybrid import HybridFFN
from picompile.runtime.load_pipeline import (
    LOAD_STEPS,
    LoadOptions,
    LoadRun,
    LoadState,
    describe,
    graph_steps,
    load_step,
    load_steps,
    registered,
    session_steps,
)
from picompile.runtime.masks import masks_of

GRAPH = ["flatten-signature", "bind-weights"]
RUN = ["drop-metadata-asserts", "drop-noop-ops", "call-directly"]


@pytest.fixture(scope="module")
def split_artifact(checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-relu for rtx4090 with a tiny VRAM budget (hot and cold parts both hold rows), trained predictors,
    reference ops (no kernel builds)."""
    out = tmp_path_factory.mktemp("load") / "split.pic"
    return picompile.build(checkpoints[("llama", "relu")], target="rtx4090", vram_budget_gib=0.0004,
                           pipeline="reference", output=out, calibration_tokens=256, max_seq_len=64,
                           placement_batch=8, emit=lambda s: None, progress=False)


# -- the lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, want", [
    (LoadOptions(), GRAPH + ["dense-prefill", "kv-arenas", "last-logits", "decode-attention"]),
    (LoadOptions(hybrid="inline", direct=True),
     GRAPH + ["schedule-hybrid", *RUN, "dense-prefill", "kv-arenas", "last-logits", "decode-attention"]),
    (LoadOptions(dense=True, aligned=True, kernels=True, direct=True),
     GRAPH + ["align-weights", "drop-masks", *RUN, "dense-prefill", "sparse-prefill-ffn", "kv-arenas", "last-logits",
              "decode-attention", "native-calls", "native-glue"]),
    (LoadOptions(aligned=True, kernels=True, prefill_dtype="bfloat16-stream", sparse_prefill=True),
     GRAPH + ["align-weights", "dense-prefill", "compute-dtype", "kv-arenas", "last-logits", "decode-attention",
              "native-calls", "native-glue"]),
    (LoadOptions(direct=True, prefill_dtype="bfloat16", kv_in_place=False),
     GRAPH + RUN + ["dense-prefill", "compute-dtype", "last-logits", "decode-attention"]),
    (LoadOptions(last_logits=False, matmul_attention=False, aligned=True, kernels=True, native=False),
     GRAPH + ["align-weights", "dense-prefill", "sparse-prefill-ffn", "kv-arenas"]),
    (LoadOptions(last_logits=False, matmul_attention=False, aligned=True, kernels=True, native=False,
                 sparse_prefill=False),
     GRAPH + ["align-weights", "dense-prefill", "kv-arenas"]),
    (LoadOptions(hybrid="thread", direct=True, compile=True),
     GRAPH + ["schedule-hybrid", *RUN, "dense-prefill", "kv-arenas", "opaque-calls", "inline-trivial", "native-calls",
              "decode-attention"]),
    (LoadOptions(compile=True, native=False, matmul_attention=False, dense_prefill=False),
     GRAPH + ["kv-arenas", "opaque-calls", "inline-trivial"]),
])
def test_each_load_path_has_its_step_list(options: LoadOptions, want: list[str]) -> None:
    assert load_steps(options) == want == graph_steps(options) + session_steps(options)
    assert all(name in registered() for name in want)
    listing = describe(want).splitlines()  # the list, printable: one line per step, with the graphs it writes
    assert [line.split()[0] for line in listing] == want
    assert all(f"[{', '.join(LOAD_STEPS[n].writes)}]" in line for n, line in zip(want, listing))


def test_a_load_reports_its_steps(split_artifact: Path) -> None:
    inline = picompile.load(split_artifact)  # auto → inline here (no CUDA)
    assert inline.load_steps == GRAPH + ["schedule-hybrid", *RUN, "dense-prefill", "kv-arenas", "last-logits", "decode-attention"]
    assert set(inline.load_seconds) == set(inline.load_steps)
    assert inline.kv is not None and inline.dense_prefill
    dense = picompile.load(split_artifact, dense=True, hybrid="off")
    assert dense.load_steps == GRAPH + ["drop-masks", *RUN, "dense-prefill", "kv-arenas", "last-logits", "decode-attention"]
    assert not dense.dense_prefill  # the graph had no mask left to drop
    # a session made from a graph runs (and reports) its own steps only
    own = Session(dense.root, dense.manifest, dense.graph, dense.tokenizer, kv_in_place=False)
    assert own.load_steps == ["dense-prefill", "last-logits", "decode-attention"] and own.kv is None and own.kv_reason == "kv_in_place=False"


def test_hybrid_masks_are_named_and_dropped(split_artifact: Path) -> None:
    """drop-masks on a scheduled graph: both partition masks of every HybridFFN, found by name."""
    sparse = picompile.load(split_artifact, hybrid="inline")
    dense = picompile.load(split_artifact, hybrid="inline", dense=True)
    for session, masked in ((sparse, True), (dense, False)):
        nodes = [n for n in session.graph.graph.nodes if n.op == "call_function" and isinstance(n.target, HybridFFN)]
        assert len(nodes) == 2
        for node in nodes:
            masks = masks_of(node)
            assert set(masks) == {"mask_h", "mask_c"}
            assert all((m is not None) == masked for m in masks.values())
    assert not any(node_op(n) == "predict" for n in dense.graph.graph.nodes)  # the predictors went with the masks


# -- print_after / dump_ir ------------------------------------------------------------------------
def test_print_after_and_dump_ir(split_artifact: Path, tmp_path: Path) -> None:
    printed: list[str] = []
    session = picompile.load(split_artifact, dense=True, print_after=["schedule-hybrid", "kv-arenas"],
                             dump_ir=tmp_path / "ir", emit=printed.append)
    steps = session.load_steps
    assert steps == GRAPH + ["drop-masks", "schedule-hybrid", *RUN, "dense-prefill", "kv-arenas", "last-logits", "decode-attention"]
    assert list(session.load_rss_bytes) == steps and all(v > 0 for v in session.load_rss_bytes.values())
    assert [t.splitlines()[0] for t in printed] == ["# ---- graph graph after load step schedule-hybrid ----",
                                                   "# ---- decode = prefill graph after load step kv-arenas ----"]
    assert printed[0].count("hybrid_ffn_") >= 2 and "kv_arena0" in printed[1]
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == [f"{i:03d}_{name}.txt" for i, name in enumerate(steps, 1)]
    text = {name: (tmp_path / "ir" / f).read_text() for name, f in zip(steps, files)}
    assert text["drop-masks"].startswith("# after load step drop-masks (")
    assert "picompile.predict" in text["bind-weights"] and "picompile.predict" not in text["drop-masks"]
    assert "_assert_tensor_metadata" in text["schedule-hybrid"]
    assert "_assert_tensor_metadata" not in text["drop-metadata-asserts"]
    casts = text["drop-metadata-asserts"].count("aten.to.dtype(")
    assert casts > 0 and text["drop-noop-ops"].count("aten.to.dtype(") < casts  # float32 → float32 casts gone


def test_print_after_all_prints_every_step(split_artifact: Path) -> None:
    printed: list[str] = []
    session = picompile.load(split_artifact, hybrid="off", print_after=["all"], emit=printed.append)
    heads = [t.splitlines()[0] for t in printed]
    steps = [h.rsplit("load step ", 1)[1].removesuffix(" ----") for h in heads]
    assert list(dict.fromkeys(steps)) == session.load_steps
    # prefill has a mask-free copy of its own here: kv-arenas wrote two graphs, each printed
    assert heads[-4:] == ["# ---- decode graph after load step kv-arenas ----",
                          "# ---- prefill graph after load step kv-arenas ----",
                          "# ---- prefill graph after load step last-logits ----",
                          "# ---- decode graph after load step decode-attention ----"]
    assert heads[-5] == "# ---- prefill graph after load step dense-prefill ----"
    assert "logit_rows" in printed[-2] and "logit_rows" not in printed[-3]
    assert "grouped_attention" in printed[-1] and "scaled_dot_product_attention" in printed[-2]


def test_unknown_step_is_one_line_listing_the_load(split_artifact: Path) -> None:
    with pytest.raises(InputError) as e:
        picompile.load(split_artifact, hybrid="off", print_after=["nope", "kv-arenas"])
    msg = str(e.value)
    assert "\n" not in msg and "unknown load step(s) nope;" in msg
    assert msg.endswith("this load runs: " + ", ".join(GRAPH + RUN + ["dense-prefill", "kv-arenas", "last-logits", "decode-attention"]))
    with pytest.raises(InputError, match="schedule-hybrid;"):  # named, but not a step of this load
        picompile.load(split_artifact, hybrid="off", print_after=["schedule-hybrid"])


# -- the CLI --------------------------------------------------------------------------------------
def test_cli_run_and_inspect(split_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.cli import main

    assert main(["run", str(split_artifact), "--ids", "5,6,7", "-n", "3", "--print-after", "schedule-hybrid",
                 "--dump-ir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "# ---- graph graph after load step schedule-hybrid ----" in out and "hybrid_ffn_1" in out
    assert (tmp_path / "run" / "003_schedule-hybrid.txt").is_file()

    assert main(["run", str(split_artifact), "--ids", "5,6,7", "-n", "3", "--json", "--print-after", "kv-arenas"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the graphs went to stderr: stdout stays JSON
    assert result["load_steps"][-3:] == ["kv-arenas", "last-logits", "decode-attention"] and "load step kv-arenas" in captured.err

    assert main(["inspect", str(split_artifact), "--graph", "--hybrid", "off", "--print-after", "bind-weights,kv-arenas",
                 "--dump-ir", str(tmp_path / "inspect")]) == 0
    out = capsys.readouterr().out
    assert out.index("FFN layers") < out.index("after load step bind-weights") < out.index("after load step kv-arenas")
    assert "load     flatten-signature → bind-weights" in out
    assert len(list((tmp_path / "inspect").iterdir())) == len(GRAPH + RUN) + 4  # + dense-prefill, kv-arenas, last-logits, decode-attention

    assert main(["inspect", str(split_artifact), "--print-after", "nope"]) == 2
    captured = capsys.readouterr()
    assert "unknown load step(s) nope" in captured.err and "schedule-hybrid" in captured.err
    assert "FFN layers" not in captured.out  # failed before any summary


# -- the runner -----------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


@pytest.fixture()
def scratch_steps() -> Any:
    """Steps registered by a test, removed after it."""
    before = set(registered())
    yield
    for name in set(LOAD_STEPS) - before:
        del LOAD_STEPS[name]


def _state() -> LoadState:
    gm = fx.symbolic_trace(_Tiny())
    return LoadState(graph=gm, prefill=gm, decode=gm)


def test_lint_after_each_step_names_the_broken_step(scratch_steps: Any) -> None:
    @load_step("test-fine", ("decode",), "decode becomes a module of its own over the same graph")
    def _fine(state: LoadState) -> None:
        assert state.decode is not None
        state.decode = fx.GraphModule(state.decode, state.decode.graph)

    @load_step("test-dangling", ("decode",), "a get_attr of a buffer that is not there")
    def _dangling(state: LoadState) -> None:
        assert state.decode is not None
        graph = state.decode.graph
        with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
            with pytest.warns(UserWarning, match="no underlying reference"):
                graph.get_attr("no_such_buffer")

    state = _state()
    run = LoadRun(["test-fine", "test-dangling"])
    run.run(state, ["test-fine"])
    assert state.decode is not state.graph and run.done == 1
    with pytest.raises(PassError, match=r"after load step test-dangling \(decode graph\): .*no_such_buffer"):
        run.run(state, ["test-dangling"])


def test_step_errors_name_the_step(scratch_steps: Any) -> None:
    @load_step("test-refuses", ("graph",), "raises a user-facing error")
    def _refuses(state: LoadState) -> None:
        raise InputError("not this graph")

    @load_step("test-crashes", ("graph",), "raises a bug")
    def _crashes(state: LoadState) -> None:
        raise ZeroDivisionError("oops")

    with pytest.raises(InputError, match="^load step test-refuses: not this graph$"):
        LoadRun(["test-refuses"]).run(_state(), ["test-refuses"])
    with pytest.raises(ZeroDivisionError) as e:
        LoadRun(["test-crashes"]).run(_state(), ["test-crashes"])
    assert "picompile: raised in load step 'test-crashes'" in e.value.__notes__
    with pytest.raises(PicompileError, match="out of order"):  # a run executes its own list, in order
        LoadRun(["test-refuses", "test-crashes"]).run(_state(), ["test-crashes"])


def test_drop_noop_ops_removes_only_what_does_nothing() -> None:
    """drop-noop-ops alone on a tiny graph: a cast to the dtype x has and an unread detach_(lift_fresh_copy(c))
    go; a real cast and a read constant copy stay; the outputs are unchanged."""
    from torch import fx

    from picompile.ir.graph import drop_noop_ops

    aten = torch.ops.aten
    x = torch.randn(4)
    root = torch.nn.Module()
    root.register_buffer("c", torch.zeros(0))
    g = fx.Graph()
    xn, cn = g.placeholder("x"), g.get_attr("c")
    xn.meta["val"], cn.meta["val"] = x, root.c

    def call(target: object, *args: object, val: torch.Tensor) -> fx.Node:
        n = g.call_function(target, args)
        n.meta["val"] = val
        return n

    same = call(aten.to.dtype, xn, torch.float32, val=x)  # x is float32 already: a no-op
    y = call(aten.mul.Tensor, same, 2.0, val=x * 2)
    unread = call(aten.lift_fresh_copy.default, cn, val=root.c)
    call(aten.detach_.default, unread, val=root.c)  # read by nothing
    kept = call(aten.lift_fresh_copy.default, cn, val=root.c)
    half = call(aten.to.dtype, y, torch.float16, val=(x * 2).half())
    total = call(aten.add.Tensor, call(aten.sum.default, y, val=x.sum()), call(aten.sum.default, kept, val=x.sum()),
                 val=x.sum())
    g.output((half, total))
    gm = fx.GraphModule(root, g)
    want = gm(x)
    assert drop_noop_ops(gm) == {"casts": 1, "constant_copies": 1}
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(aten.to.dtype) == 1 and aten.detach_.default not in targets
    assert targets.count(aten.lift_fresh_copy.default) == 1  # the one read stays
    got = gm(x)
    assert got[0].dtype == torch.float16 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

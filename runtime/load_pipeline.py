"""The load pipeline: the runtime's load-time graph rewrites as one visible, named list per load.

Like the build's pass pipeline (``picompile/pipeline.py``), a load runs named steps in order, and the
runner lints the graph after each, prints it after the steps named in ``print_after``, writes one
``NNN_step.txt`` file per step to ``dump_ir`` and names the step in any error. Each rewrite stays in its
module (``loader.py``, ``masks.py``, ``hybrid.py``, ``kv_cache.py``, ``compute_dtype.py``, ``logit_rows.py``, ``compile.py``,
``native.py``, ``native_glue.py``, ``decode_attention.py``, ``prefill_sparse.py``); its entry in ``LOAD_STEPS`` (``load_steps.py``) gives it a name.

A load rewrites up to three graphs (``LoadState``): ``graph``, the decoder step as loaded
(``Session.graph``: functional, past in, presents out), then ``prefill`` and ``decode``, the forms a
session runs for several tokens and for one (copies sharing the weights, or ``graph`` itself until a step
gives them their own form). Each step names the graphs it writes; those are the ones linted, printed and
dumped after it. The steps come in two phases: ``load_graph`` runs the graph steps, ``Session`` the session
steps (``prefill`` / ``decode``), so a ``Session`` made from a graph runs only its own.

Which steps a load runs follows from its options (``LoadOptions``: dense, hybrid, compile, prefill_dtype, …):
:func:`graph_steps` and :func:`session_steps` build the list, which ``session.load_steps`` reports.
Decisions that rewrite no graph stay out of the list: reading the files, loading the kernels, the decode
step's torch thread count (``threads.py``) and ``torch.compile`` itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import fx

from picompile.errors import InputError, PassError, PicompileError, named_step
from picompile.ir.graph import format_graph, lint
from picompile.procinfo import status

ROLES: tuple[str, ...] = ("graph", "prefill", "decode")


@dataclass(frozen=True)
class LoadOptions:
    """What decides a load's steps (see ``picompile.runtime.load``)."""

    dense: bool = False  # drop the neuron masks: every neuron computed
    hybrid: str = "off"  # "off" | "auto" | "inline" | "thread" | "cuda" (after compile's transparent_mode)
    target_has_gpu: bool = False  # the artifact's target ("auto" picks cuda only with one)
    direct: bool = False  # the picompile ops called past torch's dispatcher, metadata asserts dropped: for running
    aligned: bool = False  # the artifact has TVM kernels: weights copied into aligned anonymous memory
    kernels: bool = False  # the artifact has TVM kernels (session steps: eager decode calls them through C++ ops)
    mapped_weights: bool = False  # weights left on the file's mapping (only misaligned ones copied)
    dense_prefill: bool = True  # prefill computes every neuron (decode runs the masks)
    sparse_prefill: bool = True  # (dense prefill) a ReLU FFN's up / down rows only where its gate fired (prefill_sparse.py)
    prefill_dtype: Optional[str] = None  # "bfloat16": prefill's GEMMs on bfloat16 weight copies; "bfloat16-stream": without
    kv_in_place: bool = True  # the KV cache in preallocated arenas
    last_logits: bool = True  # (eager) prefill can compute lm_head for the last position only (logit_rows.py)
    compile: bool = False  # torch.compile'd step: opaque copies, native kernel calls, matmul attention
    native: bool = True  # the decode graph's CPU kernel calls as C++ ops (eager and compiled)
    matmul_attention: bool = True  # decode attention as matmuls (eager and compiled)


@dataclass
class LoadState:
    """What the steps read and rewrite: the graphs (``ROLES``), the inputs of the graph steps and what the
    steps found out (``notes``: kv_reason, native_calls, …)."""

    graph: Optional[fx.GraphModule] = None
    prefill: Optional[fx.GraphModule] = None
    decode: Optional[fx.GraphModule] = None
    options: LoadOptions = field(default_factory=LoadOptions)
    n_inputs: int = 1  # graph inputs before the weights: input_ids and the past
    weight_keys: list[str] = field(default_factory=list)  # the manifest's weights, in graph input order
    tensors: Optional[dict[str, torch.Tensor]] = None  # the weight file's tensors, until bind-weights binds them
    n_past: int = 0
    max_seq_len: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def graphs(self, roles: tuple[str, ...]) -> list[tuple[str, fx.GraphModule]]:
        """(roles, graph) for each distinct graph of ``roles`` (two roles on one graph: "prefill = decode")."""
        out: list[tuple[str, fx.GraphModule]] = []
        for role in roles:
            gm = getattr(self, role)
            if gm is None:
                continue
            same = next((i for i, (_, g) in enumerate(out) if g is gm), None)
            if same is None:
                out.append((role, gm))
            else:
                out[same] = (f"{out[same][0]} = {role}", gm)
        return out


StepFn = Callable[[LoadState], None]


@dataclass(frozen=True)
class LoadStep:
    """One named load step: ``fn`` rewrites the graphs named in ``writes`` (in place or by replacing them)."""

    name: str
    fn: StepFn
    writes: tuple[str, ...]
    doc: str
    lint: bool = True  # whether picompile.ir.graph.lint holds for its graphs afterwards


LOAD_STEPS: dict[str, LoadStep] = {}


def load_step(name: str, writes: tuple[str, ...], doc: str, lint: bool = True) -> Callable[[StepFn], StepFn]:
    """Register ``fn`` as the load step ``name`` (writing the graphs ``writes``)."""
    bad = [r for r in writes if r not in ROLES]
    assert not bad, f"load step {name}: unknown graph role(s) {bad}"

    def register(fn: StepFn) -> StepFn:
        LOAD_STEPS[name] = LoadStep(name, fn, writes, doc, lint)
        return fn

    return register


# -- the lists ------------------------------------------------------------------------------------
def graph_steps(o: LoadOptions) -> list[str]:
    """The steps ``load_graph`` runs on the graph as read from graph.pt2."""
    steps = ["flatten-signature", "bind-weights"]
    steps += ["align-weights"] if o.aligned else []
    steps += ["drop-masks"] if o.dense else []
    steps += ["schedule-hybrid"] if o.hybrid != "off" else []
    steps += ["drop-metadata-asserts", "drop-noop-ops", "call-directly"] if o.direct else []
    return steps


def session_steps(o: LoadOptions) -> list[str]:
    """The steps a ``Session`` runs to make its prefill and decode forms of the loaded graph."""
    steps = ["dense-prefill"] if o.dense_prefill else []
    steps += ["sparse-prefill-ffn"] if (o.dense_prefill and o.sparse_prefill and o.kernels and not o.compile
                                        and o.prefill_dtype in (None, "float32", "bfloat16")) else []
    steps += ["compute-dtype"] if o.prefill_dtype is not None else []
    steps += ["kv-arenas"] if o.kv_in_place else []
    steps += ["last-logits"] if o.last_logits and not o.compile else []
    if o.compile:
        steps += ["opaque-calls", "inline-trivial"]
        steps += ["native-calls"] if o.native else []
    steps += ["decode-attention"] if o.matmul_attention else []
    # eager: last, on a copy (runtime/batch.py batches the form before it), where there are TVM kernels to call
    steps += ["native-calls", "native-glue"] if o.native and o.kernels and not o.compile else []
    return steps


def load_steps(o: LoadOptions) -> list[str]:
    """Every step of a load with options ``o``, in order."""
    return graph_steps(o) + session_steps(o)


# -- the runner -----------------------------------------------------------------------------------
def check_print_after(steps: list[str], wanted: list[str]) -> None:
    unknown = [w for w in wanted if w != "all" and w not in steps]
    if unknown:
        raise InputError(f"print_after names unknown load step(s) {', '.join(unknown)}; this load runs: "
                         f"{', '.join(steps) or 'no steps'}")


@dataclass
class LoadRun:
    """One load's steps and how to show them; ``run`` executes the next of them on a ``LoadState``."""

    steps: list[str]  # every step of this load, in order (graph steps, then session steps)
    print_after: list[str] = field(default_factory=list)  # step names, or "all"
    dump_ir: Optional[Path] = None  # one NNN_step.txt per step
    emit: Callable[[str], None] = print
    seconds: dict[str, float] = field(default_factory=dict)  # per step run so far
    rss_bytes: dict[str, int] = field(default_factory=dict)  # this process's resident memory after each step
    done: int = 0  # steps run so far

    def __post_init__(self) -> None:
        missing = [n for n in self.steps if n not in registered()]
        if missing:
            raise PicompileError(f"the load names unregistered step(s): {', '.join(missing)}")
        check_print_after(self.steps, self.print_after)
        if self.dump_ir is not None:
            self.dump_ir = Path(self.dump_ir)
            self.dump_ir.mkdir(parents=True, exist_ok=True)

    def run(self, state: LoadState, names: list[str]) -> None:
        """Run ``names``, the next steps of this load, on ``state``."""
        upcoming = self.steps[self.done : self.done + len(names)]
        if upcoming != names:
            raise PicompileError(f"load steps {', '.join(names)} run out of order; next are: {', '.join(upcoming)}")
        for name in names:
            self._run_one(state, LOAD_STEPS[name])

    def _run_one(self, state: LoadState, step: LoadStep) -> None:
        start = time.perf_counter()
        with named_step("load step", step.name):
            step.fn(state)
        self.seconds[step.name] = time.perf_counter() - start
        self.rss_bytes[step.name] = status().get("VmRSS", 0)  # 0 where /proc is not there
        self.done += 1
        graphs = state.graphs(step.writes)
        if not graphs:
            raise PassError(f"load step {step.name} left none of its graphs ({', '.join(step.writes)})")
        if step.lint:
            for roles, gm in graphs:
                _lint(gm, step.name, roles)
        self._show(step.name, graphs)

    def _show(self, name: str, graphs: list[tuple[str, fx.GraphModule]]) -> None:
        shown = "all" in self.print_after or name in self.print_after
        if self.dump_ir is None and not shown:
            return
        texts = [(roles, format_graph(gm)) for roles, gm in graphs]
        if self.dump_ir is not None:
            body = "".join(f"# -- {roles} graph --\n{text}\n" for roles, text in texts)
            path = self.dump_ir / f"{self.done:03d}_{name}.txt"
            path.write_text(f"# after load step {name} ({self.seconds[name]:.2f} s)\n{body}")
        if shown:
            for roles, text in texts:
                self.emit(f"# ---- {roles} graph after load step {name} ----\n{text}")


def _lint(gm: fx.GraphModule, name: str, roles: str) -> None:
    try:
        lint(gm, name)
    except PassError as e:  # lint names a pass; this is a load step, and one of its graphs
        raise PassError(str(e).replace(f"pass {name}", f"load step {name} ({roles} graph)")) from None


def registered() -> dict[str, LoadStep]:
    """Every load step, by name (``runtime/load_steps.py`` registers them)."""
    import picompile.runtime.load_steps  # noqa: F401

    return LOAD_STEPS


def describe(names: list[str]) -> str:
    """One line per step: its name, the graphs it writes, what it does."""
    registered()
    return "\n".join(f"{n:22s} [{', '.join(LOAD_STEPS[n].writes)}] {LOAD_STEPS[n].doc}" for n in names)


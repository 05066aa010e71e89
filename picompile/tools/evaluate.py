"""``picompile eval``: perplexity and zero-shot accuracy of an artifact, sparse vs its own dense reference.

Both numbers come from the same artifact in the same run: ``picompile.load(art)`` (the sparse graph, predictors
choosing the neurons) and ``picompile.load(art, dense=True)`` (the same weights, every neuron computed).

- perplexity: a sliding window at the artifact's context length, stride half the context (HF's "perplexity of
  fixed-length models" recipe): each token is scored exactly once, with as much left context as the window allows;
  the first window scores all its tokens (but the very first, which nothing predicts).
- zero-shot tasks as lm-eval-harness scores them: the log-likelihood (sum of log-probs) of each choice's
  continuation tokens given the context, argmax = the answer (``acc``); ``acc_norm`` divides by the choice's byte
  length. Winogrande uses partial scoring (the shared continuation after each option-filled context), RTE is a
  True/False choice after "{premise}\\nQuestion: {hypothesis} True or False?\\nAnswer:".
- the skipped-neuron fraction is *measured*: the graph's neuron masks (``picompile::predict`` /
  ``picompile::oracle_mask`` outputs) are counted over every token position the sparse run computes, per layer,
  then averaged over layers. The manifest's estimate (mean of 1 − predicted_active) is reported beside it.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from picompile.errors import PicompileError

if TYPE_CHECKING:  # torch is imported where it runs: the CLI imports this module for every command
    from torch import Tensor, fx

TOKEN_SUFFIXES: tuple[str, ...] = (".npy", ".json")
DOC_SEPARATOR = "<|endoftext|>"  # TinyStories-style document separator: documents are encoded one by one with BOS
RELU_SWEEP: tuple[float, ...] = (0.9, 0.95, 0.99, 0.999)  # recall targets
ACT_SWEEP: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7)  # act_sparsity values (non-ReLU FFNs)
MASK_OPS: dict[str, int] = {"predict": 4, "tvm_predict": 4, "oracle_mask": 5}  # mask-producing op -> position of its layer arg

Advance = Callable[[int], None]  # advance by n graph calls


def _noop(n: int = 1) -> None:
    return None


# ----------------------------------------------------------------------------- running the graph


class Scorer:
    """Runs one session's graph from an empty cache and counts its neuron masks (when it has any).

    The graph is a copy of ``session.graph`` (sharing its weights) whose output also returns every mask node, so
    the mask counts are what the sparse run actually computed.
    """

    def __init__(self, session: Any) -> None:
        from torch import fx  # noqa: F811  (the module-level name exists only for type checking)

        from picompile.ir.ops import is_picompile_op

        self.session = session
        self.context: int = int(session.max_seq_len)
        self.vocab_size: int = int(session.vocab_size)
        gm: fx.GraphModule = session.graph
        graph = copy.deepcopy(gm.graph)
        masks: list[fx.Node] = []
        self.mask_layers: list[int] = []
        for node in graph.nodes:
            op = next((op for op in MASK_OPS if node.op == "call_function" and is_picompile_op(node.target, op)), None)
            if op is not None:
                layer = node.kwargs.get("layer", node.args[MASK_OPS[op]])
                masks.append(node)
                self.mask_layers.append(int(layer))
        self.n_outputs: int = 1 + int(session.n_past)
        if masks:
            out = next(n for n in graph.nodes if n.op == "output")
            results = out.args[0]
            if not isinstance(results, (tuple, list)) or len(results) != self.n_outputs:
                raise PicompileError(f"unexpected graph outputs in {session.root}: cannot add the neuron masks")
            out.args = ((*results, *masks),)
            self.graph: fx.GraphModule = fx.GraphModule(gm, graph)
        else:
            self.graph = gm
        self.active: dict[int, float] = {layer: 0.0 for layer in self.mask_layers}  # mask-true count per layer
        self.total: dict[int, float] = {layer: 0.0 for layer in self.mask_layers}  # mask entries per layer

    def logprobs(self, ids: Sequence[int]) -> Tensor:
        """log-softmax [len(ids), vocab] (float32) of one prefill of ``ids`` from an empty cache."""
        import torch

        if not 0 < len(ids) <= self.context:
            raise PicompileError(f"internal: {len(ids)} tokens do not fit the context of {self.context}")
        past = self.session.empty_past()
        with torch.inference_mode():
            out = self.graph(torch.tensor([list(ids)], dtype=torch.long), *past)
        for layer, mask in zip(self.mask_layers, out[self.n_outputs:]):
            self.active[layer] += float(mask.sum())
            self.total[layer] += float(mask.numel())
        return torch.log_softmax(out[0][0].float(), dim=-1)

    def skipped(self, n_layers: int) -> tuple[float | None, dict[int, float]]:
        """(mean over all FFN layers of the skipped fraction, per-layer fractions); None before any masked run.

        A layer without a mask computes every neuron (0 skipped)."""
        if not self.mask_layers or not any(self.total.values()):
            return (0.0 if not self.mask_layers else None), {}
        per = {layer: 1.0 - self.active[layer] / self.total[layer] for layer in self.mask_layers if self.total[layer]}
        return sum(per.values()) / max(n_layers, len(per)), per


def manifest_skipped(manifest: Any) -> float:
    """The build's estimate: mean over layers of 1 − predicted_active (trained predictors), the profiled
    inactive fraction (oracle), 0 for a dense graph."""
    predictor = manifest.build.get("predictor")
    if predictor == "none" or "insert-predictors" not in manifest.pipeline:
        return 0.0
    vals = []
    for layer in manifest.layers:
        if predictor == "trained" and layer.get("predicted_active") is not None:
            vals.append(1.0 - float(layer["predicted_active"]))
        elif layer.get("sparsity") is not None:
            vals.append(float(layer["sparsity"]))
        else:
            vals.append(0.0)
    return sum(vals) / len(vals) if vals else 0.0


# ----------------------------------------------------------------------------- perplexity


def encode_prefix(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    """``tokenizer.encode(text, bos=True)``, or at least its first ``max_tokens`` ids (possibly more, never
    fewer unless the whole text is shorter). A tokenizer with ``iter_encode`` (llama2.c: line by line, the
    chunks joined are exactly encode()'s ids) is only run over as much of the text as the prefix needs."""
    chunks = getattr(tokenizer, "iter_encode", None)
    if max_tokens is None or chunks is None:
        return list(tokenizer.encode(text, bos=True))
    ids: list[int] = []
    for chunk in chunks(text, bos=True):
        ids += chunk
        if len(ids) >= max_tokens:
            break
    return ids


def read_eval_tokens(path: str | Path, tokenizer: Any | None, vocab_size: int, max_tokens: int | None = None) -> list[int]:
    """Token ids of an evaluation file: a token file (.npy / .json list of ids), or text encoded with the
    artifact's tokenizer (documents split at "<|endoftext|>" are encoded one by one, each with BOS)."""
    src = Path(path)
    if not src.is_file():
        raise PicompileError(f"perplexity file {src} does not exist")
    if src.suffix in TOKEN_SUFFIXES:
        import numpy as np

        try:
            arr = np.load(src) if src.suffix == ".npy" else np.asarray(json.loads(src.read_text()))
            ids = [int(i) for i in np.asarray(arr, dtype=np.int64).reshape(-1)]
        except Exception as e:
            raise PicompileError(f"cannot read token file {src} (want a flat list of token ids): {e}") from None
    else:
        if tokenizer is None:
            raise PicompileError(f"{src} is text, but this artifact has no tokenizer: give a token file "
                                 f"({', '.join(TOKEN_SUFFIXES)} list of ids)")
        try:
            text = src.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise PicompileError(f"{src} is not UTF-8 text: {e}") from None
        docs = [d.strip() for d in text.split(DOC_SEPARATOR)] if DOC_SEPARATOR in text else [text]
        ids = []
        for doc in docs:
            if max_tokens is not None and len(ids) >= max_tokens:
                break  # the rest would be cut off anyway
            if doc:
                ids += encode_prefix(tokenizer, doc, None if max_tokens is None else max_tokens - len(ids))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise PicompileError(f"{src} gives {len(ids)} token(s); perplexity needs at least 2")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise PicompileError(f"{src} holds token id {bad[0]}, outside the vocabulary (0..{vocab_size - 1})")
    return ids


def windows(n: int, context: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Sliding windows over n tokens: (begin, end, first) — the window is ids[begin:end] (≤ context tokens) and
    it scores tokens first..end-1. Every token but the first is scored exactly once."""
    stride = max(1, context // 2) if stride is None else stride
    if not 1 <= stride < context:  # stride == context would leave each window's first token without context
        raise PicompileError(f"the stride must be in 1..{context - 1} (below the context, {context}), got {stride}")
    out: list[tuple[int, int, int]] = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return out


def sliding_nll(scorer: Scorer, ids: Sequence[int], stride: int | None = None,
                advance: Advance = _noop) -> tuple[float, int]:
    """(sum of token NLLs in nats, number of tokens scored) over ``ids`` with sliding windows."""
    import torch

    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), scorer.context, stride):
        lp = scorer.logprobs(ids[begin:end])  # [end-begin, vocab]; row j predicts token begin+j+1
        targets = torch.tensor(ids[first:end], dtype=torch.long)
        rows = lp[first - begin - 1:end - begin - 1]
        total -= float(rows.gather(1, targets[:, None]).double().sum())
        count += end - first
        advance(1)
    return total, count


# ----------------------------------------------------------------------------- zero-shot tasks


@dataclass
class Example:
    """One task example: the model picks the request with the highest continuation log-likelihood."""

    requests: list[tuple[str, str]]  # (context, continuation) per choice
    gold: int
    norm_lengths: list[int]  # bytes per choice (acc_norm divides the log-likelihood by these)


@dataclass
class Task:
    name: str
    path: Path
    examples: list[Example] = field(default_factory=list)
    kind: str = ""


def _mc_context(query: str) -> str:
    """The context of a {query, choices} row: stripped; "Question: …" gets "\\nAnswer:" as lm-eval formats
    piqa/arc (llm-foundry's continuation_delimiter "\\nAnswer: ")."""
    ctx = query.strip()
    if ctx.startswith("Question:") and "Answer:" not in ctx:
        ctx += "\nAnswer:"
    return ctx


def _example(row: Any, where: str) -> tuple[str, Example]:
    if not isinstance(row, dict):
        raise PicompileError(f"{where}: expected a JSON object")
    try:
        if "context_options" in row:  # winogrande, partial scoring
            options, cont = list(row["context_options"]), " " + str(row["continuation"]).strip()
            gold = int(row["gold"])
            return "winogrande", Example([(str(o).rstrip(), cont) for o in options], gold, [len(cont.encode())] * len(options))
        if "premise" in row and "hypothesis" in row:  # RTE
            label = row["label"]
            gold = {"entailment": 0, "not_entailment": 1}.get(label, label) if isinstance(label, str) else int(label)
            if gold not in (0, 1):
                raise ValueError(f"RTE label {label!r} is neither entailment nor not_entailment")
            ctx = f"{str(row['premise']).strip()}\nQuestion: {str(row['hypothesis']).strip()} True or False?\nAnswer:"
            return "rte", Example([(ctx, " True"), (ctx, " False")], int(gold), [4, 5])
        if "query" in row and "choices" in row:
            ctx = _mc_context(str(row["query"]))
            choices = [str(c).strip() for c in row["choices"]]
            return "choice", Example([(ctx, " " + c) for c in choices], int(row["gold"]), [len(c.encode()) for c in choices])
    except (KeyError, TypeError, ValueError) as e:
        raise PicompileError(f"{where}: bad row ({type(e).__name__}: {e})") from None
    raise PicompileError(f"{where}: unknown task format with keys {sorted(row)}; known: "
                         "{query, choices, gold}, {context_options, continuation, gold}, {premise, hypothesis, label}")


def read_task(path: str | Path, limit: int | None = None) -> Task:
    """A task file in the shared jsonl formats (the first ``limit`` examples)."""
    src = Path(path)
    if not src.is_file():
        raise PicompileError(f"task file {src} does not exist")
    task = Task(src.stem, src)
    with open(src, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(task.examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PicompileError(f"{src}:{lineno}: not JSON: {e}") from None
            kind, ex = _example(row, f"{src}:{lineno}")
            if not 0 <= ex.gold < len(ex.requests) or len(ex.requests) < 2:
                raise PicompileError(f"{src}:{lineno}: gold {ex.gold} does not index its {len(ex.requests)} choices")
            task.kind = task.kind or kind
            task.examples.append(ex)
    if not task.examples:
        raise PicompileError(f"task file {src} holds no examples")
    return task


def encode_request(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval-harness splits them: trailing context spaces move to the
    continuation; the continuation is the tail of encode(context + continuation) after len(encode(context))."""
    n_sp = len(context) - len(context.rstrip())
    if n_sp:
        continuation, context = context[-n_sp:] + continuation, context[:-n_sp]
    whole = list(tokenizer.encode(context + continuation, bos=True))
    ctx = list(tokenizer.encode(context, bos=True))
    cont = whole[len(ctx):]
    if not cont:
        cont = list(tokenizer.encode(continuation, bos=False))
    if not ctx:  # nothing to condition the first continuation token on
        start = tokenizer.bos_id if tokenizer.bos_id is not None else getattr(tokenizer, "eos_id", None)
        if start is not None:
            ctx = [start]
    return ctx, cont


def continuation_loglik(scorer: Scorer, ctx: Sequence[int], cont: Sequence[int]) -> float:
    """Sum of log p(cont | ctx) from one prefill; the context is cut from the left to fit the window."""
    import torch

    seq = (list(ctx) + list(cont))[-(scorer.context + 1):]
    inp = seq[:-1]
    n = min(len(cont), len(inp))
    if n == 0:
        raise PicompileError("a task continuation encodes to no tokens")
    lp = scorer.logprobs(inp)[-n:]
    targets = torch.tensor(seq[-n:], dtype=torch.long)
    return float(lp.gather(1, targets[:, None]).double().sum())


def encode_task(task: Task, tokenizer: Any, vocab_size: int) -> list[list[tuple[list[int], list[int]]]]:
    out = []
    for ex in task.examples:
        reqs = [encode_request(tokenizer, c, k) for c, k in ex.requests]
        for ctx, cont in reqs:
            bad = [i for i in ctx + cont if not 0 <= i < vocab_size]
            if bad:
                raise PicompileError(f"{task.path}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        out.append(reqs)
    return out


def score_task(scorer: Scorer, task: Task, encoded: list[list[tuple[list[int], list[int]]]],
               advance: Advance = _noop) -> dict[str, Any]:
    """{"acc", "acc_norm", "n", "choices": [picked index per example], "logliks": [[…]]}."""
    picks, picks_norm, logliks = [], [], []
    for ex, reqs in zip(task.examples, encoded):
        ll = []
        for ctx, cont in reqs:
            ll.append(continuation_loglik(scorer, ctx, cont))
            advance(1)
        norm = [v / max(1, n) for v, n in zip(ll, ex.norm_lengths)]
        picks.append(max(range(len(ll)), key=ll.__getitem__))
        picks_norm.append(max(range(len(norm)), key=norm.__getitem__))
        logliks.append(ll)
    n = len(task.examples)
    return {
        "n": n,
        "acc": sum(p == ex.gold for p, ex in zip(picks, task.examples)) / n,
        "acc_norm": sum(p == ex.gold for p, ex in zip(picks_norm, task.examples)) / n,
        "choices": picks,
        "logliks": logliks,
    }


# ----------------------------------------------------------------------------- evaluation


@dataclass
class Inputs:
    """What to evaluate, read and tokenized once (shared by the dense and sparse runs and the sweep)."""

    ppl_ids: list[int] | None = None
    ppl_source: str | None = None
    tasks: list[Task] = field(default_factory=list)
    encoded: list[list[list[tuple[list[int], list[int]]]]] = field(default_factory=list)

    def n_calls(self, context: int, stride: int | None) -> int:
        """Graph calls of one run (for the progress bar)."""
        n = len(windows(len(self.ppl_ids), context, stride)) if self.ppl_ids else 0
        return n + sum(len(reqs) for enc in self.encoded for reqs in enc)


def prepare(ppl: str | Path | None = None, tasks: Sequence[str | Path] = (), limit: int | None = None, *,
            tokenizer: Any | None, vocab_size: int, max_tokens: int | None = None) -> Inputs:
    """Read and tokenize the evaluation inputs (text and task files need ``tokenizer``)."""
    if ppl is None and not tasks:
        raise PicompileError("nothing to evaluate: give --ppl FILE and/or --tasks FILE …")
    if limit is not None and limit < 1:
        raise PicompileError(f"--limit must be >= 1, got {limit}")
    if max_tokens is not None and max_tokens < 2:
        raise PicompileError(f"--ppl-tokens must be >= 2, got {max_tokens}")
    inputs = Inputs()
    if ppl is not None:
        inputs.ppl_ids = read_eval_tokens(ppl, tokenizer, vocab_size, max_tokens)
        inputs.ppl_source = str(ppl)
    for path in tasks:
        task = read_task(path, limit)
        if tokenizer is None:
            raise PicompileError(f"task file {path} is text, but this artifact has no tokenizer to encode it")
        inputs.tasks.append(task)
        inputs.encoded.append(encode_task(task, tokenizer, vocab_size))
    names = [t.name for t in inputs.tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PicompileError(f"two task files share the name {dup[0]!r} (the file stem names the task)")
    return inputs


def prepare_for(session: Any, ppl: str | Path | None = None, tasks: Sequence[str | Path] = (),
                limit: int | None = None, *, tokenizer: Any | None = None, max_tokens: int | None = None) -> Inputs:
    """:func:`prepare` with a session's tokenizer (or ``tokenizer``, e.g. for a tokenizer-less model) and vocab."""
    return prepare(ppl, tasks, limit, tokenizer=tokenizer if tokenizer is not None else session.tokenizer,
                   vocab_size=session.vocab_size, max_tokens=max_tokens)


class OrtScorer:
    """Scores with the dense ONNX Runtime export of the artifact's source model (``--vs ort``)."""

    def __init__(self, ort: Any, context: int, vocab_size: int) -> None:
        self.ort, self.context, self.vocab_size = ort, context, vocab_size

    def logprobs(self, ids: Sequence[int]) -> Tensor:
        import torch

        return torch.log_softmax(torch.from_numpy(self.ort.logits(list(ids))).float(), dim=-1)

    def skipped(self, n_layers: int) -> tuple[float | None, dict[int, float]]:
        return 0.0, {}


def run_one(session: Any, inputs: Inputs, stride: int | None = None, advance: Advance = _noop,
            scorer: Any | None = None) -> dict[str, Any]:
    """One session over the inputs: {"ppl", "nll", "tokens", "tasks": {name: score}, "skipped_fraction", …}."""
    scorer = scorer if scorer is not None else Scorer(session)
    out: dict[str, Any] = {}
    if inputs.ppl_ids is not None:
        total, count = sliding_nll(scorer, inputs.ppl_ids, stride, advance)
        out.update(nll=total / count, ppl=math.exp(total / count), tokens=count)
    out["tasks"] = {t.name: score_task(scorer, t, enc, advance) for t, enc in zip(inputs.tasks, inputs.encoded)}
    skipped, per_layer = scorer.skipped(len(session.manifest.layers))
    out["skipped_fraction"] = skipped
    out["skipped_per_layer"] = {str(k): v for k, v in sorted(per_layer.items())}
    return out


def evaluate(artifact: str | Path, ppl: str | Path | None = None, tasks: Sequence[str | Path] = (),
             limit: int | None = None, *, stride: int | None = None, max_tokens: int | None = None,
             tokenizer: Any | None = None, verify: bool = True, do_sweep: bool = False,
             sweep_values: Sequence[float] | None = None, vs_ort: bool = False,
             progress: Callable[[str, int], Advance] | None = None) -> dict[str, Any]:
    """Dense and sparse evaluation of ``artifact`` in one run; the dict ``picompile eval --json`` prints.

    ``do_sweep``: also rebuild the model at several settings (:func:`sweep`), under ``result["sweep"]``.
    ``progress(description, total)`` returns an ``advance(n)`` callable (e.g. a rich progress task).
    """
    import picompile
    from picompile.formats.artifact import read_manifest

    # everything cheap (inputs, tokenizer, options) is checked before the graphs are loaded
    manifest = read_manifest(Path(artifact), verify=verify)
    if tokenizer is None and manifest.tokenizer:
        from picompile.formats.tokenizers import load_tokenizer_entry

        tokenizer = load_tokenizer_entry(manifest.tokenizer, Path(artifact))
    inputs = prepare(ppl, tasks, limit, tokenizer=tokenizer, vocab_size=int(manifest.model["vocab_size"]),
                     max_tokens=max_tokens)
    n = inputs.n_calls(int(manifest.build["max_seq_len"]), stride)
    if do_sweep:
        sweep_plan(manifest, sweep_values)
        rebuild_options(manifest)
    sparse = picompile.load(artifact, verify=False)
    dense = picompile.load(artifact, verify=False, dense=True)
    advance = progress("dense", n) if progress else _noop
    d = run_one(dense, inputs, stride, advance)
    advance = progress("sparse", n) if progress else _noop
    s = run_one(sparse, inputs, stride, advance)
    result = assemble(artifact, sparse, inputs, d, s, stride)
    if vs_ort:
        from picompile.tools.ort_reference import for_artifact

        ort = OrtScorer(for_artifact(Path(artifact)), sparse.max_seq_len, sparse.vocab_size)
        advance = progress("onnxruntime dense", n) if progress else _noop
        o = run_one(sparse, inputs, stride, advance, scorer=ort)
        result["ort_dense"] = {k: o[k] for k in ("ppl", "nll", "tokens") if k in o}
        result["ort_dense"]["tasks"] = {name: {"acc": t["acc"], "acc_norm": t["acc_norm"]} for name, t in o["tasks"].items()}
    if do_sweep:
        result["sweep"] = sweep(artifact, inputs, sweep_values, stride=stride, progress=progress)
    return result


def assemble(artifact: str | Path, session: Any, inputs: Inputs, d: dict[str, Any], s: dict[str, Any],
             stride: int | None) -> dict[str, Any]:
    m = session.manifest
    result: dict[str, Any] = {
        "artifact": str(artifact),
        "context": session.max_seq_len,
        "stride": stride if stride is not None else max(1, session.max_seq_len // 2),
        "predictor": m.build.get("predictor"),
        "ppl_file": inputs.ppl_source,
        "dense": {k: d[k] for k in ("ppl", "nll", "tokens") if k in d},
        "sparse": {k: s[k] for k in ("ppl", "nll", "tokens") if k in s},
        "skipped_fraction": s["skipped_fraction"],
        "skipped_fraction_source": "measured",
        "skipped_fraction_manifest": manifest_skipped(m),
        "skipped_per_layer": s["skipped_per_layer"],
        "tasks": {},
    }
    if result["skipped_fraction"] is None:
        result["skipped_fraction"] = result["skipped_fraction_manifest"]
        result["skipped_fraction_source"] = "manifest"
    for task in inputs.tasks:
        dt, st = d["tasks"][task.name], s["tasks"][task.name]
        result["tasks"][task.name] = {
            "file": str(task.path),
            "kind": task.kind,
            "n": dt["n"],
            "dense": {"acc": dt["acc"], "acc_norm": dt["acc_norm"]},
            "sparse": {"acc": st["acc"], "acc_norm": st["acc_norm"]},
            "agreement": sum(a == b for a, b in zip(dt["choices"], st["choices"])) / dt["n"],
        }
    return result


# ----------------------------------------------------------------------------- sweep


def rebuild_options(manifest: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`picompile.build` that rebuild an artifact's model as it was built
    (source, target and its memory budget, pipeline, build options, calibration corpus)."""
    import dataclasses

    from picompile.config import BuildConfig
    from picompile.pipeline import PIPELINES
    from picompile.targets import GiB

    from picompile.formats.provenance import recorded_path, resolve_source

    source = resolve_source(manifest.model) or manifest.model.get("source")
    if not source:
        raise PicompileError("the manifest names no source model (model.source); cannot rebuild it")
    if not Path(source).exists():
        raise PicompileError(f"the artifact's source model {source} is not found (a relative path is taken from "
                             f"the current directory); --sweep rebuilds from it")
    pipeline = next((name for name, names in PIPELINES.items() if names == list(manifest.pipeline)), None)
    if pipeline is None:
        raise PicompileError(f"the artifact's pipeline {manifest.pipeline} is none of {', '.join(PIPELINES)}")
    fields = {f.name for f in dataclasses.fields(BuildConfig)} - {"model", "output", "target", "pipeline", "progress",
                                                                     "print_after", "dump_ir", "kernel_cache"}
    opts: dict[str, Any] = {k: v for k, v in manifest.build.items() if k in fields}
    target = manifest.target
    opts.update(model=source, target=target["name"], pipeline=pipeline,
                vram_budget_gib=int(target.get("vram_bytes", 0)) / GiB)
    corpus = (manifest.sections.get("profile") or {}).get("corpus") or {}
    if corpus.get("kind") in ("text", "tokens"):
        cal = Path(recorded_path(corpus.get("sha256")) or corpus["source"])
        if not cal.is_file():
            raise PicompileError(f"the artifact's calibration file {cal} is not found; --sweep rebuilds with it")
        opts["calibration"] = cal
    if corpus.get("n_tokens"):
        opts.setdefault("calibration_tokens", max(16, int(corpus["n_tokens"])))
    return opts


def sweep_plan(manifest: Any, values: Sequence[float] | None = None) -> tuple[str, list[float]]:
    """("recall_target" | "act_sparsity", values): recall targets for ReLU FFNs, act_sparsity otherwise."""
    predictor = manifest.build.get("predictor")
    if "insert-predictors" not in manifest.pipeline or predictor == "none":
        raise PicompileError("--sweep needs a sparse artifact (pipeline default or reference, predictor trained or "
                             "oracle); this one computes every neuron")
    relu = all(layer.get("act") == "relu" for layer in manifest.layers)
    if relu:
        if predictor == "oracle":
            raise PicompileError("--sweep: this ReLU artifact uses the oracle predictor, which is exact at every "
                                 "setting; build it with --predictor trained to sweep recall targets")
        knob, default = "recall_target", RELU_SWEEP
    else:
        knob, default = "act_sparsity", ACT_SWEEP
    vals = list(values) if values else list(default)
    for v in vals:
        ok = 0.0 < v <= 1.0 if knob == "recall_target" else 0.0 <= v < 1.0
        if not ok:
            raise PicompileError(f"--sweep value {v} is out of range for {knob}")
    return knob, vals


def sweep(artifact: str | Path, inputs: Inputs, values: Sequence[float] | None = None, *, stride: int | None = None,
          progress: Callable[[str, int], Advance] | None = None, workdir: str | Path | None = None) -> dict[str, Any]:
    """Rebuild the artifact's model at several recall targets / act_sparsity values (temp dir) and evaluate each
    sparse build: {"knob", "points": [{knob, skipped_fraction, ppl, nll, tasks}], "options"}."""
    import picompile
    from picompile.formats.artifact import read_manifest

    manifest = read_manifest(Path(artifact), verify=False)
    knob, vals = sweep_plan(manifest, values)
    opts = rebuild_options(manifest)
    points = []
    with tempfile.TemporaryDirectory(prefix="picompile-sweep-", dir=workdir) as tmp:
        for v in vals:
            if progress:
                progress(f"building {knob}={v:g}", 0)
            out = picompile.build(**{**opts, knob: v}, output=Path(tmp) / f"{knob}_{v:g}.pic", emit=lambda s: None)
            session = picompile.load(out, verify=False)
            advance = progress(f"{knob}={v:g}", inputs.n_calls(session.max_seq_len, stride)) if progress else _noop
            r = run_one(session, inputs, stride, advance)
            points.append({knob: v, "skipped_fraction": r["skipped_fraction"],
                           "skipped_fraction_manifest": manifest_skipped(session.manifest),
                           **{k: r[k] for k in ("ppl", "nll") if k in r},
                           "tasks": {k: {"acc": t["acc"], "acc_norm": t["acc_norm"]} for k, t in r["tasks"].items()}})
    return {"knob": knob, "points": points,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.items()}}


# ----------------------------------------------------------------------------- command line


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _delta(a: float | None, b: float | None, digits: int = 4, pct: bool = False) -> str:
    if a is None or b is None:
        return "—"
    d = b - a
    text = f"{d:+.{digits}f}"
    if pct and a:
        text += f" ({100 * d / a:+.1f}%)"
    return text


def render(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"picompile eval {result['artifact']} (context {result['context']}, "
                        f"predictor {result['predictor']})")
    for col, just in (("metric", "left"), ("dense", "right"), ("sparse", "right"), ("delta", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    d, s = result["dense"], result["sparse"]
    if "ppl" in d:
        table.add_row(f"perplexity ({d['tokens']} tokens)", _fmt(d["ppl"]), _fmt(s["ppl"]), _delta(d["ppl"], s["ppl"], pct=True))
        table.add_row("NLL (nats/token)", _fmt(d["nll"]), _fmt(s["nll"]), _delta(d["nll"], s["nll"]))
    for name, t in result["tasks"].items():
        table.add_row(f"{name} acc (n={t['n']})", _fmt(t["dense"]["acc"]), _fmt(t["sparse"]["acc"]),
                      _delta(t["dense"]["acc"], t["sparse"]["acc"]))
        table.add_row(f"{name} acc_norm", _fmt(t["dense"]["acc_norm"]), _fmt(t["sparse"]["acc_norm"]),
                      _delta(t["dense"]["acc_norm"], t["sparse"]["acc_norm"]))
        table.add_row(f"{name} same choice", "", _fmt(t["agreement"]), "")
    table.add_row(f"skipped FFN neurons ({result['skipped_fraction_source']})", _fmt(0.0), _fmt(result["skipped_fraction"]),
                  _delta(0.0, result["skipped_fraction"]))
    table.add_row("skipped FFN neurons (manifest estimate)", "", _fmt(result["skipped_fraction_manifest"]), "")
    o = result.get("ort_dense")
    if o and "ppl" in o:  # the dense reference in ONNX Runtime; delta = sparse against it
        table.add_row("perplexity, ONNX Runtime dense", _fmt(o["ppl"]), _fmt(s["ppl"]), _delta(o["ppl"], s["ppl"], pct=True))
    for name, t in (o or {}).get("tasks", {}).items():
        table.add_row(f"{name} acc, ONNX Runtime dense", _fmt(t["acc"]), _fmt(result["tasks"][name]["sparse"]["acc"]),
                      _delta(t["acc"], result["tasks"][name]["sparse"]["acc"]))
    console.print(table)
    sw = result.get("sweep")
    if sw:
        t2 = Table(title=f"trade-off: rebuilt at several {sw['knob']} values (dense ppl "
                         f"{_fmt(d.get('ppl'))})")
        t2.add_column(sw["knob"], justify="right")
        t2.add_column("skipped (measured)", justify="right")
        if "ppl" in d:
            t2.add_column("sparse ppl", justify="right")
            t2.add_column("Δ ppl", justify="right")
        names = list(result["tasks"])
        for n in names:
            t2.add_column(f"{n} acc", justify="right")
        for p in sw["points"]:
            row = [f"{p[sw['knob']]:g}", _fmt(p["skipped_fraction"])]
            if "ppl" in d:
                row += [_fmt(p.get("ppl")), _delta(d["ppl"], p.get("ppl"), pct=True)]
            row += [_fmt(p["tasks"][n]["acc"]) for n in names]
            t2.add_row(*row)
        console.print(t2)


__all__ = [
    "Example", "Inputs", "Scorer", "Task", "continuation_loglik", "encode_request", "evaluate",
    "encode_prefix", "manifest_skipped", "prepare", "prepare_for", "read_eval_tokens", "read_task", "rebuild_options",
    "run_one", "score_task",
    "sliding_nll", "sweep", "sweep_plan", "windows",
]

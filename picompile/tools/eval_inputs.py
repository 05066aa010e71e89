"""``picompile eval``'s inputs: evaluation text or token files, zero-shot task files, read and tokenized once.

- perplexity files: a token file (.npy / .json list of ids), or text encoded with the artifact's tokenizer
  (documents split at "<|endoftext|>" encoded one by one, each with BOS); :func:`windows` cuts them into
  the sliding windows the scorer runs.
- task files in the shared jsonl formats: ``{query, choices, gold}`` (piqa/arc/copa), winogrande's
  ``{context_options, continuation, gold}`` (partial scoring), RTE's ``{premise, hypothesis, label}``;
  each choice is a (context, continuation) request, encoded as lm-eval-harness splits it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from picompile.errors import PicompileError

TOKEN_SUFFIXES: tuple[str, ...] = (".npy", ".json")
DOC_SEPARATOR = "<|endoftext|>"  # TinyStories-style document separator: documents are encoded one by one with BOS

Encoded = list[list[tuple[list[int], list[int]]]]  # per example, per choice: (context ids, continuation ids)


# ----------------------------------------------------------------------------- perplexity files


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


# ----------------------------------------------------------------------------- task files


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


# ----------------------------------------------------------------------------- all inputs


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

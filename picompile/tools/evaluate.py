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
- ``bytes_skipped_fraction`` is measured too: every mask the run computes (neuron masks and input sparsity's
  ``picompile::input_mask``), each inactive entry weighed by the weight bytes it leaves unread, per token, over the
  bytes of the transformer blocks' projections (q, k, v, o, FFN; embeddings and lm_head are not counted).
- ``cats=True`` (``--cats``): CATS rebuilt from the artifact's source at the neuron sparsity that skips the same
  bytes as the artifact did (measured above), scored on the same inputs in the same run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from picompile.tools.eval_inputs import Inputs, prepare
from picompile.tools.eval_scoring import Advance, OrtScorer, no_progress, manifest_skipped, run_one
from picompile.tools.eval_sweep import cats_same_bytes, rebuild_options, sweep, sweep_plan


def evaluate(artifact: str | Path, ppl: str | Path | None = None, tasks: Sequence[str | Path] = (),
             limit: int | None = None, *, stride: int | None = None, max_tokens: int | None = None,
             tokenizer: Any | None = None, verify: bool = True, do_sweep: bool = False,
             sweep_values: Sequence[float] | None = None, vs_ort: bool = False, cats: bool = False,
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
    if do_sweep or cats:
        rebuild_options(manifest)
    sparse = picompile.load(artifact, verify=False)
    dense = picompile.load(artifact, verify=False, dense=True)
    advance = progress("dense", n) if progress else no_progress
    d = run_one(dense, inputs, stride, advance)
    advance = progress("sparse", n) if progress else no_progress
    s = run_one(sparse, inputs, stride, advance)
    result = assemble(artifact, sparse, inputs, d, s, stride)
    if vs_ort:
        advance = progress("onnxruntime dense", n) if progress else no_progress
        result["ort_dense"] = ort_dense(artifact, sparse, inputs, stride, advance)
    if cats and result["bytes_skipped_fraction"]:
        result["cats"] = cats_same_bytes(artifact, inputs, result["bytes_skipped_fraction"], stride=stride,
                                         progress=progress)
    if do_sweep:
        result["sweep"] = sweep(artifact, inputs, sweep_values, stride=stride, progress=progress)
    return result


def ort_dense(artifact: str | Path, session: Any, inputs: Inputs, stride: int | None, advance: Advance) -> dict[str, Any]:
    """The dense source model in ONNX Runtime over the same inputs (``--vs ort``): ppl, nll, tokens, task accuracy."""
    from picompile.tools.ort_reference import for_artifact

    ort = OrtScorer(for_artifact(Path(artifact)), session.max_seq_len, session.vocab_size)
    o = run_one(session, inputs, stride, advance, scorer=ort)
    out = {k: o[k] for k in ("ppl", "nll", "tokens") if k in o}
    out["tasks"] = {name: {"acc": t["acc"], "acc_norm": t["acc_norm"]} for name, t in o["tasks"].items()}
    return out


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
        "bytes_skipped_fraction": s["bytes_skipped_fraction"],
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


# ----------------------------------------------------------------------------- printing


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
    """The result as tables: dense against sparse (and ONNX Runtime), then the sweep's trade-off."""
    console.print(_main_table(result))
    if result.get("sweep"):
        console.print(_sweep_table(result))


def _main_table(result: dict[str, Any]) -> Any:
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
    if result.get("bytes_skipped_fraction") is not None:
        table.add_row("weight bytes skipped per token (measured)", _fmt(0.0), _fmt(result["bytes_skipped_fraction"]),
                      _delta(0.0, result["bytes_skipped_fraction"]))
    c = result.get("cats")
    if c:  # CATS at the same bytes; delta = CATS against dense
        label = f"CATS at {c['act_sparsity']:.3f} neurons, bytes {_fmt(c['bytes_skipped_fraction'])}"
        if "ppl" in c:
            table.add_row(f"perplexity, {label}", _fmt(d.get("ppl")), _fmt(c["ppl"]), _delta(d.get("ppl"), c["ppl"], pct=True))
        for name, t in c["tasks"].items():
            table.add_row(f"{name} acc, CATS", _fmt(result["tasks"][name]["dense"]["acc"]), _fmt(t["acc"]),
                          _delta(result["tasks"][name]["dense"]["acc"], t["acc"]))
    o = result.get("ort_dense")
    if o and "ppl" in o:  # the dense reference in ONNX Runtime; delta = sparse against it
        table.add_row("perplexity, ONNX Runtime dense", _fmt(o["ppl"]), _fmt(s["ppl"]), _delta(o["ppl"], s["ppl"], pct=True))
    for name, t in (o or {}).get("tasks", {}).items():
        table.add_row(f"{name} acc, ONNX Runtime dense", _fmt(t["acc"]), _fmt(result["tasks"][name]["sparse"]["acc"]),
                      _delta(t["acc"], result["tasks"][name]["sparse"]["acc"]))
    return table


def _sweep_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    sw, d = result["sweep"], result["dense"]
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
    return t2

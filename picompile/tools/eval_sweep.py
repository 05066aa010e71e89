"""``picompile eval --sweep``: the artifact's model rebuilt at several recall targets (ReLU FFNs) or
act_sparsity values (other FFNs), each sparse build evaluated on the same inputs."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from picompile.errors import PicompileError
from picompile.tools.eval_inputs import Inputs
from picompile.tools.eval_scoring import Advance, no_progress, manifest_skipped, run_one

RELU_SWEEP: tuple[float, ...] = (0.9, 0.95, 0.99, 0.999)  # recall targets
ACT_SWEEP: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7)  # act_sparsity values (non-ReLU FFNs)


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
    if corpus.get("kind") in ("text", "tokens", "sampled"):  # sampled: the ids cached per model (a token file)
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
            advance = progress(f"{knob}={v:g}", inputs.n_calls(session.max_seq_len, stride)) if progress else no_progress
            r = run_one(session, inputs, stride, advance)
            points.append({knob: v, "skipped_fraction": r["skipped_fraction"],
                           "skipped_fraction_manifest": manifest_skipped(session.manifest),
                           **{k: r[k] for k in ("ppl", "nll") if k in r},
                           "tasks": {k: {"acc": t["acc"], "acc_norm": t["acc_norm"]} for k, t in r["tasks"].items()}})
    return {"knob": knob, "points": points,
            "options": {k: str(v) if isinstance(v, Path) else v for k, v in opts.items()}}


MAX_CATS_SPARSITY = 0.95  # CATS thresholds beyond this leave too few neurons to mean anything


def cats_sparsity(manifest: Any, bytes_fraction: float) -> float:
    """The CATS neuron sparsity that skips ``bytes_fraction`` of the blocks' projection bytes: an inactive neuron
    saves its up and down rows (2 of the 3 rows of a gated FFN; its gate row is read to decide)."""
    from picompile.tools.eval_scoring import block_weight_bytes

    total = block_weight_bytes(manifest)
    item = total / max(1.0, _block_elements(manifest))
    saved_per_unit = sum(2 * int(layer["d_model"]) * int(layer["n_neurons"]) for layer in manifest.layers) * item
    return min(MAX_CATS_SPARSITY, bytes_fraction * total / max(saved_per_unit, 1.0))


def _block_elements(manifest: Any) -> float:
    m, cfg = manifest.model, manifest.model.get("config") or {}
    d, hd, kv = int(m["d_model"]), int(m["head_dim"]), int(m["n_kv_heads"])
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or d // hd)
    ffn = sum((3 if l.get("kind") == "gated" else 2) * int(l["d_model"]) * int(l["n_neurons"]) for l in manifest.layers)
    return float((d * heads * hd * 2 + 2 * d * kv * hd) * int(m["n_layers"]) + ffn)


def cats_same_bytes(artifact: str | Path, inputs: Inputs, bytes_fraction: float, *, stride: int | None = None,
                    progress: Callable[[str, int], Advance] | None = None) -> dict[str, Any]:
    """CATS (|act(gate x)| thresholds, uniform over layers, oracle masks) rebuilt from the artifact's source with the
    same calibration, at the neuron sparsity that skips the bytes the artifact's input sparsity skipped: its ppl, task
    accuracy and its own measured bytes skipped."""
    import picompile
    from picompile.formats.artifact import read_manifest

    manifest = read_manifest(Path(artifact), verify=False)
    if any(layer.get("act") == "relu" for layer in manifest.layers):
        raise PicompileError("CATS applies to SiLU/GELU FFNs; this artifact has ReLU FFNs")
    s = cats_sparsity(manifest, bytes_fraction)
    opts = {**rebuild_options(manifest), "pipeline": "reference", "predictor": "oracle", "act_criterion": "gate",
            "sparsity_allocation": "uniform", "act_sparsity": s, "input_sparsity": "off"}
    with tempfile.TemporaryDirectory(prefix="picompile-cats-") as tmp:
        if progress:
            progress(f"building CATS at {s:.3f}", 0)
        out = picompile.build(**opts, output=Path(tmp) / "cats.pic", emit=lambda s: None)
        session = picompile.load(out, verify=False)
        advance = progress("CATS", inputs.n_calls(session.max_seq_len, stride)) if progress else no_progress
        r = run_one(session, inputs, stride, advance)
    return {"act_sparsity": s, "bytes_skipped_fraction": r["bytes_skipped_fraction"],
            "skipped_fraction": r["skipped_fraction"], **{k: r[k] for k in ("ppl", "nll") if k in r},
            "tasks": {k: {"acc": t["acc"], "acc_norm": t["acc_norm"]} for k, t in r["tasks"].items()}}

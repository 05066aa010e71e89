"""``picompile inspect``: a readable (or JSON) summary of an artifact, from its manifest."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from picompile.formats.artifact import Manifest, read_manifest
from picompile.errors import ArtifactError, PicompileError
from picompile.sparsity.profile_stats import LayerProfile, summarize

# per-layer keys later passes add to the manifest's layer objects, shown when present
LAYER_COLUMNS: list[str] = ["n_hot", "n_cold", "predictor_kind", "predictor_rank", "recall", "predicted_active", "sparsity"]


def summary_json(root: Path, m: Manifest) -> dict[str, Any]:
    from picompile.formats.artifact import content_hash

    return {
        "artifact": str(root),
        "format": m.format,
        "format_version": m.format_version,
        "picompile_version": m.picompile_version,
        "created": m.created,
        "content_hash": content_hash(root),  # sha256 of the manifest without "created": equal for equal builds
        "model": {k: v for k, v in m.model.items() if k != "config"},
        "target": m.target,
        "build": m.build,
        "pipeline": m.pipeline,
        "graph": {k: v for k, v in m.graph.items() if k != "weights"} | {"n_weights": len(m.graph.get("weights", []))},
        "tokenizer": m.tokenizer,
        "layers": m.layers,
        "files": m.files,
        **({"measured": m.measured} if m.measured else {}),
        **m.sections,
    }


def measured_line(root: Path) -> str:
    """"memory   peak RSS 4.20 GiB (estimated 5.0 GiB), build 95.0 s": what the build measured, or ""."""
    from picompile.formats.artifact import read_manifest_json

    try:
        measured = read_manifest_json(Path(root)).get("measured")
    except (ArtifactError, OSError):
        return ""
    if not isinstance(measured, dict):
        return ""
    num = {k: v for k, v in measured.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
           and 0 <= v < 2**62}
    if "peak_rss_bytes" not in num:
        return ""
    text = f"memory   peak RSS {num['peak_rss_bytes'] / 2**30:.2f} GiB"
    if "estimated_peak_bytes" in num:
        text += f" (estimated {num['estimated_peak_bytes'] / 2**30:.1f} GiB)"
    if "build_seconds" in num:
        text += f", build {num['build_seconds']:.1f} s"
    return text


def passes_line(root: Path) -> str:
    """"load 3.1 s (cpu 2.9 s) 1.20 GiB, capture 2.0 s (cpu 1.8 s) 1.31 GiB, …": each build phase's wall time,
    this process's CPU time in it and its peak RSS, or ""."""
    from picompile.formats.artifact import read_manifest_json

    try:
        measured = read_manifest_json(Path(root)).get("measured")
    except (ArtifactError, OSError):
        return ""
    passes = measured.get("passes") if isinstance(measured, dict) else None
    if not isinstance(passes, dict):
        return ""
    parts = []
    for name, row in list(passes.items())[:64]:
        if not isinstance(row, dict):
            continue
        sec, cpu, peak = row.get("seconds"), row.get("cpu_seconds"), row.get("peak_rss_bytes")
        if isinstance(sec, (int, float)) and isinstance(peak, (int, float)) and 0 <= peak < 2**62:
            on_cpu = f" (cpu {cpu:.1f} s)" if isinstance(cpu, (int, float)) else ""
            parts.append(f"{str(name)[:40]} {sec:.1f} s{on_cpu} {peak / 2**30:.2f} GiB")
    return "passes   " + ", ".join(parts) if parts else ""


def load_profiles(root: Path, m: Manifest) -> list[LayerProfile]:
    """The activation profile the build recorded, one LayerProfile per FFN layer."""
    section = m.sections.get("profile")
    if not section:
        raise ArtifactError(f"{root} has no activation profile (built with a pipeline without profile-activations)")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from picompile.formats.paths import listed

    path = listed(root, section.get("file"), m.files, "sections.profile.file")
    try:
        data = load_file(str(path))
        n_tokens = int(data["n_tokens"][0])
        return [LayerProfile(counts=data[f"layer{layer['index']}.counts"], n_tokens=n_tokens, name=layer["module"])
                for layer in m.layers]
    except (SafetensorError, OSError, KeyError, IndexError, ValueError, TypeError) as e:
        raise ArtifactError(f"cannot read the profile {path.name}: {type(e).__name__}: {str(e)[:120]}") from None


def plot_profiles(profiles: list[LayerProfile], path: Path, title: str) -> None:
    """Per-layer activation frequency against neuron rank, and the cumulative share of activations."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PicompileError("--plot needs matplotlib: pip install 'picompile[plot]'") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    for i, prof in enumerate(profiles):
        freq = np.sort(prof.frequency)[::-1]  # [n_neurons] descending
        x = np.arange(1, freq.size + 1) / freq.size
        color = cmap(i / max(len(profiles) - 1, 1))
        ax1.plot(x, freq, color=color, label=f"layer {i}")
        total = freq.sum()
        ax2.plot(x, np.cumsum(freq) / total if total > 0 else np.zeros_like(freq), color=color)
    ax1.set(xlabel="neurons, most frequent first (fraction)", ylabel="activation frequency", yscale="log",
            title="activation frequency per neuron")
    ax2.axhline(0.8, color="grey", lw=0.8, ls="--")
    ax2.set(xlabel="neurons, most frequent first (fraction)", ylabel="share of all activations",
            title="cumulative share (locality)")
    ax1.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def inspect_artifact(root: Path, as_json: bool = False, graph: bool = False, verify: bool = True,
                     profile: bool = False, plot: Path | None = None, export_onnx: Path | None = None,
                     dot: Path | None = None, load: dict[str, Any] | None = None) -> int:
    """Summarise the artifact at ``root``. ``load``: ``picompile.load``'s keyword arguments (print_after,
    dump_ir, emit, hybrid, …) to load it as the runtime does and show its load steps' graphs."""
    m = read_manifest(root, verify=verify)
    loaded = load_steps_of(root, load) if load is not None else None  # a bad step name fails before any output
    profiles = load_profiles(root, m) if profile or plot else []
    if plot is not None:
        plot_profiles(profiles, plot, f"{m.model['architecture']} from {Path(m.model['source']).name}: "
                      f"{m.sections['profile']['n_tokens']} calibration tokens")
    if export_onnx is not None or dot is not None:
        from picompile.tools.graph_export import export_graph_dot, export_graph_onnx

        if export_onnx is not None:
            export_graph_onnx(root, export_onnx, verify=False)
        if dot is not None:
            export_graph_dot(root, dot, verify=False)
    if as_json:
        out = summary_json(root, m)
        if profile:
            out["profile_summary"] = summarize(profiles)
        if loaded is not None:
            out["load_steps"] = loaded[0]
            _emit_all(load, loaded[1])
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    model = m.model
    console.print(f"[bold]{root}[/bold]  {m.format} v{m.format_version} (picompile {m.picompile_version}, {m.created})")
    console.print(f"model    {model['architecture']} ({model['family']}) from {model['source']}: "
                  f"{model['n_layers']} layers, d_model {model['d_model']}, vocab {model['vocab_size']}, "
                  f"context {m.build.get('max_seq_len')}")
    console.print(f"target   {m.target['name']}: {m.target.get('description', '')}")
    if line := measured_line(root):
        console.print(line)
    if line := passes_line(root):
        console.print(line)
    console.print(f"pipeline {' → '.join(m.pipeline)}")
    console.print(f"graph    {m.graph['file']}: inputs input_ids + {m.graph['n_past']} KV tensors, "
                  f"{len(m.graph['weights'])} weight tensors")
    console.print(f"tokenizer {m.tokenizer['kind'] if m.tokenizer else 'none'}")
    console.print(f"weights  {weights_line(m.weights)}")
    extra = [c for c in LAYER_COLUMNS if any(c in layer for layer in m.layers)]
    t = Table(title="FFN layers", title_justify="left")
    for col in ["layer", "kind", "act", "d_model", "neurons", *extra]:
        t.add_column(col, justify="right")
    for layer in m.layers:
        cells = [str(layer["index"]), layer["kind"], layer["act"], str(layer["d_model"]), str(layer["n_neurons"])]
        cells += [_fmt(layer.get(c)) for c in extra]
        t.add_row(*cells)
    console.print(t)
    f = Table(title="files", title_justify="left")
    for col in ["file", "bytes", "sha256"]:
        f.add_column(col, justify="right" if col == "bytes" else "left")
    for name, meta in m.files.items():
        f.add_row(name, f"{meta['bytes']:,}", meta["sha256"][:16] + "…")
    console.print(f)
    if profiles:
        p = Table(title=f"activation profile ({m.sections['profile']['active']}; corpus: "
                        f"{m.sections['profile']['corpus']['source']}, {m.sections['profile']['n_tokens']} tokens)",
                  title_justify="left")
        for col in ["layer", "sparsity", "active/token", "locality 80%", "locality 50%", "dead"]:
            p.add_column(col, justify="right")
        for row in summarize(profiles):
            p.add_row(str(row["layer"]), f"{row['sparsity']:.3f}", f"{row['mean_active']:.1f}",
                      f"{row['locality']:.3f}", f"{row['locality_50']:.3f}", f"{row['dead_fraction']:.3f}")
        console.print(p)
        console.print("locality = fraction of neurons that carries that share of all activations "
                      "(PowerInfer: 26% carry 80% in OPT-30B)")
    if plot is not None:
        console.print(f"wrote {plot}")
    for path in (export_onnx, dot):
        if path is not None:
            console.print(f"wrote {path}")
    if loaded is not None:  # the load's own prints (and dumps) show the graph after its steps
        console.print(f"load     {' → '.join(loaded[0])}")
        _emit_all(load, loaded[1])
    elif graph:
        from picompile.ir.graph import format_graph
        from picompile.runtime.loader import load_graph

        print(format_graph(load_graph(root, m)))
    return 0


def weights_line(w: dict[str, Any]) -> str:
    """The weights' format (block, quantized tensors, fallbacks) and the bytes one decode token reads by format."""
    fmt = str(w.get("dtype", "float32"))
    if "block" in w:
        fmt += f" (blocks of {w['block']}, float16 scales; {len(w.get('quantized', {}))} quantized tensors)"
    per_token = w.get("bytes_per_token") or {}
    if not per_token:
        return fmt
    parts = ", ".join(f"{k} {_size(v)}" for k, v in sorted(per_token.items(), key=lambda kv: -kv[1]))
    return f"{fmt}; read per decode token {_size(sum(per_token.values()))}: {parts}"


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def load_steps_of(root: Path, load: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Load ``root`` as the runtime does, with ``load`` (``picompile.load``'s keyword arguments: print_after,
    dump_ir, hybrid, …): the load's steps, and the graph texts its print_after asked for (held back, so that
    they follow the summary)."""
    from picompile.runtime import load as load_artifact

    texts: list[str] = []
    session = load_artifact(root, verify=False, **{**load, "emit": texts.append})
    return session.load_steps, texts


def _emit_all(load: dict[str, Any] | None, texts: list[str]) -> None:
    emit = (load or {}).get("emit") or print
    for text in texts:
        emit(text)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)

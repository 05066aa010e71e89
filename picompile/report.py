"""``picompile inspect``: a readable (or JSON) summary of an artifact, from its manifest."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from picompile.artifact import Manifest, read_manifest

# per-layer keys later passes add to the manifest's layer objects, shown when present
LAYER_COLUMNS: list[str] = ["n_hot", "n_cold", "predictor_rank", "recall", "sparsity"]


def summary_json(root: Path, m: Manifest) -> dict[str, Any]:
    return {
        "artifact": str(root),
        "format": m.format,
        "format_version": m.format_version,
        "picompile_version": m.picompile_version,
        "created": m.created,
        "model": {k: v for k, v in m.model.items() if k != "config"},
        "target": m.target,
        "build": m.build,
        "pipeline": m.pipeline,
        "graph": {k: v for k, v in m.graph.items() if k != "weights"} | {"n_weights": len(m.graph.get("weights", []))},
        "tokenizer": m.tokenizer,
        "layers": m.layers,
        "files": m.files,
        **m.sections,
    }


def inspect_artifact(root: Path, as_json: bool = False, graph: bool = False, verify: bool = True) -> int:
    m = read_manifest(root, verify=verify)
    if as_json:
        print(json.dumps(summary_json(root, m), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    model = m.model
    console.print(f"[bold]{root}[/bold]  {m.format} v{m.format_version} (picompile {m.picompile_version}, {m.created})")
    console.print(f"model    {model['architecture']} ({model['family']}) from {model['source']}: "
                  f"{model['n_layers']} layers, d_model {model['d_model']}, vocab {model['vocab_size']}, "
                  f"context {m.build.get('max_seq_len')}")
    console.print(f"target   {m.target['name']}: {m.target.get('description', '')}")
    console.print(f"pipeline {' → '.join(m.pipeline)}")
    console.print(f"graph    {m.graph['file']}: inputs input_ids + {m.graph['n_past']} KV tensors, "
                  f"{len(m.graph['weights'])} weight tensors")
    console.print(f"tokenizer {m.tokenizer['kind'] if m.tokenizer else 'none'}")
    extra = [c for c in LAYER_COLUMNS if any(c in layer for layer in m.layers)]
    t = Table(title="FFN layers (one picompile.ffn op each)", title_justify="left")
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
    if graph:
        from picompile.graph import format_graph
        from picompile.runtime.loader import load_graph

        print(format_graph(load_graph(root, m)))
    return 0


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)

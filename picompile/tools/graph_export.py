"""``picompile inspect --export-onnx / --dot``: an artifact's transformed graph, read from the artifact and
written as ONNX or Graphviz DOT by :mod:`picompile.formats.onnx_export` (which converts a given graph)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from torch import fx

from picompile.formats.onnx_export import graph_dot, graph_to_onnx, require_onnxscript


def _load(root: Path, verify: bool) -> tuple[Any, fx.GraphModule]:
    """The artifact's manifest and its graph as the runtime loads it (weights bound)."""
    from picompile.formats.artifact import read_manifest
    from picompile.runtime.loader import load_graph

    manifest = read_manifest(root, verify=verify)
    return manifest, load_graph(root, manifest)


def export_graph_onnx(root: Path, out: Path, verify: bool = True, external_data: Optional[bool] = None) -> None:
    """Write the artifact's transformed decoder-step graph to ``out`` as ONNX (see :mod:`picompile.formats.onnx_export`).

    ``external_data``: weights in ``OUT.data`` beside the model (None: only when over 2 GB).
    """
    require_onnxscript()  # before the graph is loaded
    root = Path(root)
    manifest, gm = _load(root, verify)
    graph_to_onnx(gm, manifest, Path(out), artifact=root, external_data=external_data)


def export_graph_dot(root: Path, out: Path, collapse: bool = True, verify: bool = True) -> None:
    """Write the artifact's transformed graph as Graphviz DOT (``dot -Tsvg FILE``); see ``graph_dot``."""
    root, out = Path(root), Path(out)
    manifest, gm = _load(root, verify)
    title = f"{root.name}: {manifest.model['architecture']} for {manifest.target['name']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(graph_dot(gm, title, collapse=collapse))

"""Model facts of an ONNX decoder step (``n_layers``, ``d_model``, ``vocab``, ``max_seq_len``): read from
the graph, checked against / completed by a ``config.json`` beside the file (see the package doc)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.onnx.proto import dims_of, scope_of
from picompile.frontend.onnx.signature import Signature
from picompile.frontend.onnx.values import FLOAT_TYPES

DEFAULT_MAX_SEQ_LEN: int = 2048  # when neither config.json, metadata nor a position table says

_PASS_THROUGH = ("Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten", "Expand")


@dataclass
class Facts:
    n_layers: int
    d_model: int
    vocab: int
    max_seq_len: int
    sources: dict[str, str] = field(default_factory=dict)  # fact -> where it was read


def read_config(path: Path) -> tuple[dict[str, Any], Optional[Path]]:
    """(the HF config.json beside ``path``, its path); ({}, None) when there is none."""
    from picompile.frontend.hf import read_config as read_hf_config

    cfg = path.parent / "config.json"
    if not cfg.is_file():
        return {}, None
    return read_hf_config(cfg), cfg


def _trace_to(graph: Any, name: str, target: str) -> bool:
    """Whether ``name`` is ``target`` through single-input reshaping ops."""
    producers = {o: n for n in graph.node for o in n.output}
    for _ in range(8):
        if name == target:
            return True
        n = producers.get(name)
        if n is None or n.op_type not in _PASS_THROUGH:
            return False
        name = n.input[0]
    return False


def _tables(graph: Any, ids: str) -> tuple[Any, Any]:
    """(token embedding, position table): 2-D float initializers ``Gather``-ed, the first by the token ids."""
    inits = {t.name: t for t in graph.initializer}
    table_gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
                     and len(inits[n.input[0]].dims) == 2 and inits[n.input[0]].data_type in FLOAT_TYPES]
    emb = next((inits[n.input[0]] for n in table_gathers if _trace_to(graph, n.input[1], ids)), None)
    pos_table = next((inits[n.input[0]] for n in table_gathers
                      if emb is None or n.input[0] != emb.name), None)
    return emb, pos_table


class _Picker:
    """Each fact from the graph (checked against config.json) else from config.json; records the source."""

    def __init__(self, cfg: dict[str, Any], cfg_file: Optional[Path], where: str) -> None:
        self.cfg, self.cfg_file, self.where = cfg, cfg_file, where
        self.sources: dict[str, str] = {}

    def __call__(self, key: str, graph_value: Optional[int], graph_src: str) -> Optional[int]:
        c = self.cfg.get(key)
        if graph_value is not None:
            if isinstance(c, int) and c != graph_value:
                raise ModelLoadError(
                    f"{self.cfg_file} does not describe {self.where}: its {key} is {c}, the graph's is {graph_value}")
            self.sources[key] = graph_src
            return graph_value
        if isinstance(c, int):
            self.sources[key] = "config.json"
            return c
        return None


def _graph_layers(graph: Any, sig: Signature, cfg: dict[str, Any]) -> tuple[Optional[int], str]:
    """(n_layers the graph says, from where): past inputs / 2, else (logits-only) ``layers.N`` / ``h.N`` names."""
    if sig.past:
        return len(sig.past) // 2, "KV-cache inputs"
    if "num_hidden_layers" in cfg:
        return None, "KV-cache inputs"
    found = set()
    for n in graph.node:
        for text in (scope_of(n), *n.input):
            m = re.search(r"\blayers[./](\d+)\b|\bh[./](\d+)\b", text)
            if m:
                found.add(int(m.group(1) or m.group(2)))
    if found and found == set(range(len(found))):
        return len(found), "layer names"
    return None, "KV-cache inputs"


def _max_seq_len(model: Any, cfg: dict[str, Any], pos_table: Any, sources: dict[str, str]) -> int:
    """config.json, else ONNX metadata, else a learned position table (rows - 2), else the default."""
    meta = {p.key: p.value for p in model.metadata_props}
    if isinstance(cfg.get("max_position_embeddings"), int):
        max_seq, sources["max_seq_len"] = int(cfg["max_position_embeddings"]), "config.json"
    elif any(k in meta for k in ("max_position_embeddings", "max_seq_len")):
        max_seq = int(meta.get("max_position_embeddings") or meta["max_seq_len"])
        sources["max_seq_len"] = "ONNX metadata"
    elif pos_table is not None and int(pos_table.dims[0]) > 2:
        max_seq, sources["max_seq_len"] = int(pos_table.dims[0]) - 2, "position table rows - 2"
    else:
        max_seq, sources["max_seq_len"] = DEFAULT_MAX_SEQ_LEN, "default"
    return max_seq


def read_facts(model: Any, sig: Signature, cfg: dict[str, Any], cfg_file: Optional[Path], where: str) -> Facts:
    """The model facts of ``model`` (an onnx ModelProto with signature ``sig``)."""
    graph = model.graph
    emb, pos_table = _tables(graph, sig.ids)
    pick = _Picker(cfg, cfg_file, where)
    logits_dims = next(dims_of(o) for o in graph.output if o.name == sig.logits)
    vocab_graph = logits_dims[2] if isinstance(logits_dims[2], int) and logits_dims[2] > 0 else (
        int(emb.dims[0]) if emb is not None else None)
    vocab = pick("vocab_size", vocab_graph, "logits shape")
    d_model = pick("hidden_size", int(emb.dims[1]) if emb is not None else None, "token embedding")
    n_layers = pick("num_hidden_layers", *_graph_layers(graph, sig, cfg))
    for key, value in (("vocab_size", vocab), ("hidden_size", d_model), ("num_hidden_layers", n_layers)):
        if value is None:
            raise UnsupportedArchitectureError(
                f"{where}: cannot tell the model's {key} from the graph; put its config.json beside the .onnx file")
    max_seq = _max_seq_len(model, cfg, pos_table, pick.sources)
    return Facts(int(n_layers), int(d_model), int(vocab), max_seq, pick.sources)  # type: ignore[arg-type]

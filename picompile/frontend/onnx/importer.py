"""The ONNX frontend's entry point, :func:`load_onnx`: read and check the file (supported ops, values
defined before use), detect the decoder-step signature, read the model facts, build the
:class:`~picompile.frontend.onnx.decoder.OnnxDecoder` and its :class:`~picompile.frontend.base.ModelInfo`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.base import ModelInfo
from picompile.frontend.onnx.decoder import OnnxDecoder
from picompile.frontend.onnx.facts import Facts, read_config, read_facts
from picompile.frontend.onnx.ops import SUPPORTED_OPS
from picompile.frontend.onnx.signature import Signature, signature


def _read_model(path: Path) -> Any:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as e:  # protobuf DecodeError, missing external data, …
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ModelLoadError(f"corrupt or truncated ONNX file {path}: {type(e).__name__}: {msg}") from None
    if not model.graph.node:
        raise ModelLoadError(f"corrupt or truncated ONNX file {path}: it holds no graph")
    return model


def _check_ops(graph: Any, where: str) -> None:
    """Every node's op is supported; the others are listed all at once, with their counts."""
    bad: dict[str, int] = {}
    for n in graph.node:
        key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        if key not in SUPPORTED_OPS:
            bad[key] = bad.get(key, 0) + 1
    if bad:
        raise UnsupportedArchitectureError(
            f"{where}: ONNX op(s) {', '.join(f'{k} (×{v})' for k, v in sorted(bad.items()))} are not supported by "
            f"picompile's ONNX importer; it supports {', '.join(SUPPORTED_OPS)}")


def _check_defined(graph: Any, where: str) -> None:
    """Every node reads values defined before it, and every graph output is computed."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for n in graph.node:
        for name in n.input:
            if name not in defined:
                raise ModelLoadError(
                    f"{where}: node {n.name or n.op_type} reads {name!r}, which nothing before it defines "
                    f"(a truncated or corrupt file, or nodes out of order)")
        defined.update(n.output)
    missing = [o.name for o in graph.output if o.name not in defined]
    if missing:
        raise ModelLoadError(f"{where}: graph output(s) {', '.join(missing)} are never computed (truncated or corrupt file?)")


def _extra(model: Any, path: Path, opset: int, sig: Signature, facts: Facts,
           cfg_file: Optional[Path]) -> dict[str, Any]:
    """``ModelInfo.extra``: what was imported, from which file, with which cache convention."""
    return {"onnx": {
        "file": path.name, "opset": opset, "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "kv_cache": "token-history" if not sig.past else "inputs",
        "inputs": [sig.ids, *([sig.attention_mask] if sig.attention_mask else []),
                   *([sig.position_ids] if sig.position_ids else []), *sig.past],
        "outputs": [sig.logits, *sig.presents], "facts_from": facts.sources,
        "config_json": cfg_file is not None,
    }}


def load_onnx(path: str | Path) -> tuple[OnnxDecoder, ModelInfo]:
    """Import an ONNX decoder step (see the package doc): (module for capture, ModelInfo)."""
    from picompile.frontend.hf import SUPPORTED_ARCHITECTURES

    path = Path(path)
    where = str(path)
    model = _read_model(path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    _check_ops(model.graph, where)
    _check_defined(model.graph, where)
    sig = signature(model.graph, where)
    cfg, cfg_file = read_config(path)
    facts = read_facts(model, sig, cfg, cfg_file, where)
    if sig.past and len(sig.past) != 2 * facts.n_layers:
        raise ModelLoadError(f"{where}: {len(sig.past)} KV-cache inputs for {facts.n_layers} layers")
    module = OnnxDecoder(model.graph, sig, facts.n_layers, opset).eval()
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if archs else "OnnxDecoder"
    tok = path.parent / "tokenizer.json"
    extra = _extra(model, path, opset, sig, facts, cfg_file)
    del model
    info = ModelInfo(
        architecture=arch,
        family=SUPPORTED_ARCHITECTURES.get(arch, "onnx"),
        source=where,
        source_format="onnx",
        config=cfg,
        n_layers=facts.n_layers,
        d_model=facts.d_model,
        vocab_size=facts.vocab,
        max_seq_len=facts.max_seq_len,
        n_kv_heads=sig.kv_heads,
        head_dim=sig.head_dim,
        tokenizer={"kind": "hf", "path": str(path.parent)} if tok.is_file() else None,
        extra=extra,
    )
    return module, info

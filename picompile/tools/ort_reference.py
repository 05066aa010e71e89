"""A dense onnxruntime reference of the SOURCE model: what ``eval`` / ``bench --vs ort`` compare against.

The model an artifact was built from (``manifest.model["source"]``: an HF checkpoint directory or a
llama2.c ``.bin``) is loaded in float32, wrapped in :class:`picompile.frontend.decoder.FlatDecoder`
and exported once with torch.onnx (dynamo) to an ONNX model with the artifact's flat KV-cache
signature::

    input_ids [1, seq] int64, past_0 … past_{2L-1} [1, kv_heads, past, head_dim] float32
      -> logits [1, seq, vocab], present_0 … present_{2L-1} [1, kv_heads, past + seq, head_dim]

``seq`` and ``past`` are symbolic (prefill: past 0). The export is cached under
``cache_dir/ort-dense/<key>/model.onnx`` (weights over 2 GB in ``model.onnx.data`` beside it), keyed by
the source's config and weight files (name, size, mtime), torch and transformers versions, so any
artifact of the same model reuses it. It runs with onnxruntime's CPUExecutionProvider by default;
CUDAExecutionProvider needs the ``onnxruntime-gpu`` extra.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from picompile.errors import PicompileError

EXPORT_VERSION: int = 1  # bump when the exported graph changes, so caches re-export
MODEL_FILE: str = "model.onnx"
META_FILE: str = "meta.json"


def source_key(source: str | Path) -> str:
    """Cache key of a model source: config + weight files (name, size, mtime) + library versions."""
    import torch
    import transformers

    path = Path(source).absolute()
    h = hashlib.sha256(f"v{EXPORT_VERSION} torch {torch.__version__} transformers {transformers.__version__}\n".encode())
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if p.name == "config.json":
            h.update(p.read_bytes())
        elif p.suffix in (".safetensors", ".bin", ".json"):
            st = p.stat()
            h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    h.update(str(path).encode())
    return h.hexdigest()[:20]


def export_dense_onnx(source: str | Path, out: Path) -> dict[str, Any]:
    """Export the source model's dense decoder step to ``out`` (ONNX); return its facts (meta.json)."""
    import torch

    from picompile.frontend import load_model
    from picompile.formats.onnx_export import io_names, quiet_exporter, require_onnxscript, save_onnx_program
    from picompile.frontend.decoder import FlatDecoder

    require_onnxscript()

    model, info = load_model(str(source))
    wrapper = FlatDecoder(model.eval(), info.n_layers).eval()
    n_past = 2 * info.n_layers
    ids = torch.zeros(1, 2, dtype=torch.long)  # seq 2, past 4: neither is specialised to 0 or 1
    past = info.kv_tensors(4)
    seq_dim = torch.export.Dim("seq", min=1, max=info.max_seq_len)
    past_dim = torch.export.Dim("past", min=0, max=info.max_seq_len)
    inputs, outputs = io_names(n_past)
    try:
        with torch.no_grad(), quiet_exporter():
            program = torch.onnx.export(wrapper, (ids, past), dynamo=True, input_names=inputs, output_names=outputs,
                                        dynamic_shapes=({1: seq_dim}, tuple({2: past_dim} for _ in range(n_past))),
                                        verbose=False)
    except Exception as e:
        raise PicompileError(f"ONNX export of {source} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    program.model.producer_name = "picompile"
    program.model.metadata_props.update({"picompile.source": str(source), "picompile.kind": "dense reference"})
    save_onnx_program(program, out)
    return {"source": str(source), "architecture": info.architecture, "n_layers": info.n_layers,
            "n_past": n_past, "n_kv_heads": info.n_kv_heads, "head_dim": info.head_dim,
            "vocab_size": info.vocab_size, "max_seq_len": info.max_seq_len, "export_version": EXPORT_VERSION}


def cached_dense_onnx(source: str | Path, cache_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The cached dense ONNX export of ``source`` (exported now when missing): (model path, meta)."""
    if not Path(source).exists():
        raise PicompileError(f"source model {source} does not exist (the ORT reference exports it)")
    entry = Path(cache_dir) / "ort-dense" / source_key(source)
    if (entry / MODEL_FILE).is_file() and (entry / META_FILE).is_file():
        return entry / MODEL_FILE, json.loads((entry / META_FILE).read_text())
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".partial", dir=entry.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like the kernel cache
    try:
        meta = export_dense_onnx(source, staging / MODEL_FILE)
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            staging.rename(entry)
        except OSError:  # another process put it there meanwhile
            if not (entry / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry / MODEL_FILE, json.loads((entry / META_FILE).read_text())


class OrtDenseSession:
    """The source model, dense, in onnxruntime: ``logits(ids)`` for a prefill, ``step`` for decoding.

    ``model_dir``: an HF checkpoint directory or llama2.c ``.bin`` (for an artifact:
    ``manifest.model["source"]``); ``cache_dir``: where the ONNX export is kept (see the module doc).
    """

    def __init__(self, model_dir: str | Path, cache_dir: str | Path,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None) -> None:
        import onnxruntime as ort

        self.model_path, self.meta = cached_dense_onnx(model_dir, cache_dir)
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(self.model_path), sess_options=opts, providers=list(providers))
        self.n_past: int = int(self.meta["n_past"])
        self.kv_heads: int = int(self.meta["n_kv_heads"])
        self.head_dim: int = int(self.meta["head_dim"])
        self.vocab_size: int = int(self.meta["vocab_size"])
        self.max_seq_len: int = int(self.meta["max_seq_len"])
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._inputs = [i.name for i in self.session.get_inputs()]

    def empty_past(self) -> tuple[np.ndarray, ...]:
        return tuple(np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32) for _ in range(self.n_past))

    def step(self, ids: Sequence[int] | np.ndarray, past: Sequence[np.ndarray] | None = None
             ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """One decoder step: ``ids`` ([seq] or [1, seq]) after ``past`` (None: empty) →
        (logits [seq, vocab], presents [1, kv_heads, past + seq, head_dim] each)."""
        x = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        past = self.empty_past() if past is None else tuple(past)
        if len(past) != self.n_past:
            raise PicompileError(f"step needs {self.n_past} past tensors, got {len(past)}")
        if x.shape[1] + past[0].shape[2] > self.max_seq_len:
            raise PicompileError(f"{x.shape[1] + past[0].shape[2]} tokens exceed the model's {self.max_seq_len} positions")
        feeds = {self._inputs[0]: x} | {name: np.ascontiguousarray(p, dtype=np.float32)
                                        for name, p in zip(self._inputs[1:], past)}
        out = self.session.run(self._outputs, feeds)
        return out[0][0], tuple(out[1:])

    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Logits [seq, vocab] for ``ids`` from an empty cache (one prefill)."""
        return self.step(ids)[0]


def for_artifact(root: str | Path, cache_dir: str | Path | None = None, **kwargs: Any) -> OrtDenseSession:
    """The dense ORT reference of the model an artifact was built from (cache: picompile's cache dir)."""
    from picompile.formats.artifact import read_manifest
    from picompile.config import default_cache_dir

    manifest = read_manifest(Path(root), verify=False)
    from picompile.formats.provenance import resolve_source

    return OrtDenseSession(resolve_source(manifest.model) or manifest.model["source"], cache_dir or default_cache_dir(), **kwargs)


__all__ = ["OrtDenseSession", "cached_dense_onnx", "export_dense_onnx", "for_artifact", "source_key"]

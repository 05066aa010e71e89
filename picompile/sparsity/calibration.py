"""Calibration corpus for activation profiling: a text or token file, or the built-in default."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from picompile.errors import PicompileError

# the embedded default model's calibration text (package data of picompile, not of this subpackage)
DEFAULT_TEXT: Path = Path(__file__).resolve().parents[1] / "data" / "default_model" / "calibration.txt"
TOKEN_SUFFIXES: tuple[str, ...] = (".npy", ".json")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_calibration(path: Path | None, tokenizer: Any | None, vocab_size: int, n_tokens: int,
                     seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token ids [N] (N ≤ n_tokens) and a description {source, sha256, n_tokens, kind}.

    ``path``: a text file (tokenized with the model's tokenizer) or a token file (.npy / .json list
    of ids). None: the built-in text when the model has a tokenizer, else seeded uniform random
    tokens (labelled "synthetic").
    """
    if n_tokens < 16:
        raise PicompileError(f"--calibration-tokens must be at least 16, got {n_tokens}")
    if path is None and (tokenizer is None or not DEFAULT_TEXT.is_file()):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (n_tokens,), generator=gen)
        return ids, {"source": "synthetic uniform random tokens", "kind": "synthetic", "sha256": None,
                     "n_tokens": n_tokens, "seed": seed}
    src = Path(path) if path is not None else DEFAULT_TEXT
    if not src.is_file():
        raise PicompileError(f"calibration file {src} does not exist")
    raw = src.read_bytes()
    if src.suffix in TOKEN_SUFFIXES:
        try:
            arr = np.load(src) if src.suffix == ".npy" else np.asarray(json.loads(raw), dtype=np.int64)
        except Exception as e:
            raise PicompileError(f"cannot read token file {src}: {e}") from None
        ids = torch.as_tensor(np.asarray(arr, dtype=np.int64).reshape(-1))
        kind = "tokens"
    else:
        if tokenizer is None:
            raise PicompileError(f"calibration text {src} needs a tokenizer, and this model has none: "
                                 f"give a token file ({', '.join(TOKEN_SUFFIXES)})")
        ids = torch.tensor(tokenizer.encode(raw.decode("utf-8", errors="replace"), bos=False), dtype=torch.long)
        kind = "text"
    if ids.numel() < 16:
        raise PicompileError(f"calibration file {src} holds only {ids.numel()} tokens (need at least 16)")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise PicompileError(f"calibration file {src} has token ids outside the vocabulary (0..{vocab_size - 1})")
    ids = ids[:n_tokens]
    return ids, {"source": str(src) if path is not None else "built-in (default model calibration.txt)",
                 "kind": kind, "sha256": _sha256(raw), "n_tokens": int(ids.numel())}


# ----------------------------------------------------------------------------- sampled from the model itself

SAMPLE_DOC_TOKENS = 255  # ids per sampled document after its BOS
SAMPLE_BATCH = 16  # documents per generate call (KV cache; 4,096 SmolLM2-135M tokens in ~200 s on 2 busy cores)
_FINGERPRINT_ELEMS = 4096  # values read per tensor for the model fingerprint (strided over the whole tensor)


def model_fingerprint(model: torch.nn.Module, config: dict[str, Any]) -> str:
    """sha256 over the model's config and, per named tensor, its name, shape, dtype and 4,096 values strided over it:
    a different checkpoint (other weights, shape or config) gets another key without reading every weight."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.is_meta or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _FINGERPRINT_ELEMS)
        h.update(flat[::step][:_FINGERPRINT_ELEMS].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def can_sample(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot sample its own calibration text (None: it can): transformers' ``generate`` on float32
    weights and a BOS token."""
    if not callable(getattr(model, "generate", None)) or getattr(model, "config", None) is None:
        return "the model has no generate()"
    if getattr(model.config, "bos_token_id", None) is None:
        return "the model names no BOS token"
    if any(p.dtype != torch.float32 or p.is_meta for p in model.parameters()):
        return "the model's weights are not all float32 in memory"
    return None


def sample_documents(model: torch.nn.Module, n_tokens: int, seed: int, doc_tokens: int = SAMPLE_DOC_TOKENS,
                     batch: int = SAMPLE_BATCH) -> list[int]:
    """``n_tokens`` ids sampled from ``model`` at temperature 1 (no top-k / top-p): ``batch`` documents per
    ``generate`` call, each BOS then up to ``doc_tokens`` ids or through EOS."""
    bos = int(model.config.bos_token_id)
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    ids: list[int] = []
    rounds = 0
    while len(ids) < n_tokens:
        torch.manual_seed(seed + rounds)
        need = n_tokens - len(ids)
        rows = max(1, min(batch, -(-need // (doc_tokens + 1))))  # no more documents than the ids still needed
        start = torch.full((rows, 1), bos, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=max(1, min(doc_tokens, need - 1)),
                                 pad_token_id=next(iter(eos_ids), bos))
        for row in out.tolist():
            doc = row[1:]
            end = next((i for i, t in enumerate(doc) if t in eos_ids), None)
            ids += [bos, *(doc if end is None else doc[: end + 1])]
        rounds += 1
    return ids[:n_tokens]


def sampled_calibration(model: torch.nn.Module, config: dict[str, Any], vocab_size: int, n_tokens: int, seed: int,
                        cache_dir: Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token ids [n_tokens] sampled from the model itself (:func:`sample_documents`), cached as
    ``cache_dir/<fingerprint>-<n_tokens>-<seed>.json`` so that a second build of the same model reuses them; a
    description {source, kind "sampled", sha256, n_tokens, seed, model_fingerprint} (the same whether sampled now or
    read from the cache: the artifact does not depend on it)."""
    fp = model_fingerprint(model, config)
    path = Path(cache_dir) / f"{fp[:32]}-{n_tokens}-{seed}.json"
    ids: list[int] | None = None
    if path.is_file():
        try:
            ids = [int(t) for t in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError):
            ids = None  # a damaged cache entry is resampled
    if ids is None or len(ids) != n_tokens or not all(0 <= t < vocab_size for t in ids):
        ids = sample_documents(model, n_tokens, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # concurrent builds each write their own
        tmp.write_text(json.dumps(ids))
        tmp.replace(path)
    return torch.tensor(ids, dtype=torch.long), {
        "source": str(path), "kind": "sampled", "sha256": _sha256(path.read_bytes()), "n_tokens": len(ids),
        "seed": seed, "model_fingerprint": fp}


def sample_by_default(config: Any) -> bool:
    """Whether a build without ``--calibration`` samples its calibration text from the model (``calibration_source``
    auto): when input sparsity will skip something (``--input-sparsity`` on, with a byte target or a budget)."""
    return config.input_sparsity != "off" and (config.act_sparsity > 0.0 or config.accuracy_budget is not None)


def build_calibration(path: Path | None, source: str, sample_by_default: bool, model: torch.nn.Module,
                      config: dict[str, Any], tokenizer: Any | None, vocab_size: int, n_tokens: int, seed: int,
                      cache_dir: Path) -> tuple[torch.Tensor, dict[str, Any]]:
    """The build's calibration ids: ``path`` when given (:func:`load_calibration`); else sampled from the model
    (``source`` "sampled", or "auto" with ``sample_by_default``: builds with input sparsity) where it can sample,
    cached per model (:func:`sampled_calibration`); else the built-in text (:func:`load_calibration` of None)."""
    if path is None and (source == "sampled" or (source == "auto" and sample_by_default)):
        why = can_sample(model)
        if why is None:
            return sampled_calibration(model, config, vocab_size, n_tokens, seed, cache_dir)
        if source == "sampled":
            raise PicompileError(f"--calibration-source sampled: cannot sample from this model ({why}); give "
                                 f"--calibration FILE")
        ids, desc = load_calibration(None, tokenizer, vocab_size, n_tokens, seed)
        return ids, {**desc, "not_sampled": why}
    return load_calibration(path, tokenizer, vocab_size, n_tokens, seed)

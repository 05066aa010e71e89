"""Calibration corpus for activation profiling: a text or token file, or the built-in default."""
from __future__ import annotations

import hashlib
import json
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

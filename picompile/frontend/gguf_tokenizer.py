"""A GGUF file's tokenizer as a standard Hugging Face tokenizer directory.

transformers converts the ``tokenizer.ggml.*`` metadata (vocabulary, merges or scores, token types, special
token ids) into a ``tokenizers`` tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=…)``); this module
saves it as ``tokenizer.json`` + ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``,
``pad_token``, ``add_bos_token`` / ``add_eos_token`` from ``tokenizer.ggml.add_bos_token`` /
``add_eos_token`` or, when absent, llama.cpp's default for the vocabulary type, ``chat_template`` from ``tokenizer.chat_template``) in this machine's cache,
``<cache>/gguf/<sha256 of the file>/v<LAYOUT_VERSION>/tokenizer/``, and the frontend hands that directory on as an ``hf``
tokenizer, exactly as for a checkpoint directory. Nothing of BPE or SentencePiece is re-implemented here.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from picompile.errors import ModelLoadError

# bumped when what write_tokenizer produces changes, so a cached directory of an older layout is not reused
LAYOUT_VERSION: int = 1
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
# llama.cpp's defaults when the file has no tokenizer.ggml.add_bos_token / add_eos_token (llama-vocab.cpp: SPM
# and WPM vocabularies add BOS, UGM adds EOS, BPE neither)
ADD_BOS_BY_DEFAULT: tuple[str, ...] = ("llama", "bert")
ADD_EOS_BY_DEFAULT: tuple[str, ...] = ("t5",)
# keys transformers' save_pretrained writes that name this machine or this load, not the tokenizer
_DROPPED_KEYS: tuple[str, ...] = ("is_local", "local_files_only", "name_or_path", "_commit_hash")


def cache_root() -> Path:
    from picompile.config import default_cache_dir

    return default_cache_dir() / "gguf"


def tokenizer_config(tok: Any, saved: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: what save_pretrained wrote, plus the GGUF's add_bos/add_eos and chat template."""
    cfg = {k: v for k, v in saved.items() if k not in _DROPPED_KEYS}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        val = getattr(tok, key, None)
        if isinstance(val, str):
            cfg[key] = val
    cfg["add_bos_token"] = bool(meta["add_bos_token"])
    cfg["add_eos_token"] = bool(meta["add_eos_token"])
    template = meta.get("chat_template")
    if isinstance(template, str) and template:
        cfg["chat_template"] = template
    cfg.pop("model_max_length", None)  # transformers' "unbounded" sentinel; the model's context is in config
    return dict(sorted(cfg.items()))


def tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """What of a GGUFReader's tokenizer.* metadata the tokenizer_config.json needs (the rest transformers reads)."""
    from picompile.frontend.gguf import field

    model = field(reader, "tokenizer.ggml.model")
    return {
        "model": model,
        "add_bos_token": field(reader, "tokenizer.ggml.add_bos_token", model in ADD_BOS_BY_DEFAULT),
        "add_eos_token": field(reader, "tokenizer.ggml.add_eos_token", model in ADD_EOS_BY_DEFAULT),
        "chat_template": field(reader, "tokenizer.chat_template"),
    }


def write_tokenizer(path: Path, meta: dict[str, Any], out: Path) -> bool:
    """Write the GGUF's tokenizer into directory ``out`` (TOKENIZER_FILES); False when the file has none.
    ``meta``: :func:`tokenizer_metadata` of the file."""
    if not isinstance(meta["model"], str):
        return False
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises ValueError/KeyError/NotImplementedError variously
        raise ModelLoadError(f"{path}: its {meta['model']!r} tokenizer could not be converted: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from None
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tok.save_pretrained(tmp)
        saved = json.loads((Path(tmp) / "tokenizer_config.json").read_text(encoding="utf-8"))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / "tokenizer.json", out / "tokenizer.json")
    cfg = tokenizer_config(tok, saved, meta)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return True


def tokenizer_dir(path: Path, digest: str, reader: Any) -> Path | None:
    """The HF tokenizer directory of GGUF file ``path`` (content ``digest``, open in ``reader``), made once per
    content in the cache; None when the file holds no tokenizer."""
    root = cache_root() / digest / f"v{LAYOUT_VERSION}"
    final = root / "tokenizer"
    none_marker = root / "no-tokenizer"
    if all((final / n).is_file() for n in TOKENIZER_FILES):
        return final
    if none_marker.is_file():
        return None
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tokenizer.{os.getpid()}.", dir=root))
    try:
        if not write_tokenizer(path, tokenizer_metadata(reader), staging / "tokenizer"):
            none_marker.touch()
            return None
        if final.exists():  # another build got there first, or an incomplete older one
            shutil.rmtree(final, ignore_errors=True)
        (staging / "tokenizer").replace(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


__all__ = ["TOKENIZER_FILES", "tokenizer_config", "tokenizer_dir", "tokenizer_metadata", "write_tokenizer"]

"""Frontends: turn what the user names (HF dir, hub id, llama2.c .bin, .onnx, .gguf) into a torch model + ModelInfo."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from picompile.errors import ModelLoadError
from picompile.frontend.base import ModelInfo


def _kv_shape(model: torch.nn.Module, n_layers: int) -> tuple[int, int]:
    """(n_kv_heads, head_dim) read off one tiny forward, so every family is handled alike. The forward reads
    every weight: a mapped checkpoint's pages are released after each module that read them (else a float32 1B
    build held its whole 4.1 GiB source from here to capture)."""
    from picompile.formats.tensorfile import release_pages

    def release(module: torch.nn.Module, _args: Any, _out: Any) -> None:
        release_pages([*module.parameters(recurse=False), *module.buffers(recurse=False)])

    hooks = [m.register_forward_hook(release) for m in model.modules()
             if next(m.parameters(recurse=False), None) is not None]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    keys = out.cache.layers[0].keys  # [1, n_kv_heads, 2, head_dim]
    if len(out.cache.layers) != n_layers:
        raise ModelLoadError(f"model reports {n_layers} layers but its KV cache has {len(out.cache.layers)}")
    return int(keys.shape[1]), int(keys.shape[3])


def _info(model: torch.nn.Module, config: dict[str, Any], arch: str, family: str, source: str, fmt: str,
          tokenizer: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> ModelInfo:
    cfg = model.config
    n_layers = int(cfg.num_hidden_layers)
    n_kv, head_dim = _kv_shape(model, n_layers)
    return ModelInfo(
        architecture=arch,
        family=family,
        source=source,
        source_format=fmt,
        config=config,
        n_layers=n_layers,
        d_model=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        max_seq_len=int(cfg.max_position_embeddings),
        n_kv_heads=n_kv,
        head_dim=head_dim,
        tokenizer=tokenizer,
        extra=extra or {},
    )


def load_model(spec: str) -> tuple[torch.nn.Module, ModelInfo]:
    """Import a model by what the user typed. Errors are ModelLoadError with a clear message."""
    from picompile.frontend.hf import SUPPORTED_ARCHITECTURES, load_hf

    path = Path(spec)
    if path.is_file():
        if path.suffix == ".bin" and not (path.parent / "config.json").exists():
            from picompile.frontend.llama2c import load_llama2c

            model, meta = load_llama2c(path)
            tok = path.parent / "tok512.bin"
            tokenizer = {"kind": "llama2c", "path": str(tok)} if tok.is_file() else None
            config = model.config.to_dict()
            return model, _info(model, config, "LlamaForCausalLM", "llama", str(path), "llama2c", tokenizer, meta)
        if path.suffix == ".onnx":  # an ONNX decoder step (see picompile.frontend.onnx)
            from picompile.frontend.onnx import load_onnx

            return load_onnx(path)
        if path.suffix.lower() == ".gguf":  # a llama.cpp GGUF file (see picompile.frontend.gguf)
            from picompile.frontend.gguf import load_gguf

            model, config, tokenizer, extra = load_gguf(path)
            return model, _info(model, config, "LlamaForCausalLM", "llama", str(path), "gguf", tokenizer, extra)
        raise ModelLoadError(
            f"{path} is a file, not a model: give a Hugging Face checkpoint directory, a llama2.c .bin, "
            "an .onnx or a .gguf file"
        )
    if not path.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") != 1):
        raise ModelLoadError(f"model path {spec} does not exist")
    model, config, arch, tokenizer = load_hf(spec)
    return model, _info(model, config, arch, SUPPORTED_ARCHITECTURES[arch], spec, "hf", tokenizer)


__all__ = ["ModelInfo", "load_model"]

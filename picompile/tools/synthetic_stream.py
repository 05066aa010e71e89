"""Checkpoints written shard by shard: never more than one shard (and one layer's float32 draws) in memory.

``ShardWriter`` collects tensors into ``model-0000k-of-0000N.safetensors`` shards of at most ``shard_bytes`` and
writes ``model.safetensors.index.json`` (transformers' sharded layout). ``write_random_checkpoint`` writes a
seeded random Llama-shaped checkpoint in a given dtype (for memory tests: its activations are not controlled,
unlike :mod:`picompile.tools.synthetic`'s).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from picompile.formats.tensorfile import write_safetensors


class ShardWriter:
    """Tensors added in order go to shards of at most ``shard_bytes`` each (a bigger tensor gets a shard alone)."""

    def __init__(self, out: Path, shard_bytes: int = 1 << 30) -> None:
        self.out, self.shard_bytes = Path(out), shard_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + n > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += n
        self.total_bytes += n

    def flush(self) -> None:
        if not self.pending:
            return
        write_safetensors(self.out / f"shard-{len(self.shards):05d}.tmp", self.pending, metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Name the shards ``model-0000k-of-0000N.safetensors`` and write the index; returns the shard paths."""
        self.flush()
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        paths = []
        for i, names in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / f"shard-{i:05d}.tmp").rename(self.out / name)
            weight_map.update({k: name for k in names})
            paths.append(self.out / name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        return paths


def llama_config(d_model: int, n_neurons: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int,
                 max_pos: int = 2048, act: str = "relu") -> dict[str, Any]:
    """A LlamaForCausalLM config.json (dict) of these sizes."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d_model,
            "intermediate_size": n_neurons, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads, "vocab_size": vocab, "max_position_embeddings": max_pos,
            "hidden_act": act, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "attention_bias": False, "mlp_bias": False}


def llama_layer_shapes(cfg: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    d, n, h, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // h
    p = f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
            p + "mlp.gate_proj.weight": (n, d), p + "mlp.up_proj.weight": (n, d), p + "mlp.down_proj.weight": (d, n),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}


def write_random_checkpoint(out: Path, cfg: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            shard_bytes: int = 1 << 30) -> int:
    """A seeded random Llama checkpoint of ``cfg`` in ``dtype``, layer by layer; returns its parameter count.

    Matrices are N(0, 1/fan_in) (gate rows shifted so ReLU fires for about a third of the neurons), norms 1.
    """
    out = Path(out)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out, shard_bytes)
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    count = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal count
        if len(shape) == 1:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[1]))
            if "gate_proj" in name:
                t[:, 0] -= 0.4  # hidden dim 0 of every token leans positive (embedding column 0 below)
        if name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen)
            t[:, 0] = 1.0
        writer.add(name, t.to(dtype))
        count += t.numel()

    add("model.embed_tokens.weight", (vocab, d))
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in llama_layer_shapes(cfg, i).items():
            add(name, shape)
    add("model.norm.weight", (d,))
    add("lm_head.weight", (vocab, d))
    writer.close()
    (out / "config.json").write_text(json.dumps({**cfg, "dtype": str(dtype).removeprefix("torch.")}, indent=1) + "\n")
    return count

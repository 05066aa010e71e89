"""What a frontend hands to the compiler: a standard torch model plus facts about it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ModelInfo:
    """Facts about the imported model that the passes and the manifest need."""

    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # "llama" | "opt" | "falcon"
    source: str  # path or hub id given by the user
    source_format: str  # "hf" | "llama2c"
    config: dict[str, Any]  # the HF config as a JSON-able dict
    n_layers: int
    d_model: int
    vocab_size: int
    max_seq_len: int  # positions the model supports
    n_kv_heads: int  # KV-cache heads per layer
    head_dim: int
    tokenizer: dict[str, Any] | None = None  # tokenizer source: {"kind": "hf"|"llama2c", "path": str}
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_tensors(self, past_len: int = 0) -> tuple["torch.Tensor", ...]:
        """Zero past K/V tensors, [1, n_kv_heads, past_len, head_dim] × 2 per layer (past_len 0 = prefill)."""
        import torch

        return tuple(torch.zeros(1, self.n_kv_heads, past_len, self.head_dim) for _ in range(2 * self.n_layers))

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "family": self.family,
            "source": self.source,
            "source_format": self.source_format,
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "config": self.config,
            **({"extra": self.extra} if self.extra else {}),
        }


# ----------------------------------------------------------------------------- config bounds
# Checked on a model's config before anything is allocated: a config naming hundreds of thousands of
# layers (or a vocabulary of billions) is refused at once, with the memory it implies, instead of growing
# memory for minutes.
MAX_LAYERS: int = 4096
MAX_HIDDEN: int = 1 << 17
MAX_VOCAB: int = 1 << 22
MAX_POSITIONS: int = 1 << 24
MAX_HEADS: int = 4096
# HF config keys of each quantity, across the supported families (first present wins)
CONFIG_KEYS: dict[str, tuple[tuple[str, ...], int]] = {
    "layers": (("num_hidden_layers", "n_layer", "num_layers"), MAX_LAYERS),
    "hidden": (("hidden_size", "d_model", "n_embd"), MAX_HIDDEN),
    "ffn": (("intermediate_size", "ffn_dim", "ffn_hidden_size"), MAX_HIDDEN * 64),
    "vocab": (("vocab_size",), MAX_VOCAB),
    "positions": (("max_position_embeddings", "n_positions"), MAX_POSITIONS),
    "heads": (("num_attention_heads", "n_head"), MAX_HEADS),
    "kv_heads": (("num_key_value_heads", "num_kv_heads"), MAX_HEADS),
}


def config_dims(config: dict[str, Any], where: str) -> dict[str, int]:
    """The model's dimensions named in an HF config, each a positive integer within its bound."""
    from picompile.errors import ModelLoadError

    dims: dict[str, int] = {}
    for name, (keys, hi) in CONFIG_KEYS.items():
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is None:
            continue
        v = config[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ModelLoadError(f"{where}: {key} must be an integer in 1..{hi}, got {str(v)[:40]!r}")
        dims[name] = v
    return dims


def estimate_bytes(dims: dict[str, int]) -> int:
    """float32 bytes of the weights a config implies (embeddings + lm_head, attention, gated FFN), doubled: the
    checkpoint is read into memory beside the model it fills."""
    h, n_l, v = dims.get("hidden", 1), dims.get("layers", 1), dims.get("vocab", 1)
    ffn = dims.get("ffn", 4 * h)
    params = 2 * v * h + n_l * (4 * h * h + 3 * h * ffn + 2 * h)
    return 2 * 4 * params


def check_config_bounds(config: dict[str, Any], where: str, memory_bytes: int | None = None) -> None:
    """Refuse a config whose dimensions are out of bounds or whose weights cannot fit this machine's memory."""
    from picompile.errors import ModelLoadError
    from picompile.formats.manifest_schema import gib, physical_memory_bytes

    need = estimate_bytes(config_dims(config, where))
    have = physical_memory_bytes() if memory_bytes is None else memory_bytes
    if need > have:
        raise ModelLoadError(f"{where}: this config implies about {gib(need)} of float32 weights to "
                             f"build; this machine has {gib(have)}")

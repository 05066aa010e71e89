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

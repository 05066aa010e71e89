"""The shapes the cost model plans with: a decoder-only LM's sizes, no weights (:class:`ModelShape`).

Built-in shapes of the real checkpoints PowerInfer measures (:data:`BUILTIN_MODELS`), or a shape read from a
Hugging Face ``config.json`` (:func:`shape_from_hf_config`: OPT, LLaMA/Mistral/Qwen2, Falcon).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from picompile.errors import PicompileError


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only LM: its shapes, no weights."""

    name: str
    family: str  # "opt" | "llama" | "falcon"
    n_layers: int
    d_model: int
    d_ffn: int  # FFN neurons per layer
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    gated: bool  # gate/up/down (LLaMA) vs up/down (OPT, Falcon)
    act: str = "relu"
    head_dim: int = 0  # 0 = d_model // n_heads
    bias: bool = False  # linear layers carry biases (OPT)
    max_seq_len: int = 2048
    tied: bool = False  # the lm_head is the embedding matrix (stored once)
    description: str = ""

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "d_ffn", "n_heads", "n_kv_heads", "vocab_size"):
            if int(getattr(self, f)) <= 0:
                raise PicompileError(f"model {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.head_dim <= 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    @property
    def attention_params(self) -> int:
        """Weights of one attention block: q, k, v, o (+ biases)."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        w = self.d_model * (q + 2 * kv) + q * self.d_model
        return w + ((q + 2 * kv + self.d_model) if self.bias else 0)

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def ffn_params(self) -> int:
        """Weights of one FFN layer (+ biases)."""
        w = self.ffn_matrices * self.d_model * self.d_ffn
        return w + ((self.d_ffn + self.d_model) if self.bias else 0)

    @property
    def norm_params(self) -> int:
        """Norm weights of one layer (two norms; LayerNorm has a bias too)."""
        return 2 * self.d_model * (2 if self.family in ("opt", "falcon") else 1)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def n_params(self) -> int:
        """All parameters (a tied embedding / lm_head counted once)."""
        per_layer = self.attention_params + self.ffn_params + self.norm_params
        return self.n_layers * per_layer + (1 if self.tied else 2) * self.lm_head_params + self.d_model

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "n_params": self.n_params}


#: Built-in shapes (the real checkpoints' configs; PowerInfer runs the ReLU variants of the
#: LLaMA and Falcon models: ReLU-Falcon-40B, LLaMA-ReGLU-70B, ReLU-LLaMA-7B).
BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape("opt-30b", "opt", 48, 7168, 28672, 56, 56, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-30b"),
        ModelShape("opt-66b", "opt", 64, 9216, 36864, 72, 72, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-66b"),
        ModelShape("falcon-40b", "falcon", 60, 8192, 32768, 128, 8, 65024, False, "relu", tied=True,
                   description="ReLU-Falcon-40B (tiiuae/falcon-40b shape, GQA 8 KV heads)"),
        ModelShape("llama2-70b", "llama", 80, 8192, 28672, 64, 8, 32000, True, "relu", max_seq_len=4096,
                   description="LLaMA-ReGLU-70B (meta-llama/Llama-2-70b shape, GQA 8 KV heads)"),
        ModelShape("llama2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, True, "relu", max_seq_len=4096,
                   description="ReLU-LLaMA-7B (meta-llama/Llama-2-7b shape)"),
        ModelShape("llama-7b-relu", "llama", 32, 4096, 11008, 32, 32, 32000, True, "relu", max_seq_len=2048,
                   description="synthetic llama-7b-relu (python -m picompile.tools.synthetic llama-7b-relu: "
                               "ReluLLaMA-7B shape, bfloat16)"),
        ModelShape("opt-1.3b", "opt", 24, 2048, 8192, 32, 32, 50272, False, "relu", bias=True, tied=True,
                   description="facebook/opt-1.3b (local benchmark shape)"),
        ModelShape("llama-1.1b", "llama", 22, 2048, 5632, 32, 4, 32000, True, "relu",
                   description="TinyLlama-1.1B shape with ReLU (local benchmark shape)"),
    ]
}


def builtin_model(name: str) -> ModelShape:
    try:
        return BUILTIN_MODELS[name.lower()]
    except KeyError:
        raise PicompileError(
            f"unknown model {name!r}: not a file or directory, nor a built-in name; built-in models: "
            f"{', '.join(BUILTIN_MODELS)}"
        ) from None


def shape_from_hf_config(config: dict[str, Any], name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict (OPT, LLaMA/Mistral, Falcon)."""
    mt = str(config.get("model_type", "")).lower()
    archs = [str(a) for a in config.get("architectures") or []]
    if not mt and archs:
        mt = {"OPTForCausalLM": "opt", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "FalconForCausalLM": "falcon"}.get(archs[0], "")
    name = name or str(config.get("_name_or_path") or mt)
    family = {"opt": _opt_shape, "llama": _llama_shape, "mistral": _llama_shape, "qwen2": _llama_shape,
              "falcon": _falcon_shape, "refinedweb": _falcon_shape}.get(mt)
    if family is None:
        raise PicompileError(f"cannot plan model type {mt or '?'!r} of {name!r}; supported: opt, llama, mistral, falcon")
    try:
        return family(config, name, _Fields(config, name))
    except (TypeError, ValueError) as e:
        raise PicompileError(f"config of {name!r} has a malformed field: {e}") from None


class _Fields:
    """``need(*keys, default=…)``: the first of ``keys`` a config sets, else the default, else a PicompileError."""

    def __init__(self, config: dict[str, Any], name: str) -> None:
        self.config, self.name = config, name

    def __call__(self, *keys: str, default: Any = None) -> Any:
        for k in keys:
            if self.config.get(k) is not None:
                return self.config[k]
        if default is not None:
            return default
        raise PicompileError(f"config of {self.name!r} lacks {' / '.join(keys)}")


def _opt_shape(config: dict[str, Any], name: str, need: _Fields) -> ModelShape:
    d = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    return ModelShape(name, "opt", int(need("num_hidden_layers")), d, int(need("ffn_dim")), heads, heads,
                      int(need("vocab_size")), False, str(config.get("activation_function", "relu")),
                      bias=bool(config.get("enable_bias", True)), tied=bool(config.get("tie_word_embeddings", True)),
                      max_seq_len=int(need("max_position_embeddings", default=2048)))


def _llama_shape(config: dict[str, Any], name: str, need: _Fields) -> ModelShape:
    d = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    return ModelShape(name, "llama", int(need("num_hidden_layers")), d, int(need("intermediate_size")), heads,
                      int(need("num_key_value_heads", default=heads)), int(need("vocab_size")), True,
                      str(config.get("hidden_act", "silu")), head_dim=int(config.get("head_dim") or 0),
                      bias=bool(config.get("attention_bias", False)),
                      tied=bool(config.get("tie_word_embeddings", False)),
                      max_seq_len=int(need("max_position_embeddings", default=2048)))


def _falcon_shape(config: dict[str, Any], name: str, need: _Fields) -> ModelShape:
    d = int(need("hidden_size"))
    heads = int(need("num_attention_heads", "n_head"))
    if config.get("new_decoder_architecture"):
        kv = int(need("num_kv_heads", "n_head_kv", default=heads))
    else:
        kv = 1 if config.get("multi_query", True) else heads
    return ModelShape(name, "falcon", int(need("num_hidden_layers", "n_layer")), d,
                      int(need("ffn_hidden_size", default=4 * d)), heads, kv, int(need("vocab_size")), False,
                      str(config.get("activation", "gelu")), bias=bool(config.get("bias", False)),
                      tied=bool(config.get("tie_word_embeddings", True)),
                      max_seq_len=int(need("max_position_embeddings", default=2048)))

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


def param_counts(dims: dict[str, int]) -> dict[str, int]:
    """Parameters a config implies, by part: embeddings, lm_head, one decoder layer (attention as full heads,
    gated FFN: upper bounds) and all layers."""
    h, n_l, v = dims.get("hidden", 1), dims.get("layers", 1), dims.get("vocab", 1)
    ffn = dims.get("ffn", 4 * h)
    layer = 4 * h * h + 3 * h * ffn + 2 * h
    return {"embeddings": v * h, "lm_head": v * h, "layer": layer, "ffn_layer": 3 * h * ffn, "layers": n_l * layer,
            "total": 2 * v * h + n_l * layer}


def estimate_bytes(dims: dict[str, int], itemsize: int = 4) -> int:
    """Bytes of the weights a config implies, stored ``itemsize`` bytes per parameter (checkpoints are mapped:
    nothing is copied to read them)."""
    return itemsize * param_counts(dims)["total"]


# bytes per parameter of the artifact's linear / FFN weights by --weight-dtype (int8/int4: a float16 scale per
# block of 32: llama.cpp's q8_0 / q4_0)
OUT_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "int8": 34 / 32, "int4": 18 / 32}
BASE_BYTES: int = 700 << 20  # torch, transformers and TVM imported: a build's resident memory before any model
CHUNK_TOKENS: int = 256  # profiling runs the calibration tokens in windows of this many


@dataclass
class BuildEstimate:
    """The peak resident memory a build is expected to need, by part (bytes)."""

    weights: int  # the artifact's weights as the build holds them (embeddings stay float32)
    calibration: int  # per layer: the profiled FFN inputs (float32) and masks (bool) of every calibration token
    working: int  # one decoder layer widened to float32, one window's logits and activations
    embeddings: int = 0  # the embeddings in float32 (part of ``weights``; beside the calibration data)
    base: int = BASE_BYTES
    rows: int = 0  # the weights phase's working set: one layer's FFN rows being made (16-bit copies, twice)

    @property
    def total(self) -> int:
        """The profiling phase (embeddings widened, calibration data, one layer widened) and the weights phase
        (split-ffn drops the calibration data before it makes the artifact's rows, one layer at a time) do not
        overlap. Measured on the 7B widths with 4 layers (float16, 4096 calibration tokens): weights phase 2.88 GiB
        against weights + rows + runtime 3.4 GiB (the predictors' share counted at its budget); before, the
        calibration phase's working set was counted in both (4.3 GiB)."""
        return max(self.weights + self.rows, self.embeddings + self.calibration + self.working) + self.base

    def describe(self) -> str:
        from picompile.formats.manifest_schema import gib

        return (f"{gib(self.total)} (weights {gib(self.weights)} or, before them, calibration "
                f"{gib(self.calibration)} and working {gib(self.working)}; runtime {gib(self.base)})")


def estimate_build(dims: dict[str, int], weight_dtype: str = "float32", calibration_tokens: int = 4096,
                   predictor_budget: float = 0.2) -> BuildEstimate:
    """What a build of a model of ``dims`` holds at its peak, from the config alone (before anything is loaded)."""
    p = param_counts(dims)
    h, n_l, v = dims.get("hidden", 1), dims.get("layers", 1), dims.get("vocab", 1)
    ffn = dims.get("ffn", 4 * h)
    out = OUT_BYTES.get(weight_dtype, 4.0)
    weights = int(4 * p["embeddings"] + out * (p["lm_head"] + p["layers"]) + 2 * predictor_budget * n_l * p["ffn_layer"])
    calibration = calibration_tokens * n_l * (4 * h + ffn)
    working = 4 * p["layer"] + 4 * CHUNK_TOKENS * (v + 8 * max(h, ffn)) + 8 * calibration_tokens * ffn
    return BuildEstimate(weights=weights, calibration=calibration, working=working, embeddings=4 * p["embeddings"],
                         rows=2 * 2 * p["ffn_layer"])


def available_memory_bytes() -> int:
    """Memory this machine can give a new build now (MemAvailable), else its physical memory."""
    from picompile.formats.manifest_schema import physical_memory_bytes
    from picompile.procinfo import meminfo

    return meminfo().get("MemAvailable") or physical_memory_bytes()


def check_config_bounds(config: dict[str, Any], where: str, memory_bytes: int | None = None,
                        itemsize: int | None = None) -> None:
    """Refuse a config whose dimensions are out of bounds or whose weights cannot fit this machine's memory
    (``itemsize``: bytes per stored parameter, by default the config's dtype's)."""
    from picompile.errors import ModelLoadError
    from picompile.formats.manifest_schema import gib, physical_memory_bytes

    dtype = stored_dtype_of(config)
    need = estimate_bytes(config_dims(config, where), itemsize or DTYPE_BYTES[dtype])
    have = physical_memory_bytes() if memory_bytes is None else memory_bytes
    if need > have:
        raise ModelLoadError(f"{where}: this config implies about {gib(need)} of {dtype} weights to "
                             f"build; this machine has {gib(have)}")


DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def stored_dtype_of(config: dict[str, Any]) -> str:
    """The dtype an HF config says its weights are stored in (``dtype`` / ``torch_dtype``), float32 if unsaid."""
    v = config.get("dtype") or config.get("torch_dtype")
    return v if isinstance(v, str) and v in DTYPE_BYTES else "float32"

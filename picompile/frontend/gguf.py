"""Import a Llama-family GGUF file (llama.cpp's format) as a float32 ``transformers.LlamaForCausalLM``.

The file is read with the ``gguf`` package's memory-mapped ``GGUFReader``: the config comes from its
``llama.*`` metadata, every tensor is dequantized with ``gguf.quants.dequantize`` (llama.cpp's own maths:
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants …) into float32, one tensor at a time, straight
into the parameters of a model built on the meta device (no random init, one float32 copy of the model).
``convert_hf_to_gguf`` permutes the rows of q_proj / k_proj per head for llama.cpp's interleaved RoPE;
that is undone here (as transformers' own GGUF loader does). A row permutation moves whole blocks, so a
Q8_0 / Q4_0 tensor re-quantized by ``kernels.qformat.quantize`` (llama.cpp's rounding) gives back the
file's blocks bit for bit: the weights stay float32 until the quantize pass runs.

The tokenizer (vocabulary, merges, special tokens, ``add_bos_token``, chat template) becomes a standard
Hugging Face tokenizer directory (:mod:`picompile.frontend.gguf_tokenizer`), so the rest of the compiler
sees an ordinary HF Llama checkpoint. ``ModelInfo.extra["gguf"]`` records which tensor was stored in which
GGML type.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.base import check_config_bounds
from picompile.formats.provenance import sha256_file

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama",)
# GGUF tensor name -> HF parameter name (``{i}``: the block); biases follow their weight's name
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
ROPE_FREQS: str = "rope_freqs.weight"  # llama3 RoPE: per-frequency divisors of the base frequencies


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # a runtime dependency, but say what to do if it is gone
        raise ModelLoadError("reading a GGUF file needs the 'gguf' package: pip install gguf") from e
    return gguf


def open_reader(path: Path) -> Any:
    """The file's ``GGUFReader`` (memory-mapped); a truncated or corrupt file, or an unknown tensor type, is a
    one-line ModelLoadError."""
    gguf = _gguf()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except ValueError as e:
        msg = " ".join(str(e).split())
        if "GGMLQuantizationType" in msg:
            raise ModelLoadError(f"{path}: unknown GGML tensor type ({msg})") from None
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {msg[:200]}") from None
    except (OSError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: tensor {t.name} needs bytes up to "
                                 f"{end}, the file has {size}")
    return reader


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (``str``, number, bool, or list for arrays), or ``default`` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"GGUF metadata {key} is unreadable: {' '.join(str(e).split())[:200]}") from None


def architecture_of(reader: Any, path: Path) -> str:
    arch = field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"unsupported GGUF architecture {arch} in {path}; supported: "
                                           f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return arch


def _int(reader: Any, key: str, path: Path, default: int | None = None) -> int:
    v = field(reader, key, default)
    if v is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be an integer, got {str(v)[:40]!r}")
    return int(v)


def _float(reader: Any, key: str, path: Path, default: float) -> float:
    v = field(reader, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be a finite number, got {str(v)[:40]!r}")
    return float(v)


def config_from_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """The HF ``LlamaConfig`` keyword arguments the file's metadata describes (checked against its bounds)."""
    a = architecture_of(reader, path)
    names = {t.name for t in reader.tensors}
    experts = _int(reader, f"{a}.expert_count", path, 0)
    if experts > 0:
        raise UnsupportedArchitectureError(f"{path}: a mixture-of-experts {a} model ({experts} experts) is not "
                                           "supported; only dense Llama FFNs are")
    n_embd = _int(reader, f"{a}.embedding_length", path)
    n_head = _int(reader, f"{a}.attention.head_count", path)
    if n_head < 1:
        raise ModelLoadError(f"{path}: GGUF metadata {a}.attention.head_count must be positive, got {n_head}")
    n_kv = _int(reader, f"{a}.attention.head_count_kv", path, n_head)
    head_dim = _int(reader, f"{a}.attention.key_length", path, n_embd // n_head)
    if _int(reader, f"{a}.attention.value_length", path, head_dim) != head_dim:
        raise ModelLoadError(f"{path}: key and value head lengths differ; a Llama model has one head_dim")
    rope_dim = _int(reader, f"{a}.rope.dimension_count", path, head_dim)
    if rope_dim != head_dim:
        raise ModelLoadError(f"{path}: {a}.rope.dimension_count {rope_dim} is not the head length {head_dim} "
                             "(partial rotary embeddings are not a Llama model)")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = _int(reader, f"{a}.vocab_size", path, len(tokens) if isinstance(tokens, list) else None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(reader, f"{a}.rope.freq_base", path, 1e4)}
    kind = field(reader, f"{a}.rope.scaling.type", "none")
    factor = field(reader, f"{a}.rope.scaling.factor")
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        rope.update(rope_type="linear", factor=_float(reader, f"{a}.rope.scaling.factor", path, 1.0))
    elif kind not in ("none", "linear"):
        raise ModelLoadError(f"{path}: RoPE scaling {kind!r} is not supported (supported: none, linear, llama3)")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": n_embd,
        "intermediate_size": _int(reader, f"{a}.feed_forward_length", path),
        "num_hidden_layers": _int(reader, f"{a}.block_count", path),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",  # llama.cpp's llama graph: silu(gate) * up
        "max_position_embeddings": _int(reader, f"{a}.context_length", path),
        "rms_norm_eps": _float(reader, f"{a}.attention.layer_norm_rms_epsilon", path, 1e-5),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in names,
        # llama.cpp reads each bias of a block on its own (blk.N.attn_{q,k,v,output}.bias, ffn_{gate,up,down}.bias,
        # all optional); HF Llama has one switch for q/k/v/o and one for gate/up/down: any bias turns it on, and
        # those the file lacks (Qwen2-style q/k/v biases without o) are zeros (load_weights)
        "attention_bias": any(f"blk.0.attn_{p}.bias" in names for p in ("q", "k", "v", "output")),
        "mlp_bias": any(f"blk.0.ffn_{p}.bias" in names for p in ("gate", "up", "down")),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id"),
    }
    check_config_bounds(config, str(path))
    return config


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter a GGUF tensor fills (None: not a tensor of a dense Llama model)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo ``convert_hf_to_gguf``'s per-head row permutation of q_proj / k_proj (weight [rows, in] or bias
    [rows]): GGUF rows (head, pair, half) → HF rows (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized(t: Any) -> torch.Tensor:
    """A reader tensor as float32 in HF shape (GGUF's ne reversed), with llama.cpp's dequantization."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    try:
        arr = gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(f"GGUF tensor {t.name}: type {qtype.name} cannot be dequantized by this gguf "
                             "package") from None
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    arr = np.asarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # F32: a view of the memory-mapped file
        arr = arr.copy()
    return torch.from_numpy(arr)


def _expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _meta_model(config: dict[str, Any]) -> "LlamaForCausalLM":
    """A LlamaForCausalLM with its parameters on the meta device (no memory, no random init); the rotary
    embedding's buffers (non-persistent, computed from the config) are made on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(**config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    return model


def load_weights(reader: Any, model: torch.nn.Module, config: dict[str, Any], path: Path) -> dict[str, str]:
    """Fill ``model``'s parameters with the file's tensors (dequantized to float32, Q/K unpermuted); return
    {HF name: GGML type}. Missing, unknown and misshapen tensors are refused with their names."""
    expected = _expected_shapes(model)
    tied = bool(config["tie_word_embeddings"])
    filled: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    freqs: torch.Tensor | None = None
    gguf = _gguf()
    for t in reader.tensors:
        qname = gguf.GGMLQuantizationType(t.tensor_type).name
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        if t.name == ROPE_FREQS:
            if shape != (config["head_dim"] // 2,):
                raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(shape)}, the metadata implies "
                                     f"[{config['head_dim'] // 2}]")
            freqs = dequantized(t)
            types[t.name] = qname
            continue
        name = hf_name(t.name)
        if name is None or name not in expected:
            raise ModelLoadError(f"{path}: tensor {t.name} is not part of a dense Llama model with "
                                 f"{config['num_hidden_layers']} layers")
        if shape != expected[name]:
            raise ModelLoadError(f"{path}: tensor {t.name} has shape {list(shape)}, the metadata implies "
                                 f"{list(expected[name])}")
        w = dequantized(t)
        if ".attn_q." in t.name:
            w = unpermute_qk(w, int(config["num_attention_heads"]))
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, int(config["num_key_value_heads"]))
        if not bool(torch.isfinite(w).all()):
            raise ModelLoadError(f"{path}: tensor {t.name} holds NaN or Inf")
        filled[name] = w
        types[name] = qname
    for k in expected:  # a bias the file lacks beside others of its kind (see config_from_metadata): zeros
        if k.endswith(".bias") and k not in filled and _has_sibling_bias(k, filled):
            filled[k] = torch.zeros(expected[k])
            types[k] = "zeros (absent)"
    missing = [k for k in expected if k not in filled and not (tied and k == "lm_head.weight")]
    if missing:
        gguf_names = {v: k for k, v in _GLOBAL_NAMES.items()}
        raise ModelLoadError(f"{path}: GGUF file lacks {len(missing)} tensors the metadata implies, e.g. "
                             f"{', '.join(gguf_names.get(k, k) for k in missing[:3])}")
    model.load_state_dict(filled, strict=False, assign=True)
    if tied:
        model.tie_weights()
    if freqs is not None:  # llama3 RoPE scaling: the base frequencies divided per frequency
        rot = model.model.rotary_emb
        rot.inv_freq = (rot.inv_freq / freqs).to(torch.float32)
        rot.original_inv_freq = rot.inv_freq.clone()
    return types




def _has_sibling_bias(name: str, filled: dict[str, torch.Tensor]) -> bool:
    """Whether the file gave a bias to another projection of the same kind (attention / MLP) in any block."""
    kind = ".self_attn." if ".self_attn." in name else ".mlp."
    return any(k.endswith(".bias") and kind in k for k in filled)


def load_gguf(path: Path) -> tuple["LlamaForCausalLM", dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(model in eval mode, config dict, tokenizer source or None, extra facts for ModelInfo.extra)."""
    from picompile.frontend.gguf_tokenizer import tokenizer_dir

    path = Path(path)
    reader = open_reader(path)
    config = config_from_metadata(reader, path)
    model = _meta_model(config)
    types = load_weights(reader, model, config, path)
    model.eval()
    digest = sha256_file(path)
    tok = tokenizer_dir(path, digest, reader)
    counts: dict[str, int] = {}
    for q in types.values():
        counts[q] = counts.get(q, 0) + 1
    extra = {
        "format": "gguf",
        "sha256": digest,
        "gguf": {
            "architecture": config["model_type"],
            "name": field(reader, "general.name"),
            "file_type": field(reader, "general.file_type"),
            "type_counts": dict(sorted(counts.items())),
            "tensor_types": types,
        },
    }
    tokenizer = {"kind": "hf", "path": str(tok)} if tok is not None else None
    return model, model.config.to_dict(), tokenizer, extra


__all__ = ["config_from_metadata", "dequantized", "hf_name", "load_gguf", "open_reader",
           "unpermute_qk"]

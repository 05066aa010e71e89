"""Import a llama2.c "legacy v0" checkpoint (.bin) into a standard Hugging Face LlamaForCausalLM.

File layout (all little-endian): 7 int32 header (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len), then fp32 arrays token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2,
w3, rms_final, [freq_cis_real, freq_cis_imag], [wcls]. A positive vocab_size means the classifier
is the token embedding (no wcls); a negative one means a separate wcls follows the freq_cis
tables, which are then mandatory. With a shared classifier the freq_cis tail may be omitted.

llama2.c rotates interleaved pairs (x[2i], x[2i+1]) while HF rotates halves (x[i], x[i+d/2]);
permuting the rows of wq and wk per head (as transformers' convert_llama_weights_to_hf does)
makes the HF model compute exactly the same function.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from picompile.errors import ModelLoadError
from picompile.frontend.base import check_config_bounds

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM

HEADER_INTS = 7
HEADER_BYTES = 4 * HEADER_INTS
_FLOAT_BYTES = 4
# llama2.c's later export versions start with this magic ("ak42") instead of a v0 header.
_VERSIONED_MAGIC = 0x616B3432
# Bounds that no real checkpoint comes near; they only catch garbage headers early.
_MAX_DIM = 1 << 16
_MAX_LAYERS = 1024
_MAX_VOCAB = 1 << 22
_MAX_SEQ = 1 << 22


@dataclass(frozen=True)
class Llama2cHeader:
    """The 7-int header of a llama2.c v0 checkpoint."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # absolute value
    seq_len: int
    shared_classifier: bool  # vocab_size > 0 in the file

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.n_kv_heads

    def body_floats(self) -> int:
        """fp32 count from token_embedding through rms_final (always present)."""
        d, h, n_l, v, kv = self.dim, self.hidden_dim, self.n_layers, self.vocab_size, self.kv_dim
        return v * d + n_l * (d + d * d + 2 * kv * d + d * d + d + 3 * h * d) + d

    def freq_floats(self) -> int:
        """fp32 count of freq_cis_real + freq_cis_imag: 2 x (seq_len, head_dim/2)."""
        return self.seq_len * self.head_dim

    def valid_sizes(self) -> dict[int, bool]:
        """Accepted file sizes in bytes -> whether the freq_cis tail is present at that size."""
        body = HEADER_BYTES + _FLOAT_BYTES * self.body_floats()
        freq = _FLOAT_BYTES * self.freq_floats()
        if self.shared_classifier:
            return {body: False, body + freq: True}
        return {body + freq + _FLOAT_BYTES * self.vocab_size * self.dim: True}


def _parse_header(raw: bytes, path: Path) -> Llama2cHeader:
    """Decode and sanity-check the header; anything nonsensical raises ModelLoadError."""
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = (int(x) for x in np.frombuffer(raw, dtype="<i4"))
    if dim == _VERSIONED_MAGIC:
        raise ModelLoadError(
            f"{path}: this is a versioned llama2.c export (magic 'ak42'); only the legacy v0 format is supported"
        )

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{path}: nonsensical llama2.c header ({why}); header = dim {dim}, hidden_dim {hidden}, "
            f"n_layers {n_layers}, n_heads {n_heads}, n_kv_heads {n_kv}, vocab_size {vocab}, seq_len {seq_len}"
        )

    for name, val, hi in (("dim", dim, _MAX_DIM), ("hidden_dim", hidden, _MAX_DIM * 8),
                          ("n_layers", n_layers, _MAX_LAYERS), ("n_heads", n_heads, _MAX_DIM),
                          ("n_kv_heads", n_kv, _MAX_DIM), ("seq_len", seq_len, _MAX_SEQ)):
        if not 0 < val <= hi:
            raise bad(f"{name} must be in 1..{hi}")
    if not 0 < abs(vocab) <= _MAX_VOCAB:
        raise bad(f"|vocab_size| must be in 1..{_MAX_VOCAB}")
    if dim % n_heads:
        raise bad("dim is not a multiple of n_heads")
    if (dim // n_heads) % 2:
        raise bad("head size is odd, RoPE needs pairs")
    if n_kv > n_heads or n_heads % n_kv:
        raise bad("n_heads is not a multiple of n_kv_heads")
    return Llama2cHeader(dim, hidden, n_layers, n_heads, n_kv, abs(vocab), seq_len, vocab > 0)


def read_header(path: Path) -> Llama2cHeader:
    """Read and validate the header and the file size of a llama2.c v0 checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"llama2.c checkpoint {path} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"llama2.c checkpoint {path} is not a file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ModelLoadError(f"{path}: too short for a llama2.c checkpoint ({size} bytes, header alone is 28)")
    with open(path, "rb") as fh:
        hdr = _parse_header(fh.read(HEADER_BYTES), path)
    check_config_bounds({"num_hidden_layers": hdr.n_layers, "hidden_size": hdr.dim, "intermediate_size": hdr.hidden_dim,
                         "vocab_size": hdr.vocab_size}, str(path))
    sizes = hdr.valid_sizes()
    if size not in sizes:
        want = " or ".join(str(s) for s in sorted(sizes))
        kind = "truncated" if size < min(sizes) else "wrong size (trailing data or wrong header)"
        raise ModelLoadError(f"{path}: {kind}: {size} bytes, the header implies {want} bytes")
    return hdr


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k projection rows from llama2.c's interleaved RoPE pairs to HF's rotate-half layout.

    w: [dim_out, dim_in] with dim_out = n_heads * head_dim -> same shape, rows permuted per head.
    """
    dim_out, dim_in = w.shape
    return w.view(n_heads, dim_out // n_heads // 2, 2, dim_in).transpose(1, 2).reshape(dim_out, dim_in)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _state_dict(hdr: Llama2cHeader, flat: torch.Tensor, has_freq: bool) -> dict[str, torch.Tensor]:
    """Slice the flat fp32 payload into an HF Llama state dict (tensors are views of `flat`)."""
    d, h, n_l, v, kv = hdr.dim, hdr.hidden_dim, hdr.n_layers, hdr.vocab_size, hdr.kv_dim
    pos = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal pos
        n = int(np.prod(shape))
        t = flat[pos:pos + n].view(*shape)
        pos += n
        return t

    emb = take(v, d)  # [vocab, dim]
    rms_att = take(n_l, d)  # [L, dim]
    wq = take(n_l, d, d)  # [L, dim, dim]
    wk = take(n_l, kv, d)  # [L, kv_dim, dim]
    wv = take(n_l, kv, d)  # [L, kv_dim, dim]
    wo = take(n_l, d, d)  # [L, dim, dim]
    rms_ffn = take(n_l, d)  # [L, dim]
    w1 = take(n_l, h, d)  # [L, hidden, dim]
    w2 = take(n_l, d, h)  # [L, dim, hidden]
    w3 = take(n_l, h, d)  # [L, hidden, dim]
    rms_final = take(d)  # [dim]
    if has_freq:
        take(hdr.freq_floats())  # freq_cis_real/imag: recomputed by HF's rotary embedding
    wcls = emb if hdr.shared_classifier else take(v, d)  # [vocab, dim]
    assert pos == flat.numel(), (pos, flat.numel())

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb, "model.norm.weight": rms_final,
                                   "lm_head.weight": wcls}
    for i in range(n_l):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rms_att[i]
        sd[p + "self_attn.q_proj.weight"] = _permute_rope(wq[i], hdr.n_heads)
        sd[p + "self_attn.k_proj.weight"] = _permute_rope(wk[i], hdr.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = wv[i]
        sd[p + "self_attn.o_proj.weight"] = wo[i]
        sd[p + "post_attention_layernorm.weight"] = rms_ffn[i]
        sd[p + "mlp.gate_proj.weight"] = w1[i]
        sd[p + "mlp.down_proj.weight"] = w2[i]
        sd[p + "mlp.up_proj.weight"] = w3[i]
    return sd


def config_from_header(hdr: Llama2cHeader) -> LlamaConfig:
    """The LlamaConfig equivalent to a llama2.c model (RMSNorm eps 1e-5, RoPE theta 10000, SiLU)."""
    from transformers import LlamaConfig  # noqa: F811

    return LlamaConfig(
        vocab_size=hdr.vocab_size,
        hidden_size=hdr.dim,
        intermediate_size=hdr.hidden_dim,
        num_hidden_layers=hdr.n_layers,
        num_attention_heads=hdr.n_heads,
        num_key_value_heads=hdr.n_kv_heads,
        head_dim=hdr.head_dim,
        hidden_act="silu",
        max_position_embeddings=hdr.seq_len,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=hdr.shared_classifier,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype=torch.float32,
        architectures=["LlamaForCausalLM"],
        attn_implementation="sdpa",
    )


def load_llama2c(path: Path) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Load a llama2.c v0 .bin as a float32 `transformers.LlamaForCausalLM` in eval mode.

    Returns (model, {"format": "llama2c", "source": str(path), "sha256": hex digest of the file}).
    Raises ModelLoadError for a missing, truncated, oversized or nonsensical file, or non-finite weights.
    """
    from transformers import LlamaForCausalLM  # noqa: F811 (lazy: importing transformers is slow)

    path = Path(path)
    hdr = read_header(path)
    has_freq = hdr.valid_sizes()[path.stat().st_size]
    payload = np.fromfile(path, dtype="<f4", offset=HEADER_BYTES)  # [n_floats]
    flat = torch.from_numpy(payload.astype(np.float32, copy=False))
    if not bool(torch.isfinite(flat).all()):
        raise ModelLoadError(f"{path}: corrupt llama2.c checkpoint, weights contain NaN or Inf")
    sd = _state_dict(hdr, flat, has_freq)

    model = LlamaForCausalLM(config_from_header(hdr)).to(torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # With a tied classifier lm_head.weight is the embedding; nothing else may be missing.
    missing = [k for k in missing if not (hdr.shared_classifier and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not match LlamaForCausalLM (missing {missing}, "
                             f"unexpected {unexpected})")
    if hdr.shared_classifier:
        model.tie_weights()
    model.eval()
    meta = {"format": "llama2c", "source": str(path), "sha256": _sha256(path)}
    return model, meta


__all__ = ["Llama2cHeader", "config_from_header", "load_llama2c", "read_header"]

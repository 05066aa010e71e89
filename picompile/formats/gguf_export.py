"""Convert a Hugging Face Llama-family checkpoint (safetensors) to a GGUF file for llama.cpp.

    from picompile.formats.gguf_export import export_gguf
    export_gguf(Path("ckpt"), Path("model.gguf"), outtype="f16")
    python -m picompile.formats.gguf_export CKPT OUT --outtype f16

Used by ``picompile bench`` to run llama.cpp (its native ``llama-bench``; ``llama-cpp-python`` for greedy
tokens) as a dense baseline on the very weights an artifact was built from. q8_0 / q4_0 files are not
written here: :func:`quantize_gguf` makes them from the f16 file with llama.cpp's own ``llama-quantize``
(built by ``benchmarks/build_llama_cpp.py``), as llama.cpp's users make them. Needs the optional ``gguf`` package
(``pip install 'picompile[bench]'``); nothing else in picompile imports this module.

What is written (the ``llama`` architecture, as llama.cpp's ``convert_hf_to_gguf.py`` writes it):

* hyper-parameters: context length, embedding length, block count, feed-forward length, head counts
  (and key/value lengths when ``head_dim`` is not ``hidden_size / num_attention_heads``), RoPE
  dimension count, frequency base and scaling (linear; ``llama3`` as a ``rope_freqs`` tensor), RMS-norm
  epsilon, vocabulary size, file type;
* tensors: 2-D weights as ``outtype`` (``f32`` or ``f16``), 1-D tensors and norms always f32. The
  Q and K projections (weights and biases) are permuted per head from Hugging Face's "rotate half"
  RoPE layout to the interleaved-pairs layout that llama.cpp's ``llama`` graph rotates (the
  ``permute`` of ``convert_hf_to_gguf.py``); ``lm_head`` is omitted when tied to the embeddings
  (llama.cpp then reuses ``token_embd``);
* a placeholder tokenizer (``tokenizer.ggml.model = "llama"``): ``vocab_size`` tokens, with unknown /
  BOS / EOS at the checkpoint's ids, the 256 byte tokens ``<0x00>``…``<0xFF>`` where the vocabulary has
  room, and ``<tokN>`` for the rest. Picompile's synthetic checkpoints have no tokenizer at all, and
  the benchmark feeds token ids directly, so the real tokenizer is never needed; text in or out of
  llama.cpp through this file is meaningless.

**Activation.** llama.cpp's ``llama`` architecture hard-codes SiLU in the FFN (``silu(gate) * up``);
there is no GGUF key for ReLU. A ReLU checkpoint (ReLU-LLaMA, ProSparse, picompile's synthetic
``*-relu`` checkpoints) therefore runs in llama.cpp with SiLU on the same weights: the same bytes and
FLOPs per token, so a fair *dense speed* baseline, but not the same outputs. Its logits match
Hugging Face's only for the same weights with ``hidden_act = "silu"``. The file's
``general.description`` says which activation the checkpoint had (``relu+drelu`` for a dReLU checkpoint,
config ``ffn_act: "drelu"``: llama.cpp's graph has no relu on the up branch either).

**Biases.** ``mlp_bias`` / ``attention_bias`` checkpoints (and any bias a Llama linear has) are written as
``blk.N.ffn_{gate,up,down}.bias`` and ``blk.N.attn_{q,k,v,output}.bias`` (q/k permuted as their weights),
which llama.cpp's ``llama`` graph loads as optional tensors and adds: the same model in llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from picompile.errors import PicompileError

OUTTYPES: tuple[str, ...] = ("f32", "f16")
ARCH: str = "llama"
LLAMA_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM")
SKIPPED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
N_BYTE_TOKENS: int = 256


def _gguf() -> Any:
    """The ``gguf`` package, or a PicompileError saying how to get it."""
    try:
        import gguf
    except ImportError as e:
        raise PicompileError("GGUF export needs the 'gguf' package: pip install 'picompile[bench]' "
                             "(or pip install gguf)") from e
    return gguf


# -- hyper-parameters ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaHParams:
    """What the GGUF metadata needs from a Llama ``config.json``."""

    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    rope: dict[str, Any]  # rope_type + its parameters ("default": none)
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    tied: bool
    hidden_act: str


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if value is not None else None


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings of a config, transformers 5 (``rope_parameters``) or 4 (``rope_theta`` + ``rope_scaling``)."""
    params = dict(config.get("rope_parameters") or {})
    if "full_attention" in params:  # per-layer-type form
        params = dict(params["full_attention"])
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = str(params.get("rope_type") or params.get("type") or "default")
    return params


def read_hparams(checkpoint_dir: Path) -> LlamaHParams:
    """Parse ``checkpoint_dir/config.json``; PicompileError unless it is a Llama-family checkpoint."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise PicompileError(f"{checkpoint_dir} has no config.json: give a Hugging Face checkpoint directory")
    config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    if config.get("model_type") not in ("llama", "mistral") and not set(archs) & set(LLAMA_ARCHITECTURES):
        raise PicompileError(f"{checkpoint_dir} is a {config.get('model_type') or archs} checkpoint; GGUF export "
                             f"handles Llama-family checkpoints only ({', '.join(LLAMA_ARCHITECTURES)})")
    n_head = int(config["num_attention_heads"])
    rope = rope_parameters(config)
    return LlamaHParams(
        name=Path(checkpoint_dir).resolve().name,
        n_vocab=int(config["vocab_size"]),
        n_embd=int(config["hidden_size"]),
        n_layer=int(config["num_hidden_layers"]),
        n_ff=int(config["intermediate_size"]),
        n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // n_head),
        n_ctx=int(config.get("max_position_embeddings") or 2048),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        rope=rope,
        bos_id=_first_id(config.get("bos_token_id")),
        eos_id=_first_id(config.get("eos_token_id")),
        pad_id=_first_id(config.get("pad_token_id")),
        tied=bool(config.get("tie_word_embeddings", False)),
        hidden_act=str(config.get("hidden_act", "silu")) + ("+drelu" if config.get("ffn_act") == "drelu" else ""),
    )


# -- tensors ---------------------------------------------------------------------------------------
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Q/K projection (weight ``[n_head*head_dim, in]`` or bias) per head from HF's
    rotate-half RoPE layout (pairs ``(i, i + d/2)``) to llama.cpp's interleaved pairs ``(2i, 2i + 1)``."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def llama3_rope_factors(hp: LlamaHParams) -> np.ndarray:
    """Per-frequency divisors of ``rope_type = "llama3"`` (the ``rope_freqs`` tensor llama.cpp reads)."""
    p = hp.rope
    freqs = 1.0 / (hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim))
    factor, low, high = float(p.get("factor", 8.0)), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@dataclass(frozen=True)
class PlannedTensor:
    """One GGUF tensor: its name, shape (row-major, as in numpy), dtype, and how to make its data."""

    name: str
    shape: tuple[int, ...]
    dtype: type
    load: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _safetensors_files(checkpoint_dir: Path) -> list[Path]:
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise PicompileError(f"{checkpoint_dir} has no *.safetensors files (GGUF export reads safetensors only)")
    return files


def _hf_tensors(checkpoint_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """HF tensor name -> (file, shape), from the safetensors headers (no data read)."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _safetensors_files(checkpoint_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out[name] = (file, tuple(int(n) for n in f.get_slice(name).get_shape()))
    return out


def _loader(file: Path, name: str, permute_heads: int | None, dtype: type) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            data = f.get_tensor(name).to(torch.float32).numpy()
        if permute_heads is not None:
            data = permute_qk(data, permute_heads)
        return np.ascontiguousarray(data.astype(dtype, copy=False))

    return load


def _gguf_dtype(gguf_name: str, shape: tuple[int, ...], outtype: str) -> type:
    """As convert_hf_to_gguf.py: 1-D tensors and norms stay f32, the rest is ``outtype``."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or outtype == "f32":
        return np.float32
    return np.float16


def plan_tensors(checkpoint_dir: Path, hp: LlamaHParams, outtype: str) -> list[PlannedTensor]:
    """Every tensor the GGUF gets, in checkpoint order, with its GGUF name and lazy data."""
    gguf = _gguf()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hp.n_layer)
    planned: list[PlannedTensor] = []
    if hp.rope["rope_type"].lower() == "llama3":
        factors = llama3_rope_factors(hp)
        planned.append(PlannedTensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                                     factors.shape, np.float32, lambda: factors))
    for hf_name, (file, shape) in _hf_tensors(checkpoint_dir).items():
        if hf_name.endswith(SKIPPED_SUFFIXES) or (hp.tied and hf_name == "lm_head.weight"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise PicompileError(f"{checkpoint_dir}: tensor {hf_name!r} has no llama GGUF name")
        heads = hp.n_head if hf_name.endswith(("q_proj.weight", "q_proj.bias")) else (
            hp.n_head_kv if hf_name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        dtype = _gguf_dtype(name, shape, outtype)
        planned.append(PlannedTensor(name, shape, dtype, _loader(file, hf_name, heads, dtype)))
    return planned


# -- metadata --------------------------------------------------------------------------------------
def write_hparams(writer: Any, hp: LlamaHParams, outtype: str) -> None:
    gguf = _gguf()
    writer.add_name(hp.name)
    writer.add_description(f"converted by picompile.formats.gguf_export from a Hugging Face checkpoint with "
                           f"hidden_act={hp.hidden_act}; llama.cpp's llama architecture computes SiLU"
                           f"{'' if hp.hidden_act == 'silu' else ' (same weights, different activation)'}; "
                           "placeholder tokenizer")
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    if hp.head_dim * hp.n_head != hp.n_embd:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_rope_dimension_count(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    write_rope_scaling(writer, hp)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if outtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)


def write_rope_scaling(writer: Any, hp: LlamaHParams) -> None:
    """Linear scaling as metadata; ``llama3`` goes in a tensor (see plan_tensors); others are refused."""
    gguf = _gguf()
    kind = hp.rope["rope_type"].lower()
    if kind == "linear" and hp.rope.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(hp.rope["factor"]))
    elif kind not in ("default", "llama3"):
        raise PicompileError(f"RoPE type {kind!r} is not supported by picompile's GGUF export "
                             "(default, linear and llama3 are)")


def placeholder_vocab(hp: LlamaHParams) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the placeholder SentencePiece-style vocabulary (see the module doc)."""
    gguf = _gguf()
    tokens = [f"<tok{i}>" for i in range(hp.n_vocab)]
    types = [int(gguf.TokenType.NORMAL)] * hp.n_vocab
    specials = {0: ("<unk>", gguf.TokenType.UNKNOWN)}
    for tid, text in ((hp.bos_id, "<s>"), (hp.eos_id, "</s>")):
        if tid is not None and 0 <= tid < hp.n_vocab:
            specials[tid] = (text, gguf.TokenType.CONTROL)
    for tid, (text, kind) in specials.items():
        tokens[tid], types[tid] = text, int(kind)
    free = [i for i in range(hp.n_vocab) if i not in specials]
    if len(free) > N_BYTE_TOKENS:  # byte fallback tokens, so llama.cpp finds "<0x0A>" (its newline token)
        for byte, tid in enumerate(free[:N_BYTE_TOKENS]):
            tokens[tid], types[tid] = f"<0x{byte:02X}>", int(gguf.TokenType.BYTE)
    scores = [-float(i) for i in range(hp.n_vocab)]
    return tokens, scores, types


def write_vocab(writer: Any, hp: LlamaHParams) -> None:
    tokens, scores, types = placeholder_vocab(hp)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    for tid, add in ((hp.bos_id, writer.add_bos_token_id), (hp.eos_id, writer.add_eos_token_id),
                     (hp.pad_id, writer.add_pad_token_id)):
        if tid is not None and 0 <= tid < hp.n_vocab:
            add(tid)
    writer.add_add_bos_token(False)  # callers feed token ids; nothing is prepended
    writer.add_add_eos_token(False)


# -- writing ---------------------------------------------------------------------------------------
def _write(path: Path, hp: LlamaHParams, tensors: Sequence[PlannedTensor], outtype: str,
           emit: Callable[[str], None]) -> None:
    """Stream the GGUF to ``path``: header, metadata, tensor infos, then one tensor at a time."""
    gguf = _gguf()
    writer = gguf.GGUFWriter(path, ARCH)
    try:
        write_hparams(writer, hp, outtype)
        write_vocab(writer, hp)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            emit(f"writing {t.name} ({i + 1}/{len(tensors)})")
            data = t.load()
            if data.shape != t.shape or data.dtype != np.dtype(t.dtype):
                raise PicompileError(f"tensor {t.name}: got {data.shape} {data.dtype}, planned {t.shape} {np.dtype(t.dtype)}")
            writer.write_tensor_data(data)
    finally:
        writer.close()


def export_gguf(checkpoint_dir: Path, out: Path, outtype: str = "f16", *,
                emit: Callable[[str], None] = lambda s: None) -> Path:
    """Convert the Llama-family HF checkpoint ``checkpoint_dir`` to the GGUF ``out`` and return ``out``.

    ``outtype``: ``f32`` or ``f16`` (2-D weights; norms stay f32). The file appears atomically
    (written beside ``out`` under a temporary name, then renamed); an existing ``out`` is replaced.
    """
    if outtype not in OUTTYPES:
        raise PicompileError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    hp = read_hparams(checkpoint_dir)
    tensors = plan_tensors(checkpoint_dir, hp, outtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write(tmp, hp, tensors, outtype, emit)
        tmp.chmod(0o644)  # mkstemp made it private
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


QUANT_TYPES: dict[str, str] = {"q8_0": "Q8_0", "q4_0": "Q4_0"}  # GGUF type -> llama-quantize's name for it


def quantize_gguf(src: Path, out: Path, qtype: str, llama_quantize: Path, timeout_s: float = 3600.0) -> Path:
    """``llama-quantize SRC OUT Q8_0|Q4_0``: the f16/f32 GGUF ``src`` quantized the way llama.cpp's users do it
    (its default choices per tensor, e.g. a higher-precision output layer for Q4_0); ``out`` appears atomically.

    A PicompileError names a bad ``qtype``, a missing ``src`` or the tool's last error line.
    """
    import subprocess

    if qtype not in QUANT_TYPES:
        raise PicompileError(f"quantized GGUF type must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise PicompileError(f"GGUF file {src} does not exist")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        try:
            proc = subprocess.run([str(llama_quantize), str(src), str(tmp), QUANT_TYPES[qtype]], capture_output=True,
                                  text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PicompileError(f"could not run {llama_quantize}: {e}") from None
        if proc.returncode != 0 or not tmp.is_file():
            last = ((proc.stderr + proc.stdout).strip().splitlines() or ["(no output)"])[-1]
            raise PicompileError(f"llama-quantize {qtype} of {src.name} failed (exit {proc.returncode}): {last}")
        tmp.chmod(0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def tensor_names(hp: LlamaHParams) -> Iterator[str]:
    """The GGUF tensor names a plain Llama checkpoint converts to (for checks)."""
    yield "token_embd.weight"
    for i in range(hp.n_layer):
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                     "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
            yield f"blk.{i}.{part}.weight"
    yield "output_norm.weight"
    if not hp.tied:
        yield "output.weight"


# -- command line ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m picompile.formats.gguf_export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="Hugging Face Llama-family checkpoint directory (safetensors)")
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--outtype", choices=OUTTYPES, default="f16", help="type of the 2-D weights (default f16)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    emit: Callable[[str], None] = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr))
    try:
        path = export_gguf(args.checkpoint, args.out, args.outtype, emit=emit)
    except PicompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

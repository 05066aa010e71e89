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


# -- synthetic activation-sparse checkpoints too big to hold: generated and written layer by layer ----------------
def write_synthetic_streamed(params: Any, out: Path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 1 << 30,
                             measure_tokens: int = 256, emit: Any = lambda s: None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """:mod:`picompile.tools.synthetic_model`'s construction (Llama family), one decoder layer at a time: the
    layer is drawn in float32, calibrated on the hidden states of the calibration tokens, measured on other random
    tokens (hooks on its ReLU, as ``measure_sparsity``), written in ``dtype`` and dropped. Memory holds the
    embeddings, the head (float32) and one layer. The draws come in another order than the in-memory generator's,
    so the same seed gives other weights. Returns (description, measured per-layer rows); writes the shards and
    their index into ``out`` (config.json is the caller's)."""
    from transformers.initialization import no_init_weights

    from picompile.sparsity.profile_stats import LayerProfile, locality
    from picompile.tools import synthetic_model as sm

    shape = params.shape_of()
    if shape.family != "llama":
        raise ValueError("the streamed generator makes Llama-family checkpoints")
    gen = torch.Generator().manual_seed(params.seed)
    d, c = shape.d_model, shape.d_model - 1
    p_sorted, a, alpha = sm.power_law_frequencies(shape.n_neurons, params.active, params.locality, params.p_max)
    rank = params.rank(d)
    init = sm._Init(gen, sm._residual_basis(d, rank, True, gen), params.subspace_share, c)
    one = sm._hf_config(shape)
    one.num_hidden_layers = 1
    with no_init_weights(), torch.random.fork_rng(devices=[]):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(one, dtype=torch.float32, attn_implementation="sdpa").eval()
    writer = ShardWriter(out, shard_bytes)
    with torch.no_grad():
        emb = sm._subspace_rows(shape.vocab, init.basis, init.share, 1.0, init.gen)  # [vocab, d]
        emb[:, c] = params.const_value
        head = init.normal(shape.vocab, d, std=1.0 / math.sqrt(d))
        head[:, c] = 0.0
        writer.add("model.embed_tokens.weight", emb.to(dtype))
        writer.add("lm_head.weight", head.to(dtype))
        writer.add("model.norm.weight", torch.ones(d, dtype=dtype))
        del head
        model.model.embed_tokens.weight.copy_(emb)
        b, t = sm.seq_shape(params.calibration_tokens, shape.max_pos)
        h, kwargs = sm._layer_kwargs(model, torch.randint(0, shape.vocab, (b, t), generator=gen))
        bm, tm = sm.seq_shape(measure_tokens, shape.max_pos)
        ids_m = torch.randint(0, shape.vocab, (bm, tm), generator=torch.Generator().manual_seed(params.seed + 1))
        h_m, kwargs_m = sm._layer_kwargs(model, ids_m)
        del emb
        keep = list(range(d - 1))
        target = sm._rms(h[..., keep]) / math.sqrt(shape.n_layers)
        layer = sm.decoder_layers(model)[0]
        layers_info, stats = [], []
        for i in range(shape.n_layers):
            sm._init_llama_layer(layer, shape, init)
            h, info = sm._calibrate_layer(layer, h, kwargs, shape, p_sorted, target, gen)
            layers_info.append({"layer": i, **info, "residual_rms": sm._rms(h[..., keep])})
            seen: list[torch.Tensor] = []
            hook = layer.mlp.act_fn.register_forward_hook(lambda _m, _a, o: seen.append((o > 0).reshape(-1, o.shape[-1])))
            try:
                out_m = layer(h_m, **kwargs_m)
            finally:
                hook.remove()
            h_m = out_m[0] if isinstance(out_m, tuple) else out_m
            active = torch.cat(seen)
            prof = LayerProfile(active.sum(0).numpy().astype("int64"), int(active.shape[0]), name=f"layer{i}")
            stats.append({"layer": i, "n_neurons": prof.n_neurons, "n_tokens": prof.n_tokens, "active": 1.0 - prof.sparsity,
                          "sparsity": prof.sparsity, "locality": prof.locality, "locality_50": locality(prof.counts, 0.5),
                          "dead_fraction": prof.dead_fraction})
            for name, tensor in layer.state_dict().items():
                writer.add(f"model.layers.{i}.{name}", tensor.to(dtype))
            emit(f"layer {i + 1}/{shape.n_layers}: active {stats[-1]['active']:.3f}, locality {prof.locality:.3f}")
    writer.close()
    description = {
        "power_law": {"a": a, "alpha": alpha, "p_max": params.p_max, "design_mean": float(p_sorted.mean())},
        "subspace_rank": rank, "branch_rms": target, "const_dim": c, "calibration": {"batch": b, "seq_len": t},
        "layers": layers_info, "streamed": True, "dtype": str(dtype).removeprefix("torch."),
    }
    return description, stats

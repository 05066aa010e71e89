"""Step 3 of ``benchmarks/gpu_check.py``: decode and prefill tok/s of the hybrid artifact and its peers.

Engines (each a ``(prefill, decode)`` pair of greedy steps; medians of ``rounds`` rounds after a warm-up):

* ``hybrid_<mode>``: the artifact with ``hybrid="cuda"`` (the dry run: ``"thread"``);
* ``artifact_cpu``: the same artifact with ``hybrid="off"``: both partitions on the CPU;
* ``torch_dense_gpu``: the artifact's HF architecture in torch, float16, every weight on the GPU;
* ``layer_offload``: the same with as many whole float16 layers as the VRAM budget holds on the GPU and the
  rest float32 on the CPU (``llama.cpp -ngl``), hidden states moved between them by forward pre-hooks.

The torch models are randomly initialised from the artifact's own HF config: their speed does not depend on
the values, and the checkpoint (float32) need not travel. In the dry run every "GPU" is the CPU.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Engine = tuple[Callable[[list[int]], tuple[Any, int]], Callable[[Any, int], int]]


def prompt_ids(vocab: int, n: int) -> list[int]:
    """A seeded random prompt (the synthetic models have no tokenizer)."""
    import torch

    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(11)).tolist()


def session_engine(session: Any) -> Engine:
    import torch

    def prefill(ids: list[int]) -> tuple[Any, int]:
        dec = session.decoder()
        return dec, int(torch.argmax(dec.feed(ids)[-1]))

    def decode(dec: Any, tok: int) -> int:
        return int(torch.argmax(dec.feed([tok])[-1]))

    return prefill, decode


def torch_engine(model: Any, first: str) -> Engine:
    """Greedy decode of an HF model with its KV cache; ``first`` is the device of its embedding. The cache
    argument is ``cache`` in transformers >= 5.24 and ``past_key_values`` before (the device has 5.17)."""
    import inspect

    import torch

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(ids: list[int]) -> tuple[Any, int]:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], device=first), use_cache=True)
        return getattr(out, name), int(torch.argmax(out.logits[0, -1]))

    def decode(cache: Any, tok: int) -> int:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[tok]], device=first), use_cache=True, **{name: cache})
        return int(torch.argmax(out.logits[0, -1]))

    return prefill, decode


def hf_model(config: dict[str, Any], dtype: Any, device: str) -> Any:
    """The artifact's architecture, randomly initialised (speed does not depend on the values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "picompile_synthetic"})
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()


def _to_device_hook(device: Any, dtype: Any) -> Callable[..., Any]:
    """A forward pre-hook moving every tensor argument (and tuple of tensors) to ``device``, floats in ``dtype``."""
    import torch

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return one(v)
        if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            return tuple(one(t) for t in v)
        return v

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    return hook


def offload_model(config: dict[str, Any], budget: int, gpu: str) -> tuple[Any, dict[str, Any]]:
    """Layer offload (``llama.cpp -ngl``): as many whole layers as ``budget`` holds in float16 on ``gpu``, the rest
    float32 on the CPU; the embedding on the CPU; the final norm and lm_head on the GPU only when they fit too."""
    import torch

    model = hf_model(config, torch.float32, "cpu")
    layers = model.model.layers
    layer_bytes = sum(p.numel() for p in layers[0].parameters()) * 2
    tail_bytes = sum(p.numel() for m in (model.model.norm, model.lm_head) for p in m.parameters()) * 2
    n_gpu = int(min(len(layers), budget // layer_bytes))
    tail_on_gpu = n_gpu == len(layers) and n_gpu * layer_bytes + tail_bytes <= budget
    for i, mod in enumerate([*layers, model.model.norm, model.lm_head]):
        on_gpu = i < n_gpu if i < len(layers) else tail_on_gpu
        if on_gpu:
            mod.to(device=gpu, dtype=torch.float16)
        hook = _to_device_hook(torch.device(gpu if on_gpu else "cpu"), torch.float16 if on_gpu else torch.float32)
        mod.register_forward_pre_hook(hook, with_kwargs=True)
    gpu_bytes = n_gpu * layer_bytes + (tail_bytes if tail_on_gpu else 0)
    return model, {"gpu_layers": n_gpu, "layers": len(layers), "tail_on_gpu": tail_on_gpu, "layer_bytes": layer_bytes,
                   "gpu_bytes": gpu_bytes, "budget_bytes": budget}


def measure(engine: Engine, prompt: list[int], n: int, rounds: int,
            sync: Callable[[], None]) -> dict[str, float]:
    """Median prefill and decode tok/s over ``rounds`` rounds after one warm-up round."""
    prefill, decode = engine
    pre, dec = [], []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        state, tok = prefill(prompt)
        sync()
        t1 = time.perf_counter()
        for _ in range(n):
            tok = decode(state, tok)
        sync()
        if r:
            pre.append(len(prompt) / (t1 - t0))
            dec.append(n / (time.perf_counter() - t1))
    return {"prefill_tokens_per_s": statistics.median(pre), "decode_tokens_per_s": statistics.median(dec)}


def throughput_step(art: Path, budget: int, mode: str, gpu: str, prompt_len: int, n: int, rounds: int) -> dict[str, Any]:
    """tok/s of hybrid, the artifact on the CPU, dense torch on the GPU, layer offload (dry run: ``gpu`` = "cpu")."""
    import torch

    import picompile

    config = picompile.load(art, hybrid="off", kernels="artifact").manifest.model["config"]
    sync = torch.cuda.synchronize if gpu == "cuda" else (lambda: None)
    prompt = prompt_ids(int(config["vocab_size"]), prompt_len)
    out: dict[str, Any] = {}
    out[f"hybrid_{mode}"] = measure(session_engine(picompile.load(art, hybrid=mode, kernels="artifact")), prompt, n, rounds, sync)
    out["artifact_cpu"] = measure(session_engine(picompile.load(art, hybrid="off", kernels="artifact")), prompt, n, rounds, sync)
    dense = hf_model(config, torch.float16 if gpu == "cuda" else torch.float32, gpu)
    out["torch_dense_gpu"] = measure(torch_engine(dense, gpu), prompt, n, rounds, sync)
    del dense
    model, placed = offload_model(config, budget, gpu)
    out["layer_offload"] = {**measure(torch_engine(model, "cpu"), prompt, n, rounds, sync), **placed}
    return {"ok": True, "devices": gpu, "prompt_len": len(prompt), "decode_tokens": n, "rounds": rounds, **out}

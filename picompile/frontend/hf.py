"""Import a Hugging Face causal-LM checkpoint (a local directory, or a hub id passed through)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.base import check_config_bounds

# architecture class name -> family; a family names the FFN pattern canonicalize-ffn expects.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "OPTForCausalLM": "opt",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "FalconForCausalLM": "falcon",
    "Qwen2ForCausalLM": "llama",  # Llama's layers with q/k/v biases (no o bias)
}
_MODEL_TYPES: dict[str, str] = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM"}
# config.json key naming a gated FFN's activation form beyond transformers' ``hidden_act`` (applied to the gate):
# "drelu" = dReLU, TurboSparse's ``down(relu(gate x) * relu(up x))`` (with ``hidden_act: "relu"``); absent or
# "gated" = transformers' own ``down(act(gate x) * up x)``
FFN_ACT_KEY: str = "ffn_act"
FFN_ACTS: tuple[str, ...] = ("gated", "drelu")


def _relu_output(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    return torch.relu(out)


def apply_ffn_act(model: torch.nn.Module, config: Mapping[str, Any], where: str) -> torch.nn.Module:
    """``model`` computing the FFN form ``config[FFN_ACT_KEY]`` names: for "drelu", a forward hook on every
    layer's ``mlp.up_proj`` applies relu to its output (an instance's hook: transformers' modules and the
    parameters' names stay as they are; torch.export traces it as one aten.relu, which canonicalize-ffn matches
    as act "drelu"). Anything else is a one-line ModelLoadError."""
    form = config.get(FFN_ACT_KEY, "gated")
    if form not in FFN_ACTS:
        raise ModelLoadError(f"{where}: {FFN_ACT_KEY} {form!r} is not one of {', '.join(map(repr, FFN_ACTS))}")
    if form == "gated":
        return model
    if config.get("hidden_act") != "relu":
        raise ModelLoadError(f"{where}: {FFN_ACT_KEY} 'drelu' needs hidden_act 'relu', not {config.get('hidden_act')!r}")
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp") and hasattr(m, "up_proj")]
    if not mlps:
        raise ModelLoadError(f"{where}: {FFN_ACT_KEY} 'drelu' needs a gated FFN (mlp.up_proj), which this model lacks")
    for mlp in mlps:
        if not getattr(mlp.up_proj, "_picompile_drelu", False):
            mlp.up_proj.register_forward_hook(_relu_output)
            mlp.up_proj._picompile_drelu = True
    return model


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def architecture_of(config: dict[str, Any], where: str) -> str:
    """The architecture class named by a config dict; unsupported ones raise with the supported list."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(str(config.get("model_type")), str(config.get("model_type")))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"unsupported architecture {arch} in {where}; supported: {supported_list()}")
    return arch


def read_config(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory (or the file itself), validated before any weight is read."""
    cfg_file = path if path.is_file() else path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face checkpoint directory (no config.json in it)")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg_file} does not hold a JSON object")
    return config


def _check_weight_files(path: Path) -> None:
    """Open every safetensors file once so a corrupt or truncated one fails with its name."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files and not list(path.glob("*.bin")):
        raise ModelLoadError(f"{path} has a config.json but no weights (*.safetensors)")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    sf.get_slice(key)
        except Exception as e:  # safetensors raises its own SafetensorError / OSError
            raise ModelLoadError(f"corrupt or truncated weights file {f}: {e}") from None
        # safe_open checks the header; a truncated tensor section shows only in the file size.
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if f.stat().st_size < 8 + n + end:
            raise ModelLoadError(
                f"corrupt or truncated weights file {f}: {f.stat().st_size} bytes, header needs {8 + n + end}"
            )


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names (sharded), else every one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
        bad = [str(n) for n in names if not isinstance(n, str) or Path(n).name != n or not (path / n).is_file()]
        if bad:
            raise ModelLoadError(f"{index} names shards that are not files in {path}: {', '.join(bad[:3])}")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def map_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, in its stored dtype, mapped from its files (nothing is copied)."""
    from picompile.formats.tensorfile import TensorFileError, map_safetensors

    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        try:
            tensors.update(map_safetensors(f))
        except (TensorFileError, OSError, ValueError) as e:
            raise ModelLoadError(str(e) if isinstance(e, TensorFileError) else f"cannot map {f}: {e}") from None
    return tensors


def model_from_tensors(config: Any, tensors: Mapping[str, torch.Tensor], where: str) -> torch.nn.Module:
    """An HF causal LM of ``config`` (a transformers config) whose parameters are ``tensors``, bound as they are.

    The model is made without allocating its weights (parameters uninitialised, never touched; buffers such as
    rotary frequencies computed as usual), then each parameter is replaced by the tensor of its name: a mapped
    bfloat16 checkpoint stays mapped bfloat16. Tied weights (``tie_word_embeddings``) may be absent. Any other
    frontend that has a state-dict-like mapping (a GGUF file's dequantized tensors) can build its model here.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    expected = dict(model.named_parameters(remove_duplicate=False))
    unknown = [k for k in tensors if k not in expected and not k.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise ModelLoadError(f"{where} holds {len(unknown)} tensors this model does not have, e.g. {unknown[:3]}")
    for name, t in tensors.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{where}: tensor {name} is {tuple(t.shape)}, the config implies "
                                 f"{tuple(expected[name].shape)}")
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    bound = {tensors[k].data_ptr() for k in tensors if k in expected}
    missing = [k for k, p in model.named_parameters(remove_duplicate=False) if k not in tensors
               and not (p.data_ptr() in bound and p.numel() > 0)]
    if missing:
        raise ModelLoadError(f"checkpoint {where} lacks weights for {len(missing)} tensors, e.g. {missing[:3]}")
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def stored_dtype(model: torch.nn.Module) -> str:
    """The dtype most of a model's parameter bytes are stored in ("bfloat16", "float16", "float32")."""
    by: dict[torch.dtype, int] = {}
    for p in model.parameters():
        by[p.dtype] = by.get(p.dtype, 0) + p.numel()
    return str(max(by, key=lambda d: by[d])).removeprefix("torch.") if by else "float32"


def _from_pretrained(source: str, spec: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers' own loader, in the checkpoint's stored dtype (a hub id, .bin checkpoints, renamed keys)."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype="auto", attn_implementation="sdpa", output_loading_info=True
        )
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/EnvironmentError variously
        raise ModelLoadError(f"could not load model {spec!r}: {type(e).__name__}: {e}") from None
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("rotary_emb.inv_freq")]
    if missing:
        raise ModelLoadError(f"checkpoint {spec} lacks weights for {len(missing)} tensors, e.g. {missing[:3]}")
    return model, info


def load_hf(spec: str) -> tuple[torch.nn.Module, dict[str, Any], str, dict[str, Any] | None]:
    """Load (model, config dict, architecture, tokenizer source) from a checkpoint dir or hub id.

    A directory of safetensors files is mapped and its tensors bound in their stored dtype
    (:func:`model_from_tensors`): nothing is copied or widened; capture widens what the graph computes with.
    Checkpoints whose tensor names this model does not have (older layouts transformers renames), ``.bin``
    checkpoints and hub ids go through transformers' loader, also in their stored dtype.
    """
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    path = Path(spec)
    model: torch.nn.Module | None = None
    if path.exists():
        config = read_config(path)
        arch = architecture_of(config, str(path / "config.json"))
        check_config_bounds(config, str(path / "config.json") if path.is_dir() else str(path))
        _check_weight_files(path)
        source: str = str(path)
        if path.is_dir() and checkpoint_files(path):
            try:
                hf_config = AutoConfig.from_pretrained(source)
            except Exception as e:
                raise ModelLoadError(f"could not read the config of {spec!r}: {type(e).__name__}: {e}") from None
            try:
                model = model_from_tensors(hf_config, map_checkpoint(path), spec)
            except ModelLoadError as e:
                if "does not have" not in str(e):
                    raise
                model = None  # names of another layout: transformers knows the renames
    else:
        arch = ""
        source = spec
    if model is None:
        model, _ = _from_pretrained(source, spec)
    config = model.config.to_dict()
    if not arch:
        arch = architecture_of(config, spec)
    apply_ffn_act(model, config, spec)
    tokenizer = None
    if path.exists() and (path / "tokenizer.json").is_file():
        tokenizer = {"kind": "hf", "path": str(path)}
    return model.eval(), config, arch, tokenizer

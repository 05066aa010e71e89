"""Import a Hugging Face causal-LM checkpoint (a local directory, or a hub id passed through)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from picompile.errors import ModelLoadError, UnsupportedArchitectureError
from picompile.frontend.base import check_config_bounds

# architecture class name -> family; a family names the FFN pattern canonicalize-ffn expects.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "OPTForCausalLM": "opt",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "FalconForCausalLM": "falcon",
}
_MODEL_TYPES: dict[str, str] = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


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


def load_hf(spec: str) -> tuple[torch.nn.Module, dict[str, Any], str, dict[str, Any] | None]:
    """Load (model, config dict, architecture, tokenizer source) from a checkpoint dir or hub id."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    path = Path(spec)
    if path.exists():
        config = read_config(path)
        arch = architecture_of(config, str(path / "config.json"))
        check_config_bounds(config, str(path / "config.json") if path.is_dir() else str(path))
        _check_weight_files(path)
        source: str = str(path)
    else:
        arch = ""
        source = spec
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
        )
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError/ValueError/EnvironmentError variously
        raise ModelLoadError(f"could not load model {spec!r}: {type(e).__name__}: {e}") from None
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("rotary_emb.inv_freq")]
    if missing:
        raise ModelLoadError(f"checkpoint {spec} lacks weights for {len(missing)} tensors, e.g. {missing[:3]}")
    config = model.config.to_dict()
    if not arch:
        arch = architecture_of(config, spec)
    tokenizer = None
    if path.exists() and (path / "tokenizer.json").is_file():
        tokenizer = {"kind": "hf", "path": str(path)}
    return model.eval(), config, arch, tokenizer

"""profile.safetensors: per-layer activation counts from the calibration corpus (``layer{i}.counts`` int64
[n_neurons], ``n_tokens`` int64 [1])."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from picompile.sparsity.profile_stats import LayerProfile

PROFILE_FILE = "profile.safetensors"


def counts_tensor(prof: LayerProfile) -> torch.Tensor:
    return torch.as_tensor(np.asarray(prof.counts, dtype=np.int64))


def write_profile(path: Path, profiles: dict[int, LayerProfile], n_tokens: int) -> None:
    tensors = {f"layer{index}.counts": counts_tensor(prof) for index, prof in profiles.items()}
    tensors["n_tokens"] = torch.tensor([int(n_tokens)], dtype=torch.int64)
    save_file(tensors, str(path))


def update_counts(path: Path, profiles: dict[int, LayerProfile]) -> None:
    """Rewrite the activation counts of these layers in the profile file (after their thresholds moved)."""
    tensors = dict(load_file(str(path)))
    for index, prof in profiles.items():
        tensors[f"layer{index}.counts"] = counts_tensor(prof)
    save_file(tensors, str(path))

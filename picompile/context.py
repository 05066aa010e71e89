"""The build context handed to every pass: configuration, target, model and the facts passes record."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

from picompile.config import BuildConfig
from picompile.frontend.base import ModelInfo
from picompile.targets import Target


@dataclass
class FFNLayer:
    """One FFN block found in the graph (filled in by canonicalize-ffn, extended by later passes)."""

    index: int  # 0-based decoder layer
    kind: str  # "mlp" (up → act → down) or "gated" (act(gate) * up → down)
    act: str  # "relu" | "silu" | "gelu" | "gelu_tanh" | "drelu"
    d_model: int
    n_neurons: int
    module: str  # qualified module name in the source model, e.g. "model.layers.0.mlp"
    weights: dict[str, str] = field(default_factory=dict)  # role ("up", "down", …) -> graph attribute
    stats: dict[str, Any] = field(default_factory=dict)  # what later passes measure: sparsity, n_hot, recall, …

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "act": self.act,
            "d_model": self.d_model,
            "n_neurons": self.n_neurons,
            "module": self.module,
            "weights": dict(self.weights),
            **self.stats,
        }


T = TypeVar("T")


def _no_progress(items: Iterable[T], description: str) -> Iterator[T]:
    yield from items


@dataclass
class BuildContext:
    """Shared state of one build. Passes read settings only from here (no globals, no environment)."""

    config: BuildConfig
    target: Target
    model: torch.nn.Module  # the source model (eval mode, float32)
    info: ModelInfo
    staging_dir: Path  # where the package pass writes; renamed to config.output on success
    pipeline: list[str] = field(default_factory=list)  # pass names this build runs
    ffn_layers: list[FFNLayer] = field(default_factory=list)
    manifest_extra: dict[str, Any] = field(default_factory=dict)  # sections later passes add
    tokenizer: Any | None = None  # picompile.formats.tokenizers.Tokenizer of the model, if it has one
    calibration: dict[int, Any] = field(default_factory=dict)  # layer -> LayerCalibration (profile pass)
    calibration_ids: torch.Tensor | None = None  # [T] the calibration token ids (profile pass)
    predictors: dict[int, Any] = field(default_factory=dict)  # layer -> Predictor (train-predictors)
    placement: Any | None = None  # picompile.sparsity.placement.Placement (place-neurons)
    track: Callable[[Iterable[Any], str], Iterator[Any]] = _no_progress  # progress bar over a loop
    pass_times: dict[str, float] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        """Context length of the artifact: the build option, else the model's own."""
        return self.config.max_seq_len or self.info.max_seq_len

"""Build configuration: everything a pass may read comes from here (through the BuildContext)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

PredictorMode = Literal["trained", "oracle", "none"]


def default_cache_dir() -> Path:
    """$PICOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/picompile, else ~/.cache/picompile (read when a config is made)."""
    import os

    if os.environ.get("PICOMPILE_CACHE_DIR"):
        return Path(os.environ["PICOMPILE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picompile"


@dataclass
class BuildConfig:
    """Options of ``picompile build`` (CLI flags map one to one)."""

    model: str  # HF checkpoint dir | hub id | .bin (llama2.c)
    output: Path
    target: str = "cpu"
    vram_budget_gib: float | None = None  # overrides the target preset's VRAM
    pipeline: str = "default"
    predictor: PredictorMode = "trained"
    max_seq_len: int | None = None  # context length of the artifact; None = model's own
    calibration: Path | None = None  # text or token file for profiling; None = built-in default
    calibration_tokens: int = 4096  # tokens profiled (and used to train predictors)
    act_sparsity: float = 0.5  # non-ReLU FFNs: per-layer |act| threshold giving this inactive fraction
    recall_target: float = 0.99  # predictor threshold tuned to find this share of active neurons
    predictor_budget: float = 0.1  # all predictors together, as a fraction of FFN parameters
    predictor_epochs: int = 20
    placement_batch: int = 64  # neurons per placement decision (PowerInfer: 64 in the paper, 256 in code)
    min_layer_neurons: int = 0  # a layer using the GPU holds at least this many hot neurons (0 = off)
    kernel_cache: Path = field(default_factory=lambda: default_cache_dir() / "kernels")  # compiled TVM kernels
    seed: int = 0
    print_after: list[str] = field(default_factory=list)  # pass names, or "all"
    dump_ir: Path | None = None  # one readable file per pass
    progress: bool = True

    def validate(self) -> None:
        """Range checks of the numeric options; a bad value names its flag."""
        from picompile.errors import PicompileError

        checks = [
            (0.0 <= self.act_sparsity < 1.0, "--act-sparsity must be in [0, 1)", self.act_sparsity),
            (0.0 < self.recall_target <= 1.0, "--recall-target must be in (0, 1]", self.recall_target),
            (0.0 < self.predictor_budget <= 1.0, "--predictor-budget must be in (0, 1]", self.predictor_budget),
            (self.placement_batch >= 1, "--placement-batch must be >= 1", self.placement_batch),
            (self.min_layer_neurons >= 0, "--min-layer-neurons must be >= 0", self.min_layer_neurons),
            (self.calibration_tokens >= 16, "--calibration-tokens must be >= 16", self.calibration_tokens),
            (self.predictor_epochs >= 1, "predictor_epochs must be >= 1", self.predictor_epochs),
            (self.predictor in ("trained", "oracle", "none"), "--predictor must be trained, oracle or none", self.predictor),
            (self.max_seq_len is None or self.max_seq_len >= 2, "--max-seq-len must be >= 2", self.max_seq_len),
        ]
        for ok, message, value in checks:
            if not ok:
                raise PicompileError(f"{message}, got {value!r}")

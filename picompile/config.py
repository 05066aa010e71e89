"""Build configuration: everything a pass may read comes from here (through the BuildContext)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

PredictorMode = Literal["trained", "oracle", "none"]


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
    calibration_tokens: int = 4096
    seed: int = 0
    print_after: list[str] = field(default_factory=list)  # pass names, or "all"
    dump_ir: Path | None = None  # one readable file per pass
    progress: bool = True

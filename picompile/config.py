"""Build configuration: everything a pass may read comes from here (through the BuildContext)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

PredictorMode = Literal["trained", "oracle", "none"]
PredictorKind = Literal["linear", "mlp"]
SparsityAllocation = Literal["greedy", "uniform"]
# default recall targets (measured on the embedded ReLU model and stories260K: benchmarks/README.md, "Accuracy")
RELU_RECALL: float = 0.95
DENSE_RECALL: float = 0.99
ActCriterion = Literal["gate", "product"]
WeightDType = Literal["float32", "float16", "int8", "int4"]  # int8/int4: picompile.kernels.qformat
PredictorDType = Literal["auto", "float32", "float16", "int8"]
InputSparsity = Literal["off", "attention", "all"]  # sparsify-inputs: which projections get input thresholds
InputCriterion = Literal["magnitude", "weighted"]  # sparsify-inputs: keep channel i by |x_i| or |x_i|·‖W[:, i]‖₂
CalibrationSource = Literal["auto", "sampled", "builtin"]  # without --calibration: text sampled from the model or not


def default_cache_dir() -> Path:
    """$PICOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/picompile, else ~/.cache/picompile (read when a config is made)."""
    import os

    if os.environ.get("PICOMPILE_CACHE_DIR"):
        return Path(os.environ["PICOMPILE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "picompile"


# an LLVM CPU name, as picompile.kernels.cpu.MCPU_RE accepts (the kernels import nothing of picompile, and the
# config nothing above it: the rule is stated in both, checked here before a build starts)
MCPU_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def kernel_cache_dir() -> Path:
    """Where compiled TVM kernels are kept, by spec key: what builds compile into and loads compile from."""
    return default_cache_dir() / "kernels"


def calibration_cache_dir() -> Path:
    """Where calibration ids sampled from a model are kept, by model fingerprint (a second build reuses them)."""
    return default_cache_dir() / "calibration"


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
    calibration: Path | None = None  # text or token file for profiling; None = calibration_source decides
    calibration_source: CalibrationSource = "auto"  # no --calibration: "sampled" from the model itself (cached per
    # model), "builtin" text, or "auto" = sampled when input sparsity is on and the model can generate, else builtin
    calibration_cache: Path = field(default_factory=calibration_cache_dir)  # sampled calibration ids
    calibration_tokens: int = 4096  # tokens profiled (and used to train predictors)
    act_sparsity: float = 0.5  # non-ReLU FFNs: per-layer |act| threshold giving this inactive fraction
    act_criterion: ActCriterion = "gate"  # non-ReLU gated FFNs: |act(gate)| (CATS) or |act(gate)·up| (product)
    sparsity_allocation: SparsityAllocation = "uniform"  # non-ReLU FFNs: per-layer thresholds against the loss
    allocation_step: float = 0.05  # greedy allocation: sparsity added to one layer per step
    allocation_tokens: int = 2048  # calibration tokens the allocation's loss is measured on
    input_sparsity: InputSparsity = "off"  # TEAL-style |x| thresholds on the inputs of q/k/v and o ("attention"), and
    # of gate/up and down of SiLU/GELU FFNs too ("all"; ReLU FFNs keep their neuron predictor)
    input_allocation: SparsityAllocation = "greedy"  # per-tensor input sparsities by measured loss per byte, or uniform
    input_criterion: InputCriterion = "magnitude"  # keep input channel i by |x_i| (TEAL) or |x_i|·‖W[:, i]‖₂ (WINA)
    accuracy_budget: float | None = None  # input sparsity: max relative perplexity increase on held-out calibration
    # tokens (0.01 = +1 %); None = --act-sparsity is the fraction of those projections' weight bytes skipped per token
    input_loss_tokens: int = 512  # held-out calibration tokens the input-sparsity loss curves are measured on
    recall_target: float | None = None  # predictor threshold tuned to find this share of active neurons;
    # None = RELU_RECALL when every FFN is ReLU (sparse, redundant: misses cost little), else DENSE_RECALL
    predictor_budget: float = 0.2  # all predictors together, as a fraction of FFN parameters
    predictor_kind: PredictorKind = "linear"  # linear: reduced-rank regression (Deja Vu form); mlp: PowerInfer's, BCE
    predictor_epochs: int = 20  # mlp predictors only
    weight_dtype: WeightDType = "float32"  # linear and FFN weights in the artifact (pass convert-weights)
    quant_block: int = 32  # int8/int4: elements per float16 scale (picompile.kernels.qformat.BLOCKS)
    predictor_dtype: PredictorDType = "auto"  # trained predictors' fc1/fc2 (an approximation already: the threshold is
    # tuned on the rounded weights); auto: int8 (per-row scales folded away) in int8/int4 builds, else float16
    # (``predictor_storage``)
    placement_batch: int = 64  # neurons per placement decision (PowerInfer: 64 in the paper, 256 in code)
    min_layer_neurons: int = 0  # a layer using the GPU holds at least this many hot neurons (0 = off)
    kernel_cache: Path = field(default_factory=kernel_cache_dir)  # compiled TVM kernels
    cpu_mcpu: str | None = None  # LLVM CPU the CPU kernels are built for (None: this machine's)
    seed: int = 0
    print_after: list[str] = field(default_factory=list)  # pass names, or "all"
    dump_ir: Path | None = None  # one readable file per pass
    progress: bool = True
    max_memory_gib: float | None = None  # the build's memory budget (None: what the machine has available now)

    def predictor_storage(self) -> str:
        """The dtype the predictors' fc1/fc2 are stored in: ``predictor_dtype``, where ``auto`` is int8 in an
        int8/int4 build (a selected int4 row is cheap in bytes but slow to gather, so the bytes a predictor saves buy
        a higher rank that selects fewer rows) and float16 otherwise."""
        if self.predictor_dtype != "auto":
            return self.predictor_dtype
        return "int8" if self.weight_dtype in ("int8", "int4") else "float16"

    def recall_for(self, all_relu: bool) -> float:
        """The recall target predictors are tuned to: the option, else the default for this kind of model."""
        if self.recall_target is not None:
            return self.recall_target
        return RELU_RECALL if all_relu else DENSE_RECALL

    def validate(self) -> None:
        """Range checks of the numeric options; a bad value names its flag."""
        from picompile.errors import PicompileError

        checks = [
            (0.0 <= self.act_sparsity < 1.0, "--act-sparsity must be in [0, 1)", self.act_sparsity),
            (self.weight_dtype in ("float32", "float16", "int8", "int4"), "--weight-dtype must be float32, float16, int8 "
             "or int4", self.weight_dtype),
            (self.quant_block in (32, 64, 128, 256), "--quant-block must be 32, 64, 128 or 256", self.quant_block),
            (self.predictor_dtype in ("auto", "float32", "float16", "int8"),
             "--predictor-dtype must be auto, float32, float16 or int8",
             self.predictor_dtype),
            (self.act_criterion in ("gate", "product"), "--act-criterion must be gate or product", self.act_criterion),
            (self.sparsity_allocation in ("greedy", "uniform"), "--sparsity-allocation must be greedy or uniform",
             self.sparsity_allocation),
            (0.0 < self.allocation_step <= 0.5, "--allocation-step must be in (0, 0.5]", self.allocation_step),
            (self.input_sparsity in ("off", "attention", "all"), "--input-sparsity must be off, attention or all",
             self.input_sparsity),
            (self.input_allocation in ("greedy", "uniform"), "--input-allocation must be greedy or uniform",
             self.input_allocation),
            (self.input_criterion in ("magnitude", "weighted"), "--input-criterion must be magnitude or weighted",
             self.input_criterion),
            (self.calibration_source in ("auto", "sampled", "builtin"), "--calibration-source must be auto, sampled "
             "or builtin", self.calibration_source),
            (self.accuracy_budget is None or 0.0 < self.accuracy_budget <= 10.0, "--accuracy-budget must be in (0, 10]",
             self.accuracy_budget),
            (self.input_loss_tokens >= 16, "--input-loss-tokens must be >= 16", self.input_loss_tokens),
            (self.allocation_tokens >= 16, "--allocation-tokens must be >= 16", self.allocation_tokens),
            (self.recall_target is None or 0.0 < self.recall_target <= 1.0, "--recall-target must be in (0, 1]",
             self.recall_target),
            (0.0 < self.predictor_budget <= 1.0, "--predictor-budget must be in (0, 1]", self.predictor_budget),
            (self.placement_batch >= 1, "--placement-batch must be >= 1", self.placement_batch),
            (self.min_layer_neurons >= 0, "--min-layer-neurons must be >= 0", self.min_layer_neurons),
            (self.calibration_tokens >= 16, "--calibration-tokens must be >= 16", self.calibration_tokens),
            (self.predictor_epochs >= 1, "predictor_epochs must be >= 1", self.predictor_epochs),
            (self.predictor_kind in ("linear", "mlp"), "--predictor-kind must be linear or mlp", self.predictor_kind),
            (self.predictor in ("trained", "oracle", "none"), "--predictor must be trained, oracle or none", self.predictor),
            (self.max_seq_len is None or self.max_seq_len >= 2, "--max-seq-len must be >= 2", self.max_seq_len),
            (self.cpu_mcpu is None or (isinstance(self.cpu_mcpu, str) and MCPU_RE.match(self.cpu_mcpu) is not None),
             "--cpu-mcpu must be an LLVM CPU name (e.g. x86-64-v3)", self.cpu_mcpu),
        ]
        for ok, message, value in [*self.type_checks(), *checks]:
            if not ok:
                raise PicompileError(f"{message}, got {value!r}")

    def type_checks(self) -> list[tuple[bool, str, object]]:
        """Integer options are integers, float options finite numbers (the Python API has no argparse)."""
        import math

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        ints = {"calibration_tokens": "--calibration-tokens", "allocation_tokens": "--allocation-tokens",
                "predictor_epochs": "predictor_epochs", "placement_batch": "--placement-batch",
                "min_layer_neurons": "--min-layer-neurons", "seed": "--seed", "quant_block": "--quant-block",
                "input_loss_tokens": "--input-loss-tokens"}
        nums = {"act_sparsity": "--act-sparsity", "allocation_step": "--allocation-step",
                "predictor_budget": "--predictor-budget"}
        optional = {"max_seq_len": ("--max-seq-len", is_int), "recall_target": ("--recall-target", is_num),
                    "vram_budget_gib": ("--vram-budget", is_num),
                    "accuracy_budget": ("--accuracy-budget", is_num), "max_memory_gib": ("--max-memory", is_num)}
        out: list[tuple[bool, str, object]] = [(is_int(getattr(self, k)), f"{flag} must be an integer", getattr(self, k))
                                               for k, flag in ints.items()]
        out += [(is_num(getattr(self, k)), f"{flag} must be a finite number", getattr(self, k)) for k, flag in nums.items()]
        out += [(getattr(self, k) is None or ok(getattr(self, k)), f"{flag} must be a finite number" if ok is is_num
                 else f"{flag} must be an integer", getattr(self, k)) for k, (flag, ok) in optional.items()]
        out += [(not is_int(self.seed) or 0 <= self.seed < 2**63, "--seed must be in 0..2**63-1", self.seed),
                (not is_num(self.vram_budget_gib) or 0 <= self.vram_budget_gib <= 1e6, "--vram-budget must be in "
                 "[0, 1e6] GiB", self.vram_budget_gib),
                (not is_int(self.max_seq_len) or self.max_seq_len <= 1 << 22, "--max-seq-len must be <= 4194304",
                 self.max_seq_len),
                (not is_num(self.max_memory_gib) or 0 < self.max_memory_gib <= 1e6, "--max-memory must be in "
                 "(0, 1e6] GiB", self.max_memory_gib)]
        return out

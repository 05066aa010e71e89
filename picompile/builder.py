"""``picompile.build``: the Python form of ``picompile build``."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch

from picompile.formats.artifact import MANIFEST, record_measured, staged_output
from picompile.config import BuildConfig
from picompile.context import BuildContext
from picompile.errors import BudgetError, PicompileError
from picompile.pipeline import check_print_after, pass_names, run_pipeline
from picompile.targets import get_target

if TYPE_CHECKING:
    from picompile.frontend.base import BuildEstimate


def default_model() -> str:
    """The model ``picompile build`` compiles when none is named: the one shipped in the package."""
    path = Path(__file__).parent / "data" / "default_model"
    if not (path / "config.json").is_file():
        raise PicompileError(f"no model named and the embedded default model is missing ({path})")
    return str(path)


def build(
    model: str | Path | None = None,
    target: str = "cpu",
    output: str | Path = "out.pic",
    *,
    emit: Callable[[str], None] = print,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
    **options: Any,
) -> Path:
    """Compile ``model`` for ``target`` into the artifact directory ``output``; return its path.

    ``options`` are the other fields of :class:`picompile.config.BuildConfig`
    (vram_budget_gib, pipeline, predictor, max_seq_len, print_after, dump_ir, …).
    An existing artifact at ``output`` is replaced only once the new one is complete.
    """
    fields = {f.name for f in dataclasses.fields(BuildConfig)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"unknown build option(s): {', '.join(unknown)}")
    config = BuildConfig(model=str(model) if model is not None else default_model(), output=Path(output),
                         target=target, **options)
    return build_from_config(config, emit=emit, on_pass=on_pass)


def build_from_config(
    config: BuildConfig,
    emit: Callable[[str], None] = print,
    on_pass: Optional[Callable[[str, int, int], None]] = None,
    track: Optional[Callable[[Iterable[Any], str], Iterator[Any]]] = None,
) -> Path:
    # Check everything cheap before loading weights or touching the output.
    config.validate()
    tgt = get_target(config.target, config.vram_budget_gib)
    names = pass_names(config.pipeline)
    check_print_after(names, config.print_after)
    estimate = check_memory(config)
    return_freed_memory()
    from picompile.frontend import load_model

    start = time.perf_counter()
    meter = PassMeter(on_pass)
    try:
        meter.begin("load")
        model, info = load_model(config.model)
        if config.max_seq_len is not None and config.max_seq_len > info.max_seq_len:
            raise PicompileError(f"--max-seq-len {config.max_seq_len} exceeds the model's {info.max_seq_len} positions")
        tokenizer = None
        if info.tokenizer is not None:
            from picompile.formats.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(info.tokenizer["kind"], Path(info.tokenizer["path"]))
        torch.manual_seed(config.seed)
        with staged_output(config.output) as staging:
            ctx = BuildContext(config=config, target=tgt, model=model, info=info, staging_dir=staging, pipeline=names,
                               tokenizer=tokenizer)
            if track is not None:
                ctx.track = track
            run_pipeline(ctx, names, emit=emit, on_pass=meter.on_pass)
            meter.stop()
            measured = {"peak_rss_bytes": peak_rss_bytes(), "build_seconds": round(time.perf_counter() - start, 1),
                        "passes": meter.passes}
            if estimate is not None:
                measured["estimated_peak_bytes"] = estimate.total
            if (staging / MANIFEST).is_file():
                record_measured(staging, measured)
    finally:
        meter.stop()
    return Path(config.output)


def model_config_of(model: str) -> dict[str, Any] | None:
    """The HF config.json of a checkpoint directory (None for other model kinds: llama2.c, ONNX, hub ids)."""
    path = Path(model)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    from picompile.frontend.hf import read_config

    return read_config(path)


def check_memory(config: BuildConfig) -> "BuildEstimate | None":
    """The build's estimated peak memory from the model's config (before any weight is read), refused with the
    figure when it exceeds --max-memory (default: the memory this machine has available now)."""
    from picompile.formats.manifest_schema import gib
    from picompile.frontend.base import available_memory_bytes, config_dims, estimate_build

    from picompile.frontend.base import check_config_bounds

    cfg = model_config_of(config.model)
    if cfg is None:
        return None
    check_config_bounds(cfg, str(Path(config.model) / "config.json"))  # out of bounds, or weights beyond memory
    estimate = estimate_build(config_dims(cfg, config.model), config.weight_dtype, config.calibration_tokens,
                              config.predictor_budget)
    budget = int(config.max_memory_gib * 2**30) if config.max_memory_gib is not None else available_memory_bytes()
    if estimate.total > budget:
        what = f"--max-memory {config.max_memory_gib:g} GiB" if config.max_memory_gib is not None else \
            f"the {gib(budget)} this machine has available (set --max-memory to override)"
        raise BudgetError(f"this build needs about {estimate.describe()}, more than {what}")
    return estimate


class PassMeter:
    """Time and peak resident memory of each build phase ("load", then each pass), for the build summary.

    A thread samples this process's RSS every ``interval`` s; a phase during which ``ru_maxrss`` rose peaked at
    exactly the new ``ru_maxrss`` (the kernel's own high-water mark), otherwise at the highest sample (a lower
    bound, at most one interval's growth off). ``passes``: {phase: {"seconds", "cpu_seconds", "peak_rss_bytes"}}
    in order (``cpu_seconds``: this process's user + system time, the steadier figure on a shared machine).
    """

    def __init__(self, on_pass: Optional[Callable[[str, int, int], None]] = None, interval: float = 0.05) -> None:
        import threading

        self.user_on_pass, self.interval = on_pass, interval
        self.passes: dict[str, dict[str, float | int]] = {}
        self._name: str | None = None
        self._start = 0.0
        self._cpu_start = 0.0
        self._hwm_start = 0
        self._sampled = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="picompile-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            rss = current_rss_bytes()
            with self._lock:
                self._sampled = max(self._sampled, rss)

    def _close(self) -> None:
        if self._name is None:
            return
        hwm = peak_rss_bytes()
        with self._lock:
            peak = max(self._sampled, current_rss_bytes())
            self._sampled = 0
        if hwm > self._hwm_start:
            peak = hwm
        self.passes[self._name] = {"seconds": round(time.perf_counter() - self._start, 2),
                                   "cpu_seconds": round(time.process_time() - self._cpu_start, 2),
                                   "peak_rss_bytes": int(peak)}
        self._name = None

    def begin(self, name: str) -> None:
        self._close()
        self._name, self._start, self._hwm_start = name, time.perf_counter(), peak_rss_bytes()
        self._cpu_start = time.process_time()
        with self._lock:
            self._sampled = current_rss_bytes()

    def on_pass(self, name: str, i: int, n: int) -> None:
        self.begin(name)
        if self.user_on_pass is not None:
            self.user_on_pass(name, i, n)

    def stop(self) -> None:
        """Close the current phase and end the sampling thread (again: nothing)."""
        self._close()
        if not self._done.is_set():
            self._done.set()
            self._thread.join()


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux ``VmRSS``; elsewhere the peak so far)."""
    from picompile.procinfo import status

    return status().get("VmRSS") or peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's own peak resident memory so far (bytes).

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this process's address space. Not
    ``ru_maxrss``: the kernel keeps that across exec (the largest of the process's and the address space it
    replaced), so a build started by ``subprocess`` from a large process (a pytest run, a benchmark driver)
    reported its parent's peak (vfork/posix_spawn hand the child the parent's address space until exec).
    Elsewhere ``ru_maxrss`` (macOS reports bytes, others KiB)."""
    import resource
    import sys

    from picompile.procinfo import status

    hwm = status().get("VmHWM")
    if hwm:
        return hwm
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def return_freed_memory() -> None:
    """glibc: tensors above 1 MiB get pages of their own (mmap), so freeing one returns its memory at once
    instead of leaving it in the heap (glibc's default threshold grows to 32 MiB after the first big free, and
    the per-layer copies a build makes and drops would then pile up). A no-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except OSError:
        pass


M_MMAP_THRESHOLD: int = -3  # glibc's mallopt parameter

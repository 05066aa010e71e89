"""Every TVM kernel call of a session, recorded or timed: ``recording(log)``.

Routes the process's loaded kernels (``kernels/table.py``'s ``KERNEL_TABLE``, which the ``picompile::tvm_*`` ops
look their kernels up in) through a ``Recorder`` while the context is open: each ``unchecked`` call is appended
to ``log.calls`` while ``log.on``, and timed into ``log.seconds`` / ``log.by_group`` while ``log.timing``; the
table is restored on exit. ``benchmarks/replay.py`` replays the calls; ``glue_per_layer`` (``picompile plan
--glue``) times a decode step outside them.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from picompile.kernels.table import KERNEL_TABLE

Call = tuple[Any, tuple[Any, ...]]  # (loaded kernel, its arguments)


@dataclass
class Recorder:
    """Stands in for a loaded kernel: appends each ``unchecked`` call to the shared ``log`` while
    ``log`` is on, then runs it."""

    kernel: Any
    log: "Log"

    def unchecked(self, *args: Any) -> None:
        if self.log.on:
            self.log.calls.append((self.kernel, args))
        if self.log.timing:
            t0 = time.perf_counter()
            self.kernel.unchecked(*args)
            dt = time.perf_counter() - t0
            self.log.seconds += dt
            g = group(self.kernel)
            self.log.by_group[g] = self.log.by_group.get(g, 0.0) + dt
        else:
            self.kernel.unchecked(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


@dataclass
class Log:
    calls: list[Call] = field(default_factory=list)  # in the order they ran
    on: bool = False
    timing: bool = False  # add each call's time to ``seconds`` and to its group's in ``by_group``
    seconds: float = 0.0
    by_group: dict[str, float] = field(default_factory=dict)


def group(kernel: Any) -> str:
    """A kernel's group in the report: its kind and weight shape, e.g. ``up 2560x2048`` (a GEMV) or
    ``predict 5632x2048 r128`` (n_rows x d_model, rank)."""
    spec = kernel.spec
    return f"{spec.kind} {spec.n_rows}x{spec.d_model}" + (f" r{spec.rank}" if spec.rank else "")


@contextmanager
def recording(log: Log) -> Iterator[None]:
    """Route every loaded kernel through a ``Recorder`` on ``log``; the table is restored on exit."""
    saved = dict(KERNEL_TABLE)
    KERNEL_TABLE.update({key: Recorder(kern, log) for key, kern in saved.items()})
    try:
        yield
    finally:
        KERNEL_TABLE.clear()
        KERNEL_TABLE.update(saved)


def glue_per_layer(artifact: str | Path, prompt_len: int = 64, steps: int = 40, warmup: int = 8) -> dict[str, float]:
    """Seconds per decode step and per layer that ``artifact``'s eager step spends outside its TVM kernels (norms,
    rotary, attention, residual adds, mask-to-row lists, op dispatch): ``steps`` greedy-free steps after a
    ``prompt_len``-token prompt, each kernel call timed inside the step (medians)."""
    import picompile

    session = picompile.load(artifact, native=False)  # the kernels called from Python, each one timed
    n_layers = int(session.manifest.model["config"].get("num_hidden_layers", 0) or 0)
    if n_layers <= 0:
        raise ValueError(f"{artifact}: the manifest names no layer count")
    dec = session.decoder()
    vocab = int(session.vocab_size)
    dec.feed([(7 * i + 3) % vocab for i in range(prompt_len)])
    log = Log(timing=True)
    outside, whole = [], []
    with recording(log):
        for i in range(warmup + steps):
            log.seconds = 0.0
            t0 = time.perf_counter()
            dec.feed([(11 * i + 5) % vocab])
            dt = time.perf_counter() - t0
            if i >= warmup:
                whole.append(dt)
                outside.append(dt - log.seconds)
    if not log.by_group:
        raise ValueError(f"{artifact}: no TVM kernel ran in its decode step (built without kernels)")
    glue = statistics.median(outside)
    return {"step_s": statistics.median(whole), "glue_s": glue, "glue_per_layer_s": glue / n_layers,
            "n_layers": float(n_layers)}

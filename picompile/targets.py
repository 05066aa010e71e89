"""Target presets: the figures that neuron placement and the cost model need."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from picompile.errors import PicompileError

GiB: int = 1 << 30


@dataclass(frozen=True)
class Target:
    """One deployment target: a GPU (or none) plus the host CPU.

    Bandwidths are sustained figures in GB/s (1e9 bytes/s); VRAM in bytes (int, never float).
    """

    name: str
    vram_bytes: int  # usable GPU memory; 0 = no GPU
    gpu_bandwidth_gbs: float  # GPU memory bandwidth
    link_bandwidth_gbs: float  # host <-> GPU (PCIe / NVLink-C2C), one direction
    cpu_bandwidth_gbs: float  # host memory bandwidth the CPU threads reach
    cuda_arch: str | None  # "sm_89" …; None for CPU-only
    description: str = ""

    @property
    def has_gpu(self) -> bool:
        return self.vram_bytes > 0 and self.cuda_arch is not None

    def with_vram_budget(self, gib: float) -> "Target":
        """The same target with the GPU memory budget overridden (``--vram-budget GiB``)."""
        if gib < 0:
            raise PicompileError(f"--vram-budget must be >= 0 GiB, got {gib}")
        return dataclasses.replace(self, vram_bytes=int(round(gib * GiB)))

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> "Target":
        """The target a manifest's "target" section describes (what :meth:`to_json` wrote)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("rtx4090", 24 * GiB, 1008.0, 25.0, 60.0, "sm_89", "GeForce RTX 4090, PCIe 4.0 x16"),
        Target("rtx2080ti", 11 * GiB, 616.0, 12.0, 40.0, "sm_75", "GeForce RTX 2080 Ti, PCIe 3.0 x16"),
        Target("a100-40g", 40 * GiB, 1555.0, 25.0, 100.0, "sm_80", "A100 40 GB PCIe 4.0"),
        Target("a100-80g", 80 * GiB, 2039.0, 25.0, 100.0, "sm_80", "A100 80 GB PCIe 4.0"),
        Target("h200", 141 * GiB, 4800.0, 55.0, 200.0, "sm_90", "H200 SXM, PCIe 5.0 x16"),
        Target("cpu", 0, 0.0, 0.0, 45.0, None, "host CPU only (no GPU): both partitions run on the CPU"),
    ]
}


def get_target(name: str, vram_budget_gib: float | None = None) -> Target:
    """Look a preset up by name; an unknown name lists the known ones."""
    try:
        target = TARGETS[name]
    except KeyError:
        raise PicompileError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}") from None
    return target.with_vram_budget(vram_budget_gib) if vram_budget_gib is not None else target

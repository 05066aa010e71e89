"""The build's per-phase report: time and peak RSS of loading and of every pass, in the manifest and the summary."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from picompile.builder import PassMeter, current_rss_bytes


def test_pass_meter_sees_the_phase_that_allocated() -> None:
    meter = PassMeter(interval=0.01)
    try:
        meter.begin("big")
        t = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, touched
        time.sleep(0.15)
        del t
        meter.begin("small")
        time.sleep(0.05)
    finally:
        meter.stop()
    assert list(meter.passes) == ["big", "small"]
    big, small = meter.passes["big"], meter.passes["small"]
    assert big["peak_rss_bytes"] - small["peak_rss_bytes"] > 200 << 20, meter.passes
    assert big["seconds"] >= 0.15 and big["cpu_seconds"] >= 0
    assert small["peak_rss_bytes"] <= current_rss_bytes() + (64 << 20)


def test_build_records_every_pass(f16_cpu_artifact: Path) -> None:
    from picompile.tools.report import passes_line

    m = json.loads((f16_cpu_artifact / "manifest.json").read_text())
    passes = m["measured"]["passes"]
    assert list(passes) == ["load", *m["pipeline"]]
    assert all(row["seconds"] >= 0 and 0 < row["peak_rss_bytes"] <= m["measured"]["peak_rss_bytes"]
               for row in passes.values())
    line = passes_line(f16_cpu_artifact)
    assert line.startswith("passes   load ") and "train-predictors" in line and "GiB" in line


def test_estimate_matches_the_7b_width_build_measured() -> None:
    """The pre-load estimate against what a build measured: llama-7b-relu's widths with 4 layers, bfloat16,
    --weight-dtype float16, 4096 calibration tokens: peak RSS 3.59 GiB (/usr/bin/time -v, benchmarks/README.md,
    7B section), its weights phase (split-ffn .. package) 2.88 GiB."""
    from picompile.frontend.base import estimate_build

    dims = {"layers": 4, "hidden": 4096, "ffn": 11008, "vocab": 32000, "heads": 32, "kv_heads": 32}
    est = estimate_build(dims, "float16", 4096)
    measured = 3.59 * 2**30
    assert abs(est.total - measured) / measured < 0.15, est.describe()
    assert est.weights + est.rows + est.base > 2.88 * 2**30  # the weights phase is not under-counted

"""``picompile plan``: predicted decode tokens/s of a model on a target, three strategies side by side.

    picompile plan MODEL_OR_CONFIG [--target rtx4090] [--vram-budget GiB] [--dtype float16|float32|int8|int4]
                   [--sparsity F] [--locality F] [--cpu-bandwidth GBs|host|measure|kernel] [--json] …

MODEL_OR_CONFIG: a Hugging Face checkpoint directory or its config.json (no weights are read), a
picompile artifact (its model config, recorded activation counts and predictor sizes), or a built-in
name (:data:`picompile.tools.model_shapes.BUILTIN_MODELS`). The model itself is :mod:`picompile.tools.costmodel`,
its inputs :mod:`picompile.tools.plan_inputs`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from picompile.tools.costmodel import (DTYPE_BYTES, MEASURED_HOST_CPU_GBS, CostModel, StrategyCost, measure_cpu_bandwidth,
                                       measure_kernel_rates)
from picompile.tools.plan_inputs import Assumptions, ModelInputs, load_model_inputs
from picompile.errors import PicompileError
from picompile.targets import Target, get_target

STRATEGY_ORDER: tuple[str, ...] = ("hybrid", "layer_offload", "cpu", "layer_offload_sparse", "cpu_sparse")


def _cpu_bandwidth(value: str | float | None) -> tuple[float | None, str]:
    """``--cpu-bandwidth``: a number of GB/s, ``host`` (the figure measured here), ``measure`` (the read bandwidth,
    now: the bound) or ``kernel`` (picompile's own GEMV kernel's rate, now: what its decode reaches)."""
    if value is None:
        return None, "preset"
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "host":
            return MEASURED_HOST_CPU_GBS, "measured on the development machine (MEASURED_HOST_CPU_GBS)"
        if v == "measure":
            m = measure_cpu_bandwidth()
            return m["read_gbs"], f"measured now: median read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s, 2 threads"
        if v == "kernel":
            return None, "kernel"  # measured by plan() on the model's shape, in its dtype
        try:
            value = float(v)
        except ValueError:
            raise PicompileError(f"--cpu-bandwidth takes GB/s, 'host', 'measure' or 'kernel', got {value!r}") from None
    if not value > 0:
        raise PicompileError(f"--cpu-bandwidth must be > 0 GB/s, got {value}")
    return float(value), "given on the command line"


def plan(
    model: str,
    target: str = "rtx4090",
    *,
    vram_budget_gib: float | None = None,
    dtype: str | None = None,
    sparsity: float | None = None,
    locality: float | None = None,
    cpu_bandwidth: str | float | None = None,
    gpu_bandwidth: float | None = None,
    assumptions: Assumptions | None = None,
    glue: str | None = None,
) -> dict[str, Any]:
    """The plan as a JSON-ready dict: ``{"model", "target", "assumptions", "profile", "placement", "strategies", "speedup"}``.

    ``strategies`` holds ``hybrid``, ``layer_offload`` and ``cpu`` (dense), plus ``layer_offload_sparse``
    and ``cpu_sparse``; each has ``tokens_per_s``, ``ms_per_token``, ``gpu_ms``, ``cpu_ms``, ``sync_ms``,
    bytes read per token on each side, ``vram_bytes`` and a description. ``glue``: a built artifact whose decode
    step's time outside its kernels, per layer (``tools/kernel_calls.glue_per_layer``, measured now), each CPU layer
    is charged instead of ``cpu_layer_overhead_s``.
    """
    a = assumptions or Assumptions()
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        raise PicompileError(f"--sparsity must be in [0, 1), got {sparsity}")
    if locality is not None and not 0.0 < locality <= 1.0:
        raise PicompileError(f"--locality must be in (0, 1], got {locality}")
    tgt, bw_source = _target(target, vram_budget_gib, cpu_bandwidth, gpu_bandwidth)
    inputs = load_model_inputs(model, a, sparsity, locality)
    dt = dtype or inputs.default_dtype
    if dt not in DTYPE_BYTES:
        raise PicompileError(f"unknown dtype {dt!r}; known: {', '.join(DTYPE_BYTES)}")
    if bw_source == "kernel":
        tgt, a, bw_source = _kernel_rates(tgt, a, inputs, dt)
    glue_source = "assumed (thread barrier)"
    if glue is not None:
        from picompile.tools.kernel_calls import glue_per_layer

        try:
            g = glue_per_layer(glue)
        except (OSError, ValueError, PicompileError) as e:
            raise PicompileError(f"--glue {glue}: {e}") from e
        a = dataclasses.replace(a, cpu_layer_overhead_s=g["glue_per_layer_s"])
        glue_source = (f"measured now on {glue}: {g['glue_s'] * 1e3:.1f} ms of its {g['step_s'] * 1e3:.1f} ms step "
                       f"outside its kernels, {g['glue_per_layer_s'] * 1e3:.2f} ms per layer")
    cm = CostModel(inputs, tgt, dt, a)
    hybrid, placement = cm.hybrid()
    costs = {
        "hybrid": hybrid,
        "layer_offload": cm.layer_offload(False),
        "cpu": cm.cpu(False),
        "layer_offload_sparse": cm.layer_offload(True),
        "cpu_sparse": cm.cpu(True),
    }
    out: dict[str, Any] = {
        "model": {**inputs.shape.to_json(), "source": inputs.source, "dtype": dt, "bytes_per_weight": DTYPE_BYTES[dt],
                  "weight_bytes": cm.weight_bytes()},
        "target": {**tgt.to_json(), "cpu_bandwidth_source": bw_source, "cpu_layer_overhead_source": glue_source},
        "assumptions": {**a.__dict__, "kv_cache_dtype": "float32" if dt == "float32" else "float16"},
        "profile": _profile(inputs),
        "placement": placement,
        "strategies": {k: v.to_json() for k, v in costs.items()},
    }
    return {**out, **_verdict(costs)}


def _kernel_rates(tgt: Target, a: Assumptions, inputs: ModelInputs, dtype: str) -> tuple[Target, Assumptions, str]:
    """``--cpu-bandwidth kernel``: the CPU rate is picompile's GEMV kernel's in ``dtype`` on the model's width, the
    sparse FFN's share of it its fused kernel's at the profile's predicted fraction (``measure_kernel_rates``)."""
    k = measure_kernel_rates(inputs.shape, dtype, inputs.predicted_active_fraction())
    share = k["ffn_gbs"] / k["gemv_gbs"]
    why = (f"measured now: picompile's {dtype} GEMV kernel {k['gemv_gbs']:.1f} GB/s ({k['gemv_gbs'] / k['read_gbs']:.0%} "
           f"of the read bandwidth, {k['read_gbs']:.1f} GB/s), its sparse FFN kernel {k['ffn_gbs']:.1f} GB/s at "
           f"{k['active_fraction']:.1%} of the rows, 2 threads")
    return dataclasses.replace(tgt, cpu_bandwidth_gbs=k["gemv_gbs"]), dataclasses.replace(a, cpu_sparse_ffn_share=share), why


def _target(name: str, vram_budget_gib: float | None, cpu_bandwidth: str | float | None,
            gpu_bandwidth: float | None) -> tuple[Target, str]:
    """The target preset with the command line's budget and bandwidths; where its CPU bandwidth comes from."""
    tgt = get_target(name, vram_budget_gib)
    bw, bw_source = _cpu_bandwidth(cpu_bandwidth)
    if bw is not None:
        tgt = dataclasses.replace(tgt, cpu_bandwidth_gbs=bw)
    if gpu_bandwidth is not None:
        if not gpu_bandwidth > 0:
            raise PicompileError(f"--gpu-bandwidth must be > 0 GB/s, got {gpu_bandwidth}")
        tgt = dataclasses.replace(tgt, gpu_bandwidth_gbs=float(gpu_bandwidth))
    return tgt, bw_source


def _profile(inputs: ModelInputs) -> dict[str, Any]:
    """Where the activation profile comes from and what it amounts to."""
    return {
        "source": inputs.activity.source if inputs.source == "artifact" and "artifact" in inputs.activity.source
        else f"synthetic power law ({inputs.activity.source})",
        "sparsity": inputs.activity.sparsity,
        "locality": inputs.activity.locality,
        "predicted_active_fraction": inputs.predicted_active_fraction(),
        "predictor_params": int(sum(la.predictor_params for la in inputs.layers)),
        "notes": inputs.notes,
    }


def _verdict(costs: dict[str, StrategyCost]) -> dict[str, Any]:
    """{"speedup": the ratios the report leads with, "best": the fastest main strategy (ties: the first listed)}."""
    hybrid = costs["hybrid"]
    base, cpu = costs["layer_offload"].tokens_per_s, costs["cpu"].tokens_per_s
    speedup = {
        "hybrid_vs_layer_offload": hybrid.tokens_per_s / base,
        "hybrid_vs_cpu": hybrid.tokens_per_s / cpu,
        "layer_offload_sparse_vs_layer_offload": costs["layer_offload_sparse"].tokens_per_s / base,
        "cpu_sparse_vs_cpu": costs["cpu_sparse"].tokens_per_s / cpu,
    }
    main = ("hybrid", "layer_offload", "cpu", "cpu_sparse")
    top = max(costs[k].tokens_per_s for k in main)
    return {"speedup": speedup, "best": next(k for k in main if costs[k].tokens_per_s >= top * (1 - 1e-9))}


def print_plan(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, soft_wrap=True)
    if not con.is_terminal:
        con = Console(highlight=False, soft_wrap=True, width=120)
    m, t, p, pl = result["model"], result["target"], result["profile"], result["placement"]
    def num(x: float, unit: str) -> str:
        return f"{x / 1e9:.2f} G{unit}" if x >= 1e8 else f"{x / 1e6:.2f} M{unit}"

    con.print(f"[bold]{m['name']}[/bold] ({m['family']}, {m['n_layers']} layers, d_model {m['d_model']}, "
              f"{m['d_ffn']} FFN neurons{' gated' if m['gated'] else ''}, {num(m['n_params'], '')} params) "
              f"in {m['dtype']}: {num(m['weight_bytes'], 'B')} of weights")
    con.print(f"target [bold]{t['name']}[/bold]: VRAM {t['vram_bytes'] / (1 << 30):.1f} GiB, GPU {t['gpu_bandwidth_gbs']:g} GB/s, "
              f"link {t['link_bandwidth_gbs']:g} GB/s, CPU {t['cpu_bandwidth_gbs']:g} GB/s ({t['cpu_bandwidth_source']})")
    con.print(f"CPU per-layer glue {result['assumptions']['cpu_layer_overhead_s'] * 1e3:.3f} ms "
              f"({t.get('cpu_layer_overhead_source', 'assumed')}); sparse FFN at "
              f"{result['assumptions']['cpu_sparse_ffn_share']:.0%} of the CPU rate")
    con.print(f"profile: {p['source']}; sparsity {p['sparsity']:.2f}, locality {p['locality']:.2f}, "
              f"predicted active {p['predicted_active_fraction']:.1%} of neurons per token")
    if pl.get("gpu"):
        con.print(f"placement: {pl.get('method', '-')} — FFN budget {pl['ffn_budget_bytes'] / (1 << 30):.2f} GiB after "
                  f"{', '.join(pl['fixed_parts_on_gpu']) or 'nothing'}; hot {result['strategies']['hybrid']['hot_neuron_fraction']:.1%} "
                  f"of neurons serve {result['strategies']['hybrid']['activation_coverage']:.1%} of activations")
        if "fallback" in pl:
            con.print(f"[yellow]note:[/yellow] {pl['fallback']}")
    table = Table(show_header=True, header_style="bold")
    for col in ("strategy", "tok/s", "ms/token", "GPU ms", "CPU ms", "sync ms", "VRAM GiB", "GPU layers"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for name in STRATEGY_ORDER:
        s = result["strategies"][name]
        table.add_row(name, f"{s['tokens_per_s']:.2f}", f"{s['ms_per_token']:.1f}", f"{s['gpu_ms']:.1f}", f"{s['cpu_ms']:.1f}",
                      f"{s['sync_ms']:.2f}", f"{s['vram_bytes'] / (1 << 30):.1f}", f"{s['gpu_layers']}/{m['n_layers']}")
    con.print(table)
    for name in STRATEGY_ORDER:
        con.print(f"  [bold]{name}[/bold]: {result['strategies'][name]['description']}")
    sp = result["speedup"]
    con.print(f"hybrid vs layer offload: {sp['hybrid_vs_layer_offload']:.2f}×; vs CPU dense: {sp['hybrid_vs_cpu']:.2f}×; "
              f"CPU sparse vs dense: {sp['cpu_sparse_vs_cpu']:.2f}×; fastest: [bold]{result['best']}[/bold]")

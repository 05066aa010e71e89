"""Step 1 of ``benchmarks/gpu_check.py``: every CUDA kernel picompile can emit, against its torch reference.

The kernel list is derived from the code, never copied by hand (``tests/test_gpu_check.py`` checks it):

* the kinds come from ``kernels.spec.KINDS``: each kind whose ``KernelSpec`` accepts a CUDA target
  (``predict`` is refused, CPU only: its reason is reported, taken from ``KernelSpecError``);
* the fused FFN kinds (up and down in one kernel: what ``lower-tvm`` emits for a GPU partition) run in
  every activation ``lower-tvm`` lowers (``passes.lower_tvm.KERNEL_ACTS``), every weight format
  (``kernels.spec.WEIGHT_DTYPES``) and with and without ``b_up``;
* the partial kinds (``up``, ``up_gated``, ``down``) run in every weight format with one activation each:
  ``none`` for ``up`` (a GEMV: how every linear layer runs) and ``down``, the last lowered activation for
  ``up_gated`` (SwiGLU's).

Each kernel runs at ``FRACTIONS`` of its rows active (k = 0 included) on random weights; the result is
compared with a float64 torch reference over the same rows (max error relative to the reference's
largest magnitude) and timed (median of ``reps`` calls, each after a cache flush), as GB/s of the weight
rows it must read and as a share of the device's measured copy bandwidth. The same code runs the llvm
kernels on the CPU in the dry run, so the harness itself is checked before a GPU minute is spent.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FRACTIONS: tuple[float, ...] = (0.0, 0.01, 0.10, 1.0)  # active rows per call; 0 = k = 0
TOLERANCE: float = 1e-3  # max |out - ref| / max |ref|: float32 accumulation against float64, any weight format
FLUSH_BYTES: int = 256 << 20  # written between timed calls so no call finds its rows in cache (H200 L2: 60 MB)
N_ACTIVE_SETS: int = 4  # random active sets per fraction, cycled over the timed calls


# -- the kernel list ------------------------------------------------------------------------------------
def cuda_refusals(d_model: int, n_rows: int, arch: str) -> dict[str, str]:
    """The kinds of ``kernels.spec.KINDS`` that have no CUDA kernel, with the spec's reason."""
    from picompile.kernels.spec import KINDS, KernelSpec, KernelSpecError

    refused: dict[str, str] = {}
    for kind in KINDS:
        try:
            KernelSpec(kind, "none", d_model, n_rows, "float32", False, f"cuda:{arch}", rank=1 if kind == "predict" else 0)
        except KernelSpecError as e:
            refused[kind] = str(e)
    return refused


def cuda_kinds(d_model: int, n_rows: int, arch: str) -> tuple[str, ...]:
    """The kinds of ``kernels.spec.KINDS`` that a CUDA ``KernelSpec`` accepts."""
    from picompile.kernels.spec import KINDS

    refused = cuda_refusals(d_model, n_rows, arch)
    return tuple(k for k in KINDS if k not in refused)


def _is_fused(kind: str) -> bool:
    """Up and down in one kernel (what lower-tvm emits for a partition)."""
    from picompile.kernels.spec import KernelSpec

    probe = KernelSpec(kind, "none", 1, 1, "float32", False, "llvm")
    return probe.has_up and probe.has_down


def lowered_acts() -> tuple[str, ...]:
    """``passes.lower_tvm.KERNEL_ACTS``, read from its source: importing the passes would import every pass
    (transformers, scipy …), which the kernel step on the device should not depend on."""
    import ast

    import picompile.kernels

    source = Path(picompile.kernels.__file__).resolve().parents[1] / "passes" / "lower_tvm.py"  # kernels' sibling
    for node in ast.parse(source.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "KERNEL_ACTS" and node.value is not None:
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError(f"KERNEL_ACTS not found in {source}")


def kernel_matrix(d_model: int, n_rows: int, target: str) -> list[Any]:
    """Every kernel variant checked, as ``KernelSpec`` values for ``target`` ("cuda:sm_90", "llvm")."""
    from picompile.kernels.spec import WEIGHT_DTYPES, KernelSpec, KernelSpecError

    KERNEL_ACTS = lowered_acts()

    arch = target.split(":", 1)[1] if target.startswith("cuda:") else "sm_90"
    specs: list[Any] = []
    for kind in cuda_kinds(d_model, n_rows, arch):
        fused = _is_fused(kind)
        acts = KERNEL_ACTS if fused else (("none",) if kind in ("up", "down") else ("silu",))
        biases = (False, True) if fused else (False,)
        for act in acts:
            for wdt in WEIGHT_DTYPES:
                for bias in biases:
                    try:  # an activation lower-tvm lowers for other kinds only (drelu: gated)
                        specs.append(KernelSpec(kind, act, d_model, n_rows, wdt, bias, target))
                    except KernelSpecError:
                        continue
    return specs


def sample(specs: list[Any], per_kind: int | None) -> list[Any]:
    """``specs`` itself (``per_kind`` None), else the first ``per_kind`` of each kind, the weight formats taken
    in turn from kind to kind (so a short list still has every kind and every format)."""
    if per_kind is None:
        return specs
    from picompile.kernels.spec import WEIGHT_DTYPES

    kinds = list(dict.fromkeys(s.kind for s in specs))
    out: list[Any] = []
    for i, kind in enumerate(kinds):
        mine = [s for s in specs if s.kind == kind]
        first = WEIGHT_DTYPES[i % len(WEIGHT_DTYPES)]
        mine.sort(key=lambda s: s.weight_dtype != first)  # stable: the format of this turn first
        out += mine[:per_kind]
    return out


def label(spec: Any) -> str:
    return f"{spec.kind}/{spec.act}/{spec.weight_dtype}{'/bias' if spec.has_bias else ''}"


def compile_matrix(specs: list[Any], cache_dir: Path, emit: Callable[[str], None]) -> list[dict[str, Any]]:
    """Build (or reuse) every kernel with the project's builder (``kernels.build_kernel``); one row per spec."""
    from picompile.kernels import build_kernel

    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"kernel": label(spec), "target": spec.target, "key": spec.key()}
        try:
            path = build_kernel(spec, cache_dir)
            row.update(ok=True, file=path.name, bytes=path.stat().st_size)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[-2000:])
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    emit(f"  {sum(r['ok'] for r in rows)}/{len(rows)} kernels for {specs[0].target if specs else '-'} "
         f"in {sum(r['seconds'] for r in rows):.1f} s")
    return rows


# -- one kernel's check ---------------------------------------------------------------------------------
@dataclass
class Device:
    """Where a check runs: allocation, synchronisation and timing for "cuda" or "cpu"."""

    name: str  # "cuda" | "cpu"

    def kernel_stream(self) -> Any:
        """TVM's launches on torch's current stream (CUDA), so the events that time them bracket them."""
        if self.name != "cuda":
            return contextlib.nullcontext()
        import tvm_ffi

        return tvm_ffi.use_torch_stream()

    def sync(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()

    def time_call(self, fn: Callable[[], None], flush: Callable[[], None]) -> float:
        """Seconds of one ``fn()`` call made after ``flush()``."""
        flush()
        if self.name == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def copy_bandwidth(device: Device, nbytes: int, tries: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` on ``nbytes`` buffers, counting bytes read and written (best of ``tries``)."""
    src = torch.ones(nbytes // 4, device=device.name)
    dst = torch.empty_like(src)
    dst.copy_(src)
    device.sync()
    best = min(device.time_call(lambda: dst.copy_(src), lambda: None) for _ in range(tries))
    return 2 * nbytes / best / 1e9


def _weights(spec: Any, device: str, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    """Random weights of ``spec`` on ``device`` (aligned: the kernels' contract)."""
    from picompile.kernels import aligned_empty

    wdt = getattr(torch, spec.weight_dtype)
    n, d = spec.n_rows, spec.d_model

    def rows(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        out = aligned_empty(shape, wdt, device=device)
        out.copy_((torch.randn(shape, generator=gen, device=device) * scale).to(wdt))
        return out

    return {
        "w_up": rows((n, d), d ** -0.5) if spec.has_up else None,  # [n_rows, d_model]
        "w_gate": rows((n, d), d ** -0.5) if spec.gated else None,  # [n_rows, d_model]
        "b_up": rows((n,), 0.5) if spec.has_bias else None,  # [n_rows]
        "w_down_t": rows((n, d), n ** -0.5) if spec.has_down else None,  # [n_rows, d_model]
    }


def _act(name: str, v: torch.Tensor) -> torch.Tensor:
    return {"relu": torch.relu, "silu": torch.nn.functional.silu, "none": lambda t: t}[name](v)


def reference(spec: Any, w: dict[str, torch.Tensor | None], x: torch.Tensor, h_in: torch.Tensor | None,
              idx: torch.Tensor) -> torch.Tensor:
    """The operator contract (``kernels/spec.py``) in float64 over rows ``idx``: y ``[d_model]`` or h ``[k]``."""
    rows = idx.long()

    def sel(name: str) -> torch.Tensor:
        t = w[name]
        assert t is not None
        return t.index_select(0, rows).double()  # [k, …]

    if spec.has_up:
        up = sel("w_up") @ x.double()  # [k]
        if spec.has_bias:
            up = up + sel("b_up")
        h = _act(spec.act, sel("w_gate") @ x.double()) * up if spec.gated else _act(spec.act, up)  # [k]
    else:
        assert h_in is not None
        h = h_in.double()  # [k]
    return h @ sel("w_down_t") if spec.has_down else h  # [d_model] | [k]


def _call(kern: Any, spec: Any, w: dict[str, torch.Tensor | None], x: torch.Tensor, h_in: torch.Tensor | None,
          idx: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """A no-argument call of ``kern`` (unchecked: its arguments were checked by the first, checked call)."""
    if spec.kind == "down":
        args: tuple[Any, ...] = (h_in, w["w_down_t"], idx, out)
    elif spec.has_down:
        args = (x, w["w_up"], w["w_gate"], w["b_up"], w["w_down_t"], idx, out)
    else:
        args = (x, w["w_up"], w["w_gate"], w["b_up"], idx, out)
    kern(*args)  # checked once: shapes, dtypes, devices, alignment
    return lambda: kern.unchecked(*args)


def read_bytes(spec: Any, k: int) -> int:
    """Bytes a call must read: k weight rows of every matrix (and b_up), the active list, x or h."""
    wbytes = 2 if spec.weight_dtype == "float16" else 4
    mats = int(spec.has_up) + int(spec.gated) + int(spec.has_down)
    return k * (mats * spec.d_model * wbytes + (wbytes if spec.has_bias else 0) + 4) + 4 * (
        spec.d_model if spec.has_up else k)


def check_kernel(kern: Any, spec: Any, device: Device, copy_gbs: float, reps: int, seed: int = 0) -> dict[str, Any]:
    """``kern`` at every fraction of ``FRACTIONS``: max error against ``reference``, time, GB/s."""
    from picompile.kernels import aligned_empty

    gen = torch.Generator(device=device.name).manual_seed(seed)  # weights made where they are used
    w = _weights(spec, device.name, gen)
    x = torch.randn(spec.d_model, generator=gen, device=device.name)  # [d_model]
    flush_buf = torch.empty(FLUSH_BYTES // 4 if device.name == "cuda" else 1, device=device.name)
    flush = (lambda: flush_buf.fill_(1.0)) if device.name == "cuda" else (lambda: None)
    rows: list[dict[str, Any]] = []
    for frac in FRACTIONS:
        k = round(frac * spec.n_rows) if frac < 1 else spec.n_rows
        sets = [torch.randperm(spec.n_rows, generator=gen, device=device.name)[:k].sort().values.to(torch.int32)
                for _ in range(N_ACTIVE_SETS)]  # [k] each
        h_in = torch.randn(k, generator=gen, device=device.name) if spec.kind == "down" else None  # [k]
        out = aligned_empty((spec.d_model if spec.has_down else k,), torch.float32, device=device.name)
        out.fill_(float("nan"))
        calls = [_call(kern, spec, w, x, h_in, idx, out) for idx in sets[:1]]
        device.sync()
        ref = reference(spec, w, x, h_in, sets[0])
        err = _error(out, ref, k)
        calls += [_call(kern, spec, w, x, h_in, idx, out) for idx in sets[1:]]
        times = [device.time_call(calls[i % len(calls)], flush) for i in range(reps)]
        t = statistics.median(times)
        nbytes = read_bytes(spec, k)
        gbs = nbytes / t / 1e9 if t > 0 else None
        rows.append({"fraction": frac, "k": k, "max_error": err, "ok": err <= TOLERANCE, "median_us": round(t * 1e6, 2),
                     "bytes": nbytes, "gbs": gbs, "copy_share": gbs / copy_gbs if gbs and copy_gbs else None})
    return {"kernel": label(spec), "key": spec.key(), "target": spec.target, "d_model": spec.d_model,
            "n_rows": spec.n_rows, "ok": all(r["ok"] for r in rows), "fractions": rows}


def _error(out: torch.Tensor, ref: torch.Tensor, k: int) -> float:
    """max |out - ref| / max |ref| (0 where both are all zeros; NaN, a row the kernel never wrote, is inf)."""
    got = out.detach().double().cpu()
    want = ref.detach().cpu()
    if got.numel() != want.numel():
        return float("inf")
    if not torch.isfinite(got).all():
        return float("inf")
    if k == 0 or not want.numel():
        return float(got.abs().max()) if got.numel() else 0.0  # y must be exactly 0, h empty
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / (scale if scale > 0 else 1.0)


def check_matrix(specs: list[Any], cache_dir: Path, device: Device, copy_gbs: float, reps: int,
                 emit: Callable[[str], None]) -> list[dict[str, Any]]:
    """Load each prebuilt kernel (TVM runtime only, ``kernels.load_kernel``) and check it; one row per spec."""
    from picompile.kernels import load_kernel

    results = []
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        try:
            kern = load_kernel(cache_dir / f"{spec.key()}.so", spec)
            with device.kernel_stream():
                row = check_kernel(kern, spec, device, copy_gbs, reps, seed=i)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row = {"kernel": label(spec), "key": spec.key(), "target": spec.target, "ok": False,
                   "error": f"{type(e).__name__}: {e}"[-2000:]}
        row["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(row)
        worst = max((r["max_error"] for r in row.get("fractions", [])), default=float("nan"))
        emit(f"  {'ok  ' if row['ok'] else 'FAIL'} {row['kernel']:<28} max err {worst:.1e}  "
             + "  ".join(f"{r['fraction']:.0%}:{r['gbs'] or 0:.0f}GB/s" for r in row.get("fractions", []))
             + (f"  {row['error']}" if "error" in row else ""))
    return results

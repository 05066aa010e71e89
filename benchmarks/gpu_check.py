"""One prepared check of picompile's GPU half: the CUDA kernels and the hybrid schedule (issue #27).

    python benchmarks/gpu_check.py --dry-run                 # CPU side: build everything, check all up to CUDA
    python3 benchmarks/gpu_check.py --json-out $OUT/gpu_check.json   # on the CUDA machine (carry .gpu_check)
    python benchmarks/gpu_check.py --dry-run --shape tiny    # the test's fast form (tests/test_gpu_check.py)

Steps (each timed; a failure is recorded in the JSON and the run goes on; exit 1 on any correctness failure):

1. ``kernels``: every CUDA kernel picompile can emit (``gpu_check_kernels.kernel_matrix``: derived from
   ``kernels/spec.py`` and ``passes/lower_tvm.py``; 22 variants: fused ReLU/gated FFN in relu and silu, with
   and without b_up, up / up_gated / down, the GEMV; float32 and float16 weights; ``predict`` has no CUDA
   schedule and is reported as such) at 0 / 1 / 10 / 100 % active rows of a 7B layer (11008 x 4096),
   against a float64 torch reference on the GPU: max error (tolerance 1e-3 of the largest magnitude) and
   GB/s against the device's measured copy bandwidth.
2. ``hybrid``: the carried synthetic artifact (built here for ``--target h200`` with a ``--vram-budget`` of the
   fixed parts place-neurons puts first plus a tenth of the FFN: below the float16 model, both partitions
   used; ``budget_bytes``) runs ``hybrid="cuda"`` and is compared, logit
   by logit over a prompt and greedy decode, with the same artifact on the CPU (``hybrid="off"``):
   max |difference| / max |logit| <= 2e-3 (float16 weights on both sides, float32 accumulation in
   another order; measured between thread and off in the dry run: 0).
3. ``throughput``: decode and prefill tok/s for hybrid, the artifact on the CPU alone, all-on-GPU dense torch
   (float16) and layer offload (as many whole float16 layers as the budget holds on the GPU, the rest float32
   on the CPU, as ``llama.cpp -ngl``); the dense models are the artifact's own HF config, randomly initialised.
4. everything goes to one JSON file (``--json-out``).

Why a small synthetic shape for steps 2-3 and not the 1B model: the device machine has no TVM compiler
(``apache-tvm`` is 260 MB; only its 4 MB runtime travels) and its own torch (2.11), so an artifact cannot be
built there, and the working tree that travels is at most 64 MiB: a 1B artifact (2.2 GB in float16) cannot
go. ``gpu-check-small`` keeps llama-1b-relu's proportions (ReLU Llama, d_model / FFN = 1 / 2.75, GQA 2:1) at
a quarter of its width and 4 layers: 29 MiB in float16, the same passes, kernels and schedule.

Prepared on the CPU side (``--dry-run`` does it; everything cached, a rerun reuses it): the CUDA kernels for
every arch in ``--archs`` (sm_80, sm_89, sm_90; only the device's arch travels, in ``.gpu_check/kernels``),
the artifact in ``.gpu_check/`` with its llvm kernels built for ``x86-64-v3`` (the device's CPU is another
one; AVX2 runs on any x86-64 server of the last decade), and the TVM runtime libraries in ``.gpu_check/tvm/lib``.
The device also needs ``apache-tvm-ffi==0.1.14.post1`` for its Python (3.12): the dry run downloads its wheel
into ``.whl`` (``prepare_wheels``; ignored, carried) and the device command installs it with ``pip install --target``.
Device command (carry ``.gpu_check`` and ``.whl``; timeout 420 s)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py \\
        --json-out $OUT/gpu_check.json

Dry run on the shared 2-core CPU machine (2026-12-01; first run, every cache empty / rerun, caches warm):
prepare_kernels (22 kernels x sm_80, sm_89, sm_90) 103 s / 2 s; prepare_artifact (synthetic checkpoint and
the h200 build) 47 s / 0 s; kernels (the CPU harness, 22 llvm kernels compiled) 48 s / 0.3 s; hybrid (thread
against off, 96 tokens) 16 s / 8 s; throughput (4 engines, all on the CPU) 32 s / 17 s: 4 min / 31 s.
``--shape tiny`` (the test): 29 s. GPU machine estimate (the plan printed first): 256 s of the 480 allowed (start-up 120,
transfer and install 20, imports and CUDA start 15, kernels 20, hybrid 20, throughput 61). The carried folder
is 37 MB (artifact 31, TVM runtime 4, sm_90 kernels 2), the tracked tree 6 MB: 43 MB of the 64 MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.util
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# gpu_check_kernels and gpu_check_speed, beside this file. Appended, not put first: a folder ahead of
# site-packages could shadow an installed package (transformers imports the PyPI package "kernels").
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
CHECK_DIR = ROOT / ".gpu_check"  # ignored; carried to the device machine
CARRY_LIMIT = 64 << 20  # bytes: the working tree that travels, carried folders included
GPU_SECONDS_LIMIT = 480.0
DEFAULT_ARCHS = ("sm_80", "sm_89", "sm_90")
DEVICE_ARCH = "sm_90"  # the H200's: its kernels travel in the carried folder, the other archs' stay here
PORTABLE_MCPU = "x86-64-v3"
LOGIT_TOLERANCE = 2e-3
_MAPPED = {"picompile.kernels": "kernels", "picompile.runtime": "runtime", "picompile.passes": "passes"}


# -- running from a bare working tree ------------------------------------------------------------------
class _TreeFinder(importlib.abc.MetaPathFinder):
    """pyproject.toml's package-dir mapping (picompile.kernels = kernels/ …) for a tree that is not installed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        top = _MAPPED.get(name)
        if top is None:
            return None
        return importlib.util.spec_from_file_location(name, ROOT / top / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / top)])


def bootstrap(prebuilt: Path) -> None:
    """Make picompile importable from this tree, and the carried TVM runtime findable where tvm is absent."""
    if importlib.util.find_spec("picompile") is None:
        sys.path.append(str(ROOT))  # after site-packages: ROOT/kernels must not shadow the PyPI "kernels"
    try:
        missing = importlib.util.find_spec("picompile.kernels") is None
    except ModuleNotFoundError:
        missing = True
    if missing:
        sys.meta_path.insert(0, _TreeFinder())
    if importlib.util.find_spec("tvm") is None and (prebuilt / "tvm" / "lib").is_dir():
        sys.path.append(str(prebuilt))  # a namespace package "tvm" holding lib/ (kernels.loader looks there)


# -- what the check runs on ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckShape:
    """Sizes of one plan: the kernel layer, the hybrid model and how long each measurement runs."""

    name: str
    kernel_d_model: int
    kernel_n_rows: int
    model: str  # synthetic shape of the hybrid artifact
    prompt_len: int
    decode_tokens: int
    reps: int  # timed calls per kernel and fraction
    rounds: int  # timed rounds per engine
    calibration_tokens: int
    placement_batch: int
    kernels_per_kind: int | None = None  # None: the whole kernel list; n: n variants of each kind (tests)

    def kernel_specs(self, target: str, d_model: int | None = None, n_rows: int | None = None) -> list[Any]:
        """This plan's kernel list for ``target`` (at the kernel layer's size unless given)."""
        import gpu_check_kernels as gk

        specs = gk.kernel_matrix(d_model or self.kernel_d_model, n_rows or self.kernel_n_rows, target)
        return gk.sample(specs, self.kernels_per_kind)


SHAPES: dict[str, CheckShape] = {
    "plan": CheckShape("plan", 4096, 11008, "gpu-check-small",
                       prompt_len=64, decode_tokens=32, reps=10, rounds=3, calibration_tokens=2048, placement_batch=64),
    "tiny": CheckShape("tiny", 128, 512, "tiny-llama-relu",
                       prompt_len=8, decode_tokens=4, reps=2, rounds=1, calibration_tokens=256, placement_batch=8,
                       kernels_per_kind=1),
}


@dataclass
class Options:
    shape: CheckShape
    dry_run: bool
    archs: tuple[str, ...]
    prebuilt: Path
    work: Path  # not carried: checkpoints, CPU kernels
    json_out: Path | None


# -- the plan ---------------------------------------------------------------------------------------------
def plan(shape: CheckShape, n_kernels: int) -> list[dict[str, Any]]:
    """The device steps with their estimated GPU-machine seconds and what each estimate rests on."""
    layer_bytes = 3 * shape.kernel_n_rows * shape.kernel_d_model * 4  # the gated float32 variant, the largest
    per_kernel = 0.4 + layer_bytes / 1e9 * 0.5 + len((0, 1, 2, 3)) * shape.reps * 2e-4  # alloc+randn, ref, calls
    tokens = shape.prompt_len + shape.decode_tokens
    return [
        {"step": "start-up", "seconds": 120.0, "basis": "machine start (1-2 min, device README)"},
        {"step": "transfer+install", "seconds": 20.0, "basis": "working tree and carry up, tvm-ffi wheel install"},
        {"step": "imports+cuda", "seconds": 15.0, "basis": "torch import, CUDA context, TVM runtime"},
        {"step": "kernels", "seconds": round(5 + n_kernels * per_kernel, 1),
         "basis": f"{n_kernels} prebuilt kernels x 4 fractions x {shape.reps} calls, weights made on the GPU"},
        {"step": "hybrid", "seconds": round(10 + 2 * tokens * 0.05, 1),
         "basis": f"load twice, {tokens} tokens on GPU+CPU and CPU alone"},
        {"step": "throughput", "seconds": round(15 + 4 * (shape.rounds + 1) * tokens * 0.03, 1),
         "basis": f"4 engines x {shape.rounds + 1} rounds x {tokens} tokens, model init"},
    ]


def print_plan(steps: list[dict[str, Any]], emit: Callable[[str], None]) -> float:
    total = sum(s["seconds"] for s in steps)
    emit("plan (GPU machine seconds):")
    for s in steps:
        emit(f"  {s['step']:<17} {s['seconds']:6.1f}  {s['basis']}")
    emit(f"  {'total':<17} {total:6.1f}  (limit {GPU_SECONDS_LIMIT:.0f})")
    return total


# -- recording ------------------------------------------------------------------------------------------
@dataclass
class Report:
    """Everything that goes into the JSON file; ``failures`` decide the exit code."""

    mode: str
    shape: str
    data: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def step(self, name: str, fn: Callable[[], dict[str, Any]], emit: Callable[[str], None]) -> dict[str, Any] | None:
        """Run one step: its result (with ``seconds``), or the error recorded as a failure."""
        emit(f"[{time.strftime('%H:%M:%S')}] {name}")
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the other steps still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            emit(f"  FAILED: {type(e).__name__}: {e}")
        result["seconds"] = round(time.perf_counter() - t0, 2)
        if result.get("ok") is False:
            self.failures.append(name)
        self.data[name] = result
        return result

    def write(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            body = {"mode": self.mode, "shape": self.shape, "ok": not self.failures, "failures": self.failures,
                    **self.data}
            path.write_text(json.dumps(body, indent=1, default=str) + "\n")


# -- prepare (CPU side) --------------------------------------------------------------------------------------
def kernel_dir(opt: Options, arch: str) -> Path:
    """Where the CUDA kernels of ``arch`` are built: the carried folder for the device's arch."""
    return opt.prebuilt / "kernels" if arch == DEVICE_ARCH else opt.work / "kernels" / arch


def prepare_kernels(opt: Options, emit: Callable[[str], None]) -> dict[str, Any]:
    """Compile the kernel list for every arch; the device's own arch (sm_90) goes into the carried folder."""
    import gpu_check_kernels as gk

    rows: dict[str, list[dict[str, Any]]] = {}
    for arch in opt.archs:
        cache = kernel_dir(opt, arch)
        specs = opt.shape.kernel_specs(f"cuda:{arch}")
        rows[arch] = gk.compile_matrix(specs, cache, emit)
    for junk in (opt.prebuilt / "kernels").glob("*.lock"):
        junk.unlink()
    ok = all(r["ok"] for arch_rows in rows.values() for r in arch_rows)
    return {"ok": ok, "archs": rows, "n_kernels": len(next(iter(rows.values()), []))}


def synthetic_checkpoint(opt: Options, emit: Callable[[str], None]) -> Path:
    """The hybrid model's seeded synthetic checkpoint (a shape of ``picompile.tools.synthetic``)."""
    from picompile.tools import synthetic

    return synthetic.make_synthetic(opt.shape.model, opt.work / "synthetic" / opt.shape.model, emit=emit)


def budget_bytes(config: dict[str, Any], max_seq_len: int, hot_share: float = 0.1,
                 predictor_share: float = 0.05) -> tuple[int, int]:
    """(VRAM budget, model bytes in float16). place-neurons counts the weights as captured (float32: it runs
    before convert-weights) and puts the fixed parts on the GPU first (attention, lm_head, predictors, norms,
    KV cache); the budget is those plus ``hot_share`` of the FFN, so both partitions are used, and it stays
    below the float16 model (every weight, embedding included)."""
    d, n, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * d // config["num_attention_heads"]
    ffn, attn, head = L * 3 * n * d, L * (2 * d * d + 2 * d * kv), config["vocab_size"] * d  # parameters
    fixed = 4 * (attn + head + int(predictor_share * ffn) + (2 * L + 1) * d + L * 2 * kv * max_seq_len)
    return fixed + int(hot_share * 4 * ffn), 2 * (ffn + attn + head) + 4 * head


def prepare_artifact(opt: Options, emit: Callable[[str], None]) -> dict[str, Any]:
    """Build (or reuse) the hybrid artifact for target h200 into the carried folder."""
    import picompile
    from picompile.formats.artifact import is_artifact, read_manifest
    from picompile.runtime.loader import stale_kernels

    ckpt = synthetic_checkpoint(opt, emit)
    config = json.loads((ckpt / "config.json").read_text())
    max_seq = 256
    budget, model_bytes = budget_bytes(config, max_seq)
    build = dict(target="h200", vram_budget_gib=budget / (1 << 30), weight_dtype="float16", max_seq_len=max_seq,
                 calibration_tokens=opt.shape.calibration_tokens, placement_batch=opt.shape.placement_batch,
                 predictor="trained", kernel_cache=opt.work / "kernels" / "portable", cpu_mcpu=PORTABLE_MCPU)
    stamp = {**{k: str(v) for k, v in build.items()}, "synthetic": config.get("picompile_synthetic"),
             "mcpu": PORTABLE_MCPU}
    out = opt.prebuilt / f"{opt.shape.model}.pic"
    stamp_file = opt.prebuilt / f"{opt.shape.model}.stamp.json"
    reused = (is_artifact(out) and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp
              and not stale_kernels(read_manifest(out, verify=False).sections.get("kernels") or []))
    if not reused:
        emit(f"  building {out.name} (budget {budget / 2**20:.1f} MiB of a {model_bytes / 2**20:.1f} MiB model)")
        picompile.build(ckpt, output=out, emit=lambda s: None, progress=False, **build)
        stamp_file.write_text(json.dumps(stamp, indent=1))
    return {"ok": True, "artifact": str(out), "reused": reused, "budget_bytes": budget, "model_bytes": model_bytes,
            **check_artifact(out, model_bytes)}


def check_artifact(art: Path, model_bytes: int) -> dict[str, Any]:
    """Checksums, both partitions used, budget below the model, a CUDA kernel for every hot part."""
    from picompile.formats.artifact import read_manifest

    m = read_manifest(art, verify=True)
    place = m.sections["placement"]
    kernels = m.sections.get("kernels") or []
    cuda = [e for e in kernels if str(e["spec"]["target"]).startswith("cuda:")]
    hot_layers = sum(1 for h in place["n_hot"] if h > 0)
    problems = [p for p, bad in [
        (f"VRAM budget {m.target['vram_bytes']} B is not below the model's {model_bytes} B",
         not m.target["vram_bytes"] < model_bytes),
        ("no hot neuron: the GPU partition is empty", sum(place["n_hot"]) == 0),
        ("no cold neuron: the CPU partition is empty", sum(place["n_cold"]) == 0),
        (f"target {m.target['name']}, not h200", m.target["name"] != "h200"),
        (f"{hot_layers} layers have hot neurons but {len({u for e in cuda for u in e['uses']})} CUDA kernel uses",
         hot_layers != len({u for e in cuda for u in e["uses"]})),
    ] if bad]
    return {"ok": not problems, "problems": problems, "n_hot": place["n_hot"], "n_cold": place["n_cold"],
            "placement_status": place.get("status"), "cuda_kernels": [e["spec"] for e in cuda],
            "vram_bytes": m.target["vram_bytes"]}


def prepare_runtime(opt: Options) -> dict[str, Any]:
    """The TVM runtime libraries (not the compiler) into the carried folder, and the carry's size."""
    from picompile.kernels.loader import _tvm_lib_dir

    dest = opt.prebuilt / "tvm" / "lib"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        if not (dest / name).exists():
            shutil.copy2(_tvm_lib_dir() / name, dest / name)
    carried = _tree_bytes(opt.prebuilt) + _tree_bytes(ROOT / ".whl")
    tracked = sum((ROOT / p).stat().st_size for p in _tracked_files() if (ROOT / p).is_file())
    ok = carried + tracked <= CARRY_LIMIT
    return {"ok": ok, "carried_bytes": carried, "tracked_bytes": tracked, "limit_bytes": CARRY_LIMIT,
            **({} if ok else {"error": "the working tree and the carried folders exceed 64 MiB"})}


WHEEL_DIR = ROOT / ".whl"  # ignored; carried: wheels the device's Python lacks
DEVICE_WHEELS = ("apache-tvm-ffi==0.1.14.post1",)  # the TVM FFI this picompile pins (pyproject.toml)
DEVICE_PYTHON = "3.12"


def prepare_wheels(emit: Callable[[str], None]) -> dict[str, Any]:
    """Download the device's missing wheels (for its Python 3.12) into ``.whl`` unless they are there."""
    import subprocess

    WHEEL_DIR.mkdir(exist_ok=True)
    have = [w.name for w in WHEEL_DIR.glob("*.whl")]
    wanted = [spec for spec in DEVICE_WHEELS
              if not any(name.startswith(spec.split("==")[0].replace("-", "_") + "-" + spec.split("==")[1] + "-cp"
                                         + DEVICE_PYTHON.replace(".", "")) for name in have)]
    for spec in wanted:
        emit(f"downloading {spec} for Python {DEVICE_PYTHON} into {WHEEL_DIR}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               DEVICE_PYTHON, "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "-d", str(WHEEL_DIR), spec]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"ok": False, "error": f"pip download {spec}: {done.stderr.strip().splitlines()[-1:]}"}
    return {"ok": True, "wheels": sorted(w.name for w in WHEEL_DIR.glob("*.whl")), "downloaded": wanted}


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _tracked_files() -> list[str]:
    import subprocess

    proc = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=False)
    return proc.stdout.split() if proc.returncode == 0 else []


# -- step 1: kernels -----------------------------------------------------------------------------------------
def kernels_step(opt: Options, emit: Callable[[str], None], device: str) -> dict[str, Any]:
    """CUDA: the prebuilt sm_90 kernels on the GPU. Dry run: the same harness on the CPU with llvm kernels."""
    import gpu_check_kernels as gk
    import torch

    dev = gk.Device(device)
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
        target, cache = f"cuda:{arch}", kernel_dir(opt, arch)
        d, n = opt.shape.kernel_d_model, opt.shape.kernel_n_rows
    else:
        tiny = SHAPES["tiny"]  # the CPU harness at the test's size: it checks the harness, not the GPU kernels
        target, cache, d, n = "llvm", opt.work / "kernels" / "llvm", tiny.kernel_d_model, tiny.kernel_n_rows
    specs = opt.shape.kernel_specs(target, d, n)
    if device == "cpu":
        compiled = gk.compile_matrix(specs, cache, emit)
        if not all(r["ok"] for r in compiled):
            return {"ok": False, "compile": compiled}
    copy_gbs = gk.copy_bandwidth(dev, (1 << 30) if device == "cuda" else (64 << 20))
    emit(f"  copy bandwidth {copy_gbs:.1f} GB/s ({device})")
    results = gk.check_matrix(specs, cache, dev, copy_gbs, opt.shape.reps, emit)
    return {"ok": all(r["ok"] for r in results), "device": device, "target": target, "copy_gbs": copy_gbs,
            "tolerance": gk.TOLERANCE, "not_cuda": gk.cuda_refusals(d, n, "sm_90"), "results": results}


# -- step 2: hybrid against the CPU --------------------------------------------------------------------------
def hybrid_step(opt: Options, art: Path, mode: str) -> dict[str, Any]:
    """``hybrid=mode`` ("cuda"; "thread" in the dry run) against ``hybrid="off"`` on the CPU, logits per position."""
    import torch

    import picompile
    from picompile.runtime.hybrid import schedulers

    ref, hyb = picompile.load(art, hybrid="off", kernels="artifact"), picompile.load(art, hybrid=mode, kernels="artifact")
    backends = sorted({f"{type(s.hot).__name__}{'+kernel' if getattr(s.hot, 'kernel', None) else ''}"
                       for s in schedulers(hyb.graph)})
    from gpu_check_speed import prompt_ids

    prompt = prompt_ids(ref.vocab_size, opt.shape.prompt_len)
    dr, dh = ref.decoder(), hyb.decoder()
    errors, same_top = [], 0
    lr, lh = dr.feed(prompt), dh.feed(prompt)  # [prompt_len, vocab] each
    prefill_err = float((lh - lr).abs().max() / lr.abs().max())
    for _ in range(opt.shape.decode_tokens):
        tok = int(torch.argmax(lr[-1]))
        lr, lh = dr.feed([tok]), dh.feed([tok])  # [1, vocab]: both fed the CPU's greedy token
        errors.append(float((lh - lr).abs().max() / lr.abs().max()))
        same_top += int(torch.argmax(lh[-1]) == torch.argmax(lr[-1]))
    problems = [p for p, bad in [
        (f"hybrid mode is {hyb.hybrid_mode}, not {mode}", hyb.hybrid_mode != mode),
        (f"layers left unscheduled: {hyb.hybrid_skipped}", bool(hyb.hybrid_skipped)),
        (f"hot parts without their CUDA kernel: {backends}",  # EmptyPartition: a layer without hot rows
         mode == "cuda" and ("CudaPartition" in backends or "CudaPartition+kernel" not in backends)),
        (f"prefill logits differ by {prefill_err:.2e}", not prefill_err <= LOGIT_TOLERANCE),
        (f"decode logits differ by {max(errors, default=0):.2e}", not max(errors, default=0) <= LOGIT_TOLERANCE),
    ] if bad]
    return {"ok": not problems, "problems": problems, "mode": mode, "hot_backends": backends,
            "tolerance": LOGIT_TOLERANCE, "prefill_max_rel_error": prefill_err, "decode_max_rel_error": max(errors, default=0),
            "decode_top1_agreement": same_top / max(1, len(errors)), "tokens": len(prompt) + len(errors)}


# -- step 3: throughput (gpu_check_speed.py) -------------------------------------------------------------------
def throughput(opt: Options, art: Path, budget: int, mode: str, gpu: str) -> dict[str, Any]:
    from gpu_check_speed import throughput_step

    s = opt.shape
    return throughput_step(art, budget, mode, gpu, s.prompt_len, s.decode_tokens, s.rounds)


# -- main --------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> Options:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: build and check everything up to the first CUDA call")
    ap.add_argument("--shape", choices=list(SHAPES), default="plan", help="plan (default: the real check) or tiny (tests)")
    ap.add_argument("--archs", default=",".join(DEFAULT_ARCHS), help="CUDA archs compiled in the dry run")
    ap.add_argument("--prebuilt", type=Path, default=CHECK_DIR, help="the carried folder (kernels, artifact, TVM runtime)")
    ap.add_argument("--work", type=Path, help="CPU-side cache, not carried (default: <picompile cache>/gpu_check)")
    ap.add_argument("--json-out", type=Path, help="write every result to this JSON file")
    args = ap.parse_args(argv)
    archs = tuple(a.strip() for a in args.archs.split(",") if a.strip())
    bootstrap(args.prebuilt)
    if args.work is None:
        from picompile.config import default_cache_dir

        args.work = default_cache_dir() / "gpu_check"
    return Options(SHAPES[args.shape], args.dry_run, archs, args.prebuilt, args.work, args.json_out)


def main(argv: list[str] | None = None) -> int:
    opt = parse(argv)
    emit = lambda s: print(s, flush=True)  # noqa: E731
    n_kernels = len(opt.shape.kernel_specs("cuda:sm_90"))
    report = Report("dry-run" if opt.dry_run else "device", opt.shape.name)
    steps = plan(opt.shape, n_kernels)
    total = print_plan(steps, emit)
    report.data["plan"] = {"ok": total <= GPU_SECONDS_LIMIT, "steps": steps, "total_seconds": total,
                           "limit_seconds": GPU_SECONDS_LIMIT}
    if total > GPU_SECONDS_LIMIT:
        report.failures.append("plan")
    art = opt.prebuilt / f"{opt.shape.model}.pic"
    if opt.dry_run:
        opt.prebuilt.mkdir(parents=True, exist_ok=True)
        report.step("prepare_kernels", lambda: prepare_kernels(opt, emit), emit)
        artifact = report.step("prepare_artifact", lambda: prepare_artifact(opt, emit), emit) or {}
        if opt.shape.name == "plan":  # the real plan's device needs them; the test's tiny dry run stays offline
            report.step("prepare_wheels", lambda: prepare_wheels(emit), emit)
        report.step("prepare_runtime", lambda: prepare_runtime(opt), emit)
        report.step("kernels", lambda: kernels_step(opt, emit, "cpu"), emit)
        report.step("hybrid", lambda: hybrid_step(opt, art, "thread"), emit)
        budget = int(artifact.get("budget_bytes", 0))
        report.step("throughput", lambda: throughput(opt, art, budget, "thread", "cpu"), emit)
    else:
        env = report.step("environment", lambda: environment(opt, art), emit) or {}
        report.step("kernels", lambda: kernels_step(opt, emit, "cuda"), emit)
        report.step("hybrid", lambda: hybrid_step(opt, art, "cuda"), emit)
        budget = int(env.get("vram_bytes", 0))
        report.step("throughput", lambda: throughput(opt, art, budget, "cuda", "cuda"), emit)
    report.write(opt.json_out)
    emit(f"{'OK' if not report.failures else 'FAILED: ' + ', '.join(report.failures)}"
         + (f" (results in {opt.json_out})" if opt.json_out else ""))
    return 1 if report.failures else 0


def environment(opt: Options, art: Path) -> dict[str, Any]:
    """The device: GPU, torch, CUDA runtime for TVM, the carried files; fails when CUDA or a carried file is missing."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        return {**info, "ok": False, "error": "no CUDA device (run with --dry-run on a machine without one)"}
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, sms=props.multi_processor_count, memory_bytes=props.total_memory,
                capability=list(torch.cuda.get_device_capability()))
    _preload_cudart(info)
    missing = [str(p) for p in (art, opt.prebuilt / "kernels", opt.prebuilt / "tvm" / "lib") if not p.exists()]
    if art.exists():
        from picompile.formats.artifact import read_manifest

        m = read_manifest(art, verify=False)
        info.update(check_artifact(art, budget_bytes(m.model["config"], int(m.build["max_seq_len"]))[1]))
    return {**info, "ok": not missing and info.get("ok", True), "missing": missing}


def _preload_cudart(info: dict[str, Any]) -> None:
    """libtvm_runtime_cuda.so needs libcudart.so.13: opened from the system, else from torch's nvidia wheels."""
    import ctypes

    import torch

    candidates = ["libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13"]
    candidates += [str(p) for p in Path(torch.__file__).parents[1].glob("nvidia/**/libcudart.so.13")]
    for name in candidates:
        with contextlib.suppress(OSError):
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            info["cudart"] = name
            return
    info["cudart"] = None


if __name__ == "__main__":
    sys.exit(main())

"""picompile.kernels: TVM sparse FFN kernels against a float64 numpy reference, cache, loader, CUDA build.

CPU kernels are compiled and run here (small shapes); CUDA kernels are compiled with nvcc here and
run only under ``@pytest.mark.gpu`` (skipped without a CUDA device).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from picompile.kernels import (
    IndexValidationError,
    KernelArgumentError,
    KernelSpec,
    KernelSpecError,
    aligned_empty,
    as_aligned,
    build_count,
    build_kernel,
    dense_ffn,
    is_aligned,
    load_kernel,
    validate_indices,
)

REPO = Path(__file__).resolve().parents[1]
TOL = {"float32": 1e-5, "float16": 1e-2}  # relative error (max abs error / max abs reference)
TORCH_DT = {"float32": torch.float32, "float16": torch.float16}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernel_cache")


@functools.lru_cache(maxsize=None)
def _kernel(spec: KernelSpec, cache_dir: Path):  # -> SparseKernel
    return load_kernel(build_kernel(spec, cache_dir), spec)


# -- numpy reference -------------------------------------------------------------------------------
def _act_np(act: str, v: np.ndarray) -> np.ndarray:
    if act == "relu":
        return np.maximum(v, 0.0)
    if act == "silu":
        return v / (1.0 + np.exp(-v))
    return v


def _ref_h(spec: KernelSpec, w: dict[str, torch.Tensor], x: torch.Tensor, idx: torch.Tensor) -> np.ndarray:
    """float64 h [t?, k] from the (possibly fp16-rounded) weights."""
    rows = idx.numpy().astype(np.int64)
    x64 = x.numpy().astype(np.float64)
    up = x64 @ w["w_up"].float().numpy().astype(np.float64)[rows].T
    if w.get("b_up") is not None:
        up = up + w["b_up"].float().numpy().astype(np.float64)[rows]
    if w.get("w_gate") is not None:
        gate = x64 @ w["w_gate"].float().numpy().astype(np.float64)[rows].T
        return _act_np(spec.act, gate) * up
    return _act_np(spec.act, up)


def _ref_down(w_down_t: torch.Tensor, h: np.ndarray, idx: torch.Tensor) -> np.ndarray:
    rows = idx.numpy().astype(np.int64)
    return h @ w_down_t.float().numpy().astype(np.float64)[rows]


def _rel_err(out: torch.Tensor, ref: np.ndarray) -> float:
    if ref.size == 0:
        return 0.0
    scale = float(np.abs(ref).max())
    assert scale > 0, "reference is all zeros: the test would not check anything"
    return float(np.abs(out.numpy().astype(np.float64) - ref).max()) / scale


def _weights(spec: KernelSpec, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    n, d, dt = spec.n_rows, spec.d_model, TORCH_DT[spec.weight_dtype]

    def rnd(*shape: int) -> torch.Tensor:
        return as_aligned((torch.randn(*shape, generator=gen) / d**0.5).to(dt))

    w: dict[str, torch.Tensor | None] = {"w_up": None, "w_gate": None, "b_up": None, "w_down_t": None}
    if spec.has_up:
        w["w_up"] = rnd(n, d)  # [n_rows, d_model]
        if spec.gated:
            w["w_gate"] = rnd(n, d)  # [n_rows, d_model]
        if spec.has_bias:
            w["b_up"] = rnd(n)  # [n_rows]
    if spec.has_down:
        w["w_down_t"] = rnd(n, d)  # [n_rows, d_model]
    return w


def _pick_rows(spec: KernelSpec, w: dict, x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct rows, active ones (h != 0) first, so a ReLU output is never trivially zero."""
    n = spec.n_rows
    perm = torch.randperm(n, generator=gen)
    if spec.has_up and spec.act == "relu":
        all_rows = torch.arange(n, dtype=torch.int32)
        h_all = _ref_h(spec, w, x if x.dim() == 1 else x[0], all_rows)
        active = torch.from_numpy(h_all != 0)[perm]
        perm = torch.cat([perm[active], perm[~active]])
    idx = perm[:k].sort().values.to(torch.int32).contiguous()
    validate_indices(idx, n)
    return idx


# -- CPU correctness --------------------------------------------------------------------------------
CPU_CASES: list[tuple[str, str, str, bool, int, int]] = [
    # kind, act, weight dtype, bias, d_model, n_rows
    ("ffn_relu", "relu", "float32", True, 192, 320),
    ("ffn_relu", "relu", "float32", False, 100, 96),  # d not a multiple of 8: narrow vectors
    ("ffn_relu", "relu", "float16", True, 256, 512),
    ("ffn_relu", "relu", "float16", False, 64, 160),
    ("ffn_gated", "relu", "float32", False, 128, 256),  # ReGLU
    ("ffn_gated", "silu", "float32", True, 192, 320),  # SwiGLU (+ up bias)
    ("ffn_gated", "silu", "float16", False, 256, 384),
    ("up", "relu", "float32", True, 192, 320),
    ("up", "relu", "float16", False, 128, 256),
    ("up_gated", "silu", "float32", False, 128, 256),
    ("up_gated", "relu", "float16", True, 192, 320),
    ("down", "none", "float32", False, 192, 320),
    ("down", "none", "float16", False, 256, 512),
]


def _k_values(n: int) -> list[int]:
    return [0, 1, 4, 37, n]  # none, one, small, odd, all


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_kernel_matches_numpy_reference(case: tuple, cache_dir: Path) -> None:
    kind, act, wdt, bias, d, n = case
    spec = KernelSpec(kind, act, d, n, wdt, bias, "llvm")
    kern = _kernel(spec, cache_dir)
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    w = _weights(spec, gen)
    for t in (None, 3):  # one token (decode) and the batched variant
        x = as_aligned(torch.randn(*(() if t is None else (t,)), d, generator=gen))  # [t?, d]
        for k in _k_values(n):
            idx = _pick_rows(spec, w, x, k, gen)
            tok = () if t is None else (t,)
            if spec.has_up:
                h_ref = _ref_h(spec, w, x, idx)  # [t?, k]
            else:
                h_in = as_aligned(torch.randn(*tok, k, generator=gen))  # [t?, k]
                h_ref = h_in.numpy().astype(np.float64)
            if spec.has_down:
                y = aligned_empty((*tok, d))
                y.fill_(float("nan"))  # the kernel must overwrite every element
                if spec.has_up:
                    kern(x, w["w_up"], w["w_gate"], w["b_up"], w["w_down_t"], idx, y)
                else:
                    kern(h_in, w["w_down_t"], idx, y)
                out, ref = y, _ref_down(w["w_down_t"], h_ref, idx)
            else:
                h = aligned_empty((*tok, k))
                h.fill_(float("nan"))
                kern(x, w["w_up"], w["w_gate"], w["b_up"], idx, h)
                out, ref = h, h_ref
            assert not torch.isnan(out).any(), f"{kind} t={t} k={k}: output not fully written"
            if k == 0 and spec.has_down:
                assert torch.count_nonzero(out) == 0
                continue
            err = _rel_err(out, ref)
            assert err < TOL[wdt], f"{kind}/{act}/{wdt} t={t} k={k}: relative error {err:.2e}"


def test_compiled_function_handles_k0_itself(cache_dir: Path) -> None:
    """The one compiled function serves k = 0 too (SparseKernel short-cuts it, the raw call must not fail)."""
    spec = KernelSpec("ffn_relu", "relu", 64, 96, "float32", False, "llvm")
    kern = _kernel(spec, cache_dir)
    gen = torch.Generator().manual_seed(1)
    w = _weights(spec, gen)
    x = torch.randn(64, generator=gen)
    y = torch.full((64,), float("nan"))
    kern.decode_fn(x, w["w_up"], w["w_down_t"], torch.empty(0, dtype=torch.int32), y)
    assert torch.count_nonzero(y) == 0


@pytest.mark.parametrize("wdt", ["float32", "float16"])
@pytest.mark.parametrize("d, n", [(2048, 96), (192, 130)])  # 64 lanes + halving tree, r_out 32 / 3
def test_cpu_dense_gemv_matches_torch(wdt: str, d: int, n: int, cache_dir: Path) -> None:
    """Kind ``up``/act ``none`` with idx = all rows is the dense GEMV of a linear layer."""
    spec = KernelSpec("up", "none", d, n, wdt, False, "llvm")
    kern = _kernel(spec, cache_dir)
    gen = torch.Generator().manual_seed(d * 1000 + n)
    w = as_aligned((torch.randn(n, d, generator=gen) / d**0.5).to(TORCH_DT[wdt]))  # [n, d]
    idx = as_aligned(torch.arange(n, dtype=torch.int32))  # [n]: every row, last one included
    for tok in ((), (3,)):
        x = as_aligned(torch.randn(*tok, d, generator=gen))  # [t?, d]
        h = aligned_empty((*tok, n))  # [t?, n]
        h.fill_(float("nan"))
        kern(x, w, None, None, idx, h)
        ref = torch.nn.functional.linear(x.double(), w.double())  # fp16 weights are exact in fp32
        err = float((h.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, f"{wdt} d={d} n={n} t={tok}: relative error {err:.2e}"


@pytest.mark.parametrize("act, has_offset, d, n, rank", [("none", True, 2048, 700, 128), ("relu", False, 192, 130, 24)])
def test_cpu_predict_kernel_matches_torch(act: str, has_offset: bool, d: int, n: int, rank: int, cache_dir: Path) -> None:
    """Kind ``predict``: fc1, act, fc2, offset and the threshold test in one call give the mask torch computes
    (up to scores within float32 rounding of the threshold)."""
    spec = KernelSpec("predict", act, d, n, "float16", has_offset, "llvm", rank=rank)
    kern = _kernel(spec, cache_dir)
    gen = torch.Generator().manual_seed(n)
    fc1 = as_aligned((torch.randn(rank, d, generator=gen) / d**0.5).half())  # [rank, d]
    fc2 = as_aligned((torch.randn(n, rank, generator=gen) / rank**0.5).half())  # [n, rank]
    offset = as_aligned(torch.randn(n, generator=gen)) if has_offset else None  # [n]
    for threshold in (-0.2, 0.0, 0.4):
        x = as_aligned(torch.randn(d, generator=gen))  # [d]
        mask = torch.full((n,), 7, dtype=torch.int8)  # every entry must be overwritten with 0 or 1
        kern(x, fc1, fc2, offset, torch.tensor([threshold]), mask)
        h = fc1.double() @ x.double()  # [rank]
        scores = fc2.double() @ (h.relu() if act == "relu" else h) + (0 if offset is None else offset.double())
        ref = scores > threshold
        assert set(mask.unique().tolist()) <= {0, 1} and 0 < int(ref.sum()) < n
        decided = (scores - threshold).abs() > 1e-4 * scores.abs().max()
        assert torch.equal(mask.bool()[decided], ref[decided])
    with pytest.raises(KernelArgumentError):  # the offset is part of the spec: has_bias
        kern(x, fc1, fc2, None if has_offset else torch.zeros(n), torch.tensor([0.0]), mask)


@pytest.mark.parametrize("kind", ["up", "up_gated", "ffn_relu", "ffn_gated"])
@pytest.mark.parametrize("batched", [False, True])
def test_cpu_schedule_streams_rows(kind: str, batched: bool) -> None:
    """The CPU schedule's per-row structure (see kernels/cpu.py): rfactor accumulators on the stack
    (no ``local`` scope: TVM lowers that to a workspace call per row), a halving lane-sum tree, and
    prefetches of the next selected row in every weight-streaming loop (none with prefetch=False)."""
    import dataclasses

    from picompile.kernels import cpu
    from picompile.kernels.compute import describe, describe_partitioned

    spec = KernelSpec(kind, "relu", 256, 512, "float16", False, "llvm")
    desc = describe_partitioned(spec, 2, batched) if kind.startswith("ffn") else describe(spec, batched)
    params = cpu.default_params(spec, cores=2)
    text = cpu.schedule(desc, spec, params).script()
    assert 'scope="local"' not in text
    assert "T.unroll(64)" not in text and "T.unroll(2)" in text  # tree, not a 64-add chain
    streams = {"up": 1, "up_gated": 2, "ffn_relu": 2, "ffn_gated": 3}[kind]  # weight matrices read
    skips = kind.startswith("ffn") and not batched  # one token: a row whose ReLU is 0 skips the rest
    guard = {"ffn_relu": "if h[p, rj] != T.float32(0.0):", "ffn_gated": "if not gate[p, rj] <= T.float32(0.0):"}
    if skips:  # rows whose ReLU is 0 skip the rest, and the next row's prefetch waits for its gate (relu: h)
        assert guard[kind] in text
        decider = "gate" if kind == "ffn_gated" else "h"
        assert f"if not gate[p, T.min(rj + 1," in text if kind == "ffn_gated" else f"if {decider}[p, T.min(rj + 1," in text
    up_lines = params.up_lanes * 2 // 64  # cache lines per dot product iteration (fp16): 32 lanes (spec.dot_lanes), 1
    down_lines = params.down_lanes * 2 // 64 if kind.startswith("ffn") else 0  # the fused kinds' down rows: 64, 2
    assert params.up_lanes == 32
    assert text.count("llvm.prefetch") == (streams - (down_lines > 0)) * up_lines + down_lines
    assert "k - 1)" in text  # the next-row index is clamped
    plain = cpu.schedule(desc, spec, dataclasses.replace(params, prefetch=False)).script()
    assert "llvm.prefetch" not in plain
    whole = cpu.schedule(desc, spec, dataclasses.replace(params, skip_inactive=False)).script()
    assert not any(g in whole for g in guard.values())
    if kind.startswith("ffn"):
        full = {"ffn_relu": 2, "ffn_gated": 3}[kind]
        assert whole.count("llvm.prefetch") == (full - 1) * up_lines + down_lines


def test_dense_fallback_matches_reference() -> None:
    spec = KernelSpec("ffn_gated", "silu", 64, 128, "float16", True, "llvm")
    gen = torch.Generator().manual_seed(2)
    w = _weights(spec, gen)
    x = torch.randn(5, 64, generator=gen)
    idx = _pick_rows(spec, w, x, 50, gen)
    out = dense_ffn(x, w["w_up"], w["w_gate"], w["b_up"], w["w_down_t"], idx, "silu")
    ref = _ref_down(w["w_down_t"], _ref_h(spec, w, x, idx), idx)
    assert _rel_err(out, ref) < 1e-5


# -- spec, cache, loader ---------------------------------------------------------------------------
def test_spec_key_is_stable_and_validated() -> None:
    a = KernelSpec("ffn_relu", "relu", 4096, 16384, "float16", True, "llvm")
    b = KernelSpec("ffn_relu", "relu", 4096, 16384, "float16", True, "llvm")
    assert a.key() == b.key() and a.key().startswith("pi_ffn_relu_")
    assert a.key().replace("_", "").isalnum()
    others = [
        KernelSpec("ffn_relu", "relu", 4096, 16384, "float32", True, "llvm"),
        KernelSpec("ffn_relu", "relu", 4096, 16384, "float16", False, "llvm"),
        KernelSpec("ffn_relu", "relu", 4096, 16384, "float16", True, "cuda:sm_89"),
        KernelSpec("ffn_gated", "relu", 4096, 16384, "float16", True, "llvm"),
    ]
    assert len({a.key(), *(o.key() for o in others)}) == 5
    assert "rank" not in a.to_json()  # specs of the other kinds keep the keys they had before "predict"
    p = KernelSpec("predict", "none", 4096, 16384, "float16", True, "llvm", rank=64)
    assert p.key().startswith("pi_predict_") and KernelSpec.from_json(p.to_json()) == p
    # computed in another process: no dependence on hash seeds or dict order
    code = (
        "from picompile.kernels import KernelSpec; "
        "print(KernelSpec('ffn_relu', 'relu', 4096, 16384, 'float16', True, 'llvm').key())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == a.key()
    for bad in [
        dict(kind="mlp"),
        dict(act="gelu"),
        dict(kind="down", act="relu"),
        dict(d_model=0),
        dict(weight_dtype="bfloat16"),
        dict(target="cuda"),
        dict(target="rocm:gfx90a"),
        dict(rank=8),  # rank is for kind "predict" only
        dict(kind="predict", act="none"),  # … which needs it
        dict(kind="predict", act="silu", rank=8),
        dict(kind="predict", act="none", rank=8, target="cuda:sm_89"),
    ]:
        fields = dict(
            kind="ffn_relu", act="relu", d_model=64, n_rows=96, weight_dtype="float32", has_bias=False, target="llvm"
        )
        fields.update(bad)
        with pytest.raises(KernelSpecError):
            KernelSpec(**fields)


def test_kernel_built_for_another_cpu(tmp_path: Path) -> None:
    """--cpu-mcpu: a CPU kernel built for a named LLVM CPU (x86-64-v3: AVX2, runs on any recent x86-64) records
    it, computes the same result, and is rebuilt when this machine's own build is asked for."""
    import json

    from picompile.config import BuildConfig
    from picompile.errors import PicompileError

    spec = KernelSpec("up", "relu", 64, 96, "float32", False, "llvm")
    before = build_count()
    portable = build_kernel(spec, tmp_path / "portable", mcpu="x86-64-v3")
    meta = json.loads(portable.with_suffix(".json").read_text())
    assert "x86-64-v3" in meta["compile_target"] and build_count() == before + 1
    native = build_kernel(spec, tmp_path / "portable")  # the same cache, another CPU: rebuilt, not reused
    assert build_count() == before + 2 and "x86-64-v3" not in json.loads(native.with_suffix(".json").read_text())["compile_target"]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, generator=gen), torch.randn(96, 64, generator=gen)
    idx = torch.arange(96, dtype=torch.int32)
    out = []
    for mcpu in ("x86-64-v3", None):
        kern = load_kernel(build_kernel(spec, tmp_path / str(mcpu), mcpu=mcpu), spec)
        y = torch.empty(96)
        kern(x, w, None, None, idx, y)  # x, w_up, w_gate, b_up, idx, h
        out.append(y)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], torch.relu(w @ x), rtol=1e-4, atol=1e-4)
    with pytest.raises(PicompileError, match="--cpu-mcpu"):
        BuildConfig(model="m", output=tmp_path / "o.pic", cpu_mcpu="x86 64; rm -rf").validate()


def test_cache_reuses_compiled_library(tmp_path: Path) -> None:
    spec = KernelSpec("down", "none", 64, 96, "float32", False, "llvm")
    before = build_count()
    path = build_kernel(spec, tmp_path)
    assert build_count() == before + 1 and path.exists() and path.name == f"{spec.key()}.so"
    mtime = path.stat().st_mtime_ns
    again = build_kernel(spec, tmp_path)
    assert again == path and build_count() == before + 1 and path.stat().st_mtime_ns == mtime
    # a different spec compiles; a damaged cache entry (no metadata) is rebuilt
    build_kernel(KernelSpec("down", "none", 64, 96, "float16", False, "llvm"), tmp_path)
    assert build_count() == before + 2
    path.with_suffix(".json").unlink()
    build_kernel(spec, tmp_path)
    assert build_count() == before + 3
    load_kernel(path, spec)  # still loadable
    with pytest.raises(Exception, match="built for key"):
        load_kernel(path, KernelSpec("down", "none", 64, 96, "float16", False, "llvm"))


def test_import_is_cheap() -> None:
    code = (
        "import sys, picompile.kernels; "
        "assert 'tvm' not in sys.modules, 'tvm'; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_loader_is_runtime_only(cache_dir: Path) -> None:
    """Loading and calling a kernel imports neither ``tvm`` nor maps ``libtvm_compiler.so``."""
    spec = KernelSpec("ffn_relu", "relu", 64, 96, "float32", True, "llvm")
    path = build_kernel(spec, cache_dir)
    code = textwrap.dedent(
        f"""
        import sys, torch
        from pathlib import Path
        from picompile.kernels import KernelSpec, load_kernel, aligned_empty
        spec = KernelSpec("ffn_relu", "relu", 64, 96, "float32", True, "llvm")
        kern = load_kernel(Path({str(path)!r}), spec)
        x = torch.randn(64); wu = torch.randn(96, 64); b = torch.randn(96); wd = torch.randn(96, 64)
        idx = torch.arange(0, 96, 3, dtype=torch.int32); y = aligned_empty(64)
        kern(x, wu, None, b, wd, idx, y)
        ref = torch.relu(wu[idx.long()] @ x + b[idx.long()]) @ wd[idx.long()]
        assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
        assert "tvm" not in sys.modules, [m for m in sys.modules if m.startswith("tvm")]
        maps = open("/proc/self/maps").read()
        assert "libtvm_compiler" not in maps
        assert "libtvm_runtime.so" in maps
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_alignment_is_checked(cache_dir: Path) -> None:
    spec = KernelSpec("ffn_relu", "relu", 64, 96, "float32", False, "llvm")
    kern = _kernel(spec, cache_dir)
    shapes = [((7,), torch.float32), ((3, 5), torch.float16), ((96, 64), torch.float32), ((0, 3), torch.float32)]
    for shape, dtype in shapes:
        t = aligned_empty(shape, dtype)
        assert is_aligned(t) and t.shape == shape and t.dtype == dtype and t.is_contiguous()
    big = aligned_empty((1024, 4096), torch.float16)  # 8 MiB: backed by transparent huge pages
    big.fill_(0.5)
    assert is_aligned(big) and float(big.float().sum()) == 0.5 * big.numel()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and any(mode in thp.read_text() for mode in ("[always]", "[madvise]")):
        assert big.data_ptr() % (2 << 20) == 0
    buf = aligned_empty(65)
    buf.copy_(torch.randn(65))
    x_bad = buf[1:]  # 4 bytes past a 64-byte boundary
    assert not is_aligned(x_bad)
    assert is_aligned(as_aligned(x_bad)) and torch.equal(as_aligned(x_bad), x_bad)
    w_up, w_dn = torch.randn(96, 64), torch.randn(96, 64)
    idx = torch.arange(10, dtype=torch.int32)
    y = aligned_empty(64)
    with pytest.raises(KernelArgumentError, match="64-byte aligned"):
        kern(x_bad, w_up, None, None, w_dn, idx, y)
    w_bad = aligned_empty(98 * 64)[3 : 3 + 96 * 64].view(96, 64)
    with pytest.raises(KernelArgumentError, match="w_down_t is not 64-byte aligned"):
        kern(buf[:64], w_up, None, None, w_bad, idx, y)


def test_argument_checks(cache_dir: Path) -> None:
    spec = KernelSpec("ffn_relu", "relu", 64, 96, "float32", False, "llvm")
    kern = _kernel(spec, cache_dir)
    x, w, y = torch.randn(64), torch.randn(96, 64), torch.empty(64)
    idx = torch.arange(5, dtype=torch.int32)
    cases = [
        ((x.double(), w, None, None, w, idx, y), "x must be torch.float32"),
        ((x, w.half(), None, None, w, idx, y), "w_up must be torch.float16|w_up must be torch.float32"),
        ((x, w, w, None, w, idx, y), "w_gate must be None"),
        ((x, w, None, torch.randn(96), w, idx, y), "b_up must be None"),
        ((x, w[:, :32].contiguous(), None, None, w, idx, y), "w_up must have shape"),
        ((x, w, None, None, w, idx.long(), y), "idx must be torch.int32"),
        ((x, w, None, None, torch.randn(64, 96).t(), idx, y), "w_down_t must be contiguous"),
        ((x, w, None, None, w, idx), "takes 7 arguments"),
        ((torch.randn(2, 64), w, None, None, w, idx, y), "y must have shape"),
    ]
    for args, msg in cases:
        with pytest.raises(KernelArgumentError, match=msg):
            kern(*args)


def test_validate_indices() -> None:
    validate_indices(torch.tensor([0, 5, 95], dtype=torch.int32), 96)
    validate_indices(torch.empty(0, dtype=torch.int32), 96)
    with pytest.raises(IndexValidationError, match="out of range"):
        validate_indices(torch.tensor([0, 96], dtype=torch.int32), 96)
    with pytest.raises(IndexValidationError, match="out of range"):
        validate_indices(torch.tensor([-1, 3], dtype=torch.int32), 96)
    with pytest.raises(IndexValidationError, match="int32"):
        validate_indices(torch.tensor([1, 2]), 96)
    with pytest.raises(IndexValidationError, match="duplicate"):
        validate_indices(torch.tensor([3, 3], dtype=torch.int32), 96)
    validate_indices(torch.tensor([3, 3], dtype=torch.int32), 96, allow_duplicates=True)
    with pytest.raises(IndexValidationError, match="1-D"):
        validate_indices(torch.zeros(2, 2, dtype=torch.int32), 96)


# -- CUDA ------------------------------------------------------------------------------------------
def _nvcc() -> str | None:
    candidate = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(candidate) if candidate.exists() else None)


CUDA_COMPILE_CASES: list[tuple[str, str, str, bool, int, int]] = [
    ("ffn_relu", "relu", "float16", True, 256, 512),
    ("ffn_gated", "silu", "float32", False, 192, 320),
    ("up_gated", "relu", "float16", False, 128, 256),
    ("down", "none", "float32", False, 256, 512),
]


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (CUDA toolkit not installed)")
@pytest.mark.parametrize("case", CUDA_COMPILE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_kernels_compile_with_nvcc_sm89(case: tuple, tmp_path: Path) -> None:
    kind, act, wdt, bias, d, n = case
    spec = KernelSpec(kind, act, d, n, wdt, bias, "cuda:sm_89")
    path = build_kernel(spec, tmp_path)
    key = spec.key()
    source = (tmp_path / f"{key}.cu").read_text()
    cubin = (tmp_path / f"{key}.cubin").read_bytes()
    assert "__global__" in source and key in source
    assert cubin[:4] == b"\x7fELF"  # nvcc's cubin (an ELF image) for sm_89
    lib = path.read_bytes()
    assert cubin in lib, "the cubin must be embedded in the host library"
    assert b"__global__" not in lib, "no CUDA source in the library (the runtime cannot JIT it)"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [c for c in CPU_CASES if c[4] % 4 == 0],
    ids=lambda c: "-".join(map(str, c)),
)
def test_cuda_kernel_matches_numpy_reference(case: tuple, tmp_path: Path) -> None:
    kind, act, wdt, bias, d, n = case
    major, minor = torch.cuda.get_device_capability()
    spec = KernelSpec(kind, act, d, n, wdt, bias, f"cuda:sm_{major}{minor}")
    kern = load_kernel(build_kernel(spec, tmp_path), spec)
    gen = torch.Generator().manual_seed(5)
    w_cpu = _weights(spec, gen)
    w = {name: (t.cuda() if t is not None else None) for name, t in w_cpu.items()}
    x_cpu = torch.randn(d, generator=gen)
    x = x_cpu.cuda()
    for k in _k_values(n):
        idx_cpu = _pick_rows(spec, w_cpu, x_cpu, k, gen)
        idx = idx_cpu.cuda()
        h_ref = _ref_h(spec, w_cpu, x_cpu, idx_cpu) if spec.has_up else None
        if spec.has_down:
            y = torch.full((d,), float("nan"), device="cuda")
            if spec.has_up:
                kern(x, w["w_up"], w["w_gate"], w["b_up"], w["w_down_t"], idx, y)
            else:
                h_in = torch.randn(k, generator=gen)
                h_ref = h_in.numpy().astype(np.float64)
                kern(h_in.cuda(), w["w_down_t"], idx, y)
            out, ref = y, _ref_down(w_cpu["w_down_t"], h_ref, idx_cpu)
        else:
            h = torch.full((k,), float("nan"), device="cuda")
            kern(x, w["w_up"], w["w_gate"], w["b_up"], idx, h)
            out, ref = h, h_ref
        torch.cuda.synchronize()
        out = out.cpu()
        assert not torch.isnan(out).any()
        if k == 0 and spec.has_down:
            assert torch.count_nonzero(out) == 0
            continue
        assert _rel_err(out, ref) < TOL[wdt], f"{kind} k={k}"


def test_aligned_copies_pack_small_tensors_apart() -> None:
    """Load-time copies: equal values, every one aligned; the small ones share one mapping yet own their storage."""
    from picompile.kernels import aligned_copies
    from picompile.kernels.loader import ALIGNMENT, HUGE_PAGE_MIN_BYTES

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(HUGE_PAGE_MIN_BYTES // 4 + 7, generator=gen)[1:]  # over the threshold, unaligned view
    src = {"norm": torch.randn(3, 5, generator=gen), "fc2": torch.randn(40, 8, generator=gen).half(),
           "big": big, "empty": torch.empty(0), "idx": torch.arange(7, dtype=torch.int32)}
    out = aligned_copies(src)
    assert list(out) == list(src)
    for k, t in src.items():
        c = out[k]
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t) and c.is_contiguous()
        assert c.data_ptr() % ALIGNMENT == 0 and (c.data_ptr() != t.data_ptr() or t.numel() == 0)
        assert c.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage, no aliasing
    out["norm"].zero_()  # neighbours in the shared mapping are untouched
    assert torch.equal(out["fc2"], src["fc2"]) and torch.equal(out["idx"], src["idx"])


def test_cached_kernel_from_another_code_generator_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key names what a kernel computes; a library compiled by other schedule code (the package's
    sources changed since) is rebuilt, not reused."""
    import json

    from picompile.kernels import cache

    spec = KernelSpec("up", "relu", 64, 32, "float32", False, "llvm")
    before = build_count()
    path = build_kernel(spec, tmp_path)
    assert json.loads(path.with_suffix(".json").read_text())["codegen"] == cache.codegen_fingerprint()
    assert build_kernel(spec, tmp_path) == path and build_count() == before + 1  # same sources: a hit
    monkeypatch.setattr(cache, "codegen_fingerprint", lambda: "0123456789abcdef")
    build_kernel(spec, tmp_path)
    assert build_count() == before + 2
    assert json.loads(path.with_suffix(".json").read_text())["codegen"] == "0123456789abcdef"

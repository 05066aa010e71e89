"""Quantized (int8 / int4) TVM kernels against a float64 torch reference of the same quantized maths.

The reference dequantizes the weights with ``qformat.dequantize`` (``q * s``, ``(nibble - 8) * s``) and computes
the FFN in float64; the kernels accumulate in float32 (no activation quantization), so the tolerance is the
float32 kernels' one: max abs error / max abs reference below ``TOL``.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch

from picompile.kernels import (
    KernelArgumentError,
    KernelSpec,
    KernelSpecError,
    aligned_empty,
    as_aligned,
    build_kernel,
    call_args,
    load_kernel,
)
from picompile.kernels import cpu_qdot
from picompile.kernels.qformat import BLOCKS, QUANT_DTYPES, QFormat, dequantize, quantize
from picompile.kernels.spec import QUANT_BLOCKS
from picompile.kernels.spec import QUANT_DTYPES as SPEC_QUANT_DTYPES

TOL = 1e-5  # float32 accumulation of exactly dequantized weights (measured ~3e-7)
ACT = {"up": "none", "up_gated": "silu", "down": "none", "ffn_relu": "relu", "ffn_gated": "relu"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("qkernel_cache")


@functools.lru_cache(maxsize=None)
def _kernel(spec: KernelSpec, cache_dir: Path, mcpu: str | None = None):  # -> SparseKernel
    return load_kernel(build_kernel(spec, cache_dir, mcpu=mcpu), spec)


def _act(act: str, v: torch.Tensor) -> torch.Tensor:
    return torch.relu(v) if act == "relu" else torch.nn.functional.silu(v) if act == "silu" else v


def _quantized(spec: KernelSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, the dequantized weight in float64) of a random ``[n_rows, d_model]`` weight."""
    w = torch.randn(spec.n_rows, spec.d_model, generator=gen)
    w[0, : spec.block] = 0.0  # an all-zero block (scale 0)
    q, s = quantize(w, QFormat(spec.weight_dtype, spec.block))
    return as_aligned(q), as_aligned(s), dequantize(q, s, torch.float64)


def _run(spec: KernelSpec, cache_dir: Path, k: int, tokens: int | None, seed: int = 0,
         mcpu: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel of ``spec`` on random quantized weights and ``k`` random rows (on the spec's device);
    (out on the CPU, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    d, n = spec.d_model, spec.n_rows
    up, gate, down = (_quantized(spec, gen) for _ in range(3))
    shape = (tokens, d) if tokens else (d,)
    x = as_aligned(torch.randn(shape, generator=gen))
    idx = as_aligned(torch.randperm(n, generator=gen)[:k].to(torch.int32))
    b_up = as_aligned(torch.randn(n, generator=gen)) if spec.has_bias else None
    rows = idx.long()
    ref_h = None
    if spec.has_up:
        u = x.double() @ up[2][rows].T  # [t?, k]
        if b_up is not None:
            u = u + b_up.double()[rows]
        ref_h = _act(spec.act, x.double() @ gate[2][rows].T) * u if spec.gated else _act(spec.act, u)
    h_in = as_aligned(torch.randn((*shape[:-1], k), generator=gen)) if spec.kind == "down" else None
    out = aligned_empty((*shape[:-1], d) if spec.has_down else (*shape[:-1], k))
    args = {"x": x, "w_up": up[0], "s_up": up[1], "w_gate": gate[0] if spec.gated else None,
            "s_gate": gate[1] if spec.gated else None, "b_up": b_up, "w_down_t": down[0], "s_down": down[1],
            "idx": idx, "h": h_in if spec.kind == "down" else out, "y": out}
    if spec.is_cuda:
        dev = {a: None if t is None else t.cuda() for a, t in args.items()}
        name = "y" if spec.has_down else "h"  # the output
        dev[name] = torch.full_like(dev[name], float("nan"))
        _kernel(spec, cache_dir)(*(dev[a] for a in call_args(spec)))
        torch.cuda.synchronize()
        out = dev[name].cpu()
    else:
        _kernel(spec, cache_dir, mcpu)(*(args[a] for a in call_args(spec)))
    if spec.has_down:
        h = h_in.double() if spec.kind == "down" else ref_h
        return out, h @ down[2][rows]
    return out, ref_h


CASES = [  # kind, weight dtype, block, d_model, n_rows, has_bias, tokens (None: one token)
    *[(kind, wdt, 32, 256, 70, False, None) for kind in ACT for wdt in ("int8", "int4")],
    ("ffn_gated", "int4", 64, 384, 50, False, None),
    ("ffn_relu", "int8", 128, 256, 40, True, None),
    ("up", "int4", 256, 512, 33, True, None),
    ("down", "int4", 64, 192, 30, False, None),
    ("ffn_gated", "int8", 32, 256, 45, False, 3),
    ("up_gated", "int4", 32, 256, 45, False, 2),
    ("down", "int8", 32, 256, 45, False, 2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantized_cpu_kernel_matches_reference(case: tuple, cache_dir: Path) -> None:
    kind, wdt, block, d, n, bias, tokens = case
    spec = KernelSpec(kind, ACT[kind], d, n, wdt, bias, "llvm", block=block)
    for k in (1, n // 3, n):
        out, ref = _run(spec, cache_dir, k, tokens, seed=k)
        err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        assert err < TOL, f"k={k}: relative error {err:.2e}"


@pytest.mark.parametrize("kind, wdt", [("ffn_gated", "int4"), ("ffn_relu", "int8")])
def test_quantized_kernel_for_avx2_cpus(kind: str, wdt: str, tmp_path: Path) -> None:
    """Built for ``x86-64-v3`` (AVX2, no AVX-512: LLVM's generic lowering of the same TIR), still exact."""
    spec = KernelSpec(kind, ACT[kind], 256, 40, wdt, False, "llvm")
    out, ref = _run(spec, tmp_path, 13, None, mcpu="x86-64-v3")
    assert "x86-64-v3" in (tmp_path / f"{spec.key()}.json").read_text()  # the compile target it was built for
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < TOL


def test_quantized_spec_key_and_checks() -> None:
    assert (QUANT_BLOCKS, SPEC_QUANT_DTYPES) == (BLOCKS, QUANT_DTYPES)  # spec.py mirrors qformat (torch-free)
    f16 = KernelSpec("up", "none", 256, 8, "float16", False, "llvm")
    assert f16.key() == KernelSpec("up", "none", 256, 8, "float16", False, "llvm", block=64).key()  # block ignored
    assert "block" not in f16.to_json()
    q32 = KernelSpec("up", "none", 256, 8, "int4", False, "llvm")
    q64 = KernelSpec("up", "none", 256, 8, "int4", False, "llvm", block=64)
    assert q32.key() != q64.key() != KernelSpec("up", "none", 256, 8, "int8", False, "llvm", block=64).key()
    assert KernelSpec.from_json(q64.to_json()) == q64
    with pytest.raises(KernelSpecError, match="block must be one of"):
        KernelSpec("up", "none", 256, 8, "int8", False, "llvm", block=48)
    with pytest.raises(KernelSpecError, match="whole number of 64-element blocks"):
        KernelSpec("up", "none", 96, 8, "int8", False, "llvm", block=64)
    with pytest.raises(KernelSpecError, match="kind 'predict' takes float32, float16 or int8"):
        KernelSpec("predict", "relu", 256, 8, "int4", False, "llvm", rank=16)
    plain = KernelSpec("predict", "relu", 256, 8, "int8", False, "llvm", rank=16)  # int8 with its scales folded away
    assert not plain.quantized and call_args(plain) == ("x", "fc1", "fc2", "offset", "thr", "mask")
    assert call_args(KernelSpec("ffn_gated", "silu", 256, 8, "int4", True, "llvm")) == (
        "x", "w_up", "s_up", "w_gate", "s_gate", "b_up", "w_down_t", "s_down", "idx", "y")


def test_quantized_argument_checks(cache_dir: Path) -> None:
    spec = KernelSpec("up", "none", 256, 70, "int4", False, "llvm")
    kern = _kernel(spec, cache_dir)
    q, s = (as_aligned(t) for t in quantize(torch.randn(70, 256), QFormat("int4")))
    x, idx, h = aligned_empty(256), as_aligned(torch.arange(5, dtype=torch.int32)), aligned_empty(5)
    kern(x, q, s, None, None, None, idx, h)
    with pytest.raises(KernelArgumentError, match="s_up must be torch.float16"):
        kern(x, q, as_aligned(s.float()), None, None, None, idx, h)
    with pytest.raises(KernelArgumentError, match="w_up must have shape"):
        kern(x, as_aligned(torch.zeros(70, 256, dtype=torch.uint8)), s, None, None, None, idx, h)
    with pytest.raises(KernelArgumentError, match="s_gate must be None"):
        kern(x, q, s, None, s, None, idx, h)



# -- CUDA ------------------------------------------------------------------------------------------
def _nvcc() -> str | None:
    candidate = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(candidate) if candidate.exists() else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (CUDA toolkit not installed)")
@pytest.mark.parametrize("kind, wdt, arch", [("ffn_gated", "int4", "sm_80"), ("ffn_relu", "int8", "sm_89"),
                                             ("down", "int4", "sm_90"), ("up_gated", "int8", "sm_90")])
def test_quantized_cuda_kernels_compile_with_nvcc(kind: str, wdt: str, arch: str, tmp_path: Path) -> None:
    spec = KernelSpec(kind, ACT[kind], 256, 64, wdt, False, f"cuda:{arch}")
    lib = build_kernel(spec, tmp_path).read_bytes()
    source = (tmp_path / f"{spec.key()}.cu").read_text()
    cubin = (tmp_path / f"{spec.key()}.cubin").read_bytes()
    assert "__global__" in source and ("s_down" in source or "s_up" in source)  # the scales are read
    assert cubin[:4] == b"\x7fELF" and cubin in lib


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c[6] is None], ids=lambda c: "-".join(map(str, c)))
def test_quantized_cuda_kernel_matches_reference(case: tuple, cache_dir: Path) -> None:
    kind, wdt, block, d, n, bias, _ = case
    major, minor = torch.cuda.get_device_capability()
    spec = KernelSpec(kind, ACT[kind], d, n, wdt, bias, f"cuda:sm_{major}{minor}", block=block)
    for k in (1, n // 3, n):
        out, ref = _run(spec, cache_dir, k, None, seed=k)
        assert not torch.isnan(out).any()
        err = float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        assert err < TOL, f"k={k}: relative error {err:.2e}"


QDOT_CASES = [  # weight dtype, block, d_model, mcpu (LLVM CPU: which integer dot products it has), expected isa
    ("int4", 32, 512, "icelake-server", "vnni"),
    ("int8", 32, 512, "icelake-server", "vnni"),
    ("int4", 32, 1024, "skylake-avx512", "avx512bw"),
    ("int8", 64, 1024, "skylake-avx512", "avx512bw"),
    ("int4", 64, 1024, None, None),  # this machine's CPU: whichever it has (AVX-512 hosts: one of the two)
    ("int4", 32, 512, "x86-64-v3", "avx2"),  # AVX2 (AMD Zen 2/3, Intel Haswell..): vpmaddubsw on 256-bit halves
    ("int8", 32, 512, "x86-64-v3", "avx2"),
    ("int4", 64, 1024, "x86-64-v3", "avx2"),
    ("int4", 32, 512, "x86-64-v2", "float"),  # no AVX2: the float kernel (exact dequantized maths)
]

_NEEDS = {"icelake-server": "avx512_vnni", "skylake-avx512": "avx512bw", "x86-64-v3": "avx2", "znver2": "avx2"}


@pytest.mark.parametrize("case", QDOT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_integer_dot_gemv_matches_quantized_x_reference(case: tuple, tmp_path: Path) -> None:
    """Kind ``up`` with d_model a multiple of 16 blocks: integer dot products (``kernels/cpu_qdot.py``) where the
    target has VNNI or AVX512-BW, chosen from the LLVM CPU's features at build time (both built and run here: this
    machine kind has VNNI, so either runs). Against ``qdot_reference`` (x quantized to int8 blocks, exact integer
    block dots, float64): max abs error / max abs reference < TOL; against the float maths within x's rounding."""
    import json

    from picompile.kernels import cpu_qdot
    from picompile.kernels.qformat import qdot_reference

    wdt, block, d, mcpu, isa = case
    if mcpu in _NEEDS and not _host_has(_NEEDS[mcpu]):
        pytest.skip(f"this CPU cannot run {isa} code")
    spec = KernelSpec("up", "none", d, 37, wdt, False, "llvm", block=block)
    gen = torch.Generator().manual_seed(block + d)
    q, s, w = _quantized(spec, gen)
    x = torch.randn(d, generator=gen)
    x[block : 2 * block] = 0.0  # an all-zero block of x (its scale 0)
    x = as_aligned(x)
    idx = as_aligned(torch.tensor([36, 0, 5, 17, 3, 35, 1], dtype=torch.int32))
    h = aligned_empty(idx.numel())
    load_kernel(build_kernel(spec, tmp_path, mcpu=mcpu), spec)(x, q, s, None, None, None, idx, h)
    built = json.loads((tmp_path / f"{spec.key()}.json").read_text()).get("qdot")
    expected = None if isa == "float" else isa
    if isa is None:
        import tvm

        expected = cpu_qdot.isa_for(tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}))
    assert built == expected
    rows = idx.long()
    flt = x.double() @ w[rows].T
    if built is None:  # the float kernel: exact dequantized maths
        assert float((h.double() - flt).abs().max() / flt.abs().max()) < TOL
        return
    ref = qdot_reference(x, q, s)[rows]
    assert float((h.double() - ref).abs().max() / ref.abs().max()) < TOL
    assert float((h.double() - flt).abs().max() / flt.abs().max()) < 2e-2  # x's int8 rounding (~5e-3 measured)


@pytest.mark.parametrize("case", [("int4", 32, 512, None), ("int8", 32, 512, None), ("int4", 64, 1024, "x86-64-v3"),
                                  ("int8", 32, 512, "icelake-server")], ids=lambda c: "-".join(map(str, c)))
def test_integer_dot_batched_form_is_the_one_token_kernel_per_token(case: tuple, tmp_path: Path) -> None:
    """Kind ``up``'s several-token form with integer dot products (``cpu_qdot.describe_up_batched``, what the
    serving batch's quantized linears call): row j of token t is the one-token kernel's h[j] for x[t], bit for
    bit, for 1, 3 and 70 tokens (over a block of rows: ``BATCH_ROWS``) and a k that is not a whole block."""
    wdt, block, d, mcpu = case
    if mcpu in _NEEDS and not _host_has(_NEEDS[mcpu]):
        pytest.skip(f"this CPU cannot run {mcpu} code")
    spec = KernelSpec("up", "relu", d, 150, wdt, False, "llvm", block=block)
    import json

    kern = load_kernel(build_kernel(spec, tmp_path, mcpu=mcpu), spec)
    if json.loads((tmp_path / f"{spec.key()}.json").read_text()).get("qdot") is None:
        pytest.skip("this CPU has no integer dot-product kernel")
    gen = torch.Generator().manual_seed(d)
    q, s, w = _quantized(spec, gen)
    idx = as_aligned(torch.randperm(150, generator=gen)[:131].to(torch.int32))
    for t in (1, 3, 70):
        x = as_aligned(torch.randn(t, d, generator=gen))
        x[0, :block] = 0.0  # an all-zero block of x
        h = aligned_empty((t, 131))
        kern(x, q, s, None, None, None, idx, h)
        for i in range(t):
            one = aligned_empty(131)
            kern(as_aligned(x[i].clone()), q, s, None, None, None, idx, one)
            assert torch.equal(h[i], one), f"token {i} of {t}"
        ref = torch.relu(x.double() @ w[idx.long()].T)
        assert float((h.double() - ref).abs().max() / ref.abs().max()) < 2e-2  # x's int8 rounding


def _host_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


QDOT_FFN_CASES = [  # kind, act, weight dtype, block, d_model, mcpu, cpu_qdot.INT_DOWN
    ("ffn_gated", "relu", "int4", 32, 512, "icelake-server", True),
    ("ffn_gated", "relu", "int4", 32, 512, "icelake-server", False),
    ("ffn_gated", "silu", "int8", 32, 512, "icelake-server", True),
    ("ffn_gated", "silu", "int4", 64, 1024, "skylake-avx512", True),
    ("ffn_gated", "silu", "int8", 32, 512, "skylake-avx512", True),  # AVX512-BW int8: the float down rows
    ("ffn_relu", "relu", "int4", 64, 1024, "skylake-avx512", True),
    ("ffn_relu", "relu", "int8", 32, 512, "icelake-server", True),
    ("ffn_relu", "relu", "int8", 32, 512, "icelake-server", False),
    ("ffn_gated", "relu", "int4", 32, 512, "x86-64-v3", True),
    ("ffn_gated", "relu", "int4", 32, 512, "x86-64-v3", False),
    ("ffn_gated", "silu", "int8", 32, 512, "x86-64-v3", True),  # AVX2 int8: the float down rows
    ("ffn_relu", "relu", "int4", 64, 1024, "x86-64-v3", True),
    ("ffn_relu", "relu", "int8", 32, 512, "x86-64-v3", True),
]


def _grouped_down(h: torch.Tensor, rows: torch.Tensor, qd: torch.Tensor, sd: torch.Tensor, k: int) -> torch.Tensor:
    """The integer down rows' reference: the kernel's parts (``build_cores`` contiguous runs of the k rows), in each
    the active rows (h != 0) in order, 4 at a time (``qdown_reference``)."""
    from picompile.kernels.cpu import build_cores
    from picompile.kernels.qformat import qdown_reference

    per = -(-k // build_cores())
    y = torch.zeros(qd.shape[1] * (2 if qd.dtype == torch.uint8 else 1), dtype=torch.float64)
    for p0 in range(0, k, per):
        hp, rp = h[p0:p0 + per], rows[p0:p0 + per]
        live = hp != 0
        if live.any():
            y += qdown_reference(hp[live], qd[rp[live]], sd[rp[live]])
    return y


@pytest.mark.parametrize("case", QDOT_FFN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_integer_dot_ffn_matches_quantized_x_reference(case: tuple, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused one-token FFN with integer up/gate dot products (``cpu_qdot.describe_ffn``): h from
    ``qdot_reference`` dots (x quantized), y = h · the dequantized down rows in float64 or, for the integer down
    rows (``cpu_qdot.INT_DOWN``), ``qdown_reference`` over the kernel's groups of 4 active rows per part; < TOL of max |y|, for k = 1, a third and all rows (short last part, skipped inactive rows)."""
    import json

    from picompile.kernels.qformat import qdot_reference

    kind, act, wdt, block, d, mcpu, int_down = case
    if not _host_has(_NEEDS[mcpu]):
        pytest.skip(f"this CPU cannot run {mcpu} code")
    n = 41
    spec = KernelSpec(kind, act, d, n, wdt, False, "llvm", block=block)
    monkeypatch.setattr(cpu_qdot, "INT_DOWN", int_down)
    kern = load_kernel(build_kernel(spec, tmp_path, mcpu=mcpu), spec)
    isa = json.loads((tmp_path / f"{spec.key()}.json").read_text())["qdot"]
    assert isa in ("vnni", "avx512bw", "avx2")
    integer_down = cpu_qdot.int_down(spec, isa)
    assert integer_down == (int_down and (isa == "vnni" or wdt == "int4"))
    gen = torch.Generator().manual_seed(d + block)
    (qu, su, _), (qg, sg, _), (qd, sd, wd) = (_quantized(spec, gen) for _ in range(3))
    x = as_aligned(torch.randn(d, generator=gen))
    for k in (1, n // 3, n):
        idx = as_aligned(torch.randperm(n, generator=gen)[:k].to(torch.int32))
        rows = idx.long()
        u = qdot_reference(x, qu, su)[rows]
        h = _act(act, qdot_reference(x, qg, sg)[rows]) * u if spec.gated else _act(act, u)
        ref = h @ wd[rows] if not integer_down else _grouped_down(h, rows, qd, sd, k)
        y = aligned_empty(d)
        named = {"x": x, "w_up": qu, "s_up": su, "w_gate": qg if spec.gated else None,
                 "s_gate": sg if spec.gated else None, "b_up": None, "w_down_t": qd, "s_down": sd, "idx": idx, "y": y}
        kern(*(named[a] for a in call_args(spec)))
        err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        assert err < TOL, f"k={k}: relative error {err:.2e}"


@pytest.mark.parametrize("kind,act,block,d", [("ffn_gated", "relu", 32, 512), ("ffn_relu", "relu", 64, 1024)])
def test_paired_down_rows_equal_the_four_row_form(kind: str, act: str, block: int, d: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2 int4: the integer down rows as two pairs with int16 sums (``cpu_qdot.paired_down``) give y bit for bit
    equal to the 4-row ``vpmaddwd`` form, for k = 1 (one padded group), a third and all rows; with large h and
    scales, so the int16 sums reach their bound's order."""
    if not _host_has("avx2"):
        pytest.skip("this CPU cannot run x86-64-v3 code")
    n = 53
    spec = KernelSpec(kind, act, d, n, "int4", False, "llvm", block=block)
    kerns = {}
    for paired in (True, False):
        monkeypatch.setattr(cpu_qdot, "PAIRED_DOWN", paired)
        kerns[paired] = load_kernel(build_kernel(spec, tmp_path / str(paired), mcpu="x86-64-v3"), spec)
        assert cpu_qdot.paired_down(spec, "avx2") is paired
    gen = torch.Generator().manual_seed(d)
    (qu, su, _), (qg, sg, _), (qd, sd, _) = (_quantized(spec, gen) for _ in range(3))
    qd.copy_(torch.full_like(qd, 0xF0))  # down nibbles 0 and 15: the extremes of (q - 8)
    qd[::3] = torch.randint(0, 256, qd[::3].shape, generator=gen, dtype=torch.uint8)
    sd.mul_(40)
    x = as_aligned(torch.randn(d, generator=gen) * 3)
    for k in (1, n // 3, n):
        idx = as_aligned(torch.randperm(n, generator=gen)[:k].to(torch.int32))
        ys = {}
        for paired, kern in kerns.items():
            ys[paired] = aligned_empty(d)
            named = {"x": x, "w_up": qu, "s_up": su, "w_gate": qg if spec.gated else None,
                     "s_gate": sg if spec.gated else None, "b_up": None, "w_down_t": qd, "s_down": sd, "idx": idx,
                     "y": ys[paired]}
            kern(*(named[a] for a in call_args(spec)))
        assert torch.equal(ys[True], ys[False]), f"k={k}: {int((ys[True] != ys[False]).sum())} outputs differ"
    assert ys[True].abs().max() > 0  # all rows: some active


def test_integer_dot_can_be_turned_off(tmp_path: Path) -> None:
    """``build_kernel(..., integer_dot=False)`` (benchmarks' A/B) keeps the float path: exact dequantized maths."""
    import json

    spec = KernelSpec("up", "none", 512, 9, "int4", False, "llvm")
    kern = load_kernel(build_kernel(spec, tmp_path, integer_dot=False), spec)
    assert json.loads((tmp_path / f"{spec.key()}.json").read_text())["qdot"] is None
    gen = torch.Generator().manual_seed(3)
    q, s, w = _quantized(spec, gen)
    x, idx, h = as_aligned(torch.randn(512, generator=gen)), as_aligned(torch.arange(9, dtype=torch.int32)), aligned_empty(9)
    kern(x, q, s, None, None, None, idx, h)
    ref = x.double() @ w.T
    assert float((h.double() - ref).abs().max() / ref.abs().max()) < TOL


QPREDICT_CASES = [  # act, offset, d_model, rank, mcpu, expected isa ("float": the float kernel)
    ("relu", True, 256, 64, "x86-64-v3", "avx2"),
    ("none", False, 512, 128, "x86-64-v3", "avx2"),
    ("relu", True, 256, 128, "icelake-server", "vnni"),
    ("relu", False, 256, 64, "skylake-avx512", "avx512bw"),
    ("relu", True, 256, 64, None, None),  # this machine's CPU
    ("relu", True, 256, 48, "x86-64-v3", "float"),  # rank not a multiple of 64: the float kernel
    ("relu", True, 256, 64, "x86-64-v2", "float"),  # no AVX2
]


@pytest.mark.parametrize("case", QPREDICT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_integer_predictor_matches_quantized_reference(case: tuple, tmp_path: Path) -> None:
    """Kind ``predict`` with int8 rows (``kernels/cpu_qpredict.py``): x and h quantized to int8 blocks, integer dot
    products. Its mask equals ``qpredict_reference``'s scores > thr for every row whose score is not within float32
    rounding of the threshold (set to the median score, so half the rows each side), and the float maths' mask
    except within x's and h's int8 rounding (under 2 % of the largest score, ~0.8 % measured)."""
    import json

    from picompile.kernels import cpu_qpredict

    act, has_offset, d, rank, mcpu, isa = case
    if mcpu in _NEEDS and not _host_has(_NEEDS[mcpu]):
        pytest.skip(f"this CPU cannot run {isa} code")
    n = 200
    spec = KernelSpec("predict", act, d, n, "int8", has_offset, "llvm", rank=rank)
    kern = load_kernel(build_kernel(spec, tmp_path, mcpu=mcpu), spec)
    built = json.loads((tmp_path / f"{spec.key()}.json").read_text()).get("qdot")
    if isa is None:
        import tvm

        host = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
        isa = cpu_qdot.isa_for(host) if cpu_qpredict.applies(spec, cpu_qdot.isa_for(host)) else "float"
    assert built == (None if isa == "float" else isa)
    gen = torch.Generator().manual_seed(d + rank)
    x = torch.randn(d, generator=gen)
    x[32:64] = 0.0  # an all-zero block of x (its scale 0)
    fc1 = torch.randint(-127, 128, (rank, d), generator=gen, dtype=torch.int8)
    fc2 = torch.randint(-127, 128, (n, rank), generator=gen, dtype=torch.int8)
    offset = torch.randn(n, generator=gen) * 3e3 if has_offset else None
    flt = _act(act, x.double() @ fc1.double().T) @ fc2.double().T + (offset.double() if has_offset else 0)
    ref = cpu_qpredict.qpredict_reference(x, fc1, fc2, act, offset) if built else flt
    thr = float(ref.median())
    mask = torch.zeros(n, dtype=torch.int8)
    kern(x, fc1, fc2, offset, torch.tensor([thr]), mask)
    scale = float(ref.abs().max())
    clear = (ref - thr).abs() > 1e-5 * scale  # rows not within float32 rounding of the threshold
    assert int(clear.sum()) >= n - 4
    assert torch.equal(mask.bool()[clear], (ref > thr)[clear])
    far = (flt - thr).abs() > 2e-2 * scale  # against the float maths: x's and h's int8 rounding
    assert int(far.sum()) >= n // 2
    assert torch.equal(mask.bool()[far], (flt > thr)[far])
    if built:
        assert float((ref - flt).abs().max()) / scale < 2e-2


def test_integer_predictor_can_be_turned_off(tmp_path: Path) -> None:
    """``integer_dot=False`` builds the float predictor for int8 rows too (exact int8 → float32 maths)."""
    import json

    spec = KernelSpec("predict", "relu", 256, 40, "int8", False, "llvm", rank=64)
    load_kernel(build_kernel(spec, tmp_path, integer_dot=False), spec)
    assert json.loads((tmp_path / f"{spec.key()}.json").read_text())["qdot"] is None

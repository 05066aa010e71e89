"""sparsify-inputs: input-sparse linears (q/k/v, o, gate/up, down) equal their torch reference through the row-axpy
kernel, 0 % gives the dense logits exactly, the allocation keeps its budget, and a bad allocation is clearly worse."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import picompile
from picompile.ir.graph import count_ops
from picompile.ir.ops import input_sparse_linear
from picompile.pipeline import pass_names
from picompile.runtime.loader import load_kernels
from picompile.sparsity import input_sparsity as isp
from picompile.testing import context_for, run_passes

IDS = [9, 8, 7, 60, 50, 40, 30, 20]


def _decode(gm: torch.fx.GraphModule, ctx, ids: list[int]) -> torch.Tensor:
    """Prefill 3 tokens (torch path), then one token at a time (the kernels): logits [len(ids), vocab]."""
    outs = []
    with torch.no_grad():
        out = gm(torch.tensor([ids[:3]]), *ctx.info.kv_tensors())
        outs.append(out[0][0])
        for t in ids[3:]:
            out = gm(torch.tensor([[t]]), *out[1:])
            outs.append(out[0][0])
    return torch.cat(outs)


@pytest.mark.parametrize("kind,d_in,d_out", [("input_sparse", 96, 80), ("input_sparse", 70, 576),
                                              ("input_sparse", 33, 24), ("input_sparse_rows", 70, 576),
                                              ("input_sparse_rows", 33, 24), ("down", 96, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_torch_reference(dtype: torch.dtype, kind: str, d_in: int, d_out: int, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-token kernel (``input_sparse``, its tasks splitting y or, ``_rows``, the active rows; ``down``:
    artifacts built before it) against (x · mask) Wᵀ + b, at shapes whose row lengths are whole cache lines, not
    (24 float32 = 1.5 lines), and whose active counts are not multiples of the kernel's four rows per step; every
    channel active (mask None) and none."""
    from picompile.kernels import KernelSpec, as_aligned, build_kernel
    from picompile.kernels import input_sparse as isk
    from picompile.kernels.loader import load_kernel
    from picompile.kernels.table import add_kernel

    if kind == "input_sparse_rows":  # (the kernel cache is this test's own tmp_path)
        monkeypatch.setattr(isk, "ROW_SPLIT_MAX_BYTES", 1 << 30)
        kind = "input_sparse"
    else:
        monkeypatch.setattr(isk, "ROW_SPLIT_MAX_BYTES", 0)

    spec = KernelSpec(kind=kind, act="none", d_model=d_out, n_rows=d_in, weight_dtype=str(dtype).removeprefix("torch."),
                      has_bias=False, target="llvm")
    add_kernel(spec.key(), load_kernel(build_kernel(spec, tmp_path), spec))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=g).to(dtype)  # nn.Linear layout
    w_t = as_aligned(w.t().contiguous(), copy=True)  # [d_in, d_out]
    b = torch.randn(d_out, generator=g)
    x = torch.randn(1, 1, d_in, generator=g)
    mask = x.abs() > 0.8  # about 40 % of the channels
    ref = torch.nn.functional.linear(x * mask, w.float(), b)  # the dense product over the active channels
    got = input_sparse_linear(x, w_t, b, mask, spec.key())
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    # the torch path: ops.lin computes a float16 weight in float16 where the CPU has a native float16 GEMM (x and
    # y rounded to float16: ~5e-4 of |y|), in float32 elsewhere
    from picompile.ir.ops import native_half_gemm

    tol = 2e-3 if dtype == torch.float16 and native_half_gemm() else 1e-4
    assert torch.allclose(input_sparse_linear(x, w_t, b, mask), ref, atol=10 * tol, rtol=tol)
    assert torch.allclose(input_sparse_linear(x, w_t, b, None, spec.key()),
                          torch.nn.functional.linear(x, w.float(), b), atol=1e-4, rtol=1e-4)
    none = torch.zeros_like(mask)
    assert torch.equal(input_sparse_linear(x, w_t, b, none, spec.key()), b.expand_as(ref))  # no channel: y = b
    for k in range(1, 6):  # the first k channels: 1..5 active rows (padding of the four-row steps)
        m = torch.zeros_like(mask)
        m[..., :k] = True
        assert torch.allclose(input_sparse_linear(x, w_t, b, m, spec.key()),
                              torch.nn.functional.linear(x * m, w.float(), b), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def silu_ckpt(checkpoints: dict) -> Path:
    return checkpoints[("llama", "silu")]


def test_lowered_pass_matches_reference_and_skips_bytes(silu_ckpt: Path, tmp_path: Path) -> None:
    names = pass_names("default")[:-1]  # through sparsify-inputs
    ctx = context_for(silu_ckpt, tmp_path, predictor="none", input_sparsity="all", act_sparsity=0.4,
                      calibration_tokens=512, input_loss_tokens=128)
    gm = run_passes(ctx, names)
    ops = count_ops(gm)
    L = ctx.info.n_layers
    assert ops.get("picompile::tvm_sparse_ffn", 0) == 0 and ops.get("picompile::merge", 0) == 0
    assert ops["picompile::input_sparse_linear"] == 4 * L  # qkv (fused), o, gate/up (fused), down per layer
    assert ops["picompile::tvm_linear"] == 1  # lm_head stays a dense GEMV
    report = ctx.manifest_extra["input_sparsity"]
    assert ctx.manifest_extra["profile"]["corpus"]["kind"] == "sampled"  # input sparsity: sampled from the model
    assert abs(report["bytes_saved_calibration"] - 0.4) < 0.1
    assert {g["group"] for g in report["groups"]} == {"qkv", "o", "gate_up", "down"}
    kinds = sorted(e["spec"]["kind"] for e in ctx.manifest_extra["kernels"])
    assert kinds.count("up") == 1 and set(kinds) == {"up", "input_sparse"}  # the replaced GEMV / FFN kernels are gone
    for e in ctx.manifest_extra["kernels"]:
        assert (tmp_path / e["file"]).is_file()
    with torch.no_grad():  # every token in one prefill: the torch path (x · mask) @ Wᵀ
        full = gm(torch.tensor([IDS]), *ctx.info.kv_tensors())[0][0]
    load_kernels(tmp_path, ctx.manifest_extra["kernels"])
    lowered = _decode(gm, ctx, IDS)  # the last five tokens one at a time: the input-sparse kernels
    assert (full - lowered).abs().max().item() < 1e-4


def test_zero_sparsity_is_exactly_dense(silu_ckpt: Path, tmp_path: Path) -> None:
    dense = picompile.build(silu_ckpt, output=tmp_path / "d.pic", predictor="none", act_sparsity=0.0)
    zero = picompile.build(silu_ckpt, output=tmp_path / "z.pic", predictor="none", act_sparsity=0.0, input_sparsity="all")
    a, b = picompile.load(dense).logits(IDS), picompile.load(zero).logits(IDS)
    assert torch.equal(a, b)
    # thresholds of 0 on every input: the input-sparse graph computes the dense model (up to summation order)
    some = picompile.build(silu_ckpt, output=tmp_path / "s.pic", predictor="none", act_sparsity=0.3, input_sparsity="all",
                           calibration_tokens=256, input_loss_tokens=64, input_allocation="uniform")
    s = picompile.load(some)
    assert count_ops(s.graph).get("picompile::input_mask", 0) > 0
    # its input-sparse linears call their TVM kernels for one token: none is a torch weight read, so the decode
    # step runs on one torch thread (runtime/threads.py)
    assert s.torch_weight_reads == [] and s.decode_torch_threads == 1
    recorded = s.manifest.build  # the input-sparsity options that shaped it, so that it can be rebuilt alike
    assert (recorded["input_sparsity"], recorded["input_allocation"], recorded["input_loss_tokens"]) == ("all", "uniform", 64)
    assert torch.allclose(picompile.load(some, dense=True).logits(IDS), a, atol=1e-4)
    with torch.no_grad():  # the masked graph (what decode and eval run; the prompt's prefill is dense)
        masked = s.graph(torch.tensor([IDS]), *s.empty_past())[0][0]
    assert not torch.allclose(masked, a, atol=1e-4)  # the masks do change the logits


def test_budget_is_respected_and_bad_allocation_is_worse(silu_ckpt: Path, tmp_path: Path) -> None:
    from picompile.passes.sparsify_inputs import _Calibrator, _rewrite

    ctx = context_for(silu_ckpt, tmp_path, predictor="none", input_sparsity="all", accuracy_budget=0.02,
                      calibration_tokens=512, input_loss_tokens=128, pipeline="reference")
    run_passes(ctx, pass_names("reference")[:-1])
    r = ctx.manifest_extra["input_sparsity"]
    nll = r["calibration_nll"]
    assert nll["sparse"] <= nll["dense"] + math.log1p(0.02) + 1e-9  # the budget, on the held-out calibration tokens
    assert r["bytes_saved_calibration"] > 0.05  # … and it does skip bytes
    # the same bytes spent where the measured loss per byte is worst: clearly worse than the greedy allocation
    ctx2 = context_for(silu_ckpt, tmp_path / "b", predictor="none", input_sparsity="all", act_sparsity=0.4,
                       calibration_tokens=512, input_loss_tokens=128, pipeline="reference")
    gm = run_passes(ctx2, pass_names("reference")[:-2])  # up to sparsify-inputs
    rw = _rewrite(gm, ctx2)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    cal = _Calibrator(gm, ctx2, rw)
    cal.collect()
    curves = cal.curves(lambda: None)
    sizes = [g.bytes for g in rw.groups]
    good = isp.for_bytes(isp.greedy_path(curves, sizes), 0.4)
    worst = sorted(range(len(sizes)), key=lambda i: -curves[i][-1] / sizes[i])
    bad, saved = [0.0] * len(sizes), 0.0
    for i in worst:  # the most sensitive groups at 90 % until 40 % of the bytes are skipped
        if saved >= 0.4 * sum(sizes):
            break
        bad[i] = 0.9
        saved += 0.9 * sizes[i]
    assert saved >= 0.4 * sum(sizes) - 1e-6
    dense = cal.dense_nll
    assert cal.nll(bad) - dense > 1.4 * (cal.nll(good.sparsity) - dense)  # 1.65x here (a random tiny model)


def test_greedy_path_spends_bytes_where_loss_is_cheapest() -> None:
    # group 0 costs 10x the loss of group 1 per level; equal sizes: group 1 fills up first
    curves = [[0.1 * (j + 1) for j in range(9)], [0.01 * (j + 1) for j in range(9)]]
    path = isp.greedy_path(curves, [100, 100])
    assert [a.saved for a in path] == sorted(a.saved for a in path)
    half = isp.for_bytes(path, 0.45)
    assert half.sparsity[0] == 0.0 and half.sparsity[1] == 0.9
    found, _ = isp.within_budget(path, lambda a: a.predicted_loss <= 0.2)
    assert found is not None and found.predicted_loss <= 0.2 and found.saved > 0.45


def test_batched_calibration_sampler_writes_documents_from_bos(silu_ckpt: Path) -> None:
    """examples/sample_calibration.py from a checkpoint directory: batched documents, each starting at BOS."""
    import importlib.util
    import json

    from transformers import AutoConfig

    spec = importlib.util.spec_from_file_location("sample_calibration",
                                                  Path(__file__).parents[1] / "examples" / "sample_calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    bos = AutoConfig.from_pretrained(silu_ckpt).bos_token_id
    ids = mod.sample_ids_hf(silu_ckpt, 40, seed=0, doc_tokens=7, batch=3)
    assert len(ids) == 40 and ids[0] == bos
    assert ids.count(bos) >= 40 // 8  # one BOS per document of at most 8 ids
    vocab = json.loads((silu_ckpt / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for t in ids)


def test_weighted_criterion_folds_into_per_channel_thresholds() -> None:
    """WINA's |x_i|·‖W[:, i]‖ > t is |x_i| > t / ‖W[:, i]‖: the cut keeps exactly the channels whose weighted score
    is above the quantile; at 0 % it is 0 (every nonzero channel read); a zero column is never read."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    scale = torch.rand(16, generator=g) + 0.1
    scale[3] = 0.0
    grp = isp.Group(0, "o", 16, 16 * 8 * 4, scale=scale)
    grp.add(x, g)
    grp.finish()
    assert grp.cut(0.0) == 0.0
    cut = grp.cut(0.4)
    assert isinstance(cut, torch.Tensor) and cut.shape == (16,) and math.isinf(float(cut[3]))
    t = grp.threshold(0.4)
    keep = (x.abs() > cut)[:, [i for i in range(16) if i != 3]]
    want = (x.abs() * scale > t)[:, [i for i in range(16) if i != 3]]
    assert torch.equal(keep, want)
    assert abs(float((x.abs() * scale <= t).float().mean()) - 0.4) < 0.03  # the quantile of the weighted scores


def test_weighted_thresholds_are_stored_and_dense_is_dense(silu_ckpt: Path, tmp_path: Path) -> None:
    """A weighted build stores one threshold vector per mask; with the masks dropped (dense=True) it computes the
    dense model, with them it does not (0 %: no mask at all, as test_zero_sparsity_is_exactly_dense checks)."""
    some = picompile.build(silu_ckpt, output=tmp_path / "w.pic", predictor="none", act_sparsity=0.3,
                           input_sparsity="all", calibration_tokens=256, input_loss_tokens=64,
                           input_allocation="uniform", input_criterion="weighted")
    s = picompile.load(some)
    masks = [n for n in s.graph.graph.nodes if n.op == "call_function" and "input_mask" in str(n.target)]
    assert masks and all(n.kwargs.get("thresholds") is not None or len(n.args) > 4 for n in masks)
    from transformers import AutoModelForCausalLM

    a = picompile.load(some, dense=True).logits(IDS)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(silu_ckpt, dtype=torch.float32)(torch.tensor([IDS])).logits[0]
    assert torch.allclose(a, ref, atol=1e-4)  # the source model's logits
    with torch.no_grad():
        masked = s.graph(torch.tensor([IDS]), *s.empty_past())[0][0]
    assert not torch.allclose(masked, a, atol=1e-4)
    assert s.manifest.sections["input_sparsity"]["criterion"] == "weighted"


def test_dense_groups_run_the_gemv_and_bench_counts_input_masks(silu_ckpt: Path, tmp_path: Path) -> None:
    """A group the allocation leaves at 0 % becomes a dense GEMV (tvm_linear, kind ``up``); bench's bytes per token
    count the input masks measured on a decode (fewer bytes than the same graph dense)."""
    from picompile.ir.reads import weight_bytes
    from picompile.tools.traffic import measured_input_active

    names = pass_names("default")[:-1]
    ctx = context_for(silu_ckpt, tmp_path, predictor="none", input_sparsity="all", act_sparsity=0.15,
                      calibration_tokens=512, input_loss_tokens=128)
    gm = run_passes(ctx, names)
    groups = ctx.manifest_extra["input_sparsity"]["groups"]
    n_dense = sum(g["sparsity"] == 0.0 for g in groups)
    assert 0 < n_dense < len(groups)  # the greedy path leaves some groups dense at 15 %
    ops = count_ops(gm)
    assert ops["picompile::input_sparse_linear"] == len(groups) - n_dense
    assert ops["picompile::tvm_linear"] == 1 + n_dense  # lm_head and the dense groups
    load_kernels(tmp_path, ctx.manifest_extra["kernels"])
    with torch.no_grad():
        full = gm(torch.tensor([IDS]), *ctx.info.kv_tensors())[0][0]
    assert (full - _decode(gm, ctx, IDS)).abs().max().item() < 1e-4

    art = picompile.build(silu_ckpt, output=tmp_path / "u.pic", predictor="none", act_sparsity=0.4,
                          input_sparsity="all", calibration_tokens=256, input_loss_tokens=64, input_allocation="uniform")
    s = picompile.load(art)
    read = measured_input_active(s, IDS[:3], 4)
    assert read and all(0.0 < f < 1.0 for f in read.values())
    sparse, dense = weight_bytes(s.graph, None, None, read)["total"], weight_bytes(s.graph, None)["total"]
    assert sparse < 0.8 * dense


def test_calibration_is_sampled_cached_and_keyed_by_model(checkpoints: dict, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --calibration an input-sparse build samples its calibration ids from the model
    (``build_calibration``, what profile-activations calls); a second build of the same model reuses them from the
    cache, another model (same shape, other weights) samples its own; ``builtin`` and a file are not sampled."""
    from picompile.frontend import load_model
    from picompile.sparsity import calibration
    from picompile.testing import save_tiny_checkpoint

    sampled: list[int] = []
    real = calibration.sample_documents
    monkeypatch.setattr(calibration, "sample_documents", lambda *a, **k: sampled.append(1) or real(*a, **k))
    cache = tmp_path / "cal"

    def calib(path: Path, source: str = "auto", file: Path | None = None) -> tuple[torch.Tensor, dict]:
        model, info = load_model(str(path))
        return calibration.build_calibration(file, source, True, model, info.config, None, info.vocab_size, 48, 0,
                                             cache)

    silu = checkpoints[("llama", "silu")]
    (ids1, first), (ids2, second) = calib(silu), calib(silu)
    assert len(sampled) == 1 and first == second and torch.equal(ids1, ids2)  # the second read the cache
    assert first["kind"] == "sampled" and Path(first["source"]).parent == cache and ids1.numel() == 48
    _, other = calib(save_tiny_checkpoint(tmp_path / "other", "llama", "silu", seed=8))
    assert len(sampled) == 2 and other["model_fingerprint"] != first["model_fingerprint"]
    assert calib(silu, "builtin")[1]["kind"] != "sampled"
    (tmp_path / "ids.json").write_text("[" + ",".join(["5"] * 40) + "]")
    assert calib(silu, "auto", tmp_path / "ids.json")[1]["kind"] == "tokens" and len(sampled) == 2


def test_loss_curves_are_cached_for_the_same_groups(tmp_path: Path) -> None:
    """A second build of the same model and calibration reuses the measured curves (other options: another key)."""
    names, curves = ["0.qkv", "0.o"], [[0.1 * j for j in range(9)], [0.2 * j for j in range(9)]]
    key = isp.curves_key("fp", "sha", 4096, "all", "magnitude", 512, 512, "float32", 0, False)
    assert isp.cached_curves(tmp_path, key, names) is None
    isp.store_curves(tmp_path, key, names, curves)
    assert isp.cached_curves(tmp_path, key, names) == curves
    assert isp.cached_curves(tmp_path, key, ["0.qkv", "1.o"]) is None  # other groups: not these curves
    assert isp.curves_key("fp", "sha", 4096, "all", "weighted", 512, 512, "float32", 0, False) != key


def test_input_sparse_decode_runs_as_native_ops(silu_ckpt: Path, tmp_path: Path) -> None:
    """The eager decode step of an input-sparse artifact calls its kernels as C++ ops (``input_sparse``), its masks
    as aten ops, and runs as a C++ program (runtime/graph_exec.py). From the same cache its logits are the Python
    ops' within 1e-5: the kernel calls compute the same floats, the one-token RMSNorm and attention loops sum in
    another order (~1e-7 relative). (Over several steps a channel that such a difference moves across its mask
    threshold then changes the logits by a jump, |x| ≈ threshold times its weights, as any other order of the
    same sums would: on this 64-wide model by up to a quarter of the logits' range from the fourth step on.)"""
    from picompile.runtime import native

    if native.load_library():
        pytest.skip(f"picompile_native could not be built here: {native.load_library()}")
    art = picompile.build(silu_ckpt, output=tmp_path / "n.pic", predictor="none", act_sparsity=0.3,
                          input_sparsity="all", calibration_tokens=256, input_loss_tokens=64,
                          input_allocation="uniform")
    s = picompile.load(art)
    decode = next(g for g in s.step_graphs if g is not s.prefill_graph and g is not s.decode_graph)
    targets = [str(n.target) for n in decode.graph.nodes if n.op == "call_function"]
    assert "picompile_native.input_sparse.default" in targets and "aten.gt.Scalar" in targets
    assert not any("input_mask" in t or "input_sparse_linear" in t for t in targets)
    assert s.exec_reason == ""
    tokens = s.generate(IDS, max_new_tokens=6, stop_at_eos=False)  # the new ones
    assert len(tokens) == 6

    def step_logits() -> torch.Tensor:  # [6, vocab]: the prompt, then each generated token fed alone
        d = s.decoder()
        out = [d.feed(IDS)[-1:]]
        out += [d.feed([t]) for t in tokens[:-1]]
        return torch.cat(out)

    got = step_logits()
    step_fn, python = s.step_fn, s.decode_graph  # the same step with the Python ops
    s.step_fn = lambda ids, *past: (s.prefill_graph if ids.shape[-1] > 1 else python)(ids, *past)
    try:
        want = step_logits()
    finally:
        s.step_fn = step_fn
    assert got.shape == want.shape == (6, s.vocab_size) and torch.equal(got[0], want[0])  # the prefill: one graph
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5 * float(want[1].abs().max()))  # the first step
    assert int(got[1].argmax()) == int(want[1].argmax()) == tokens[1]

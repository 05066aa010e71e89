"""prefill_dtype="bfloat16" (runtime/compute_dtype.py): the prefill graph's linear and FFN ops read bfloat16
copies of their weights (the TVM-lowered linears become reference ops, the FFNs packed PrefillFFNs), "auto"
picks it only where it pays and fits, the decode graph is untouched, the
prompt's logits stay within bfloat16 rounding of the default prefill's, and a CPU or a name it cannot serve
fails before anything is loaded."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import picompile
from picompile.errors import InputError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.runtime import compute_dtype
from picompile.runtime.compute_dtype import choose, with_compute_dtype
from picompile.runtime.hybrid import HybridFFN
from picompile.runtime.prefill_gemm import PrefillFFN
from picompile.runtime.loader import without_masks

PROMPT = [5, 17, 33, 4, 99, 120, 7, 61, 2, 250, 31, 18]
HAS_BF16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has neither AMX nor AVX512-BF16")
WEIGHT_ARGS = {"linear": (1,), "sparse_ffn": (1, 3, 4), "ffn": (1, 3, 4)}


def _gemm_weights(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The weights every linear / FFN op of ``gm`` reads."""
    out = []
    for node in gm.graph.nodes:
        for name, positions in WEIGHT_ARGS.items():
            if node.op == "call_function" and is_picompile_op(node.target, name):
                out += [get_tensor(gm, node.args[p]) for p in positions if node.args[p] is not None]
    return out


def test_rewrite_structure(f16_cpu_artifact: Path) -> None:
    session = picompile.load(f16_cpu_artifact, hybrid="off")
    prefill = without_masks(session.graph)
    before = [n.format_node() for n in prefill.graph.nodes]
    low = with_compute_dtype(prefill, torch.bfloat16)
    calls = [n for n in low.graph.nodes if n.op == "call_function"]
    # the kernels read float16: no lowered op is left, each became its reference op
    assert not [n for n in calls if is_picompile_op(n.target, "tvm_linear") or is_picompile_op(n.target, "tvm_sparse_ffn")]
    # each FFN part with rows is one PrefillFFN (up and gate fused), the empty ones reference ops
    n_parts = sum(is_picompile_op(n.target, "tvm_sparse_ffn") and get_tensor(prefill, n.args[1]).shape[0] > 0
                  for n in prefill.graph.nodes)
    assert n_parts > 0 and sum(isinstance(n.target, PrefillFFN) for n in calls) == n_parts
    n_lin = sum(is_picompile_op(n.target, "tvm_linear") for n in prefill.graph.nodes)
    assert n_lin > 0 and sum(is_picompile_op(n.target, "linear") for n in calls) == n_lin
    weights = _gemm_weights(low)
    assert weights and all(w.dtype == torch.bfloat16 for w in weights)
    # one copy per distinct weight, equal to it within bfloat16 rounding
    originals = {str(n.target): getattr(prefill, str(n.target)) for n in prefill.graph.nodes if n.op == "get_attr"}
    copies = {str(n.target) for n in low.graph.nodes if n.op == "get_attr" and str(n.target).endswith("_bfloat16")}
    assert len(copies) == len({id(w) for w in weights})
    for name in copies:
        src = originals[name.removesuffix("_bfloat16")]
        torch.testing.assert_close(getattr(low, name).float(), src.float(), rtol=2 ** -8, atol=0)
    # the graph it was made from is as it was, and so are the session's decode weights
    assert [n.format_node() for n in prefill.graph.nodes] == before
    lowered = {"tvm_linear": (1,), "tvm_sparse_ffn": (1, 3, 4)}
    decode = [get_tensor(session.graph, n.args[p]) for n in session.graph.graph.nodes for name, ps in lowered.items()
              if n.op == "call_function" and is_picompile_op(n.target, name) for p in ps if n.args[p] is not None]
    assert decode and all(w.dtype == torch.float16 for w in decode)


@needs_bf16
@pytest.mark.parametrize("kind", ["float16", "float32"])
def test_bfloat16_prefill_logits(f16_cpu_artifact: Path, artifacts: dict, kind: str) -> None:
    """Prompt logits within bfloat16 rounding of the default prefill's (not equal to them: the GEMMs did
    change dtype), the same top token nearly everywhere; decode then runs on the cache bf16 prefill wrote."""
    art = f16_cpu_artifact if kind == "float16" else artifacts[("llama", "relu")]  # float32: aten.linear weights
    default = picompile.load(art, prefill_dtype="weights")
    low = picompile.load(art, prefill_dtype="bfloat16")
    assert low.prefill_dtype == "bfloat16" and default.prefill_dtype is None
    want, got = default.logits(PROMPT), low.logits(PROMPT)  # [len(PROMPT), vocab]
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 2e-2, rel
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9
    # decode: one token after each prefill, close again (the caches differ by bfloat16 rounding only)
    d_want, d_got = default.decoder(), low.decoder()
    d_want.feed(PROMPT), d_got.feed(PROMPT)
    step_want, step_got = d_want.feed([9]), d_got.feed([9])  # [1, vocab]
    assert float((step_got - step_want).norm() / step_want.norm()) < 2e-2
    assert low.generate(PROMPT, max_new_tokens=6) == default.generate(PROMPT, max_new_tokens=6)  # greedy: same tokens


def test_float32_prefill_copies(f16_cpu_artifact: Path, checkpoints: dict, tmp_path: Path) -> None:
    """prefill_dtype="float32" (auto's choice on CPUs without a fast bfloat16 GEMM): float32 copies made once,
    in oneDNN's packed layout (``prefill_gemm.gemm_layout``), for a float16 and an int4 artifact; the prompt's
    logits are the per-call path's: int4 (dequantized to the same float32 values per call) within float32
    summation order; float16 within float16 rounding (the per-call path computes a short prompt's GEMMs in
    float16, ``ops.lin``); greedy text equal."""
    int4 = picompile.build(checkpoints[("llama", "relu")], output=tmp_path / "q.pic", calibration_tokens=256,
                           emit=lambda s: None, weight_dtype="int4")
    for art, tol in ((f16_cpu_artifact, 1e-2), (int4, 1e-5)):
        per_call = picompile.load(art, prefill_dtype="weights")
        copies = picompile.load(art, prefill_dtype="float32")
        assert copies.prefill_dtype == "float32" and "compute-dtype" in copies.load_steps
        weights = _gemm_weights(copies.prefill_graph) + [
            get_tensor(copies.prefill_graph, n.args[i]) for n in copies.prefill_graph.graph.nodes
            if n.op == "call_function" and isinstance(n.target, PrefillFFN) for i in (1, 3)]
        # oneDNN's packed layout where torch has oneDNN, else input-major storage
        assert weights and all(w.dtype == torch.float32 and (w.is_mkldnn or w.t().is_contiguous()) for w in weights)
        assert all(w.is_mkldnn for w in weights if w.shape[0]) == torch.backends.mkldnn.is_available()  # (an empty part stays)
        want, got = per_call.logits(PROMPT), copies.logits(PROMPT)
        assert float((got - want).abs().max() / want.abs().max()) < tol
        assert copies.generate(PROMPT, 6, stop_at_eos=False) == per_call.generate(PROMPT, 6, stop_at_eos=False)


def test_bad_prefill_dtype_fails_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nothing.pic"
    with pytest.raises(InputError, match="prefill_dtype must be one of auto, weights, bfloat16.*'float8'"):
        picompile.load(missing, prefill_dtype="float8")  # the name fails first, not the missing artifact
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(InputError, match="AMX or AVX512-BF16"):
        picompile.load(missing, prefill_dtype="bfloat16")


def test_cli_run_prefill_dtype(f16_cpu_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from picompile.cli import main

    if not HAS_BF16:
        assert main(["run", str(f16_cpu_artifact), "--ids", "5,17,33", "-n", "3", "--prefill-dtype", "bfloat16"]) == 2
        return
    assert main(["run", str(f16_cpu_artifact), "--ids", "5,17,33", "-n", "3", "--json",
                 "--prefill-dtype", "bfloat16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ids"]) == 3


def _cpu(monkeypatch: pytest.MonkeyPatch, amx: bool, bf16: bool, available_gib: float, total_gib: float = 24,
         amx_fp16: bool = False) -> None:
    from picompile.ir import ops

    monkeypatch.setattr(ops, "native_half_gemm", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(compute_dtype, "_meminfo", lambda: {"MemAvailable": int(available_gib * 2**30),
                                                            "MemTotal": int(total_gib * 2**30)})


def test_auto_is_bfloat16_only_where_it_pays_and_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: bfloat16 for float16 weights on AVX512-BF16 or AMX-BF16 without AMX-FP16 — on copies where they
    leave the reserve free and cost at most an eighth of the memory, streamed (no copy) otherwise; the weights'
    dtype with AMX-FP16, without a bfloat16 GEMM, or for float32 weights."""
    gib = 2**30
    _cpu(monkeypatch, amx=False, bf16=True, available_gib=20)
    assert choose(None, "float16", 2 * gib)[0] == "bfloat16" == choose("auto", "float16", 2 * gib)[0]
    assert choose("weights", "float16", 2 * gib) == (None, "prefill_dtype='weights'")
    assert choose(None, "float32", 2 * gib) == (None, "auto: float32 weights keep their dtype")
    _cpu(monkeypatch, amx=False, bf16=True, available_gib=9)  # a 7B float16 model loaded: 24 - 13.5 - the rest
    dtype, why = choose(None, "float16", int(13.5 * gib))  # 9 - 13.5 GiB < 24 / 8 = 3 GiB kept free
    assert dtype == "bfloat16-stream" and "13.5 GiB" in why and "under the 3.0 GiB kept free" in why
    assert "converted to bfloat16 per call" in why
    _cpu(monkeypatch, amx=False, bf16=True, available_gib=22)  # the same 7B before its load: the weights count too
    dtype, why = choose(None, "float16", int(13.5 * gib), loading_bytes=int(13.5 * gib))
    assert dtype == "bfloat16-stream" and "beside the weights (13.5 GiB)" in why
    dtype, why = choose(None, "float16", int(13.5 * gib))  # it would fit (22 - 13.5 > 3), but it is most of memory
    assert dtype == "bfloat16-stream" and "more than 1/8 of the machine's 24.0 GiB" in why
    assert choose(None, "float16", 3 * gib)[0] == "bfloat16"  # an eighth: still a copy
    assert choose(None, "float16", 2 * gib, loading_bytes=2 * gib)[0] == "bfloat16"  # a 1B: both fit
    assert choose(None, "float16", 2 * gib, kernels=False)[0] is None  # the reference pipeline's artifact
    _cpu(monkeypatch, amx=True, bf16=True, available_gib=20)  # Sapphire Rapids: AMX-BF16, float16 on AVX512-FP16
    assert choose(None, "float16", 2 * gib) == ("bfloat16", "auto: AMX-BF16 without AMX-FP16; bfloat16 copy 2.0 GiB")
    _cpu(monkeypatch, amx=True, bf16=True, available_gib=20, amx_fp16=True)  # Granite Rapids: a float16 unit
    assert choose(None, "float16", 2 * gib) == (None, "auto: this CPU has AMX-FP16 (a float16 GEMM unit)")
    assert choose("bfloat16", "float16", 2 * gib)[0] == "bfloat16"  # asked for: still there
    assert choose("bfloat16-stream", "float16", 2 * gib)[0] == "bfloat16-stream"
    _cpu(monkeypatch, amx=False, bf16=False, available_gib=20)  # AVX2 (AMD Zen 2 / 3): float32 copies
    dtype, why = choose(None, "float16", 2 * gib)
    assert dtype == "float32" and "float32 copy 4.0 GiB" in why and "widened once at load" in why
    dtype, why = choose(None, "float16", int(3.5 * gib))  # 7 GiB of copies: more than a quarter of 24 GiB
    assert dtype is None and "more than 1/4 of the machine's 24.0 GiB" in why and "widened to float32 per call" in why
    assert choose(None, "float32", 2 * gib)[0] is None  # float32 weights are the copy already
    assert choose("float32", "float16", 2 * gib)[0] == "float32"  # asked for by name: any CPU
    with pytest.raises(InputError, match="bfloat16-stream"):
        choose("bfloat16-stream", "float16", 2 * gib)  # no fast bfloat16 GEMM: refused by name


def test_hybrid_ffn_becomes_two_packed_gemms(f16_cpu_artifact: Path) -> None:
    """A dense hybrid-scheduled FFN layer becomes one PrefillFFN per part with rows (a CPU target: one, every
    neuron): up and gate in one bfloat16 weight, the down rows transposed to nn.Linear layout; its output is the
    HybridFFN's within bfloat16 rounding."""
    session = picompile.load(f16_cpu_artifact, prefill_dtype="weights")  # hybrid auto: inline here
    prefill = without_masks(session.graph)
    hybrid = [n for n in prefill.graph.nodes if isinstance(n.target, HybridFFN)]
    low = with_compute_dtype(prefill, torch.bfloat16)
    packed = [n for n in low.graph.nodes if isinstance(n.target, PrefillFFN)]
    assert hybrid and len(packed) == len(hybrid)
    assert not [n for n in low.graph.nodes if isinstance(n.target, HybridFFN)]
    node, ref = packed[0], hybrid[0]
    fn = node.target
    x, w_in, b_in, w_out, bias = node.args
    assert bias is None  # the down bias (if any) is added after the parts, as merge does
    w_in, w_out = get_tensor(low, w_in), get_tensor(low, w_out)
    d_model = w_in.shape[1]
    assert fn.gated and w_in.dtype == w_out.dtype == torch.bfloat16
    assert w_in.shape == (2 * fn.n_ff, d_model) and w_out.shape == (d_model, fn.n_ff) and w_out.is_contiguous()
    xs = torch.randn(1, 7, d_model, generator=torch.Generator().manual_seed(3))  # [1, seq, d_model]
    args = [xs, *[get_tensor(prefill, a) if isinstance(a, torch.fx.Node) else a for a in ref.args[1:]]]
    want = ref.target(*args)  # [1, 7, d_model]
    got = fn(xs, w_in, None if b_in is None else get_tensor(low, b_in), w_out,
             None if bias is None else get_tensor(low, bias))
    assert got.dtype == torch.float32 and got.shape == want.shape
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 2e-2, rel


def test_auto_for_quantized_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on int8 / int4 weights: bfloat16 on any CPU with a fast bfloat16 GEMM (AVX512-BF16, or AMX) — a copy
    where it fits and is small, streamed otherwise; the per-call float32 dequantize path without one."""
    gib = 2**30
    for amx, bf16 in ((False, True), (True, False), (True, True)):
        _cpu(monkeypatch, amx=amx, bf16=bf16, available_gib=20)
        for wd in ("int8", "int4"):
            dtype, why = choose(None, wd, 2 * gib)
            assert dtype == "bfloat16" and f"{wd} weights with a fast bfloat16 GEMM" in why and "2.0 GiB" in why
            dtype, why = choose(None, wd, 13 * gib)  # a 7B int4's copies: streamed
            assert dtype == "bfloat16-stream" and "13.0 GiB" in why and "no copy" in why
    assert choose("weights", "int4", 2 * gib) == (None, "prefill_dtype='weights'")
    assert choose(None, "int4", 2 * gib, kernels=False)[0] is None  # the reference pipeline's artifact
    _cpu(monkeypatch, amx=False, bf16=False, available_gib=20)  # AVX2: float32 copies where they fit
    assert choose(None, "int4", 2 * gib) == ("float32", "auto: no AMX or AVX512-BF16 here: float32 copy 4.0 GiB, "
                                                        "int4 weights dequantized once at load")
    dtype, why = choose(None, "int4", 13 * gib)  # a 7B int4's copies: dequantized per call, no copy
    assert dtype is None and "26.0 GiB" in why and "dequantized to float32 per call" in why
    _cpu(monkeypatch, amx=False, bf16=True, available_gib=4)
    dtype, why = choose(None, "int8", 3 * gib)  # 4 - 3 GiB < the 3 GiB kept free
    assert dtype == "bfloat16-stream" and "3.0 GiB" in why and "kept free" in why


@needs_bf16
def test_streamed_prefill_equals_copies(f16_cpu_artifact: Path) -> None:
    """bfloat16-stream: every linear / FFN GEMM is a StreamedLinear / StreamedFFN call on the artifact's own
    float16 weights (no bfloat16 buffer registered: no copy), and the prompt's logits equal the copies' (the same
    bfloat16 values, the same GEMMs; the down rows' transposed layout may sum in another order: within 1e-5);
    decode after it gives the same tokens; lm_head still runs on the last position only for generation."""
    from picompile.runtime.logit_rows import LogitRows
    from picompile.runtime.prefill_stream import StreamedFFN, StreamedLinear

    session = picompile.load(f16_cpu_artifact, prefill_dtype="weights")
    prefill = without_masks(session.graph)
    low = with_compute_dtype(prefill, torch.bfloat16, streamed=True)
    calls = [n for n in low.graph.nodes if n.op == "call_function"]
    n_lin = sum(is_picompile_op(n.target, "tvm_linear") for n in prefill.graph.nodes)
    assert n_lin > 0 and sum(isinstance(n.target, StreamedLinear) for n in calls) == n_lin
    assert sum(isinstance(n.target, StreamedFFN) for n in calls) == sum(isinstance(n.target, HybridFFN)
                                                                       for n in prefill.graph.nodes) > 0
    assert not [n for n in calls if is_picompile_op(n.target, "tvm_linear") or isinstance(n.target, HybridFFN)]
    assert not [b for b, t in low.named_buffers() if t.dtype == torch.bfloat16]
    for node in calls:  # the GEMMs read the artifact's float16 weights themselves
        if isinstance(node.target, (StreamedLinear, StreamedFFN)):
            assert get_tensor(low, node.args[1]).dtype == torch.float16
    copies = picompile.load(f16_cpu_artifact, prefill_dtype="bfloat16")
    streamed = picompile.load(f16_cpu_artifact, prefill_dtype="bfloat16-stream")
    assert streamed.prefill_dtype == "bfloat16-stream" and "compute-dtype" in streamed.load_steps
    want, got = copies.logits(PROMPT), streamed.logits(PROMPT)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert copies.generate(PROMPT, 8, stop_at_eos=False) == streamed.generate(PROMPT, 8, stop_at_eos=False)
    last = streamed.decoder().feed(PROMPT, last_only=True)  # [1, vocab]
    assert last.shape[0] == 1 and torch.allclose(last[0], got[-1], rtol=0, atol=1e-5 * float(got.abs().max()))
    assert streamed.logit_rows is not None and any(isinstance(n.target, LogitRows) for n in streamed.prefill_graph.graph.nodes)


def test_last_logits(f16_cpu_artifact: Path) -> None:
    """Decoder.feed(ids, last_only=True): lm_head on the last position only (a LogitRows selector on its input
    in the prefill graph), its logits those of the full prefill's last row, the KV cache the same; logits() and
    feed() without it still return every position."""
    from picompile.runtime.logit_rows import LogitRows

    for dtype in ("weights", "bfloat16") if HAS_BF16 else ("weights",):
        s = picompile.load(f16_cpu_artifact, prefill_dtype=dtype)
        assert "last-logits" in s.load_steps and isinstance(s.logit_rows, LogitRows)
        cuts = [n for n in s.prefill_graph.graph.nodes if isinstance(n.target, LogitRows)]
        assert len(cuts) == 1 and not [n for n in s.decode_graph.graph.nodes if isinstance(n.target, LogitRows)]
        full = s.logits(PROMPT)  # [len(PROMPT), vocab]
        assert full.shape == (len(PROMPT), s.vocab_size)
        dec = s.decoder()
        last = dec.feed(PROMPT, last_only=True)
        assert last.shape == (1, s.vocab_size) and not s.logit_rows.last
        # one row of a float16 lm_head runs its TVM GEMV (float32 activations), 12 rows torch's float16 GEMM:
        # within float16 rounding; bfloat16 GEMMs of 1 and 12 rows agree
        assert float((last - full[-1:]).norm() / full[-1:].norm()) < (1e-2 if dtype == "weights" else 1e-5)
        after_last = dec.feed([9])  # [1, vocab]
        ref = s.decoder()  # (one decoder at a time: dec's cache is overwritten from here)
        assert ref.feed(PROMPT).shape == full.shape
        torch.testing.assert_close(after_last, ref.feed([9]), rtol=0, atol=0)  # the same cache either way
    rows = LogitRows()
    with rows.last_only():  # the last row with standard strides (a sliced [1, 1, d] sends torch's bfloat16
        cut = rows(torch.randn(1, 5, 8))  # matmul to a bmm that copies the transposed weight per call)
    assert cut.shape == (1, 1, 8) and cut.stride() == (8, 8, 1) and rows(torch.ones(1, 5, 8)).shape == (1, 5, 8)


@needs_bf16
def test_streamed_prefill_of_float32_weights(artifacts: dict) -> None:
    """bfloat16-stream on a float32 artifact (asked for by name): the float32 FFN rows have no dequant kernel and
    convert with torch into the same buffer, giving the copies' logits."""
    art = artifacts[("llama", "relu")]
    copies = picompile.load(art, prefill_dtype="bfloat16")
    streamed = picompile.load(art, prefill_dtype="bfloat16-stream")
    want, got = copies.logits(PROMPT), streamed.logits(PROMPT)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@needs_bf16
def test_input_sparse_linears_prefill_on_bfloat16(checkpoints: dict, tmp_path: Path) -> None:
    """An input-sparse artifact (``sparsify-inputs``, float16): prefill's input-sparse linears become bfloat16
    GEMMs, on copies in nn.Linear layout (``w_tᵀ``, contiguous) or streamed from the input-major rows, both giving
    the same logits, within bfloat16 rounding of the float16 weights' own path; decode keeps its kernels."""
    from picompile.runtime.prefill_stream import StreamedLinear

    art = picompile.build(checkpoints[("llama", "silu")], output=tmp_path / "is.pic", predictor="none",
                          weight_dtype="float16", act_sparsity=0.3, input_sparsity="all", calibration_tokens=256,
                          input_loss_tokens=64, input_allocation="uniform")
    session = picompile.load(art, prefill_dtype="weights")
    prefill = without_masks(session.graph)
    sparse = [n for n in prefill.graph.nodes if is_picompile_op(n.target, "input_sparse_linear")]
    assert sparse
    low = with_compute_dtype(prefill, torch.bfloat16)
    calls = [n for n in low.graph.nodes if n.op == "call_function"]
    assert not [n for n in calls if is_picompile_op(n.target, "input_sparse_linear")]
    for n in sparse:  # its weight as a bfloat16 copy, [d_out, d_in], equal to w_tᵀ within bfloat16 rounding
        w_t = get_tensor(prefill, n.args[1])
        copy = getattr(low, f"{n.args[1].target}_t_bfloat16")
        assert copy.dtype == torch.bfloat16 and copy.is_contiguous() and copy.shape == w_t.t().shape
        torch.testing.assert_close(copy.float(), w_t.t().float(), rtol=2 ** -8, atol=0)
    streamed = with_compute_dtype(prefill, torch.bfloat16, streamed=True)
    inputs = [n for n in streamed.graph.nodes if isinstance(n.target, StreamedLinear) and n.target.input_major]
    assert len(inputs) == len(sparse)
    assert not [b for b, t in streamed.named_buffers() if t.dtype == torch.bfloat16]
    want = session.logits(PROMPT)
    copies = picompile.load(art, prefill_dtype="bfloat16").logits(PROMPT)
    stream = picompile.load(art, prefill_dtype="bfloat16-stream").logits(PROMPT)
    assert float((stream - copies).abs().max() / copies.abs().max()) < 1e-5
    rel = float((copies - want).norm() / want.norm())
    assert 0 < rel < 2e-2, rel
    decode = [n for n in picompile.load(art, prefill_dtype="bfloat16").decode_graph.graph.nodes
              if is_picompile_op(n.target, "input_sparse_linear")]
    assert decode and all(get_tensor(session.graph, n.args[1]).dtype == torch.float16 for n in sparse)

"""picompile_native (runtime/native.py, native_ops.cpp): the decode step's kernel calls as C++ ops (eager and compiled).
Each op gives its Python op's result on the same loaded kernel (masks with no active row included), the
compiled step rewrites every CPU kernel call, and a library that cannot be built leaves the Python ops."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import picompile
from picompile.ir import ops, schema
from picompile.ir.graph import get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.kernels.table import threshold_tensor
from picompile.runtime import native

LOWERED = ("tvm_linear", "tvm_sparse_ffn", "tvm_predict")


@pytest.fixture(scope="module")
def session(f16_cpu_artifact: Path) -> picompile.Session:
    if native.load_library():
        pytest.skip(f"picompile_native could not be built here: {native.load_library()}")
    return picompile.load(f16_cpu_artifact, hybrid="off")


def _nodes(session: picompile.Session, name: str) -> list[torch.fx.Node]:
    return [n for n in session.graph.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, name)]


def test_each_op_equals_its_python_op(session: picompile.Session) -> None:
    gm = session.graph
    g = torch.Generator().manual_seed(3)
    nat = torch.ops.picompile_native
    lin = _nodes(session, "tvm_linear")[0]
    x = torch.randn(1, 1, get_tensor(gm, lin.args[1]).shape[1], generator=g)
    w = get_tensor(gm, lin.args[1])
    fn = native._kernel_id(lin.args[3])
    assert fn is not None
    torch.testing.assert_close(nat.gemv(x, w, None, fn), ops.tvm_linear(x, w, None, lin.args[3]), rtol=0, atol=0)
    bias = torch.randn(w.shape[0], generator=g)
    torch.testing.assert_close(nat.gemv(x, w, bias, fn), ops.tvm_linear(x, w, bias, lin.args[3]), rtol=0, atol=0)

    ffn = next(n for n in _nodes(session, "tvm_sparse_ffn") if n.args[10])
    x_up, b_up, w_gate, w_down_t = (get_tensor(gm, a) if a is not None else None for a in ffn.args[1:5])
    x = torch.randn(1, 1, x_up.shape[1], generator=g)
    fn = native._kernel_id(ffn.args[10])
    for mask in (torch.rand(1, 1, x_up.shape[0], generator=g) < 0.2, torch.zeros(1, 1, x_up.shape[0], dtype=torch.bool), None):
        want = ops.tvm_sparse_ffn(x, x_up, b_up, w_gate, w_down_t, mask, *ffn.args[6:12])
        got = nat.sparse_ffn(x, x_up, b_up, w_gate, w_down_t, mask, fn)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    none_active = torch.zeros(1, 1, x_up.shape[0], dtype=torch.bool)  # k = 0: zeros, no kernel launch
    assert not nat.sparse_ffn(x, x_up, b_up, w_gate, w_down_t, none_active, fn).any()

    pred = _nodes(session, "tvm_predict")[0]
    a = schema.args_of(pred)
    fc1, fc2 = get_tensor(gm, a["fc1"]), get_tensor(gm, a["fc2"])
    offset = get_tensor(gm, a["offset"]) if a["offset"] is not None else None
    x = torch.randn(1, 1, fc1.shape[1], generator=g)
    want = ops.tvm_predict(x, fc1, fc2, a["threshold"], a["layer"], a["kernel1"], a["kernel2"], a["act"], offset)
    got = nat.predict(x, fc1, fc2, offset, threshold_tensor(a["threshold"]), native._kernel_id(a["kernel1"]))
    assert got.dtype == torch.bool and torch.equal(got, want) and 0 < int(got.sum()) < got.numel()


def test_compiled_decode_graph_is_native(session: picompile.Session) -> None:
    from picompile.runtime.compile import _opaque_copy

    decode = _opaque_copy(session.graph)
    n = native.to_native(decode)
    calls = [node for node in decode.graph.nodes if node.op == "call_function"]
    # every lowered call with a CPU kernel and rows became native; none is left
    assert not [c for c in calls if any(is_picompile_op(c.target, op) for op in LOWERED)]
    assert n == sum(str(c.target).startswith("picompile_native.") for c in calls)
    assert n == sum(len(_nodes(session, op)) for op in LOWERED) - sum(
        get_tensor(session.graph, f.args[1]).shape[0] == 0 for f in _nodes(session, "tvm_sparse_ffn"))
    # and it decodes as the eager graph does (the compiled step: test_compile.py)
    with torch.inference_mode():
        want = session.graph(torch.tensor([[9]]), *session.empty_past())[0]
        got = decode(torch.tensor([[9]]), *session.empty_past())[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_session_uses_native_ops(session: picompile.Session) -> None:
    """The rewrite happens as the session is made (the compilation itself waits for the first step; the
    compiled step's tokens against the eager step's: test_compile.py, which runs these ops)."""
    compiled = picompile.load(session.root, hybrid="off", compile=True)
    assert compiled.step_fn.native_calls > 0 and compiled.step_fn.native_reason == ""


def test_eager_session_decodes_through_native_ops(session: picompile.Session) -> None:
    """An eager load of a kernel artifact runs ``native-calls`` and ``native-glue`` last: its decode form calls the
    C++ ops, the form runtime/batch.py batches keeps the picompile ops, and greedy decoding gives the same tokens
    as the Python ops, and logits within 1e-4 (the kernel calls are the same floats; RMSNorm's and attention's
    one-token loops sum in another order: tests/test_native_glue.py)."""
    assert session.load_steps[-2:] == ["native-calls", "native-glue"]
    assert session.native_calls > 0 and session.native_reason == ""
    assert session.exec_reason == ""  # and the decode graph runs as a C++ program (runtime/graph_exec.py)
    decode = next(g for g in session.step_graphs if g is not session.prefill_graph and g is not session.decode_graph)
    targets = [str(n.target) for n in decode.graph.nodes if n.op == "call_function"]
    kernel_ops = ("gemv", "sparse_ffn", "qgemv", "qsparse_ffn", "predict", "input_sparse")
    assert sum(t.startswith("picompile_native.") and t.split(".")[1] in kernel_ops for t in targets) == session.native_calls
    left = [n for n in decode.graph.nodes if n.op == "call_function" and any(is_picompile_op(n.target, op) for op in LOWERED)]
    assert not left  # the empty FFN parts folded away with their merges (native-glue)
    assert any(is_picompile_op(n.target, "tvm_linear") for n in session.decode_graph.graph.nodes)
    prompt = [5, 9, 2, 7, 1, 30, 4]
    got = session.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    got_logits = session.last_logits.clone()
    step_fn = session.step_fn
    python = session.decode_graph  # the same step with the Python ops
    session.step_fn = lambda ids, *past: (session.prefill_graph if ids.shape[-1] > 1 else python)(ids, *past)
    try:
        want = session.generate(prompt, max_new_tokens=8, stop_at_eos=False)
    finally:
        session.step_fn = step_fn
    assert got == want
    torch.testing.assert_close(got_logits, session.last_logits, rtol=1e-4, atol=1e-4)


def test_unbuildable_library_leaves_python_ops(session: picompile.Session, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "SOURCE", tmp_path / "missing.cpp")
    reason = native.load_library()
    assert reason and native.load_library() == reason  # the reason, remembered (one attempt per process)
    compiled = picompile.load(session.root, hybrid="off", compile=True)  # the Python ops (test_compile.py runs them)
    assert compiled.step_fn.native_calls == 0 and compiled.step_fn.native_reason == reason


@pytest.fixture(scope="module")
def quantized_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """int4 / int8 builds of a llama-relu whose d_model (512) takes the integer-dot kernels (kernels/cpu_qdot.py)."""
    from picompile.testing import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("qnative")
    ckpt = save_tiny_checkpoint(root / "ckpt", "llama", "relu", seed=7, d_model=512, n_neurons=512, n_heads=8,
                                n_kv_heads=2)
    return {dt: picompile.build(ckpt, output=root / f"{dt}.pic", weight_dtype=dt, calibration_tokens=128,
                                max_seq_len=32, emit=lambda s: None, progress=False) for dt in ("int4", "int8")}


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_quantized_decode_graph_is_native(quantized_artifacts: dict[str, Path], dtype: str) -> None:
    """Quantized GEMVs and sparse FFN parts become ``qgemv`` / ``qsparse_ffn`` (quants and scales passed in C++),
    and the native decode graph's logits equal the inline (Python op) graph's bit for bit, step after step."""
    if native.load_library():
        pytest.skip(f"picompile_native could not be built here: {native.load_library()}")
    from picompile.runtime.compile import _opaque_copy

    session = picompile.load(quantized_artifacts[dtype], hybrid="off")
    decode = _opaque_copy(session.graph)
    n = native.to_native(decode)
    targets = [str(c.target) for c in decode.graph.nodes if c.op == "call_function"]
    assert not [t for t in targets if any(op in t for op in LOWERED)]
    assert sum("picompile_native.qgemv" in t for t in targets) == 2 * 2 + 1  # q/k/v, o per layer; lm_head
    assert sum("picompile_native.qsparse_ffn" in t for t in targets) >= 2 and n == len(
        [t for t in targets if t.startswith("picompile_native.")])
    past_e, past_n = session.empty_past(), session.empty_past()
    with torch.inference_mode():
        for tok in (9, 41, 7):
            want, *past_e = session.graph(torch.tensor([[tok]]), *past_e)
            got, *past_n = decode(torch.tensor([[tok]]), *past_n)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_native_graph_names_its_kernels_by_stable_ids(session: picompile.Session) -> None:
    """The rewritten graph holds no kernel address (one per process: the code, and with it the key of inductor's
    on-disk cache, would differ at every load), only ids from the kernels' keys; an id never registered fails
    with a message naming it."""
    from picompile.kernels.table import find_kernel
    from picompile.runtime.compile import _opaque_copy

    decode = _opaque_copy(session.graph)
    assert native.to_native(decode) > 0
    calls = [n for n in decode.graph.nodes if n.op == "call_function" and str(n.target).startswith("picompile_native.")]
    keys = {str(schema.args_of(n)["kernel"]) for n in _nodes(session, "tvm_linear") + _nodes(session, "tvm_sparse_ffn")}
    keys.discard("")  # a part without rows names no kernel
    handles = {int(find_kernel(k).decode_fn.__chandle__()) for k in keys}  # type: ignore[union-attr]
    ids = {n.args[-1] for n in calls}
    assert ids and not ids & handles and not any(str(h) in decode.code for h in handles)
    assert ids <= {native._kernel_id(k) for k in keys} | {native._kernel_id(str(schema.args_of(n)["kernel1"]))
                                                          for n in _nodes(session, "tvm_predict")}
    again = _opaque_copy(session.graph)
    native.to_native(again)
    assert again.code == decode.code  # the same graph rewritten twice: the same code
    lin = _nodes(session, "tvm_linear")[0]
    w = get_tensor(session.graph, lin.args[1])
    with pytest.raises(RuntimeError, match="kernel id 12345 was never registered"):
        torch.ops.picompile_native.gemv(torch.randn(1, 1, w.shape[1]), w, None, 12345)

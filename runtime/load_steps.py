"""The load steps, by name: each entry runs one rewrite of its own module on the load's graphs.

Graph steps (``load_graph``: the ``graph`` as read from graph.pt2):
flatten-signature, bind-weights, align-weights, drop-masks, schedule-hybrid, drop-metadata-asserts,
drop-noop-ops, call-directly. Session steps (``Session``: its ``prefill`` and ``decode`` forms of that graph):
dense-prefill, sparse-prefill-ffn, compute-dtype, kv-arenas, last-logits, opaque-calls, inline-trivial, native-calls, native-glue, decode-attention.
Which of them a load runs: ``load_pipeline.graph_steps`` / ``session_steps``.
"""
from __future__ import annotations

from torch import fx

from picompile.runtime.load_pipeline import LoadState, load_step


def _graph(state: LoadState) -> fx.GraphModule:
    assert state.graph is not None, "no graph loaded"
    return state.graph


# -- graph steps ----------------------------------------------------------------------------------
@load_step("flatten-signature", ("graph",), "torch.export's pytree wrapper and shape guards dropped: "
           "forward(input_ids, *past, *weights) -> (logits, *presents)")
def _flatten_signature(state: LoadState) -> None:
    from picompile.ir.graph import flatten_codegen

    state.graph = flatten_codegen(_graph(state))


@load_step("bind-weights", ("graph",), "the weight inputs become buffers the graph reads (get_attr)")
def _bind_weights(state: LoadState) -> None:
    from picompile.runtime.loader import bind_weights

    assert state.tensors is not None, "the weight file's tensors are gone"
    state.graph = bind_weights(_graph(state), state.n_inputs, state.weight_keys, state.tensors)
    state.tensors = None  # the graph holds the ones it reads


@load_step("align-weights", ("graph",), "every weight copied into aligned anonymous memory (huge pages) for the kernels")
def _align_weights(state: LoadState) -> None:
    from picompile.runtime.loader import align_weights

    state.graph = align_weights(_graph(state), len(state.weight_keys), mapped=state.options.mapped_weights)


@load_step("drop-masks", ("graph",), "every FFN neuron computed: the masks dropped, the predictors dead code")
def _drop_masks(state: LoadState) -> None:
    from picompile.runtime.masks import drop_masks

    state.graph = drop_masks(_graph(state))


@load_step("schedule-hybrid", ("graph",), "each (hot, cold, merge) triple becomes one HybridFFN scheduler call")
def _schedule_hybrid(state: LoadState) -> None:
    from picompile.runtime.hybrid import schedule_hybrid

    o = state.options
    state.graph = schedule_hybrid(_graph(state), o.hybrid, target_has_gpu=o.target_has_gpu)


@load_step("drop-metadata-asserts", ("graph",), "torch.export's _assert_tensor_metadata checks removed")
def _drop_metadata_asserts(state: LoadState) -> None:
    from picompile.ir.graph import drop_metadata_asserts

    state.graph = drop_metadata_asserts(_graph(state))


@load_step("drop-noop-ops", ("graph",), "casts to the dtype a tensor has and unread copies of constants removed "
           "(each a Python call per step)")
def _drop_noop_ops(state: LoadState) -> None:
    from picompile.ir.graph import drop_noop_ops

    state.notes["noop_ops"] = drop_noop_ops(_graph(state))


@load_step("call-directly", ("graph",), "picompile ops called past torch's dispatcher (DirectCall)")
def _call_directly(state: LoadState) -> None:
    from picompile.ir.ops import call_directly

    state.graph = call_directly(_graph(state))


# -- session steps --------------------------------------------------------------------------------
@load_step("dense-prefill", ("prefill",), "prefill computes every neuron: a mask-free copy (decode keeps the masks)")
def _dense_prefill(state: LoadState) -> None:
    from picompile.runtime.masks import without_masks

    assert state.prefill is not None
    state.prefill = without_masks(state.prefill)
    state.notes["dense_prefill"] = state.prefill is not state.graph  # False: no mask to drop


@load_step("sparse-prefill-ffn", ("prefill",), "prefill's ReLU FFNs: the gate GEMM (on a copy in the prefill dtype, "
           "or the stored float rows), then the up and down rows only where a gate fired (notes sparse_prefill_parts, and "
           "sparse_prefill_skipped: why an FFN was left to the dense GEMMs)")
def _sparse_prefill_ffn(state: LoadState) -> None:
    from picompile.ir.graph import shared_copy
    from picompile.runtime.prefill_sparse import sparse_prefill_ffn

    assert state.prefill is not None
    if state.prefill is state.graph or state.prefill is state.decode:  # those keep their FFN nodes
        state.prefill = shared_copy(state.prefill)
    parts, skipped = sparse_prefill_ffn(state.prefill, state.options.prefill_dtype)
    state.notes.update(sparse_prefill_parts=parts, sparse_prefill_skipped=skipped)


@load_step("compute-dtype", ("prefill",), "prefill's GEMMs in the prefill dtype: on copies of their weights, or "
           "(bfloat16-stream) on each weight converted per call into one reused buffer")
def _compute_dtype(state: LoadState) -> None:
    from picompile.runtime.compute_dtype import STREAMED, resolve, with_compute_dtype

    dtype = resolve(state.options.prefill_dtype)
    assert state.prefill is not None and dtype is not None
    state.prefill = with_compute_dtype(state.prefill, dtype, streamed=state.options.prefill_dtype in STREAMED,
                                       onednn=not state.options.compile)  # inductor cannot trace oneDNN's packed tensors


@load_step("kv-arenas", ("decode", "prefill"), "the KV cache in place: presents written into preallocated "
           "arenas both forms share (notes kv_reason when the graph's cache is not that pattern)")
def _kv_arenas(state: LoadState) -> None:
    from picompile.runtime.kv_cache import ArenaPatternError, arena_step

    assert state.decode is not None and state.prefill is not None
    try:
        kv = arena_step(state.decode, state.n_past, state.max_seq_len)
    except ArenaPatternError as e:
        state.notes["kv_reason"] = str(e)
        return
    prefill = kv if state.prefill is state.decode else arena_step(state.prefill, state.n_past, state.max_seq_len,
                                                                    kv.arenas)
    state.notes.update(kv=kv, kv_reason="")
    state.decode, state.prefill = kv.graph, prefill.graph


@load_step("last-logits", ("prefill",), "lm_head's input through a LogitRows selector: the last position only "
           "when the caller asks (notes logit_rows; logit_rows_reason when the logits are not one linear's output)")
def _last_logits(state: LoadState) -> None:
    from picompile.ir.graph import shared_copy
    from picompile.runtime.logit_rows import last_logits

    assert state.prefill is not None
    if state.prefill is state.decode or state.prefill is state.graph:  # those stay as they are: a copy
        state.prefill = shared_copy(state.prefill)
    rows, why = last_logits(state.prefill)
    state.notes.update(logit_rows=rows, logit_rows_reason=why)


@load_step("opaque-calls", ("decode", "prefill"), "compiler copies (one each): picompile ops as their torch "
           "overloads, hybrid schedulers as graph breaks")
def _opaque_calls(state: LoadState) -> None:
    from picompile.runtime.compile import opaque_calls

    assert state.decode is not None and state.prefill is not None
    state.decode, state.prefill = opaque_calls(state.decode), opaque_calls(state.prefill)


@load_step("inline-trivial", ("decode", "prefill"), "merges as adds, FFN parts without rows as zeros, linears "
           "on bfloat16 copies as their casts and GEMM (aten ops the compiler fuses)")
def _inline_trivial(state: LoadState) -> None:
    from picompile.runtime.compile import inline_trivial

    for gm in {id(g): g for g in (state.decode, state.prefill) if g is not None}.values():
        inline_trivial(gm)


@load_step("native-calls", ("decode",), "the decode graph's CPU kernel calls as picompile_native C++ ops "
           "(notes native_reason when the library cannot be built)")
def _native_calls(state: LoadState) -> None:
    from picompile.ir.graph import shared_copy
    from picompile.runtime.native import has_native_calls, load_library, to_native

    assert state.decode is not None
    # the form before it stays what runtime/batch.py batches (it reads picompile ops: C++ ones take one token)
    state.notes["batch_decode"] = state.decode
    if not has_native_calls(state.decode):  # nothing to rewrite (no CPU kernel): the library is not built
        state.notes.update(native_reason="no CPU kernel calls", native_calls=0)
        return
    reason = load_library()
    if reason:
        state.notes.update(native_reason=reason, native_calls=0)
        return
    state.decode = shared_copy(state.decode)  # the others, and batch_decode, keep the Python ops
    state.notes.update(native_reason="", native_calls=to_native(state.decode))


@load_step("native-glue", ("decode",), "the decode graph's per-layer glue (RMSNorm, q/k/v heads and rotary, KV cache "
           "writes and attention, empty FFN parts) as single picompile_native C++ ops (notes glue_counts; "
           "glue_reason when none were)")
def _native_glue(state: LoadState) -> None:
    from picompile.runtime.native_glue import fuse_glue

    assert state.decode is not None
    if state.notes.get("native_reason") or state.decode is state.notes.get("batch_decode"):
        state.notes["glue_reason"] = state.notes.get("native_reason") or "the decode graph is not native-calls' copy"
        return
    state.notes.update(glue_counts=fuse_glue(state.decode), glue_reason="")


@load_step("decode-attention", ("decode",), "the decode graph's scaled_dot_product_attention as two matmuls "
           "and a softmax")
def _decode_attention(state: LoadState) -> None:
    from picompile.ir.graph import shared_copy
    from picompile.runtime.decode_attention import rewrite_attention

    assert state.decode is not None
    if state.decode is state.graph or state.decode is state.prefill:  # the others keep torch's attention
        state.decode = shared_copy(state.decode)
    state.notes["attention_rewrites"] = rewrite_attention(state.decode)

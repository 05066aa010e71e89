"""lower-tvm: sparse_ffn(x, rows…, mask, part, device) → tvm_sparse_ffn(…, kernel=KEY, gpu_kernel=KEY)
calling TVM-generated kernels: an llvm kernel for every part (the CPU, and the GPU partition's
fallback on a machine without one) and a CUDA kernel for the hot part when the target has a GPU;
every predict → tvm_predict (one llvm kernel for the whole predictor: fc1, act, fc2, offset, threshold);
every linear with a stored weight (aten's, or convert-weights' narrowed one) → tvm_linear (an llvm GEMV kernel).
Quantized weights (int8 / int4 quants + float16 scales) get kernels of that format and block
(``KernelSpec.weight_dtype``, ``block``) where ``picompile.kernels`` has them; where it has none, the node stays
its reference op (dequantize + torch matmul) and ``kernels_skipped`` says so.
Compiled libraries go to the artifact's kernels/ and are listed in the manifest.
"""
from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.ir.graph import get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.patterns import linear_parts, quantized_weights, scale_of
from picompile.ir.schema import args_of, call_args, op_name
from picompile.passes.registry import register_pass

aten = torch.ops.aten
KERNEL_DIR = "kernels"
KERNEL_ACTS: tuple[str, ...] = ("relu", "silu", "drelu")


def _build(ctx: BuildContext, spec: Any, entries: dict[str, dict[str, Any]], use: str) -> str:
    """Compile (or reuse from the kernel cache) one kernel, copy it into the artifact, return its key."""
    from picompile.kernels import build_kernel

    key = spec.key()
    if key not in entries:
        path = build_kernel(spec, ctx.config.kernel_cache, ctx.config.cpu_mcpu)
        dest = ctx.staging_dir / KERNEL_DIR
        dest.mkdir(exist_ok=True)
        shutil.copyfile(path, dest / path.name)  # the library …
        meta = path.with_suffix(".json")
        shutil.copyfile(meta, dest / meta.name)  # … and its build metadata, which the loader checks
        entries[key] = {"key": key, "file": f"{KERNEL_DIR}/{path.name}", "meta": f"{KERNEL_DIR}/{meta.name}",
                        "spec": spec.to_json(), "uses": []}
    entries[key]["uses"].append(use)
    return key


def _replace(gm: fx.GraphModule, node: fx.Node, op: Any, values: Mapping[str, Any]) -> None:
    """``node`` becomes a call of picompile ``op`` on the arguments ``values`` by name (same place, same
    metadata, same users)."""
    name = op_name(op)
    assert name is not None, op
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, call_args(name, values))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def weight_format(w: torch.Tensor, s: torch.Tensor | None) -> dict[str, Any]:
    """The KernelSpec fields of a stored weight: its dtype (float32 / float16), or its quantized format and block
    (int8 / int4 quants ``w`` with float16 scales ``s``, ``picompile.kernels.qformat``)."""
    if s is None:
        return {"weight_dtype": str(w.dtype).removeprefix("torch.")}
    from picompile.kernels.qformat import format_of

    fmt = format_of(w, s)
    return {"weight_dtype": fmt.name, "block": fmt.block}


def quant_kernels(fmt: dict[str, Any], cuda: bool = False) -> str | None:
    """Why ``picompile.kernels`` cannot build (``cuda``: CUDA) kernels for a weight format (None: it can)."""
    from picompile.kernels import spec as kspec

    have = kspec.WEIGHT_DTYPES if cuda else (*kspec.WEIGHT_DTYPES, *getattr(kspec, "QUANT_DTYPES", ()))
    if fmt["weight_dtype"] in have:
        return None
    return f"picompile.kernels has no {'CUDA ' if cuda else ''}{fmt['weight_dtype']} kernel (it has {', '.join(have)})"


def _gemv_spec(w: torch.Tensor, act: str, s: torch.Tensor | None = None) -> Any:
    """Kind ``up`` over every row of ``w`` [d_out, d_in]: a dense GEMV (no bias; the op adds it). Quantized:
    ``w`` the quants, ``s`` the scales [d_out, d_in / block]."""
    from picompile.kernels import KernelSpec

    d_in = int(w.shape[1]) * (2 if s is not None and w.dtype == torch.uint8 else 1)
    return KernelSpec(kind="up", act=act, d_model=d_in, n_rows=int(w.shape[0]), has_bias=False, target="llvm",
                      **weight_format(w, s))


def _predict_spec(fc1: torch.Tensor, fc2: torch.Tensor, act: str, has_offset: bool) -> Any:
    """Kind ``predict``: the whole predictor (fc1 [rank, d], act, fc2 [n, rank], offset, threshold) in one kernel."""
    from picompile.kernels import KernelSpec

    return KernelSpec(kind="predict", act=act, d_model=int(fc1.shape[1]), n_rows=int(fc2.shape[0]),
                      weight_dtype=str(fc1.dtype).removeprefix("torch."), has_bias=has_offset, target="llvm",
                      rank=int(fc1.shape[0]))


def _stored_linear(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(x, w, b) of a linear with stored weights (``ir.patterns.linear_parts``) on a float32 input: a GEMV per
    token. float32 weights too: back to back, as in a decode step, the TVM GEMV streams a 1B model's attention and
    lm_head weights at 25.7 GB/s against torch ``F.linear``'s 24.6 (``benchmarks/README.md``)."""
    parts = linear_parts(node)
    if parts is None:
        return None
    val = parts[0].meta.get("val")
    return parts if is_picompile_op(node.target, "linear") or (val is not None and val.dtype == torch.float32) else None


def _align(gm: fx.GraphModule, node: fx.Node) -> None:
    """The stored tensor ``node`` reads, 64-byte aligned and contiguous (as the kernels require), in place:
    a weight straight from a checkpoint may sit at any offset of its file; every reader keeps sharing it."""
    from picompile.kernels import as_aligned, is_aligned

    t = get_tensor(gm, node)
    if t.is_contiguous() and is_aligned(t):
        return
    path, _, attr = str(node.target).rpartition(".")
    owner = gm.get_submodule(path) if path else gm
    new = as_aligned(t.detach(), copy=True)
    if isinstance(getattr(owner, attr), torch.nn.Parameter):
        getattr(owner, attr).data = new
    else:
        setattr(owner, attr, new)


def _lower_gemvs(gm: fx.GraphModule, ctx: BuildContext, entries: dict[str, dict[str, Any]],
                 skipped: list[str]) -> None:
    """linear → tvm_linear; predict → tvm_predict, whatever its weights' dtype: one kernel call instead of
    torch's two small GEMVs, add and compare (float32, 1B model: 0.26 against 0.67 ms per predictor)."""
    todo = [(n, _stored_linear(n)) for n in gm.graph.nodes]
    todo = [(n, parts) for n, parts in todo if parts is not None or (
        n.op == "call_function" and is_picompile_op(n.target, "predict"))]
    for node, parts in ctx.track(todo, "compiling TVM GEMV kernels"):
        if parts is not None:
            x, w, b = parts
            s = scale_of(node, "w")
            w_t, s_t = get_tensor(gm, w), None if s is None else get_tensor(gm, s)
            why = quant_kernels(weight_format(w_t, s_t))
            if why is not None:
                skipped.append(f"{node.name}: {why}; it stays picompile.linear (dequantized per call)")
                continue
            for t in (w, s):
                if t is not None:
                    _align(gm, t)
            key = _build(ctx, _gemv_spec(w_t, "none", s_t), entries, node.name)
            _replace(gm, node, torch.ops.picompile.tvm_linear.default, dict(x=x, w=w, b=b, kernel=key, s=s))
        else:
            a = args_of(node)  # an older graph's predict (no act, offset) reads the schema's defaults
            key = _build(ctx, _predict_spec(get_tensor(gm, a["fc1"]), get_tensor(gm, a["fc2"]), str(a["act"]),
                                            a["offset"] is not None), entries, f"layer{a['layer']}.predictor")
            _replace(gm, node, torch.ops.picompile.tvm_predict.default, dict(a, kernel1=key, kernel2=""))


def _ffn_kernels(gm: fx.GraphModule, ctx: BuildContext, a: Mapping[str, Any],
                 entries: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The (llvm, cuda) kernel keys of one sparse_ffn part, its arguments ``a`` by name: ("", "") for a part
    without rows; no cuda kernel but for a GPU part on a target with a GPU."""
    from picompile.kernels import KernelSpec

    up = get_tensor(gm, a["w_up"])  # [n_rows, d_model] (int4 quants: [n_rows, d_model / 2])
    s_up = None if a["s_up"] is None else get_tensor(gm, a["s_up"])
    fmt = weight_format(up, s_up)
    n_rows, d_model = int(up.shape[0]), int(up.shape[1]) * (2 if fmt["weight_dtype"] == "int4" else 1)
    if n_rows == 0:
        return "", ""
    use = f"layer{a['layer']}.{a['part']}"
    common = dict(kind="ffn_gated" if a["w_gate"] is not None else "ffn_relu", act=a["act"], d_model=d_model,
                  n_rows=n_rows, has_bias=a["b_up"] is not None, gate_bias=a["b_gate"] is not None, **fmt)
    cpu_key = _build(ctx, KernelSpec(**common, target="llvm"), entries, use)
    gpu_key = ""
    # CUDA: float weights; a part with a gate bias runs inline on the CPU (the hybrid scheduler passes no b_gate)
    if (a["device"] == "gpu" and ctx.target.has_gpu and quant_kernels(fmt, cuda=True) is None
            and a["b_gate"] is None):
        gpu_key = _build(ctx, KernelSpec(**common, target=f"cuda:{ctx.target.cuda_arch}"), entries, use)
    return cpu_key, gpu_key


def _part_format_problem(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why a sparse_ffn part cannot run one kernel: its row weights in different formats, or a quantized format
    ``picompile.kernels`` has no kernel for (None: it can)."""
    a = args_of(node)
    fmts = [weight_format(get_tensor(gm, a[w]), None if a[s] is None else get_tensor(gm, a[s]))
            for w, s in (("w_up", "s_up"), ("w_gate", "s_gate"), ("w_down_t", "s_down")) if a[w] is not None]
    if any(f != fmts[0] for f in fmts):
        return f"its rows are stored in different formats ({fmts})"
    return quant_kernels(fmts[0])


@register_pass("lower-tvm")
def lower_tvm(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    entries: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and is_picompile_op(n.target, "sparse_ffn")]
    if not nodes:
        raise PassError("lower-tvm found no sparse_ffn node to lower (run split-ffn first)")
    _lower_gemvs(gm, ctx, entries, skipped)
    for node in ctx.track(nodes, "compiling TVM kernels"):
        a = args_of(node)
        if a["act"] not in KERNEL_ACTS:
            skipped.append(f"layer {a['layer']} {a['part']}: activation {a['act']} has no TVM kernel "
                           f"(supported: {', '.join(KERNEL_ACTS)})")
            continue
        why = _part_format_problem(gm, node)
        if why is not None:
            skipped.append(f"layer {a['layer']} {a['part']}: {why}; it stays picompile.sparse_ffn")
            continue
        for w, s in quantized_weights(node).values():
            _align(gm, w)
            _align(gm, s)
        cpu_key, gpu_key = _ffn_kernels(gm, ctx, a, entries)
        _replace(gm, node, torch.ops.picompile.tvm_sparse_ffn.default, dict(a, kernel=cpu_key, gpu_kernel=gpu_key))
    gm.recompile()
    ctx.manifest_extra["kernels"] = list(entries.values())
    if skipped:
        ctx.manifest_extra["kernels_skipped"] = skipped
    return gm

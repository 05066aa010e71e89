"""split-ffn: ffn(x, …, mask) → merge(sparse_ffn(x, hot rows, mask[:n_hot], device=gpu),
                                      sparse_ffn(x, cold rows, mask[n_hot:], device=cpu), b_down).
A neuron's rows go with it: up, gate and down_t rows and its up and gate biases (``b_up``, ``b_gate``); the
down bias is added once, by the merge.
Each part's rows are contiguous and neuron-major (down projection transposed); the mask producer's
rows are permuted into the same hot-then-cold order so the mask is split by slicing.

With --weight-dtype float16 the parts' rows are made in float16 here, with int8 / int4 as their quants and
scales (``ir.patterns.add_quantized``; rows that are not whole blocks in float16), named as convert-weights names
its copies, which then finds them done: the same artifact. So a build never holds the FFN rows in float32 (a
float32 1B source: 2.8 GiB) beside the converted ones; each layer's original rows are dropped (a mapped
checkpoint's pages released) once split.
The calibration tokens' FFN inputs and masks are dropped first (profiles and thresholds stay): no pass after
this one reads them, and the build's peak is here and in convert-weights.
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.formats.tensorfile import release_pages
from picompile.ir.graph import drop_unused_weights, get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.patterns import QUANT_WEIGHT_DTYPES, SCALE_ARGS, add_buffer, add_quantized, ffn_nodes
from picompile.ir.schema import args_of, call_args, position, set_args
from picompile.kernels.qformat import QFormat
from picompile.passes.registry import register_pass

aten = torch.ops.aten
# mask-producing op -> its per-neuron row tensors (permuted with the neurons)
MASK_ROWS: dict[str, tuple[str, ...]] = {"predict": ("fc2", "offset"), "oracle_mask": ("w", "b", "w_mul", "b_mul")}
NARROWED: dict[str, torch.dtype] = {"float16": torch.float16}  # --weight-dtype -> the dtype rows are made in


def _permute_mask_producer(gm: fx.GraphModule, mask: fx.Node, perm: torch.Tensor, layer: int) -> None:
    for op, names in MASK_ROWS.items():
        if mask.op == "call_function" and is_picompile_op(mask.target, op):
            break
    else:
        raise PassError(f"layer {layer}: the FFN mask comes from {mask.target}, which split-ffn cannot permute "
                        f"(expected one of {', '.join(MASK_ROWS)})")
    args = args_of(mask)
    permuted = {}
    for name in names:
        if args[name] is None:
            continue
        t = get_tensor(gm, args[name])[perm]  # rows in hot-then-cold order
        # the buffer keeps its positional name: the artifact's weight names stay as they were
        permuted[name] = add_buffer(gm, f"ffn{layer}_{op}_rows{position(op, name)}", t, mask)
    set_args(mask, **permuted)


@register_pass("split-ffn")
def split_ffn(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    if ctx.placement is None:
        raise PassError("split-ffn needs place-neurons to run first")
    for cal in ctx.calibration.values():  # [N, d_model] inputs, [N, n_neurons] masks: done with
        cal.x, cal.mask = cal.x.new_empty((0, cal.x.shape[-1])), cal.mask.new_empty((0, cal.mask.shape[-1]))
    nodes = ffn_nodes(gm)
    g = gm.graph
    narrow = NARROWED.get(ctx.config.weight_dtype)  # rows made in the artifact's dtype (convert-weights' copies)
    fmt = _quant_format(ctx)  # or quantized (convert-weights' quants and scales)
    if fmt is not None:
        narrow = torch.float16  # what a weight whose rows are not whole blocks is stored in
    for layer, hot, cold in zip(ctx.ffn_layers, ctx.placement.hot, ctx.placement.cold):
        node = nodes[layer.index]
        a = args_of(node)
        x, w_up, b_up, w_gate, w_down, b_down, act, index, mask, b_gate = (a[k] for k in (
            "x", "w_up", "b_up", "w_gate", "w_down", "b_down", "act", "layer", "mask", "b_gate"))
        hot_t, cold_t = torch.as_tensor(hot, dtype=torch.long), torch.as_tensor(cold, dtype=torch.long)
        n_hot = int(hot_t.numel())
        if mask is not None:
            _permute_mask_producer(gm, mask, torch.cat([hot_t, cold_t]), layer.index)
        up, down_t = get_tensor(gm, w_up), get_tensor(gm, w_down).t()  # [n, d], [n, d]
        originals = [t for t in (up, down_t, *(get_tensor(gm, n) for n in (b_up, w_gate, b_gate) if n is not None))]
        parts: list[fx.Node] = []
        for part, idx, device, lo, hi in (("hot", hot_t, "gpu", 0, n_hot), ("cold", cold_t, "cpu", n_hot, None)):
            def rows(t: torch.Tensor | None, role: str, quantized: bool = False) -> fx.Node | None:
                if t is None:
                    return None
                name = f"ffn{layer.index}_{part}_{role}"
                if quantized and fmt is not None and t.is_floating_point() and t.shape[1] % fmt.block == 0:
                    q, s = add_quantized(gm, name, t[idx], fmt, node)
                    scales[role] = s
                    return q
                if narrow is not None and t.is_floating_point() and t.dtype != narrow and (
                        quantized or fmt is None):  # a quantized build's biases stay as they are
                    return add_buffer(gm, f"{name}_{str(narrow).removeprefix('torch.')}", t[idx].to(narrow), node)
                return add_buffer(gm, name, t[idx], node)

            scales: dict[str, fx.Node] = {}
            weights = dict(
                w_up=rows(up, "up", True),
                b_up=rows(None if b_up is None else get_tensor(gm, b_up), "up_bias"),
                w_gate=rows(None if w_gate is None else get_tensor(gm, w_gate), "gate", True),
                w_down_t=rows(down_t, "down_t", True),
            )
            for w, s_name in SCALE_ARGS["sparse_ffn"].items():
                if w.removeprefix("w_") in scales:
                    weights[s_name] = scales[w.removeprefix("w_")]
            if b_gate is not None:  # a trailing argument: graphs without it keep their calls
                weights["b_gate"] = rows(get_tensor(gm, b_gate), "gate_bias")
            with g.inserting_before(node):
                part_mask = None if mask is None else g.call_function(aten.slice.Tensor, (mask, -1, lo, hi))
                parts.append(g.call_function(torch.ops.picompile.sparse_ffn.default, call_args("sparse_ffn", dict(
                    x=x, **weights, mask=part_mask, act=act, layer=index, part=part, device=device))))
        with g.inserting_before(node):
            merged = g.call_function(torch.ops.picompile.merge.default, call_args("merge", dict(
                hot=parts[0], cold=parts[1], bias=b_down, layer=index)))
        merged.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
        node.replace_all_uses_with(merged)
        g.erase_node(node)
        drop_unused_weights(gm)  # this layer's original rows
        release_pages(originals)
        del originals, up, down_t
    g.eliminate_dead_code()
    drop_unused_weights(gm)  # e.g. mask rows replaced by permuted copies
    gm.recompile()
    return gm


def _quant_format(ctx: BuildContext) -> QFormat | None:
    """The block format of a quantized --weight-dtype (None otherwise, or when convert-weights will refuse it)."""
    if ctx.config.weight_dtype not in QUANT_WEIGHT_DTYPES:
        return None
    try:
        return QFormat(ctx.config.weight_dtype, ctx.config.quant_block)
    except ValueError:
        return None


"""capture: HF model (nn.Module) → torch.export graph of one decoder step.

forward(input_ids [1, seq], past_0 … past_{2L-1} [1, kv_heads, past, head_dim]) -> (logits, present_0 …)
(the calling convention of picompile.frontend.decoder).

The graph always computes in float32. A model stored narrower (a bfloat16 or float16 checkpoint, mapped by the
frontend) is exported with uninitialised float32 stand-ins for its parameters (never touched: no memory), then
its own tensors are bound to the graph: a weight only linear layers read stays in its stored dtype (the passes
that run the graph widen it one tensor at a time, ``picompile.sparsity.widen``; convert-weights narrows it to
--weight-dtype), everything else (embeddings, norms, biases) is widened to float32 here, and so is everything in
a --weight-dtype float32 build.
"""
from __future__ import annotations

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.frontend.decoder import FlatDecoder, dynamic_shapes, example_inputs
from picompile.ir.graph import flatten_codegen
from picompile.ir.patterns import linear_parts
from picompile.passes.registry import register_pass
from picompile.sparsity.widen import release_stored


def _stand_ins(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """Swap every narrow floating parameter of ``model`` for an uninitialised float32 one (tied ones stay tied);
    returns {stand-in data_ptr: original parameter}."""
    made: dict[int, torch.nn.Parameter] = {}
    by_id: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == torch.float32:
                continue
            if id(p) not in by_id:
                by_id[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False)
                made[by_id[id(p)].data_ptr()] = p
            module._parameters[name] = by_id[id(p)]
    return made


def _restore(model: torch.nn.Module, made: dict[int, torch.nn.Parameter]) -> None:
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.data_ptr() in made and p.dtype == torch.float32:
                module._parameters[name] = made[p.data_ptr()]


def _only_linear_weight(node: fx.Node) -> bool:
    parts = [linear_parts(u) for u in node.users]
    return bool(parts) and all(p is not None and p[1] is node and node is not p[0] and node is not p[2] for p in parts)


def bind_stored(gm: fx.GraphModule, made: dict[int, torch.nn.Parameter], keep_stored: bool) -> dict[str, int]:
    """Replace the graph's float32 stand-ins by the model's tensors; returns bytes kept stored / widened."""
    counts = {"stored_bytes": 0, "widened_bytes": 0}
    nodes = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
    for target, node in nodes.items():
        *path, leaf = target.split(".")
        owner = gm.get_submodule(".".join(path)) if path else gm
        slots = owner._parameters if leaf in owner._parameters else owner._buffers
        t = slots.get(leaf)
        if t is None or t.data_ptr() not in made:
            continue
        stored = made[t.data_ptr()].detach()
        keep = keep_stored and stored.dim() == 2 and _only_linear_weight(node)
        value = stored if keep else stored.float()
        counts["stored_bytes" if keep else "widened_bytes"] += value.numel() * value.element_size()
        slots[leaf] = torch.nn.Parameter(value, requires_grad=False) if leaf in owner._parameters else value
    return counts


@register_pass("capture")
def capture(gm: fx.GraphModule | None, ctx: BuildContext) -> fx.GraphModule:
    if gm is not None:
        raise PassError("capture must be the first pass of a pipeline")
    wrapper = FlatDecoder(ctx.model, ctx.info.n_layers).eval()
    ids, past = example_inputs(ctx.info)
    release_stored()  # the frontend's first forward (KV shape) read every weight
    made = _stand_ins(ctx.model)
    try:
        with torch.no_grad():
            ep = torch.export.export(wrapper, (ids, past), dynamic_shapes=dynamic_shapes(ctx.max_seq_len, len(past)), strict=False)
    except Exception as e:
        raise PassError(f"torch.export could not capture {ctx.info.architecture}: {type(e).__name__}: {e}") from e
    finally:
        _restore(ctx.model, made)
    out = flatten_codegen(ep.module())
    del ep
    if made:
        counts = bind_stored(out, made, keep_stored=ctx.config.weight_dtype != "float32")
        ctx.manifest_extra["capture"] = {"stored_dtype": str(next(iter(made.values())).dtype).removeprefix("torch."),
                                         **counts}
    return out

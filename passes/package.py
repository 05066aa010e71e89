"""package: graph with weights as attributes → artifact files in the staging dir
(graph.pt2 with weights lifted to inputs, weights.safetensors, tokenizer, manifest.json).

The manifest's ``weights`` section records the storage format: ``dtype`` (--weight-dtype), for int8 / int4
builds ``block`` and ``quantized`` ({quants key: {format, block, scales: scales key}} for every quantized
weight), and ``bytes_per_token`` ({format: bytes}: what one decode token reads, FFN rows at the layers'
predicted active fraction; ``picompile inspect`` shows it).

The files are reproducible: the same inputs and options give the same bytes (no timings, no node
metadata of the build machine, a serialization id derived from the graph, the source recorded by name
and content hash); only the manifest's ``created`` differs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import fx

from picompile.formats.archive import pin_serialization_id
from picompile.formats.artifact import Manifest, write_manifest
from picompile.formats.tensorfile import write_safetensors
from picompile.formats.provenance import portable_model, portable_sections
from picompile.context import BuildContext
from picompile.frontend.decoder import dynamic_shapes, example_inputs
from picompile.ir.graph import get_tensor, placeholders
from picompile.ir.patterns import quantized_weights
from picompile.ir.reads import weight_bytes
from picompile.passes.registry import register_pass

GRAPH_FILE = "graph.pt2"
WEIGHTS_FILE = "weights.safetensors"
WEIGHTS_ALIGN = 64  # bytes: picompile.kernels.ALIGNMENT (the passes may not import the kernels' loader)
# build options that shape the artifact, recorded in the manifest ("build") so that it can be rebuilt alike
RECORDED_OPTIONS: tuple[str, ...] = (
    "predictor", "seed", "calibration_tokens", "act_sparsity", "act_criterion", "sparsity_allocation", "allocation_step",
    "allocation_tokens", "recall_target", "predictor_budget", "predictor_epochs", "placement_batch", "min_layer_neurons",
    "weight_dtype", "predictor_kind", "predictor_dtype", "quant_block", "calibration_source", "input_sparsity",
    "input_allocation", "input_criterion", "accuracy_budget", "input_loss_tokens",
)


def lift_weights(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str], dict[str, torch.Tensor]]:
    """A copy of the graph whose get_attr tensors are extra inputs (after the model inputs).

    Returns (graph module, weight keys in input order, {key: tensor}); tensors shared by several
    attributes (tied embeddings) become one input.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for ph in placeholders(gm):
        env[ph] = graph.placeholder(ph.name)
        env[ph].meta = dict(ph.meta)
    keys: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    by_storage: dict[tuple[int, tuple[int, ...], torch.dtype], fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = get_tensor(gm, node)
        sig = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), tuple(t.shape), t.dtype)
        if sig in by_storage and t.numel() > 0:
            env[node] = by_storage[sig]
            continue
        key = str(node.target)
        env[node] = graph.placeholder("w_" + key.replace(".", "_"))
        keys.append(key)
        tensors[key] = t.detach().contiguous()
        by_storage[sig] = env[node]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(torch.nn.Module(), graph), keys, tensors


# node metadata that differs between two builds of the same graph: the source lines of the build machine
# (absolute paths) and the ids of the Python objects the graph passed through
BUILD_METADATA: tuple[str, ...] = ("stack_trace", "from_node")
# keys torch.export's dynamo wrappers annotate into node.meta["custom"]; "_torchdynamo_disable_method" names the
# wrapped function, which depends on what the process traced before (a second build in one process differs)
DYNAMO_ANNOTATIONS: tuple[str, ...] = ("_torchdynamo_disable", "_torchdynamo_disable_recursive",
                                       "_torchdynamo_disable_method")


def strip_build_metadata(ep: torch.export.ExportedProgram) -> None:
    """Drop the node metadata that would make graph.pt2 depend on the build machine and run (BUILD_METADATA,
    and torch.export's own DYNAMO_ANNOTATIONS in ``meta["custom"]``)."""
    for module in ep.graph_module.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                for key in BUILD_METADATA:
                    node.meta.pop(key, None)
                custom = node.meta.get("custom")
                if isinstance(custom, dict):
                    for key in DYNAMO_ANNOTATIONS:
                        custom.pop(key, None)
                    if not custom:
                        node.meta.pop("custom")


def quantized_section(gm: fx.GraphModule, keys: list[str]) -> dict[str, dict[str, object]]:
    """{quants key: {format, block, scales}} of every quantized weight ``gm`` reads (``keys``: the lifted
    weights' keys, which these must be among)."""
    from picompile.kernels.qformat import format_of

    listed = set(keys)
    out: dict[str, dict[str, object]] = {}
    for node in gm.graph.nodes:
        for q, s in quantized_weights(node).values():
            qk, sk = str(q.target), str(s.target)
            if qk in listed and sk in listed:
                fmt = format_of(get_tensor(gm, q), get_tensor(gm, s))
                out[qk] = {"format": fmt.name, "block": fmt.block, "scales": sk}
    return dict(sorted(out.items()))


def decode_bytes(gm: fx.GraphModule, ctx: BuildContext) -> dict[str, int]:
    """{format: bytes} one decode token reads, FFN rows at each layer's predicted (else true) active fraction."""
    active = {}
    for layer in ctx.ffn_layers:
        frac = layer.stats.get("predicted_active", layer.stats.get("true_active"))
        if isinstance(frac, (int, float)):
            active[layer.index] = float(frac)
    return {k: int(round(v)) for k, v in weight_bytes(gm, active or None)["by_format"].items()}


def weights_section(gm: fx.GraphModule, ctx: BuildContext, keys: list[str]) -> dict[str, object]:
    """The manifest's ``weights``: file, dtype, (block, quantized,) bytes_per_token."""
    section: dict[str, object] = {"file": WEIGHTS_FILE, "dtype": ctx.config.weight_dtype}
    quantized = quantized_section(gm, keys)
    if quantized:
        section.update(block=ctx.config.quant_block, quantized=quantized)
    section["bytes_per_token"] = decode_bytes(gm, ctx)
    return section


@register_pass("package")
def package(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    out = ctx.staging_dir
    lifted, keys, tensors = lift_weights(gm)
    ids, past = example_inputs(ctx.info)
    weights = tuple(tensors[k] for k in keys)
    ids_dim, past_dims = dynamic_shapes(ctx.max_seq_len, len(past))
    with torch.no_grad():
        ep = torch.export.export(
            lifted, (ids, *past, *weights), dynamic_shapes=(ids_dim, *past_dims, *([None] * len(weights))), strict=False
        )
    ep.example_inputs = None  # they would be the weights again, serialized inside graph.pt2
    strip_build_metadata(ep)
    torch.export.save(ep, out / GRAPH_FILE)
    pin_serialization_id(out / GRAPH_FILE)
    # tensor by tensor, each on a 64-byte boundary: the runtime can map them where the kernels read them
    write_safetensors(out / WEIGHTS_FILE, tensors, metadata={"format": "pt"}, align=WEIGHTS_ALIGN)
    tokenizer = None
    if ctx.info.tokenizer is not None:
        from picompile.formats.tokenizers import load_tokenizer, save_tokenizer

        tok = load_tokenizer(ctx.info.tokenizer["kind"], Path(ctx.info.tokenizer["path"]))
        tokenizer = save_tokenizer(tok, out)
    manifest = Manifest(
        model=portable_model(ctx.info),
        target=ctx.target.to_json(),
        build={
            "max_seq_len": ctx.max_seq_len,
            **{name: getattr(ctx.config, name) for name in RECORDED_OPTIONS},
        },
        pipeline=list(ctx.pipeline),
        graph={
            "file": GRAPH_FILE,
            "inputs": ["input_ids"] + [f"past_{i}" for i in range(len(past))],
            "n_past": len(past),
            "kv_shape": [1, ctx.info.n_kv_heads, "past", ctx.info.head_dim],
            "outputs": ["logits"] + [f"present_{i}" for i in range(len(past))],
            "weights": keys,
        },
        weights=weights_section(gm, ctx, keys),
        layers=[layer.to_json() for layer in ctx.ffn_layers],
        tokenizer=tokenizer,
        sections=portable_sections(ctx.manifest_extra),
    )
    write_manifest(out, manifest)
    return gm

"""An artifact's transformed graph, given as an fx graph, for viewing: ONNX (for Netron) and Graphviz DOT.

:func:`graph_to_onnx` writes the decoder-step graph the artifact runs as an ONNX model: the aten
parts become standard ONNX ops (torch.onnx's dynamo exporter) and every picompile op becomes one
node in the custom domain ``picompile`` (version 1), its arguments as attributes:

=================  ==============  =============================================================
picompile op       ONNX op type    inputs (``""`` = absent optional) / attributes
=================  ==============  =============================================================
ffn                FFN             x, w_up, b_up, w_gate, w_down, b_down, mask[, s_*][, b_gate] /
                                   act, layer, n_rows, d_model, gated
predict            Predict         x, fc1, fc2[, offset] → bool mask / threshold, layer, act, n_rows, rank, d_model
oracle_mask        OracleMask      x, w, b[, w_mul, b_mul] → bool mask / act, threshold, layer, n_rows, d_model
sparse_ffn         SparseFFN       x, w_up, b_up, w_gate, w_down_t, mask[, s_*][, b_gate] /
                                   act, layer, part, device, n_rows, d_model, gated
tvm_sparse_ffn     TvmSparseFFN    as SparseFFN, plus kernel, gpu_kernel (kernel keys)
merge              Merge           hot, cold, bias / layer, d_model
linear             Linear          x, w, b / n_rows, d_model   (float16 weights: convert-weights)
tvm_linear         TvmLinear       as Linear, plus kernel
tvm_predict        TvmPredict      as Predict, plus kernel1, kernel2
=================  ==============  =============================================================

Quantized weights (int8 / int4 artifacts) are their quants (int8 / uint8 initializers) with their float16
scales as trailing inputs: ``s_up, s_gate, s_down`` of the FFN ops, ``s`` of Linear / TvmLinear. A gate bias
(Llama ``mlp_bias``) is the FFN ops' last input ``b_gate``, after the scales (``""`` for a float node's).
``n_rows`` is the neuron count the node covers (the part's rows for SparseFFN, all neurons for
Predict / OracleMask / FFN). The model is for inspection, not for running: onnxruntime has no
kernels for the ``picompile`` domain. Inputs and outputs are those of the artifact's graph, with
symbolic dimensions ``seq`` (new tokens) and ``past`` (cached tokens): input_ids [1, seq],
past_i [1, kv_heads, past, head_dim] → logits [1, seq, vocab], present_i [1, kv_heads, past + seq,
head_dim]. Should a graph not export with symbolic shapes, it is exported at one fixed decode step
instead (seq ``SEQ`` = 1 after past ``PAST`` = 4), which the model's ``picompile.shapes`` metadata
says. Weights are initializers named by the artifact's weight keys (``manifest.graph["weights"]``,
e.g. ``ffn0_hot_up``); over 2 GB they go to an external data file ``OUT.data`` beside the model. The
graph is cleaned up (shape arithmetic folded) but weights are never folded or merged (see :func:`tidy`).
:func:`graph_dot` draws the same graph as Graphviz DOT. Reading an artifact and loading its graph is the
caller's (``picompile inspect``: :mod:`picompile.tools.graph_export`).
"""
from __future__ import annotations

import re
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import fx

from picompile.errors import PicompileError
from picompile.ir import schema

DOMAIN: str = "picompile"
DOMAIN_VERSION: int = 1
SEQ: int = 1  # new tokens in the exported step
PAST: int = 4  # cached tokens before it

# picompile op name -> ONNX op type in the picompile domain
OP_TYPES: dict[str, str] = {
    "ffn": "FFN",
    "predict": "Predict",
    "oracle_mask": "OracleMask",
    "sparse_ffn": "SparseFFN",
    "tvm_sparse_ffn": "TvmSparseFFN",
    "merge": "Merge",
    "linear": "Linear",
    "tvm_linear": "TvmLinear",
    "tvm_predict": "TvmPredict",
}
MASK_OUTPUT: set[str] = {"predict", "tvm_predict", "oracle_mask"}  # ops whose output is a bool mask

_FLOAT_TYPES: list[str] = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)",
                           "tensor(int8)", "tensor(uint8)"]  # int8 / int4 weights: their quants


def _op_type(name: str) -> str:
    return OP_TYPES.get(name) or "".join(p.capitalize() for p in name.split("_"))


def _schema(name: str, extra_attrs: dict[str, str]) -> Any:
    """An (unregistered) ONNX OpSchema for picompile::NAME derived from the torch op's own schema:
    Tensor arguments become inputs (``Tensor?`` optional), the others attributes."""
    from onnx.defs import OpSchema

    op = getattr(torch.ops.picompile, name).default
    attr_types = {"str": OpSchema.AttrType.STRING, "int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT,
                  "SymInt": OpSchema.AttrType.INT}
    inputs, attrs = [], []
    for arg in op._schema.arguments:
        t = str(arg.type)  # "Tensor", "Optional[Tensor]", "str", "int", "float"
        optional = t.startswith("Optional[")
        t = t[len("Optional["):-1] if optional else t
        if t == "Tensor":
            ty = "B" if arg.name == "mask" else "T"
            inputs.append(OpSchema.FormalParameter(
                arg.name, ty, param_option=OpSchema.FormalParameterOption.Optional if optional
                else OpSchema.FormalParameterOption.Single))
        else:
            attrs.append(OpSchema.Attribute(arg.name, attr_types[t], required=False))
    for attr, kind in extra_attrs.items():
        attrs.append(OpSchema.Attribute(attr, attr_types[kind], required=False))
    out = OpSchema.FormalParameter("mask" if name in MASK_OUTPUT else "y", "B" if name in MASK_OUTPUT else "T")
    return OpSchema(_op_type(name), DOMAIN, DOMAIN_VERSION, inputs=inputs, outputs=[out],
                    type_constraints=[("T", _FLOAT_TYPES, "activations and weights"), ("B", ["tensor(bool)"], "masks")],
                    attributes=attrs)


_OPS: dict[str, Any] = {}


def _emit(name: str, inputs: Sequence[Any], attrs: dict[str, Any]) -> Any:
    """Record one picompile-domain node with the exporter's onnxscript evaluator."""
    from onnxscript import values

    if name not in _OPS:
        extra = {k: ("int" if isinstance(v, int) else "float" if isinstance(v, float) else "str")
                 for k, v in attrs.items()}
        op_args = {a.name for a in getattr(torch.ops.picompile, name).default._schema.arguments}
        _OPS[name] = values.Op(values.Opset(DOMAIN, DOMAIN_VERSION), _op_type(name),
                               _schema(name, {k: t for k, t in extra.items() if k not in op_args}))
    return _OPS[name](*inputs, **attrs)


def _rows(w: Any) -> int:
    return int(w.shape[0]) if w is not None and w.shape is not None and isinstance(w.shape[0], int) else -1


def _d_model(x: Any) -> int:
    return int(x.shape[-1]) if x.shape is not None and isinstance(x.shape[-1], int) else -1


def _scales(*scales: Optional[Any]) -> list[Optional[Any]]:
    """A quantized node's trailing scale inputs (int8 / int4 weights); none for a float node."""
    return list(scales) if any(s is not None for s in scales) else []


def _ffn_tail(s_up: Optional[Any], s_gate: Optional[Any], s_down: Optional[Any], b_gate: Optional[Any]) -> list[Optional[Any]]:
    """An FFN node's trailing inputs: its scales (quantized), then its gate bias where it has one (the scales
    absent, "" in their places)."""
    if b_gate is None:
        return _scales(s_up, s_gate, s_down)
    return [s_up, s_gate, s_down, b_gate]


# The translation functions: called by torch.onnx with the fx node's arguments, in the torch op's order.
def _t_ffn(x: Any, w_up: Any, b_up: Optional[Any], w_gate: Optional[Any], w_down: Any, b_down: Optional[Any],
           act: str, layer: int, mask: Optional[Any] = None, s_up: Optional[Any] = None, s_gate: Optional[Any] = None,
           s_down: Optional[Any] = None, b_gate: Optional[Any] = None) -> Any:
    return _emit("ffn", [x, w_up, b_up, w_gate, w_down, b_down, mask, *_ffn_tail(s_up, s_gate, s_down, b_gate)],
                 dict(act=act, layer=layer, n_rows=_rows(w_up), d_model=_d_model(x), gated=int(w_gate is not None)))


def _t_predict(x: Any, fc1: Any, fc2: Any, threshold: float, layer: int, act: str = "relu",
               offset: Optional[Any] = None) -> Any:
    return _emit("predict", [x, fc1, fc2, offset], dict(threshold=float(threshold), layer=layer, act=act,
                                                        n_rows=_rows(fc2), rank=_rows(fc1), d_model=_d_model(x)))


def _t_tvm_predict(x: Any, fc1: Any, fc2: Any, threshold: float, layer: int, kernel1: str, kernel2: str,
                   act: str = "relu", offset: Optional[Any] = None) -> Any:
    return _emit("tvm_predict", [x, fc1, fc2, offset], dict(threshold=float(threshold), layer=layer, act=act,
                                                            kernel1=kernel1, kernel2=kernel2, n_rows=_rows(fc2),
                                                            rank=_rows(fc1), d_model=_d_model(x)))


def _t_linear(x: Any, w: Any, b: Optional[Any], s: Optional[Any] = None) -> Any:
    return _emit("linear", [x, w, b, *_scales(s)], dict(n_rows=_rows(w), d_model=_d_model(x)))


def _t_tvm_linear(x: Any, w: Any, b: Optional[Any], kernel: str, s: Optional[Any] = None) -> Any:
    return _emit("tvm_linear", [x, w, b, *_scales(s)], dict(kernel=kernel, n_rows=_rows(w), d_model=_d_model(x)))


def _t_oracle_mask(x: Any, w: Any, b: Optional[Any], act: str, threshold: float, layer: int,
                   w_mul: Optional[Any] = None, b_mul: Optional[Any] = None) -> Any:
    return _emit("oracle_mask", [x, w, b, w_mul, *([b_mul] if b_mul is not None else [])], dict(act=act, threshold=float(threshold), layer=layer, n_rows=_rows(w),
                                                d_model=_d_model(x)))


def _t_sparse_ffn(x: Any, w_up: Any, b_up: Optional[Any], w_gate: Optional[Any], w_down_t: Any, mask: Optional[Any],
                  act: str, layer: int, part: str, device: str, s_up: Optional[Any] = None,
                  s_gate: Optional[Any] = None, s_down: Optional[Any] = None, b_gate: Optional[Any] = None) -> Any:
    return _emit("sparse_ffn", [x, w_up, b_up, w_gate, w_down_t, mask, *_ffn_tail(s_up, s_gate, s_down, b_gate)],
                 dict(act=act, layer=layer, part=part, device=device, n_rows=_rows(w_up), d_model=_d_model(x),
                      gated=int(w_gate is not None)))


def _t_tvm_sparse_ffn(x: Any, w_up: Any, b_up: Optional[Any], w_gate: Optional[Any], w_down_t: Any,
                      mask: Optional[Any], act: str, layer: int, part: str, device: str, kernel: str,
                      gpu_kernel: str, s_up: Optional[Any] = None, s_gate: Optional[Any] = None,
                      s_down: Optional[Any] = None, b_gate: Optional[Any] = None) -> Any:
    return _emit("tvm_sparse_ffn", [x, w_up, b_up, w_gate, w_down_t, mask, *_ffn_tail(s_up, s_gate, s_down, b_gate)],
                 dict(act=act, layer=layer, part=part, device=device, kernel=kernel, gpu_kernel=gpu_kernel,
                      n_rows=_rows(w_up), d_model=_d_model(x), gated=int(w_gate is not None)))


def _t_merge(hot: Any, cold: Any, bias: Optional[Any], layer: int) -> Any:
    return _emit("merge", [hot, cold, bias], dict(layer=layer, d_model=_d_model(hot)))


def translation_table() -> dict[Any, Any]:
    """torch.onnx ``custom_translation_table`` entries for every picompile op."""
    import picompile.ir.ops  # noqa: F401  (registers the ops)

    ops = torch.ops.picompile
    return {ops.ffn.default: _t_ffn, ops.predict.default: _t_predict, ops.oracle_mask.default: _t_oracle_mask,
            ops.sparse_ffn.default: _t_sparse_ffn, ops.tvm_sparse_ffn.default: _t_tvm_sparse_ffn,
            ops.merge.default: _t_merge, ops.linear.default: _t_linear, ops.tvm_linear.default: _t_tvm_linear,
            ops.tvm_predict.default: _t_tvm_predict}


def require_onnxscript() -> None:
    try:
        import onnxscript  # noqa: F401
    except ImportError:
        raise PicompileError("ONNX export needs onnxscript: pip install onnxscript") from None


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """Silence torch.onnx's progress lines and warnings (it logs and warns a lot at INFO/WARNING)."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def step_inputs(manifest: Any, seq: int = SEQ, past: int = PAST) -> tuple[torch.Tensor, ...]:
    """Example inputs of one decoder step: input_ids [1, seq], past_i [1, kv_heads, past, head_dim]."""
    model = manifest.model
    ids = torch.zeros(1, seq, dtype=torch.long)
    kv = [torch.zeros(1, int(model["n_kv_heads"]), past, int(model["head_dim"])) for _ in range(int(manifest.graph["n_past"]))]
    return (ids, *kv)


def io_names(n_past: int) -> tuple[list[str], list[str]]:
    return (["input_ids", *[f"past_{i}" for i in range(n_past)]],
            ["logits", *[f"present_{i}" for i in range(n_past)]])


def save_onnx_program(program: Any, out: Path, external_data: Optional[bool] = None) -> None:
    """Save a torch.onnx ONNXProgram; weights go to ``OUT.data`` beside it when over 2 GB (or when asked)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(out), external_data=external_data)


def name_weights(model: Any, keys: list[str]) -> None:
    """Name the initializers after the artifact's weight keys (the loader binds key i as buffer ``w{i}``)."""
    for name, value in list(model.graph.initializers.items()):
        match = re.fullmatch(r"(?:b_)?w(\d+)", name)
        if match and int(match.group(1)) < len(keys):
            value.name = keys[int(match.group(1))]


def tidy(model: Any) -> None:
    """torch.onnx's optimizer without what hides which layer reads which weight: it would fold weights
    into new constants (e.g. transposed) and merge equal ones (every zero bias into one). Here nodes
    that read a weight are never folded and initializers are never deduplicated; the rest (shape
    arithmetic, reshapes, dead nodes, repeated subexpressions) is cleaned up the same way."""
    import onnx_ir as ir
    from onnx_ir.passes import common

    weights = {id(v) for v in model.graph.initializers.values()}
    try:
        from onnxscript import optimizer, rewriter

        optimizer.fold_constants(model, should_fold=lambda node: False if any(
            v is not None and id(v) in weights for v in node.inputs) else None)
        rewriter.rewrite(model)
    except Exception:  # an onnxscript without these: the common passes below still apply
        pass
    try:
        ir.passes.Sequential(
            common.RemoveUnusedNodesPass(),
            common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            common.CommonSubexpressionEliminationPass(),
            common.IdentityEliminationPass(),
            common.RemoveUnusedNodesPass(),
            common.RemoveUnusedOpsetsPass(),
            common.NameFixPass(),
        )(model)
    except Exception:  # an onnx_ir without one of these passes: the untidied model is still valid
        pass


def graph_to_onnx(gm: fx.GraphModule, manifest: Any, out: Path, *, artifact: Path,
                  external_data: Optional[bool] = None) -> None:
    """Write ``gm``, the transformed decoder-step graph of the artifact at ``artifact`` (its ``manifest``), to
    ``out`` as ONNX (see the module doc). ``external_data``: weights in ``OUT.data`` beside the model (None:
    only when over 2 GB)."""
    require_onnxscript()
    program, shapes = _export_step(gm, manifest, artifact)
    model = program.model  # onnx_ir Model
    name_weights(model, list(manifest.graph["weights"]))
    tidy(model)
    _describe(model, manifest, Path(artifact), shapes)
    save_onnx_program(program, Path(out), external_data)


def _export_step(gm: fx.GraphModule, manifest: Any, artifact: Path) -> tuple[Any, str]:
    """torch.onnx's program of one decoder step, with symbolic (seq, past) where it exports, else fixed;
    and which shapes it has."""
    n_past = int(manifest.graph["n_past"])
    inputs, outputs = io_names(n_past)
    table = translation_table()
    seq = torch.export.Dim("seq", min=1, max=int(manifest.build.get("max_seq_len") or 4096))
    past = torch.export.Dim("past", min=0, max=int(manifest.build.get("max_seq_len") or 4096))
    dynamic = ({1: seq}, *({2: past} for _ in range(n_past)))
    shapes = "dynamic (seq, past)"
    try:
        with torch.no_grad(), quiet_exporter():
            try:  # symbolic seq / past; the example needs seq > 1 so that it is not specialised to 1
                program = torch.onnx.export(gm, step_inputs(manifest, 2, PAST), dynamo=True, input_names=inputs,
                                            output_names=outputs, custom_translation_table=table,
                                            dynamic_shapes=dynamic, optimize=False, verbose=False)
            except Exception:
                shapes = f"fixed (seq {SEQ}, past {PAST})"
                program = torch.onnx.export(gm, step_inputs(manifest), dynamo=True, input_names=inputs,
                                            output_names=outputs, custom_translation_table=table, optimize=False,
                                            verbose=False)
    except Exception as e:
        raise PicompileError(f"ONNX export of {artifact} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return program, shapes


def _describe(model: Any, manifest: Any, root: Path, shapes: str) -> None:
    """The model's producer, doc string and ``picompile.*`` metadata."""
    from picompile import __version__

    model.producer_name = "picompile"
    model.producer_version = __version__
    model.doc_string = (f"picompile artifact {root.name}: {manifest.model['architecture']}, target "
                        f"{manifest.target['name']}, pipeline {' -> '.join(manifest.pipeline)}. One decoder step, shapes "
                        f"{shapes}; picompile-domain nodes are for inspection only (no kernels).")
    model.metadata_props.update({
        "picompile.artifact": str(root), "picompile.source": str(manifest.model.get("source", "")),
        "picompile.target": str(manifest.target["name"]), "picompile.pipeline": ",".join(manifest.pipeline),
        "picompile.shapes": shapes,
    })


# -- Graphviz -------------------------------------------------------------------------------------

_COLOURS: dict[str, str] = {
    "predict": "#ffd966", "oracle_mask": "#ffd966", "merge": "#b4a7d6", "ffn": "#cfe2f3",
    "gpu": "#93c47d", "cpu": "#6fa8dc",
}


def _shape(node: Any) -> Optional[tuple[int, ...]]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    try:
        return tuple(int(s) for s in val.shape)
    except Exception:
        return None


def _rows_of(gm: fx.GraphModule, node: Any) -> Optional[int]:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        from picompile.ir.graph import get_tensor

        return int(get_tensor(gm, node).shape[0])
    shape = _shape(node)
    return shape[0] if shape else None


def _picompile_label(gm: fx.GraphModule, node: fx.Node, name: str) -> tuple[str, str]:
    """(label, fill colour) of a picompile node."""
    args = schema.args_of(node)
    layer = args.get("layer")  # None for the ops without one (linear)
    lines = [f"{_op_type(name)}  {node.name}", f"layer {layer}"]
    colour = _COLOURS.get(name, "#e6b8af")
    if name in ("sparse_ffn", "tvm_sparse_ffn"):
        part, device = args["part"], args["device"]
        lines[1] += f"  {part} on {device}"
        rows = _rows_of(gm, args["w_up"])
        lines.append(f"{rows} neurons, act {args['act']}" + ("" if args["mask"] is not None else ", dense"))
        if name == "tvm_sparse_ffn":
            lines.append(f"kernel {args['kernel'] or '-'}")
            if args["gpu_kernel"]:
                lines.append(f"gpu kernel {args['gpu_kernel']}")
        colour = _COLOURS.get(device, colour)
    elif name == "predict":
        lines.append(f"rank {_rows_of(gm, args['fc1'])} → {_rows_of(gm, args['fc2'])} neurons, "
                     f"threshold {float(args['threshold']):.3g}")
    elif name == "oracle_mask":
        lines.append(f"{_rows_of(gm, args['w'])} neurons, |{args['act']}| > {float(args['threshold']):.3g}")
    elif name == "ffn":
        lines.append(f"{_rows_of(gm, args['w_up'])} neurons, act {args['act']}")
    return "\\n".join(lines), colour


def _q(s: str) -> str:
    """A DOT string literal; ``\\n`` in ``s`` stays DOT's line break."""
    return '"' + s.replace('"', '\\"') + '"'


def _op_label(node: fx.Node) -> str:
    t = node.target
    name = t.name() if hasattr(t, "name") else getattr(t, "__name__", str(t))  # type: ignore[union-attr]
    return re.sub(r"\.[A-Za-z_]+$", "", re.sub(r"^aten::", "", str(name)))  # aten::mul.Tensor -> mul


def graph_dot(gm: fx.GraphModule, title: str = "picompile", collapse: bool = True) -> str:
    """DOT text of a graph; picompile nodes are coloured (hot/GPU green, cold/CPU blue, predictors
    yellow, merges purple) and labelled with layer, part, device and neuron counts.

    ``collapse``: each run of other nodes between two picompile nodes (in graph order) becomes one
    box that counts its ops; weights (get_attr) are left out. Otherwise every node is drawn.
    """
    lines = [f"digraph {_q(title)} {{", "  rankdir=TB;", f"  label={_q(title)}; labelloc=t;",
             '  node [shape=box, style="rounded,filled", fillcolor="#f3f3f3", fontname="Helvetica", fontsize=10];',
             '  edge [color="#666666"];']
    group, members = _dot_nodes(gm, collapse, lines)
    lines += _dot_segments(members)
    lines += _dot_edges(gm, group)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_nodes(gm: fx.GraphModule, collapse: bool, lines: list[str]) -> tuple[dict[fx.Node, str], dict[str, list[fx.Node]]]:
    """Append the drawn nodes to ``lines``; return (fx node -> the DOT id it is drawn as, segment id -> its nodes)."""
    group: dict[fx.Node, str] = {}
    members: dict[str, list[fx.Node]] = {}
    seg = 0
    prev_was_pi = True
    for node in gm.graph.nodes:
        name = schema.node_op(node)
        if name is not None:
            label, colour = _picompile_label(gm, node, name)
            lines.append(f"  {_q(node.name)} [label={_q(label)}, fillcolor={_q(colour)}, penwidth=2];")
            group[node] = node.name
            prev_was_pi = True
        elif node.op == "get_attr":
            if not collapse:
                lines.append(f"  {_q(node.name)} [label={_q(node.name)}, shape=note, fillcolor=white, fontsize=8];")
                group[node] = node.name
        elif node.op in ("placeholder", "output"):
            label = "output" if node.op == "output" else node.name
            lines.append(f"  {_q(node.name)} [label={_q(label)}, shape=ellipse, fillcolor=white];")
            group[node] = node.name
        elif not collapse:
            label = node.name + "\\n" + _op_label(node)
            lines.append(f"  {_q(node.name)} [label={_q(label)}];")
            group[node] = node.name
        else:
            if prev_was_pi:
                seg += 1
                prev_was_pi = False
            gid = f"seg{seg}"
            group[node] = gid
            members.setdefault(gid, []).append(node)
    return group, members


def _dot_segments(members: dict[str, list[fx.Node]]) -> list[str]:
    """One box per collapsed run of nodes, counting its most frequent ops."""
    lines = []
    for gid, nodes in members.items():
        counts = Counter(_op_label(n) for n in nodes if n.op == "call_function")
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(4))
        if len(nodes) == 1:
            label = _op_label(nodes[0])
        else:
            label = f"{len(nodes)} ops\\n{top}" if top else f"{len(nodes)} nodes"
        lines.append(f"  {_q(gid)} [label={_q(label)}, shape=box, style=filled, fillcolor=\"#eeeeee\", fontsize=8];")
    return lines


def _dot_edges(gm: fx.GraphModule, group: dict[fx.Node, str]) -> list[str]:
    """Each edge between two drawn boxes, once."""
    lines = []
    edges: set[tuple[str, str]] = set()
    for node in gm.graph.nodes:
        dst = group.get(node)
        if dst is None:
            continue
        for src_node in node.all_input_nodes:
            src = group.get(src_node)
            if src is not None and src != dst and (src, dst) not in edges:
                edges.add((src, dst))
                lines.append(f"  {_q(src)} -> {_q(dst)};")
    return lines

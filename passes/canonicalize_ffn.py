"""canonicalize-ffn: linear → act → linear  |  act(linear_g(x)) * linear_u(x) → linear
                  |  relu(linear_g(x)) * relu(linear_u(x)) → linear (dReLU)
→ one ``picompile.ffn(x, w_up, b_up, w_gate, w_down, b_down, act, layer, b_gate=…)`` node per decoder layer.

Every linear may carry a bias (Llama ``mlp_bias``: gate, up and down); dReLU (TurboSparse's FFN, ReLU on both
branches) becomes act ``drelu``.

"linear" is any linear-like form a frontend leaves in the graph (:func:`match_linear`):
``aten.linear(x, W, b)``; ``x @ Wᵀ`` written ``aten.matmul`` / ``aten.mm`` of ``aten.t`` /
``aten.numpy_T`` / ``aten.permute(W, [1, 0])`` / ``aten.transpose(W, 0, 1)`` of a weight
(Falcon's ``FalconLinear``, the ONNX importer's MatMul); ``x @ W`` of a weight stored ``[d_in, d_out]``
(an ONNX MatMul initializer: a transposed copy is registered as a new buffer); ``aten.addmm``; and
any of those followed by ``aten.add`` of a 1-D bias. "act" is relu, silu, gelu (exact or tanh)
as one op, or decomposed: SiLU as ``x * sigmoid(x)``, GELU as ``0.5 · x · (1 + erf(x / √2))``
(:func:`match_activation`). The decoder layer of an FFN is read from the module path of its
nodes (``layers.N`` / ``h.N``), else from its weights' names, else — when no FFN has either —
from the order the FFNs appear in the graph.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from picompile.context import BuildContext, FFNLayer
from picompile.errors import PatternError
from picompile.ir.graph import get_tensor
from picompile.ir.schema import call_args
from picompile.passes.registry import register_pass

aten = torch.ops.aten
ACT_TARGETS: dict[object, str] = {aten.relu.default: "relu", aten.silu.default: "silu", aten.gelu.default: "gelu"}
# ops where a decomposed activation starts: sigmoid (SiLU = x * sigmoid(x)), erf (GELU, erf form)
DECOMPOSED_ANCHORS: tuple[object, ...] = (aten.sigmoid.default, aten.erf.default)
_LAYER_RE = re.compile(r"\blayers\.(\d+)\b|\bh\.(\d+)\b")
_MATMULS = (aten.matmul.default, aten.mm.default)
_ADDS = (aten.add.Tensor,)
_MULS = (aten.mul.Tensor,)


@dataclass
class LinearMatch:
    """A linear-like subgraph ``out = x @ Wᵀ + b`` with W in nn.Linear layout [d_out, d_in]."""

    x: fx.Node  # input [..., d_in]
    w: fx.Node  # get_attr node of W [d_out, d_in] (or of W [d_in, d_out] when transpose_w)
    b: Optional[fx.Node]  # get_attr node of the bias [d_out], or None
    out: fx.Node  # the node whose value is the linear's result
    nodes: list[fx.Node] = field(default_factory=list)  # its nodes, output first (erased after the rewrite)
    transpose_w: bool = False  # w is stored [d_in, d_out]: canonicalize-ffn registers a transposed copy


@dataclass
class ActMatch:
    act: str  # "relu" | "silu" | "gelu" | "gelu_tanh"
    inp: fx.Node  # pre-activation
    out: fx.Node  # activation output
    nodes: list[fx.Node]  # its nodes, output first


@dataclass
class FFNMatch:
    layer: int
    module: str
    act: str
    x: fx.Node  # FFN input [..., d_model]
    up: LinearMatch
    gate: Optional[LinearMatch]  # gated FFN only
    mul: Optional[fx.Node]
    act_match: ActMatch
    down: LinearMatch
    up_act: Optional[fx.Node] = None  # dReLU: the relu on the up branch

    @property
    def act_node(self) -> fx.Node:
        return self.act_match.out


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _layer_of(node: fx.Node) -> int | None:
    m = _LAYER_RE.search(_module_path(node))
    return None if m is None else int(m.group(1) or m.group(2))


def _call(node: object, targets: tuple[object, ...]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _is_attr(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def _attr_rank(gm: fx.GraphModule | None, node: fx.Node) -> int | None:
    """Rank of the tensor a get_attr node reads (from its meta, else from the module)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim()
    if gm is not None:
        try:
            return get_tensor(gm, node).dim()
        except AttributeError:
            return None
    return None


def _transposed_2d(node: object) -> Optional[fx.Node]:
    """W when ``node`` is Wᵀ of a 2-D tensor: aten.t / numpy_T / permute(W, [1, 0]) / transpose(W, 0, 1)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target in (aten.t.default, aten.numpy_T.default):
        return node.args[0]  # type: ignore[return-value]
    if node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        return node.args[0]  # type: ignore[return-value]
    if node.target == aten.transpose.int:
        dims = {int(node.args[1]), int(node.args[2])}
        if dims in ({0, 1}, {-1, -2}, {0, -1}, {1, -2}):
            return node.args[0]  # type: ignore[return-value]
    return None


def match_linear(node: object, gm: fx.GraphModule | None = None) -> LinearMatch | None:
    """The linear-like subgraph whose output is ``node`` (see the module doc), or None.

    The weight (and bias) returned may be any node; callers check that they are parameters.
    """
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target == aten.linear.default:
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return LinearMatch(node.args[0], node.args[1], b, node, [node])  # type: ignore[arg-type]
    if node.target in _ADDS and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
        for mm, b in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if not (_is_attr(b) and _attr_rank(gm, b) == 1 and isinstance(mm, fx.Node) and len(mm.users) == 1):
                continue
            inner = match_linear(mm, gm)
            if inner is not None and inner.b is None:
                inner.b, inner.out, inner.nodes = b, node, [node, *inner.nodes]
                return inner
        return None
    if node.target == aten.addmm.default and not node.kwargs:
        b, x, wt = node.args[:3]
        inner = _matmul_weight(wt, gm)
        if inner is None:
            return None
        w, transpose_w, extra = inner
        return LinearMatch(x, w, b, node, [node, *extra], transpose_w)  # type: ignore[arg-type]
    if node.target in _MATMULS:
        x, wt = node.args[:2]
        inner = _matmul_weight(wt, gm)
        if inner is None:
            return None
        w, transpose_w, extra = inner
        return LinearMatch(x, w, None, node, [node, *extra], transpose_w)  # type: ignore[arg-type]
    return None


def _matmul_weight(wt: object, gm: fx.GraphModule | None) -> tuple[fx.Node, bool, list[fx.Node]] | None:
    """(W, stored transposed?, nodes) for the right operand of ``x @ wt`` when it is a 2-D weight."""
    w = _transposed_2d(wt)
    if w is not None and isinstance(wt, fx.Node):
        if not _is_attr(w) or _attr_rank(gm, w) != 2:
            return None
        return w, False, ([wt] if len(wt.users) == 1 else [])
    if _is_attr(wt) and _attr_rank(gm, wt) == 2:  # type: ignore[arg-type]
        return wt, True, []  # type: ignore[return-value]
    return None


def _const(x: object, value: float, rel: float = 1e-5) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isclose(float(x), value, rel_tol=rel)


def _other(node: fx.Node, one: object) -> object:
    return node.args[1] if node.args[0] is one else node.args[0]


def _sole_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def match_activation(node: fx.Node) -> ActMatch | str | None:
    """The activation computed at ``node`` (a one-op activation, sigmoid or erf), a reason it is one
    picompile.ffn cannot compute, or None when ``node`` does not start an activation."""
    if node.op != "call_function":
        return None
    if node.target in ACT_TARGETS:
        act = ACT_TARGETS[node.target]
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if act == "gelu" and approx != "none":
            if approx != "tanh":
                return f"{node.name} is gelu(approximate={approx!r}), which picompile.ffn does not implement"
            act = "gelu_tanh"
        return ActMatch(act, node.args[0], node, [node])  # type: ignore[arg-type]
    if node.target == aten.sigmoid.default:  # SiLU: a * sigmoid(a)
        a, mul = node.args[0], _sole_user(node)
        if _call(mul, _MULS) and _other(mul, node) is a:  # type: ignore[arg-type]
            return ActMatch("silu", a, mul, [mul, node])  # type: ignore[arg-type]
        return None
    if node.target == aten.erf.default:  # GELU: 0.5 * a * (1 + erf(a / sqrt(2))), factors in any order
        scaled = node.args[0]
        if _call(scaled, (aten.div.Tensor,)) and _const(scaled.args[1], math.sqrt(2.0)):  # type: ignore[union-attr]
            a = scaled.args[0]  # type: ignore[union-attr]
        elif _call(scaled, _MULS) and (_const(scaled.args[1], math.sqrt(0.5)) or _const(scaled.args[0], math.sqrt(0.5))):  # type: ignore[union-attr]
            a = scaled.args[0] if _const(scaled.args[1], math.sqrt(0.5)) else scaled.args[1]  # type: ignore[union-attr]
        else:
            return None
        plus = _sole_user(node)
        if not (_call(plus, _ADDS) and _const(_other(plus, node), 1.0) and not plus.kwargs):  # type: ignore[arg-type]
            return None
        nodes = [plus, node] + ([scaled] if len(scaled.users) == 1 else [])  # type: ignore[union-attr]
        need, cur = ["a", "half"], plus
        for _ in range(2):
            mul = _sole_user(cur)  # type: ignore[arg-type]
            if not _call(mul, _MULS):
                return None
            other = _other(mul, cur)  # type: ignore[arg-type]
            if other is a and "a" in need:
                need.remove("a")
            elif _const(other, 0.5) and "half" in need:
                need.remove("half")
            elif (_call(other, _MULS) and need == ["a", "half"] and len(other.users) == 1  # type: ignore[union-attr]
                  and a in other.args and _const(_other(other, a), 0.5)):  # type: ignore[union-attr, arg-type]
                need = []
                nodes.append(other)  # type: ignore[arg-type]
            else:
                return None
            nodes.insert(0, mul)  # type: ignore[arg-type]
            cur = mul
            if not need:
                return ActMatch("gelu", a, cur, nodes)  # type: ignore[arg-type]
        return None
    return None


def _desc(node: object) -> object:
    return getattr(node, "target", node)


def _weights_are_attrs(*linears: LinearMatch) -> bool:
    return all(_is_attr(n) for lin in linears for n in (lin.w, lin.b) if n is not None)


def _layer_from_weights(*linears: Optional[LinearMatch]) -> int | None:
    for lin in linears:
        if lin is not None and _is_attr(lin.w):
            m = _LAYER_RE.search(str(lin.w.target))
            if m is not None:
                return int(m.group(1) or m.group(2))
    return None


def match_ffn(act_node: fx.Node, gm: fx.GraphModule | None = None) -> FFNMatch | str | None:
    """Match the FFN around one activation; a string says why it does not match, None: no activation here."""
    am = match_activation(act_node)
    if am is None or isinstance(am, str):
        return am
    act, out = am.act, am.out
    first = match_linear(am.inp, gm)
    if first is None:
        return f"the input of {out.name} ({act}) is {_desc(am.inp)}, not a linear"
    users = list(out.users)
    if len(users) != 1:
        return f"{out.name} ({act}) has {len(users)} users, expected 1"
    user = users[0]
    x = first.x
    gate: Optional[LinearMatch] = None
    mul: Optional[fx.Node] = None
    up: LinearMatch = first
    up_relu: Optional[fx.Node] = None
    if _call(user, _MULS):
        other = _other(user, out)
        other_lin = match_linear(other, gm)
        if other_lin is None and act == "relu" and _call(other, (aten.relu.default,)) and len(other.users) == 1:  # type: ignore[union-attr]
            if user.args[0] is not out:
                return None  # the up branch's relu of a dReLU FFN: matched from its gate's relu (args[0])
            other_lin = match_linear(other.args[0], gm)  # type: ignore[union-attr]
            if other_lin is not None:
                up_relu, act = other, "drelu"  # type: ignore[assignment]
        if other_lin is None:
            return f"{user.name} multiplies {out.name} by {_desc(other)}, not a linear (gated FFN expected)"
        if other_lin.x is not x:
            return f"gate {first.out.name} and up {other_lin.out.name} read different inputs ({x} vs {other_lin.x})"
        gate, up, mul = first, other_lin, user
        if len(mul.users) != 1:
            return f"{mul.name} has {len(mul.users)} users, expected 1"
        user = next(iter(mul.users))
    down = _down_of(user, mul or out, gm)
    if down is None:
        return f"{out.name} ({act}) feeds {user.target}, expected the down projection (a linear)"
    linears = [lin for lin in (up, gate, down) if lin is not None]
    if not _weights_are_attrs(*linears):
        return f"the FFN weights around {out.name} are not module parameters"
    layer = _layer_of(out)
    if layer is None:
        layer = _layer_of(down.out)
    if layer is None:
        layer = _layer_from_weights(down, up, gate)
    if layer is None:
        layer = -1  # decided by graph order in canonicalize_ffn, or reported there
    module = _module_path(down.out).rsplit(".", 1)[0]
    if not module and _is_attr(down.w):
        module = str(down.w.target).rsplit(".", 2)[0]
    return FFNMatch(layer, module, act, x, up, gate, mul, am, down, up_relu)


def _down_of(user: fx.Node, inp: fx.Node, gm: fx.GraphModule | None) -> Optional[LinearMatch]:
    """The down projection reading ``inp`` at ``user``, including a bias add after it."""
    lin = match_linear(user, gm)
    if lin is None or lin.x is not inp:
        return None
    bias_add = _sole_user(user)
    if lin.b is None and bias_add is not None:
        wider = match_linear(bias_add, gm)
        if wider is not None and wider.b is not None and wider.x is inp:
            return wider
    return lin


def _weight_node(gm: fx.GraphModule, lin: LinearMatch, before: fx.Node) -> fx.Node:
    """get_attr node of the linear's weight in [d_out, d_in] layout (a transposed copy when stored [d_in, d_out])."""
    if not lin.transpose_w:
        return lin.w
    base = re.sub(r"\W", "_", str(lin.w.target)) + "_t"
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}{i}"
    gm.register_buffer(name, get_tensor(gm, lin.w).detach().t().contiguous())
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = getattr(gm, name)
    return node


def _check_bias(gm: fx.GraphModule, m: FFNMatch, role: str, lin: Optional[LinearMatch], b: Optional[fx.Node]) -> None:
    """A bias must be one float per output row of its linear (a [d_out] vector): else a one-line PatternError."""
    if lin is None or b is None:
        return
    w, bias = get_tensor(gm, lin.w), get_tensor(gm, b)
    rows = int(w.shape[1] if lin.transpose_w else w.shape[0])
    if tuple(bias.shape) != (rows,):
        raise PatternError(f"layer {m.layer}: the {role} projection's bias {b.target} has shape {tuple(bias.shape)}, "
                           f"expected ({rows},) (one per output row of its weight)")


def _rewrite(gm: fx.GraphModule, m: FFNMatch) -> dict[str, str]:
    """Replace the matched FFN with picompile.ffn; return {role: graph attribute} of its weights."""
    g = gm.graph
    anchor = m.down.out
    w_up = _weight_node(gm, m.up, anchor)
    w_gate = _weight_node(gm, m.gate, anchor) if m.gate is not None else None
    w_down = _weight_node(gm, m.down, anchor)
    b_up, b_down = m.up.b, m.down.b
    b_gate = m.gate.b if m.gate is not None else None
    for role, lin, b in (("up", m.up, b_up), ("gate", m.gate, b_gate), ("down", m.down, b_down)):
        _check_bias(gm, m, role, lin, b)
    with g.inserting_before(anchor):
        new = g.call_function(torch.ops.picompile.ffn.default, call_args("ffn", dict(
            x=m.x, w_up=w_up, b_up=b_up, w_gate=w_gate, w_down=w_down, b_down=b_down, act=m.act, layer=m.layer,
            b_gate=b_gate)))
    new.meta.update({k: v for k, v in anchor.meta.items() if k in ("val", "tensor_meta", "nn_module_stack", "stack_trace")})
    anchor.replace_all_uses_with(new)
    chain = [*m.down.nodes, *([m.mul] if m.mul is not None else []), *m.act_match.nodes,
             *([m.up_act] if m.up_act is not None else []),
             *(m.gate.nodes if m.gate is not None else []), *m.up.nodes]
    for n in chain:  # outputs before inputs, so each is unused by the time it is reached
        if not n.users and n.graph is g:
            g.erase_node(n)
    roles = {"up": w_up, "up_bias": b_up, "gate": w_gate, "gate_bias": b_gate, "down": w_down, "down_bias": b_down}
    return {role: str(n.target) for role, n in roles.items() if n is not None}


@register_pass("canonicalize-ffn")
def canonicalize_ffn(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    found: list[FFNMatch] = []
    reasons: dict[int | None, list[str]] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or (node.target not in ACT_TARGETS and node.target not in DECOMPOSED_ANCHORS):
            continue
        m = match_ffn(node, gm)
        if m is None:
            continue
        if isinstance(m, str):
            reasons.setdefault(_layer_of(node), []).append(m)
        else:
            found.append(m)
    n_layers = ctx.info.n_layers
    if found and all(m.layer < 0 for m in found):
        # no module path or weight name says which layer: the i-th FFN in the graph is layer i
        if len(found) == n_layers:
            for i, m in enumerate(found):
                m.layer = i
        else:
            reasons.setdefault(None, []).append(
                f"{len(found)} FFNs found but nothing in the graph names their layers, so they cannot be "
                f"assigned to the model's {n_layers} layers by order")
    matches: dict[int, FFNMatch] = {}
    for m in found:
        if m.layer < 0:
            reasons.setdefault(None, []).append(
                f"cannot tell the decoder layer of {m.act_node.name} from its module path "
                f"{_module_path(m.act_node)!r} or its weights' names")
        elif m.layer in matches:
            reasons.setdefault(m.layer, []).append(f"a second FFN in layer {m.layer} at {m.act_node.name}")
        else:
            matches[m.layer] = m
    missing = [i for i in range(n_layers) if i not in matches]
    if missing:
        lines = [f"layer {i}: " + ("; ".join(reasons.get(i, [])) or "no relu/silu/gelu activation found") for i in missing]
        lines += [f"(layer unknown): {r}" for r in reasons.get(None, [])]
        raise PatternError(f"no FFN pattern matched in {len(missing)} of {n_layers} layers:\n  " + "\n  ".join(lines))
    ctx.ffn_layers = []
    for i in sorted(matches):
        m = matches[i]
        weights = _rewrite(gm, m)
        w_up = _attr(gm, weights["up"])  # [n_neurons, d_model]
        ctx.ffn_layers.append(FFNLayer(
            index=i, kind="gated" if m.gate is not None else "mlp", act=m.act,
            d_model=int(w_up.shape[1]), n_neurons=int(w_up.shape[0]), module=m.module, weights=weights,
        ))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]

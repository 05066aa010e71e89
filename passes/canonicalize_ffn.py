"""canonicalize-ffn: linear → act → linear  |  act(linear_g(x)) * linear_u(x) → linear
→ one ``picompile.ffn(x, w_up, b_up, w_gate, w_down, b_down, act, layer)`` node per decoder layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from picompile.context import BuildContext, FFNLayer
import picompile.ops  # noqa: F401  (registers picompile::ffn)
from picompile.errors import PatternError
from picompile.graph import get_tensor
from picompile.passes.registry import register_pass

aten = torch.ops.aten
ACT_TARGETS: dict[object, str] = {aten.relu.default: "relu", aten.silu.default: "silu", aten.gelu.default: "gelu"}
_LAYER_RE = re.compile(r"\blayers\.(\d+)\b|\bh\.(\d+)\b")


@dataclass
class FFNMatch:
    layer: int
    module: str
    act: str
    x: fx.Node  # FFN input [..., d_model]
    up: fx.Node  # linear node
    gate: Optional[fx.Node]  # linear node (gated FFN only)
    mul: Optional[fx.Node]
    act_node: fx.Node
    down: fx.Node  # linear node


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _layer_of(node: fx.Node) -> int | None:
    m = _LAYER_RE.search(_module_path(node))
    return None if m is None else int(m.group(1) or m.group(2))


def _is_linear(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == aten.linear.default


def _weights_are_attrs(*nodes: fx.Node) -> bool:
    return all(isinstance(a, fx.Node) and a.op == "get_attr" for n in nodes for a in n.args[1:] if a is not None)


def match_ffn(act_node: fx.Node) -> FFNMatch | str:
    """Match the FFN around one activation node; a string says why it does not match."""
    act = ACT_TARGETS[act_node.target]
    approx = act_node.kwargs.get("approximate", "none")
    if act == "gelu" and approx != "none":
        if approx != "tanh":
            return f"{act_node.name} is gelu(approximate={approx!r}), which picompile.ffn does not implement"
        act = "gelu_tanh"
    first = act_node.args[0]
    if not _is_linear(first):
        return f"the input of {act_node.name} ({act}) is {getattr(first, 'target', first)}, not a linear"
    users = list(act_node.users)
    if len(users) != 1:
        return f"{act_node.name} ({act}) has {len(users)} users, expected 1"
    user = users[0]
    x = first.args[0]
    gate: Optional[fx.Node] = None
    mul: Optional[fx.Node] = None
    up: fx.Node = first
    if user.op == "call_function" and user.target == aten.mul.Tensor:
        other = user.args[1] if user.args[0] is act_node else user.args[0]
        if not _is_linear(other):
            return f"{user.name} multiplies {act_node.name} by {getattr(other, 'target', other)}, not a linear (gated FFN expected)"
        if other.args[0] is not x:
            return f"gate {first.name} and up {other.name} read different inputs ({x} vs {other.args[0]})"
        gate, up, mul = first, other, user
        if len(mul.users) != 1:
            return f"{mul.name} has {len(mul.users)} users, expected 1"
        user = next(iter(mul.users))
    if not _is_linear(user):
        return f"{act_node.name} ({act}) feeds {user.target}, expected the down projection (a linear)"
    nodes = [n for n in (up, gate, user) if n is not None]
    if not _weights_are_attrs(*nodes):
        return f"the FFN weights around {act_node.name} are not module parameters"
    if gate is not None and len(gate.args) > 2 and gate.args[2] is not None:
        return f"gate projection {gate.name} has a bias, which picompile.ffn does not take"
    layer = _layer_of(act_node)
    if layer is None:
        return f"cannot tell the decoder layer of {act_node.name} from its module path {_module_path(act_node)!r}"
    module = _module_path(user).rsplit(".", 1)[0]
    return FFNMatch(layer, module, act, x, up, gate, mul, act_node, user)


def _rewrite(gm: fx.GraphModule, m: FFNMatch) -> None:
    g = gm.graph

    def arg(n: Optional[fx.Node], i: int) -> Optional[fx.Node]:
        return None if n is None or len(n.args) <= i else n.args[i]

    with g.inserting_before(m.down):
        new = g.call_function(
            torch.ops.picompile.ffn.default,
            (m.x, arg(m.up, 1), arg(m.up, 2), arg(m.gate, 1), arg(m.down, 1), arg(m.down, 2), m.act, m.layer),
        )
    new.meta.update({k: v for k, v in m.down.meta.items() if k in ("val", "tensor_meta", "nn_module_stack", "stack_trace")})
    m.down.replace_all_uses_with(new)
    for n in (m.down, m.mul, m.act_node, m.gate, m.up):
        if n is not None and not n.users:
            g.erase_node(n)


@register_pass("canonicalize-ffn")
def canonicalize_ffn(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    matches: dict[int, FFNMatch] = {}
    reasons: dict[int | None, list[str]] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ACT_TARGETS:
            continue
        m = match_ffn(node)
        if isinstance(m, str):
            reasons.setdefault(_layer_of(node), []).append(m)
        elif m.layer in matches:
            reasons.setdefault(m.layer, []).append(f"a second FFN in layer {m.layer} at {node.name}")
        else:
            matches[m.layer] = m
    missing = [i for i in range(ctx.info.n_layers) if i not in matches]
    if missing:
        lines = [f"layer {i}: " + ("; ".join(reasons.get(i, [])) or "no relu/silu/gelu activation found") for i in missing]
        raise PatternError(f"no FFN pattern matched in {len(missing)} of {ctx.info.n_layers} layers:\n  " + "\n  ".join(lines))
    ctx.ffn_layers = []
    for i in sorted(matches):
        m = matches[i]
        w_up = get_tensor(gm, m.up.args[1])  # [n_neurons, d_model]
        roles = {"up": (m.up, 1), "up_bias": (m.up, 2), "gate": (m.gate, 1), "down": (m.down, 1), "down_bias": (m.down, 2)}
        weights = {role: str(n.args[pos].target) for role, (n, pos) in roles.items()
                   if n is not None and len(n.args) > pos and n.args[pos] is not None}
        ctx.ffn_layers.append(FFNLayer(
            index=i, kind="gated" if m.gate is not None else "mlp", act=m.act,
            d_model=int(w_up.shape[1]), n_neurons=int(w_up.shape[0]), module=m.module, weights=weights,
        ))
        _rewrite(gm, m)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm

"""sparsify-inputs: linear(x, W) of q/k/v and o (and, for SiLU/GELU FFNs, merge(sparse_ffn hot, cold) — gate/up
and down) → input_sparse_linear(x, Wᵀ, b, input_mask(x, threshold)): a per-tensor |x| threshold from calibration
quantiles; the skipped input channels skip their rows of the weight stored input-major (y = Σ_{i active} x_i Wᵀ[i]).
Thresholds are allocated against ``--act-sparsity`` (fraction of these projections' weight bytes skipped per token)
or ``--accuracy-budget`` (calibration perplexity), greedily by measured loss per byte (``sparsity.input_sparsity``).
After lower-tvm each input-sparse linear runs the TVM kernel of kind ``input_sparse`` for one token (it compacts the
mask and reads only the active rows, ``kernels/input_sparse.py``); one the allocation leaves at 0 % goes back to the
dense GEMV (tvm_linear). ``--input-criterion weighted`` scores channel i by |x_i|·‖W[:, i]‖₂ (WINA), stored as a
per-channel threshold vector t / ‖W[:, i]‖. The greedy's loss curves are cached per model, calibration and options.
"""
from __future__ import annotations

import math
import re
import shutil
from typing import Any, Callable

import torch
from torch import fx

from picompile.context import BuildContext
from picompile.errors import PassError
from picompile.ir.graph import drop_unused_weights, get_tensor
from picompile.ir.ops import is_picompile_op
from picompile.ir.patterns import add_buffer, linear_parts
from picompile.ir.schema import args_of, bind, call_args, node_op, set_args
from picompile.passes.registry import register_pass
from picompile.sparsity import input_sparsity as isp

aten = torch.ops.aten
_LAYER_RE = re.compile(r"\blayers\.(\d+)\b|\bh\.(\d+)\b")
_QKV = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "query", "key", "value")
_O = ("o_proj", "out_proj", "dense", "c_proj")
_ACTS: dict[str, tuple[Any, dict[str, Any]]] = {"silu": (aten.silu.default, {}), "gelu": (aten.gelu.default, {}),
                                                "gelu_tanh": (aten.gelu.default, {"approximate": "tanh"})}
KERNEL_DIR = "kernels"


def _module_paths(node: fx.Node) -> list[str]:
    out = []
    for n in (node, *node.users):
        stack = n.meta.get("nn_module_stack") or {}
        if stack:
            out.append(str(list(stack.values())[-1][0]))
    return out


def _attention_site(node: fx.Node) -> tuple[int, str] | None:
    """(layer, "qkv" | "o") of an attention projection (by its module path, or its slices' when fused)."""
    for path in _module_paths(node):
        m = _LAYER_RE.search(path)
        leaf = path.rsplit(".", 1)[-1]
        if m is None:
            continue
        layer = int(m.group(1) or m.group(2))
        if leaf in _QKV:
            return layer, "qkv"
        if leaf in _O and "att" in path:
            return layer, "o"
    return None


def _linear_xwb(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    if node_op(node) == "tvm_linear":
        a = args_of(node)
        return a["x"], a["w"], a["b"]
    return linear_parts(node)


class _Rewriter:
    """Puts input_mask + input_sparse_linear nodes in place (threshold 0 until allocated) and collects groups."""

    def __init__(self, gm: fx.GraphModule, weighted: bool = False) -> None:
        self.gm = gm
        self.weighted = weighted  # score channels by |x_i|·‖W[:, i]‖₂ (Group.scale) instead of |x_i|
        self.groups: list[isp.Group] = []
        self.masks: list[fx.Node] = []
        self.lowered = False  # the inputs were lowered (tvm_*): the input-sparse linears get kernels too

    def _masked(self, x: fx.Node, layer: int, group: str, before: fx.Node, w_t: torch.Tensor) -> fx.Node:
        """An input mask on ``x`` for the input-major weight ``w_t`` [d_in, d_out] (every projection reading x)."""
        with self.gm.graph.inserting_before(before):
            mask = self.gm.graph.call_function(torch.ops.picompile.input_mask.default,
                                               call_args("input_mask", dict(x=x, threshold=0.0, layer=layer, group=group)))
        scale = w_t.float().norm(dim=1) if self.weighted else None  # [d_in] the norm of each channel's weights
        self.groups.append(isp.Group(layer, group, int(w_t.shape[0]), w_t.numel() * w_t.element_size(), scale=scale))
        self.masks.append(mask)
        return mask

    def _isl(self, x: fx.Node, w_t: torch.Tensor, b: fx.Node | None, mask: fx.Node, before: fx.Node, name: str) -> fx.Node:
        w_node = add_buffer(self.gm, name, w_t, before)  # [d_in, d_out]
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.call_function(torch.ops.picompile.input_sparse_linear.default, call_args(
                "input_sparse_linear", dict(x=x, w_t=w_node, b=b, mask=mask)))

    def linear(self, node: fx.Node, layer: int, group: str) -> None:
        parts = _linear_xwb(node)
        assert parts is not None
        x, w, b = parts
        self.lowered |= node_op(node) == "tvm_linear"
        w_t = get_tensor(self.gm, w).t().contiguous()  # [d_in, d_out]
        mask = self._masked(x, layer, group, node, w_t)
        out = self._isl(x, w_t, b, mask, node, f"isp{layer}_{group}_w_t")
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        self.gm.graph.erase_node(node)

    def ffn(self, merge: fx.Node, layer: int) -> bool:
        """merge(hot, cold, b_down) of a SiLU/GELU FFN → gate/up and down input-sparse; False if not applicable."""
        m = args_of(merge)
        parts = [args_of(m["hot"]), args_of(m["cold"])]
        act = str(parts[0]["act"])
        if act not in _ACTS or any((p["b_up"] is not None and p["w_gate"] is not None) or p.get("b_gate") is not None
                                   for p in parts):  # gated FFNs with biases keep their neuron form
            return False
        self.lowered |= node_op(m["hot"]) == "tvm_sparse_ffn"
        t = lambda name: torch.cat([get_tensor(self.gm, p[name]) for p in parts])  # noqa: E731  [n, d] hot then cold
        gated = parts[0]["w_gate"] is not None
        w_in = torch.cat([t("w_gate"), t("w_up")]) if gated else t("w_up")  # [n_in_rows, d]
        b_in = None if gated or parts[0]["b_up"] is None else add_buffer(self.gm, f"isp{layer}_up_b", t("b_up"), merge)
        down_t = t("w_down_t")  # [n, d]
        n, x, g = int(down_t.shape[0]), parts[0]["x"], self.gm.graph
        w_in_t = w_in.t().contiguous()  # [d, n_in_rows]
        mask_in = self._masked(x, layer, "gate_up", merge, w_in_t)
        gu = self._isl(x, w_in_t, b_in, mask_in, merge, f"isp{layer}_gate_up_w_t")  # [..., n_in_rows]
        fn, kw = _ACTS[act]
        with g.inserting_before(merge):
            if gated:
                gate = g.call_function(aten.slice.Tensor, (gu, -1, 0, n))
                up = g.call_function(aten.slice.Tensor, (gu, -1, n, 2 * n))
                h = g.call_function(aten.mul.Tensor, (g.call_function(fn, (gate,), kw), up))  # [..., n]
            else:
                h = g.call_function(fn, (gu,), kw)
        mask_h = self._masked(h, layer, "down", merge, down_t)
        out = self._isl(h, down_t, m["bias"], mask_h, merge, f"isp{layer}_down_w_t")
        out.meta.update({k: v for k, v in merge.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
        merge.replace_all_uses_with(out)
        g.erase_node(merge)
        return True


class _Runner(fx.Interpreter):
    """Runs the rewritten graph with per-mask thresholds; can resume from any node (the dense prefix reused)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.order = list(gm.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.order)}
        last: dict[fx.Node, int] = {}
        for i, n in enumerate(self.order):
            for a in n.all_input_nodes:
                last[a] = i
        self.frees: list[list[fx.Node]] = [[] for _ in self.order]
        for a, i in last.items():
            self.frees[i].append(a)
        self.thresholds: dict[fx.Node, float] = {}
        self.record: Callable[[fx.Node, torch.Tensor], None] | None = None
        self._node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_picompile_op(target, "input_mask"):
            x = bind("input_mask", args, kwargs)["x"]
            if self.record is not None:
                self.record(self._node, x)  # type: ignore[arg-type]
            return x.abs() > self.thresholds.get(self._node, 0.0)  # type: ignore[arg-type]
        return super().call_function(target, args, kwargs)

    def steps(self, env: dict[fx.Node, Any], start: int, stop: int, inputs: tuple[Any, ...]) -> Any:
        """Run nodes [start, stop) into ``env`` (freeing values past their last use); the output if reached."""
        self.env, self.args_iter = env, iter(inputs)
        for i in range(start, stop):
            n = self.order[i]
            if n.op == "output":
                return self.run_node(n)
            env[n] = self.run_node(n)
            for a in self.frees[i]:
                env.pop(a, None)
        return None

    def logprobs(self, inputs: tuple[Any, ...], env: dict[fx.Node, Any] | None = None, start: int = 0) -> torch.Tensor:
        out = self.steps({} if env is None else dict(env), start, len(self.order), inputs)
        return torch.log_softmax(out[0][0].float(), dim=-1)  # [seq, vocab]


def _windows(ids: torch.Tensor, window: int) -> list[torch.Tensor]:
    return [ids[i: i + window] for i in range(0, ids.numel(), window) if ids[i: i + window].numel() > 1]


def _nll(lp: torch.Tensor, chunk: torch.Tensor) -> float:
    return -float(lp[:-1].gather(1, chunk[1:, None]).double().sum())


def _kl(dense: torch.Tensor, sparse: torch.Tensor) -> float:
    return float((dense.exp() * (dense - sparse)).sum())


class _Calibrator:
    def __init__(self, gm: fx.GraphModule, ctx: BuildContext, rw: _Rewriter) -> None:
        self.runner, self.ctx, self.rw = _Runner(gm), ctx, rw
        ids = ctx.calibration_ids
        if ids is None or ids.numel() < 32:
            raise PassError("sparsify-inputs needs profile-activations' calibration tokens (at least 32)")
        window = min(ctx.max_seq_len, 256)
        half = ids.numel() // 2
        self.stats = _windows(ids[:half], window)
        self.held = _windows(ids[half: half + ctx.config.input_loss_tokens], window)
        self.inputs = lambda c: (c.unsqueeze(0), *ctx.info.kv_tensors())  # noqa: E731
        with torch.no_grad():
            self.dense = [self.runner.logprobs(self.inputs(c)) for c in self.held]  # [seq, vocab] each
        self.tokens = sum(int(c.numel()) - 1 for c in self.held)
        self.dense_nll = sum(_nll(lp, c) for lp, c in zip(self.dense, self.held)) / self.tokens

    def collect(self) -> None:
        index = {m: g for m, g in zip(self.rw.masks, self.rw.groups)}
        gen = torch.Generator().manual_seed(self.ctx.config.seed)
        self.runner.record = lambda node, x: index[node].add(x, gen)
        with torch.no_grad():
            for c in self.stats:
                self.runner.logprobs(self.inputs(c))
        self.runner.record = None
        for g in self.rw.groups:
            g.finish()

    def errors(self) -> list[list[float]]:
        """Per group, the relative output error of its projections at each level (``Group.output_error``)."""
        gm = self.runner.module
        out = []
        for mask, group in zip(self.rw.masks, self.rw.groups):
            w_ts = [get_tensor(gm, args_of(u)["w_t"]) for u in mask.users if node_op(u) == "input_sparse_linear"]
            out.append(group.output_error(w_ts))
        return out

    def nll(self, sparsity: list[float]) -> float:
        """Mean held-out NLL (nats per token) with every group at its sparsity."""
        self.runner.thresholds = {m: g.cut(s) for m, g, s in zip(self.rw.masks, self.rw.groups, sparsity)}
        with torch.no_grad():
            total = sum(_nll(self.runner.logprobs(self.inputs(c)), c) for c in self.held)
        self.runner.thresholds = {}
        return total / self.tokens

    def curves(self, on_group: Callable[[], None]) -> list[list[float]]:
        """Per group, its loss curve over the levels: the mean KL from dense per held-out token with only that group
        sparsified, measured at ANCHOR (each group's forward resumed from the dense run at its mask), shaped by the
        group's output error at the other levels."""
        errors = self.errors()
        r = self.runner
        order = sorted(range(len(self.rw.masks)), key=lambda i: r.pos[self.rw.masks[i]])
        out: list[list[float]] = [[] for _ in self.rw.masks]
        cursors: list[tuple[dict[fx.Node, Any], int]] = [({}, 0) for _ in self.held]
        with torch.no_grad():
            for gi in order:
                mask, group = self.rw.masks[gi], self.rw.groups[gi]
                p = r.pos[mask]
                kl = 0.0
                for ci, chunk in enumerate(self.held):
                    env, at = cursors[ci]
                    r.thresholds = {}
                    r.steps(env, at, p, self.inputs(chunk))
                    cursors[ci] = (env, p)
                    r.thresholds = {mask: group.cut(isp.ANCHOR)}
                    kl += _kl(self.dense[ci], r.logprobs(self.inputs(chunk), env, p))
                out[gi] = isp.anchored(kl / self.tokens, errors[gi])
                r.thresholds = {}
                on_group()
        return out


def _allocate(cal: _Calibrator, ctx: BuildContext) -> tuple[isp.Allocation, dict[str, Any]]:
    cfg, groups = ctx.config, cal.rw.groups
    sizes = [g.bytes for g in groups]
    info: dict[str, Any] = {"method": cfg.input_allocation}
    budget = cfg.accuracy_budget
    if cfg.input_allocation == "uniform":
        path = [isp.uniform(len(groups), sizes, s) for s in [i / 20 for i in range(1, 19)]]
    else:
        key, names = _curves_key(ctx), [f"{g.layer}.{g.name}" for g in groups]
        curves = isp.cached_curves(cfg.calibration_cache, key, names)  # a build of this model and calibration before
        if curves is None:
            bar = iter(ctx.track(range(len(groups)), "measuring input-sparsity loss curves"))
            curves = cal.curves(lambda: next(bar, None))
            isp.store_curves(cfg.calibration_cache, key, names, curves)
        path = isp.greedy_path(curves, sizes)
        info["curves"] = {f"{g.layer}.{g.name}": [round(v, 6) for v in c] for g, c in zip(groups, curves)}
    if budget is None:
        alloc = isp.for_bytes(path, cfg.act_sparsity) if cfg.input_allocation == "greedy" else \
            isp.uniform(len(groups), sizes, cfg.act_sparsity)
        return alloc, info
    limit = cal.dense_nll + math.log1p(budget)
    found, evals = isp.within_budget(path, lambda a: cal.nll(a.sparsity) <= limit)
    info.update(budget_evaluations=evals, budget_nll_limit=limit)
    return (found or isp.uniform(len(groups), sizes, 0.0)), info


def _curves_key(ctx: BuildContext) -> str:
    """What the loss curves depend on: the model, the calibration ids, and the options shaping the graph and the
    measurement (a build at another --act-sparsity or --accuracy-budget reuses them)."""
    from picompile.sparsity.calibration import model_fingerprint

    cfg = ctx.config
    corpus = ctx.manifest_extra.get("profile", {}).get("corpus", {})
    return isp.curves_key(model_fingerprint(ctx.model, ctx.info.config), corpus.get("sha256"), corpus.get("n_tokens"),
                          cfg.input_sparsity, cfg.input_criterion, cfg.input_loss_tokens, ctx.max_seq_len,
                          cfg.weight_dtype, cfg.seed, "lower-tvm" in ctx.pipeline)


def _build_kernel(ctx: BuildContext, w: torch.Tensor, use: str, kind: str = "input_sparse") -> str:
    """Kind ``input_sparse`` over the input-major weight ``w`` [d_in, d_out], or kind ``up`` (the dense GEMV) over
    ``w`` [d_out, d_in] (compiled or reused; copied into the artifact)."""
    from picompile.kernels import KernelSpec, build_kernel

    spec = KernelSpec(kind=kind, act="none", d_model=int(w.shape[1]), n_rows=int(w.shape[0]),
                      weight_dtype=str(w.dtype).removeprefix("torch."), has_bias=False, target="llvm")
    key = spec.key()
    entries: list[dict[str, Any]] = ctx.manifest_extra.setdefault("kernels", [])
    entry = next((e for e in entries if e["key"] == key), None)
    if entry is None:
        path = build_kernel(spec, ctx.config.kernel_cache, ctx.config.cpu_mcpu)
        dest = ctx.staging_dir / KERNEL_DIR
        dest.mkdir(exist_ok=True)
        shutil.copyfile(path, dest / path.name)
        meta = path.with_suffix(".json")
        shutil.copyfile(meta, dest / meta.name)
        entry = {"key": key, "file": f"{KERNEL_DIR}/{path.name}", "meta": f"{KERNEL_DIR}/{meta.name}",
                 "spec": spec.to_json(), "uses": []}
        entries.append(entry)
    entry["uses"].append(use)
    return key


def _dense_gemv(gm: fx.GraphModule, ctx: BuildContext, node: fx.Node) -> None:
    """An input-sparse linear the allocation left dense (no mask) → tvm_linear over its weight back in nn.Linear's
    layout [d_out, d_in]: the dense GEMV kernel (kind ``up``), not the input-sparse kernel over every row (0.9×)."""
    from picompile.kernels import as_aligned

    a = args_of(node)
    w = as_aligned(get_tensor(gm, a["w_t"]).t().contiguous(), copy=True)  # [d_out, d_in]
    w_node = add_buffer(gm, f"{node.name}_w", w, node)
    key = _build_kernel(ctx, w, node.name, kind="up")
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.picompile.tvm_linear.default,
                                     call_args("tvm_linear", dict(x=a["x"], w=w_node, b=a["b"], kernel=key)))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _prune_kernels(gm: fx.GraphModule, ctx: BuildContext) -> None:
    """Kernel entries (and files) no node calls any more: the linears and FFN parts this pass replaced."""
    entries = ctx.manifest_extra.get("kernels")
    if not entries:
        return
    used = {v for n in gm.graph.nodes if node_op(n) is not None for v in args_of(n).values() if isinstance(v, str)}
    keep = [e for e in entries if e["key"] in used]
    files = {f for e in keep for f in (e["file"], e["meta"])}
    for e in entries:
        if e not in keep:
            for f in (e["file"], e["meta"]):
                if f not in files:
                    (ctx.staging_dir / f).unlink(missing_ok=True)
    ctx.manifest_extra["kernels"] = keep


def _rewrite(gm: fx.GraphModule, ctx: BuildContext) -> _Rewriter:
    rw = _Rewriter(gm, weighted=ctx.config.input_criterion == "weighted")
    sites = [(n, _attention_site(n)) for n in gm.graph.nodes if _linear_xwb(n) is not None]
    for node, site in sites:
        if site is not None:
            rw.linear(node, *site)
    if ctx.config.input_sparsity == "all":
        for node in [n for n in gm.graph.nodes if node_op(n) == "merge"]:
            hot = args_of(node)["hot"]
            if node_op(hot) in ("sparse_ffn", "tvm_sparse_ffn"):
                rw.ffn(node, int(args_of(node)["layer"]))
    return rw


@register_pass("sparsify-inputs")
def sparsify_inputs(gm: fx.GraphModule, ctx: BuildContext) -> fx.GraphModule:
    cfg = ctx.config
    if cfg.input_sparsity == "off" or (cfg.accuracy_budget is None and cfg.act_sparsity <= 0.0):
        return gm  # nothing skipped: the dense linears stay (exactly the dense model's logits)
    if cfg.weight_dtype not in ("float32", "float16"):
        raise PassError(f"sparsify-inputs: input-sparse kernels exist for float32 and float16 weights, not "
                        f"{cfg.weight_dtype} (build with --weight-dtype float16 or --input-sparsity off)")
    rw = _rewrite(gm, ctx)
    if not rw.groups:
        raise PassError("sparsify-inputs found no attention projection or SiLU/GELU FFN to sparsify")
    gm.graph.eliminate_dead_code()
    drop_unused_weights(gm)
    gm.recompile()
    cal = _Calibrator(gm, ctx, rw)
    cal.collect()
    alloc, info = _allocate(cal, ctx)
    sparse_nll = cal.nll(alloc.sparsity)
    per_group = []
    for mask, group, s in zip(rw.masks, rw.groups, alloc.sparsity):
        thr, cut = group.threshold(s), group.cut(s)
        per_group.append({"layer": group.layer, "group": group.name, "sparsity": round(s, 4), "threshold": thr,
                          "bytes": group.bytes})
        if s > 0.0:
            set_args(mask, threshold=thr)
            if isinstance(cut, torch.Tensor):  # weighted: |x_i| > t / ‖W[:, i]‖ per channel
                set_args(mask, thresholds=add_buffer(gm, f"isp_{mask.name}_thr", cut, mask))
        else:  # a dense input: no mask (every row read)
            for user in list(mask.users):
                set_args(user, mask=None)
    gm.graph.eliminate_dead_code()
    if rw.lowered:
        for node in [n for n in gm.graph.nodes if node_op(n) == "input_sparse_linear"]:
            if args_of(node)["mask"] is None:
                _dense_gemv(gm, ctx, node)
                continue
            w_t = get_tensor(gm, args_of(node)["w_t"])
            set_args(node, kernel=_build_kernel(ctx, w_t, node.name))
        drop_unused_weights(gm)
        _prune_kernels(gm, ctx)
    gm.recompile()
    ctx.manifest_extra["input_sparsity"] = {
        "mode": cfg.input_sparsity, "criterion": cfg.input_criterion, **{k: v for k, v in info.items() if k != "curves"},
        "target_bytes": None if cfg.accuracy_budget is not None else cfg.act_sparsity,
        "accuracy_budget": cfg.accuracy_budget, "bytes_saved_calibration": round(alloc.saved, 4),
        "calibration_nll": {"dense": cal.dense_nll, "sparse": sparse_nll, "tokens": cal.tokens},
        "groups": per_group,
    }
    return gm

"""``picompile eval``'s scoring: one session's graph run over the inputs, and its neuron masks counted.

- perplexity: a sliding window at the artifact's context length, stride half the context (HF's "perplexity of
  fixed-length models" recipe): each token is scored exactly once, with as much left context as the window allows;
  the first window scores all its tokens (but the very first, which nothing predicts).
- zero-shot tasks as lm-eval-harness scores them: the log-likelihood (sum of log-probs) of each choice's
  continuation tokens given the context, argmax = the answer (``acc``); ``acc_norm`` divides by the choice's byte
  length.
- the skipped-neuron fraction is *measured*: the graph's neuron masks (``picompile::predict`` /
  ``picompile::oracle_mask`` outputs) are counted over every token position the sparse run computes, per layer,
  then averaged over layers. The manifest's estimate (mean of 1 − predicted_active) is reported beside it.
"""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from picompile.errors import PicompileError
from picompile.tools.eval_inputs import Encoded, Inputs, Task, windows

if TYPE_CHECKING:  # torch is imported where it runs: the CLI imports this module for every command
    from torch import Tensor, fx

MASK_OPS: tuple[str, ...] = ("predict", "tvm_predict", "oracle_mask")  # the ops that make a neuron mask
INPUT_MASK_OPS: tuple[str, ...] = ("input_mask",)  # the ops that make an input-channel mask (input sparsity)
# bytes per weight element as stored (int8/int4: picompile.kernels.qformat blocks of 32 with a float16 scale)
ELEMENT_BYTES: dict[str, float] = {"float32": 4.0, "float16": 2.0, "int8": 34 / 32, "int4": 18 / 32}

Advance = Callable[[int], None]  # advance by n graph calls


def no_progress(n: int = 1) -> None:
    """An :data:`Advance` that shows nothing."""
    return None


# ----------------------------------------------------------------------------- running the graph


class Scorer:
    """Runs one session's graph from an empty cache and counts its neuron masks (when it has any).

    The graph is a copy of ``session.graph`` (sharing its weights) whose output also returns every mask node, so
    the mask counts are what the sparse run actually computed.
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        self.context: int = int(session.max_seq_len)
        self.vocab_size: int = int(session.vocab_size)
        self.n_outputs: int = 1 + int(session.n_past)
        self.graph, self.mask_layers, self.entry_bytes = _with_mask_outputs(session, self.n_outputs)
        self.active: dict[int, float] = {layer: 0.0 for layer in self.mask_layers}  # mask-true count per layer
        self.total: dict[int, float] = {layer: 0.0 for layer in self.mask_layers}  # mask entries per layer
        self.bytes_skipped = 0.0  # weight bytes not read, summed over every position computed
        self.positions = 0
        self.block_bytes = block_weight_bytes(session.manifest)

    def logprobs(self, ids: Sequence[int]) -> Tensor:
        """log-softmax [len(ids), vocab] (float32) of one prefill of ``ids`` from an empty cache."""
        import torch

        if not 0 < len(ids) <= self.context:
            raise PicompileError(f"internal: {len(ids)} tokens do not fit the context of {self.context}")
        past = self.session.empty_past()
        with torch.inference_mode():
            out = self.graph(torch.tensor([list(ids)], dtype=torch.long), *past)
        for layer, mask, per in zip(self.mask_layers, out[self.n_outputs:], self.entry_bytes):
            active = float(mask.sum())
            if per.neuron:
                self.active[layer] += active
                self.total[layer] += float(mask.numel())
            self.bytes_skipped += (float(mask.numel()) - active) * per.of(mask)
        self.positions += len(ids)
        return torch.log_softmax(out[0][0].float(), dim=-1)

    def skipped(self, n_layers: int) -> tuple[float | None, dict[int, float]]:
        """(mean over all FFN layers of the skipped fraction, per-layer fractions); None before any masked run.

        A layer without a mask computes every neuron (0 skipped)."""
        neuron = [layer for layer, per in zip(self.mask_layers, self.entry_bytes) if per.neuron]
        if not neuron or not any(self.total.values()):
            return (0.0 if not neuron else None), {}
        per = {layer: 1.0 - self.active[layer] / self.total[layer] for layer in neuron if self.total[layer]}
        return sum(per.values()) / max(n_layers, len(per)), per


    def bytes_fraction(self) -> float | None:
        """Measured fraction of the transformer blocks' projection weight bytes (q, k, v, o and the FFN's) not read
        per token, from the masks the run computed; None before any run or without the model's shapes."""
        if not self.positions or not self.block_bytes:
            return None
        return self.bytes_skipped / self.positions / self.block_bytes


def block_weight_bytes(manifest: Any) -> float:
    """Bytes of every transformer block's projections (q, k, v, o, FFN; not embeddings or lm_head) as stored."""
    model, cfg = manifest.model, manifest.model.get("config") or {}
    item = ELEMENT_BYTES.get(str(manifest.build.get("weight_dtype", "float32")), 4.0)
    d, hd, kv = int(model["d_model"]), int(model["head_dim"]), int(model["n_kv_heads"])
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or d // hd)
    attn = d * heads * hd * 2 + 2 * d * kv * hd
    ffn = sum((3 if layer.get("kind") == "gated" else 2) * int(layer["d_model"]) * int(layer["n_neurons"])
              for layer in manifest.layers)
    return float(attn * int(model["n_layers"]) + ffn) * item


class _EntryBytes:
    """Weight bytes one inactive entry of a mask skips: a neuron's rows, or an input channel's weight row."""

    def __init__(self, neuron: bool, fixed: float = 0.0, group_bytes: float = 0.0) -> None:
        self.neuron, self.fixed, self.group_bytes = neuron, fixed, group_bytes

    def of(self, mask: Tensor) -> float:
        return self.fixed if self.neuron else self.group_bytes / max(1, int(mask.shape[-1]))


def _entry_bytes(manifest: Any, node: fx.Node) -> _EntryBytes:
    """What an inactive entry of mask ``node`` saves: a neuron the predictor drops, all its rows; one the oracle
    drops, its up and down rows (its gate row was read to decide; product criterion: only its down row); an input
    channel below threshold, its row of every projection reading it (the manifest's ``input_sparsity`` groups)."""
    from picompile.ir import schema

    a = schema.args_of(node)
    item = ELEMENT_BYTES.get(str(manifest.build.get("weight_dtype", "float32")), 4.0)
    if schema.node_op(node) in INPUT_MASK_OPS:
        groups = {(int(g["layer"]), str(g["group"])): float(g["bytes"])
                  for g in (manifest.sections.get("input_sparsity") or {}).get("groups", [])}
        return _EntryBytes(False, group_bytes=groups.get((int(a["layer"]), str(a["group"])), 0.0))
    layer = next((l for l in manifest.layers if int(l.get("index", -1)) == int(a["layer"])), None)
    if layer is None:
        return _EntryBytes(True)
    gated = layer.get("kind") == "gated"
    if schema.node_op(node) == "oracle_mask":
        rows = 1 if a.get("w_mul") is not None or not gated else 2
    else:
        rows = 3 if gated else 2
    return _EntryBytes(True, fixed=rows * int(layer["d_model"]) * item)


def _with_mask_outputs(session: Any, n_outputs: int) -> tuple[fx.GraphModule, list[int], list[_EntryBytes]]:
    """``session.graph``, or a copy sharing its weights that also returns every mask node (neuron and input-channel
    masks); the masks' layers and what each of their inactive entries saves."""
    from torch import fx  # noqa: F811  (the module-level name exists only for type checking)

    from picompile.ir import schema

    gm: fx.GraphModule = session.graph
    graph = copy.deepcopy(gm.graph)
    masks = [node for node in graph.nodes if schema.node_op(node) in MASK_OPS + INPUT_MASK_OPS]
    if not masks:
        return gm, [], []
    out = next(n for n in graph.nodes if n.op == "output")
    results = out.args[0]
    if not isinstance(results, (tuple, list)) or len(results) != n_outputs:
        raise PicompileError(f"unexpected graph outputs in {session.root}: cannot add the neuron masks")
    out.args = ((*results, *masks),)
    return (fx.GraphModule(gm, graph), [int(schema.arg(node, "layer")) for node in masks],
            [_entry_bytes(session.manifest, node) for node in masks])


class OrtScorer:
    """Scores with the dense ONNX Runtime export of the artifact's source model (``--vs ort``)."""

    def __init__(self, ort: Any, context: int, vocab_size: int) -> None:
        self.ort, self.context, self.vocab_size = ort, context, vocab_size

    def logprobs(self, ids: Sequence[int]) -> Tensor:
        import torch

        return torch.log_softmax(torch.from_numpy(self.ort.logits(list(ids))).float(), dim=-1)

    def skipped(self, n_layers: int) -> tuple[float | None, dict[int, float]]:
        return 0.0, {}

    def bytes_fraction(self) -> float | None:
        return 0.0


def manifest_skipped(manifest: Any) -> float:
    """The build's estimate: mean over layers of 1 − predicted_active (trained predictors), the profiled
    inactive fraction (oracle), 0 for a dense graph."""
    predictor = manifest.build.get("predictor")
    if predictor == "none" or "insert-predictors" not in manifest.pipeline:
        return 0.0
    vals = []
    for layer in manifest.layers:
        if predictor == "trained" and layer.get("predicted_active") is not None:
            vals.append(1.0 - float(layer["predicted_active"]))
        elif layer.get("sparsity") is not None:
            vals.append(float(layer["sparsity"]))
        else:
            vals.append(0.0)
    return sum(vals) / len(vals) if vals else 0.0


# ----------------------------------------------------------------------------- scores


def sliding_nll(scorer: Scorer, ids: Sequence[int], stride: int | None = None,
                advance: Advance = no_progress) -> tuple[float, int]:
    """(sum of token NLLs in nats, number of tokens scored) over ``ids`` with sliding windows."""
    import torch

    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), scorer.context, stride):
        lp = scorer.logprobs(ids[begin:end])  # [end-begin, vocab]; row j predicts token begin+j+1
        targets = torch.tensor(ids[first:end], dtype=torch.long)
        rows = lp[first - begin - 1:end - begin - 1]
        total -= float(rows.gather(1, targets[:, None]).double().sum())
        count += end - first
        advance(1)
    return total, count


def continuation_loglik(scorer: Scorer, ctx: Sequence[int], cont: Sequence[int]) -> float:
    """Sum of log p(cont | ctx) from one prefill; the context is cut from the left to fit the window."""
    import torch

    seq = (list(ctx) + list(cont))[-(scorer.context + 1):]
    inp = seq[:-1]
    n = min(len(cont), len(inp))
    if n == 0:
        raise PicompileError("a task continuation encodes to no tokens")
    lp = scorer.logprobs(inp)[-n:]
    targets = torch.tensor(seq[-n:], dtype=torch.long)
    return float(lp.gather(1, targets[:, None]).double().sum())


def score_task(scorer: Scorer, task: Task, encoded: Encoded,
               advance: Advance = no_progress) -> dict[str, Any]:
    """{"acc", "acc_norm", "n", "choices": [picked index per example], "logliks": [[…]]}."""
    picks, picks_norm, logliks = [], [], []
    for ex, reqs in zip(task.examples, encoded):
        ll = []
        for ctx, cont in reqs:
            ll.append(continuation_loglik(scorer, ctx, cont))
            advance(1)
        norm = [v / max(1, n) for v, n in zip(ll, ex.norm_lengths)]
        picks.append(max(range(len(ll)), key=ll.__getitem__))
        picks_norm.append(max(range(len(norm)), key=norm.__getitem__))
        logliks.append(ll)
    n = len(task.examples)
    return {
        "n": n,
        "acc": sum(p == ex.gold for p, ex in zip(picks, task.examples)) / n,
        "acc_norm": sum(p == ex.gold for p, ex in zip(picks_norm, task.examples)) / n,
        "choices": picks,
        "logliks": logliks,
    }


def run_one(session: Any, inputs: Inputs, stride: int | None = None, advance: Advance = no_progress,
            scorer: Any | None = None) -> dict[str, Any]:
    """One session over the inputs: {"ppl", "nll", "tokens", "tasks": {name: score}, "skipped_fraction", …}."""
    scorer = scorer if scorer is not None else Scorer(session)
    out: dict[str, Any] = {}
    if inputs.ppl_ids is not None:
        total, count = sliding_nll(scorer, inputs.ppl_ids, stride, advance)
        out.update(nll=total / count, ppl=math.exp(total / count), tokens=count)
    out["tasks"] = {t.name: score_task(scorer, t, enc, advance) for t, enc in zip(inputs.tasks, inputs.encoded)}
    skipped, per_layer = scorer.skipped(len(session.manifest.layers))
    out["skipped_fraction"] = skipped
    out["skipped_per_layer"] = {str(k): v for k, v in sorted(per_layer.items())}
    out["bytes_skipped_fraction"] = scorer.bytes_fraction()
    return out

"""ONNX frontend: ``picompile build model.onnx`` — an ONNX decoder step brought into the same
``torch.export`` graph the passes work on.

What it takes
=============
An ONNX model of one decoder step, as ``torch.onnx.export`` writes it from a causal LM wrapped in
the flat KV-cache convention of :class:`picompile.frontend.decoder.FlatDecoder` (what
:mod:`picompile.tools.ort_reference` exports), or without a cache:

- inputs: token ids (int64/int32 ``[1, seq]``: the input named ``input_ids``, else the only integer
  input); optionally ``attention_mask`` ``[1, past + seq]`` (fed all ones) and ``position_ids``
  ``[1, seq]`` (fed ``past … past + seq - 1``); the KV cache: every rank-4 float input,
  ``[1, kv_heads, past, head_dim]`` with ``kv_heads`` and ``head_dim`` fixed, in layer order (key,
  value of layer 0, then layer 1, …; any names), ``past`` symbolic (0 at prefill);
- outputs: logits ``[1, seq, vocab]`` (the output named ``logits``, else the first) and one
  present ``[1, kv_heads, past + seq, head_dim]`` per past input, in the same order. Other outputs
  are ignored.

Without KV-cache inputs (a logits-only export) the artifact still decodes, by re-running the whole
sequence every step: the importer gives the model a *token-history cache* — each of the
``2 · n_layers`` cache tensors is ``[1, 1, past, 1]`` and holds the tokens seen so far (as float32,
exact below 2**24) — so the artifact keeps the one calling convention the runtime knows
(``forward(input_ids, past_0 …) -> (logits, present_0 …)``); a step costs a full forward over
``past + seq`` tokens (quadratic in the length; fine for checks, slow for long generations). The
manifest's ``kv_shape`` is then ``[1, 1, past, 1]`` and ``model.extra.onnx.kv_cache`` says
``"token-history"``.

Refused, each with a one-line :class:`~picompile.errors.UnsupportedArchitectureError` naming what
is wrong: no integer token-id input; batch fixed above 1; a fixed sequence or past length (exported
without dynamic axes); an input that is none of the above (e.g. ``inputs_embeds``, encoder states);
KV inputs with symbolic heads / head_dim, an odd number of them, or a different number of present
outputs; logits not ``[batch, seq, vocab]``; ops outside the
supported set (:data:`SUPPORTED_OPS`; e.g. ``If`` / ``Loop`` control flow, opset-23 ``Attention`` /
``RotaryEmbedding``, ``com.microsoft`` contrib ops) — all listed at once. FFNs that are not
linear → act → linear (or gated) fail later in canonicalize-ffn, which says why per layer.
A truncated or corrupt file, missing external data, or a graph reading undefined values is a
:class:`~picompile.errors.ModelLoadError`.

Model facts (:class:`~picompile.frontend.base.ModelInfo`)
=========================================================
Read from the graph: ``n_layers`` = past inputs / 2; ``n_kv_heads``, ``head_dim`` from the past
inputs' fixed dims; ``vocab`` from the logits' last dim (else the token embedding's rows);
``d_model`` from the token embedding (the ``Gather`` of a 2-D initializer by the token ids).
A ``config.json`` beside the ``.onnx`` (an HF config), when present, names the architecture and
gives ``max_position_embeddings``; its ``num_hidden_layers`` / ``hidden_size`` / ``vocab_size`` must
agree with the graph (else a clear error) and fill in what the graph does not say (``n_layers`` of
a logits-only export). ``max_seq_len`` comes from, in order: config.json, ONNX metadata
``max_position_embeddings`` / ``max_seq_len``, a learned position table (rows − 2, OPT's offset,
a safe bound for any learned table), else :data:`DEFAULT_MAX_SEQ_LEN`. A ``tokenizer.json`` beside
the file is the artifact's tokenizer.

Why a small interpreter (and not onnx2torch)
============================================
The graph becomes :class:`OnnxDecoder`, an ``nn.Module`` whose forward walks the ONNX nodes in
order and calls one torch function per node; ``capture`` wraps it in ``FlatDecoder`` (it answers
the HF calling convention FlatDecoder uses) and ``torch.export`` traces it like an HF model, so
every pass runs unchanged on the usual aten graph with weights as parameters. onnx2torch 1.5.15
was tried: it imports torchvision at import time (not a dependency here, and pinned to torch
builds), has no converter for opset-19+ ``Shape`` (torch.onnx writes opset 20), and turns shape
arithmetic into tensor ops, which torch.export cannot reshape by with symbolic ``seq`` / ``past``.
Here:

- Shape arithmetic (``Shape``, ``Gather`` / ``Slice`` / ``Concat`` / ``Squeeze`` / ``Unsqueeze``
  of shapes, arithmetic, comparisons, ``Where``, ``Cast`` on them, small integer constants) is
  evaluated in Python on ints and torch.export SymInts (:class:`Known`), so ``seq`` and ``past``
  stay symbolic.
- Each node runs inside a module named after its source module (torch.onnx's ``namespace``
  metadata, else the ``/a/b/Op`` node-name convention), so ``nn_module_stack`` reads e.g.
  ``…layers.3.mlp.up_proj`` as in a captured HF model and canonicalize-ffn finds the layer.
- Initializers become parameters under those module paths; anonymous ones (``val_12``) are named
  after the module that uses them (``…mlp.up_proj.weight``). A 2-D initializer used only as the
  right operand of ``MatMul`` (``x @ W``, ``W [d_in, d_out]``: how torch.onnx writes nn.Linear) is
  stored transposed, in nn.Linear layout, and read as ``W.t()``: canonicalize-ffn then uses the
  parameter itself (no copy) and placement's accounting sees the FFN weights by name.
- One-element constants in elementwise ops are Python numbers (``x * 0.5``, as torch writes it),
  which is what canonicalize-ffn's decomposed-GELU match expects.
- Floating-point tensors of any precision are imported as float32 (picompile's weight dtype).

Layout
======
- :mod:`.values` — :class:`Known`, the dtype tables, initializers / constants / shape-like operands;
- :mod:`.ops_math`, :mod:`.ops_shape`, :mod:`.ops_nn` — the op functions, by kind; :mod:`.ops` — the table
  (:data:`SUPPORTED_OPS`);
- :mod:`.proto` — nodes, scopes and value-info shapes read off the protobuf;
- :mod:`.signature` — which inputs / outputs are ids, mask, positions, KV cache, logits;
- :mod:`.interpreter` — :class:`~.interpreter.OnnxGraph`, the graph run node by node in its module hierarchy;
- :mod:`.decoder` — :class:`OnnxDecoder`, the graph behind the calling convention ``capture`` traces;
- :mod:`.facts` — ``n_layers`` / ``d_model`` / ``vocab`` / ``max_seq_len`` from the graph and config.json;
- :mod:`.importer` — :func:`load_onnx`, the entry point.
"""
from __future__ import annotations

from picompile.frontend.onnx.decoder import OnnxDecoder
from picompile.frontend.onnx.facts import DEFAULT_MAX_SEQ_LEN
from picompile.frontend.onnx.importer import load_onnx
from picompile.frontend.onnx.ops import SUPPORTED_OPS
from picompile.frontend.onnx.values import Known

__all__ = ["DEFAULT_MAX_SEQ_LEN", "Known", "OnnxDecoder", "SUPPORTED_OPS", "load_onnx"]

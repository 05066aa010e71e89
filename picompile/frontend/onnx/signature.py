"""The decoder-step signature of an ONNX graph: which input is the token ids, the attention mask, the
position ids and the KV cache, which output the logits and the presents; every other shape refused
with a one-line :class:`~picompile.errors.UnsupportedArchitectureError` (see the package doc)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from picompile.errors import UnsupportedArchitectureError
from picompile.frontend.onnx.proto import desc, dims_of
from picompile.frontend.onnx.values import FLOAT_TYPES, INT_TYPES, TORCH_DTYPES


@dataclass
class Signature:
    """Value names of the step's inputs / outputs, and the KV-cache tensors' fixed dims."""

    ids: str
    ids_dtype: torch.dtype
    attention_mask: Optional[str]
    position_ids: Optional[str]
    past: list[str]  # key, value of layer 0, then layer 1, …
    logits: str
    presents: list[str]  # one per past, same order
    kv_heads: int = 1
    head_dim: int = 1


@dataclass
class _Inputs:
    ids: Any  # the token-id value-info, or None
    attention_mask: Optional[str]
    position_ids: Optional[str]
    past: list[Any]


def _classify_inputs(inputs: list[Any], where: str) -> _Inputs:
    """Each graph input as token ids, attention mask, position ids or a KV-cache tensor (else refused)."""
    found = _Inputs(None, None, None, [])
    ints = [i for i in inputs if i.type.tensor_type.elem_type in INT_TYPES]
    for vi in inputs:
        t, dims = vi.type.tensor_type.elem_type, dims_of(vi)
        lname = vi.name.lower()
        if t in INT_TYPES and len(dims) == 2 and "attention_mask" in lname:
            found.attention_mask = vi.name
        elif t in INT_TYPES and len(dims) == 2 and "position" in lname:
            found.position_ids = vi.name
        elif t in INT_TYPES and len(dims) == 2 and (lname == "input_ids" or found.ids is None and
                                                     not any(i.name.lower() == "input_ids" for i in ints)):
            if found.ids is not None:
                raise UnsupportedArchitectureError(
                    f"{where}: two integer inputs ({found.ids.name}, {vi.name}) could be the token ids; "
                    f"name one input_ids")
            found.ids = vi
        elif t in FLOAT_TYPES and len(dims) == 4:
            found.past.append(vi)
        else:
            raise UnsupportedArchitectureError(
                f"{where}: input {vi.name!r} ({desc(vi)}) is not token ids [1, seq], attention_mask, position_ids "
                f"or a KV-cache tensor [1, kv_heads, past, head_dim]; picompile builds decoder-only causal LMs")
    return found


def _check_ids(ids: Any, inputs: list[Any], where: str) -> None:
    """Token ids exist, with batch 1 (or symbolic) and a symbolic sequence length."""
    if ids is None:
        raise UnsupportedArchitectureError(
            f"{where}: no integer token-id input [1, seq] (inputs: "
            f"{', '.join(f'{i.name} ({desc(i)})' for i in inputs) or 'none'}); picompile builds decoder-only causal LMs")
    batch, seq = dims_of(ids)
    if isinstance(batch, int) and batch not in (0, 1):
        raise UnsupportedArchitectureError(f"{where}: token ids {ids.name} have a fixed batch of {batch}; picompile runs batch 1")
    if isinstance(seq, int):
        raise UnsupportedArchitectureError(
            f"{where}: token ids {ids.name} have a fixed length {seq}; export the model with a dynamic sequence axis")


def _logits_output(outputs: list[Any], where: str) -> Any:
    """The logits value-info: the output named ``logits``, else the first; a float [1, seq, vocab]."""
    logits = next((o for o in outputs if o.name == "logits"), outputs[0] if outputs else None)
    if logits is None or len(dims_of(logits)) != 3 or logits.type.tensor_type.elem_type not in FLOAT_TYPES:
        raise UnsupportedArchitectureError(
            f"{where}: the logits output ({logits.name + ' ' + desc(logits) if logits is not None else 'none'}) "
            f"is not a float [1, seq, vocab] tensor")
    return logits


def _kv_dims(past: list[Any], presents: list[Any], where: str) -> tuple[int, int]:
    """(kv_heads, head_dim) every past / present pair shares; the past axis symbolic."""
    if len(past) % 2:
        raise UnsupportedArchitectureError(f"{where}: {len(past)} KV-cache inputs; expected a key and a value per layer")
    if len(presents) != len(past):
        raise UnsupportedArchitectureError(
            f"{where}: {len(past)} KV-cache inputs but {len(presents)} present outputs; each past needs its present")
    shapes = set()
    for p, q in zip(past, presents):
        pd, qd = dims_of(p), dims_of(q)
        if isinstance(pd[2], int):
            raise UnsupportedArchitectureError(
                f"{where}: KV-cache input {p.name} ({desc(p)}) has a fixed past length; export it with a dynamic past axis")
        if not (isinstance(pd[1], int) and isinstance(pd[3], int)):
            raise UnsupportedArchitectureError(
                f"{where}: KV-cache input {p.name} ({desc(p)}) must have fixed kv_heads and head_dim")
        if (isinstance(qd[1], int) and qd[1] != pd[1]) or (isinstance(qd[3], int) and qd[3] != pd[3]):
            raise UnsupportedArchitectureError(
                f"{where}: present {q.name} ({desc(q)}) does not match its past {p.name} ({desc(p)})")
        shapes.add((pd[1], pd[3]))
    if len(shapes) != 1:
        raise UnsupportedArchitectureError(f"{where}: KV-cache inputs differ in shape ({sorted(shapes)})")
    return shapes.pop()


def signature(graph: Any, where: str) -> Signature:
    """The decoder-step signature of ``graph`` (``where`` names the file in errors)."""
    inits = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in inits]
    found = _classify_inputs(inputs, where)
    _check_ids(found.ids, inputs, where)
    ids, past = found.ids, found.past
    outputs = list(graph.output)
    logits = _logits_output(outputs, where)
    presents = [o for o in outputs if o is not logits and o.type.tensor_type.elem_type in FLOAT_TYPES
                and len(dims_of(o)) == 4]
    sig = Signature(ids.name, TORCH_DTYPES[ids.type.tensor_type.elem_type], found.attention_mask,
                    found.position_ids, [p.name for p in past], logits.name, [])
    if not past:
        return sig
    sig.kv_heads, sig.head_dim = _kv_dims(past, presents, where)
    sig.presents = [q.name for q in presents]
    return sig

"""The ONNX decoder step as the model ``capture`` traces: :class:`OnnxDecoder` feeds the graph
(token ids, attention mask, positions, past) and answers the HF calling convention
:class:`picompile.frontend.decoder.FlatDecoder` uses. Without KV-cache inputs the cache is the token
history and every step re-runs the whole sequence (see the package doc)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from picompile.errors import ModelLoadError
from picompile.frontend.onnx.interpreter import OnnxGraph
from picompile.frontend.onnx.signature import Signature
from picompile.frontend.onnx.values import as_tensor


class OnnxDecoder(OnnxGraph):
    """An ONNX decoder step as a torch module.

    ``flat(input_ids, *past) -> (logits, *presents)`` is the picompile calling convention;
    ``forward(input_ids=…, cache=…, position_ids=…)`` answers the HF calling convention
    :class:`~picompile.frontend.decoder.FlatDecoder` uses (past read from and presents written to
    the ``DynamicCache`` layers). Without KV inputs the cache is the token history (package doc).
    """

    def __init__(self, graph: Any, sig: Signature, n_layers: int, opset: int) -> None:
        super().__init__(opset)
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(num_hidden_layers=n_layers)
        self.sig = sig
        self.n_layers = n_layers
        self.token_history = not sig.past
        self._load(graph, keep={sig.logits, *sig.presents})

    def _history_inputs(self, input_ids: torch.Tensor, past: tuple[torch.Tensor, ...]
                        ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(n_past, ids, positions) of a token-history step: the whole sequence so far, from 0."""
        seq = input_ids.shape[1]
        hist = past[0]  # [1, 1, past, 1]: the tokens seen so far
        n_past = hist.shape[2]
        ids = torch.cat([hist.reshape(1, -1).to(input_ids.dtype), input_ids], dim=1)  # [1, past + seq]
        positions = torch.arange(0, n_past + seq).unsqueeze(0)
        return n_past, ids, positions

    def _step_inputs(self, input_ids: torch.Tensor, past: tuple[torch.Tensor, ...],
                     position_ids: Optional[torch.Tensor]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(n_past, ids, positions) of a KV-cache step: the new tokens after ``past``."""
        seq = input_ids.shape[1]
        n_past = past[0].shape[2] if past else 0
        positions = position_ids if position_ids is not None else torch.arange(n_past, n_past + seq).unsqueeze(0)
        return n_past, input_ids, positions

    def _feeds(self, n_past: int, ids: torch.Tensor, positions: torch.Tensor,
               past: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """The graph inputs by name: token ids, an all-ones attention mask, positions, the past."""
        sig = self.sig
        feeds: dict[str, torch.Tensor] = {sig.ids: ids.to(sig.ids_dtype)}
        if sig.attention_mask is not None:
            total = ids.shape[1] + (0 if self.token_history else n_past)
            feeds[sig.attention_mask] = torch.ones(1, total, dtype=torch.int64)  # [1, past + seq]
        if sig.position_ids is not None:
            feeds[sig.position_ids] = positions.to(torch.int64)
        if not self.token_history:
            feeds.update(zip(sig.past, past))
        return feeds

    def flat(self, input_ids: torch.Tensor, *past: torch.Tensor,
             position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """(logits [1, seq, vocab], presents…) for ``input_ids`` [1, seq] after ``past``."""
        if self.token_history:
            n_past, ids, positions = self._history_inputs(input_ids, past)
        else:
            n_past, ids, positions = self._step_inputs(input_ids, past, position_ids)
        env = self.run(self._feeds(n_past, ids, positions, past))
        logits = as_tensor(env[self.sig.logits]).to(torch.float32)
        if self.token_history:
            new = input_ids.to(torch.float32).reshape(1, 1, input_ids.shape[1], 1)
            return (logits[:, n_past:], *(torch.cat([p, new], dim=2) for p in past))
        return (logits, *(as_tensor(env[name]) for name in self.sig.presents))

    def forward(self, input_ids: torch.Tensor, cache: Any = None, position_ids: Optional[torch.Tensor] = None,
                use_cache: bool = True, **unused: Any) -> Any:
        past: list[torch.Tensor] = []
        layers = list(cache.layers) if cache is not None else []
        for layer in layers:
            past += [layer.keys, layer.values]
        if len(past) != 2 * self.n_layers:
            raise ModelLoadError(f"the ONNX model needs {2 * self.n_layers} cache tensors, got {len(past)}")
        out = self.flat(input_ids, *past, position_ids=position_ids)
        for i, layer in enumerate(layers):
            layer.keys, layer.values = out[1 + 2 * i], out[2 + 2 * i]
        return SimpleNamespace(logits=out[0], cache=cache)

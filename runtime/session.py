"""A loaded artifact: prefill + decode with a KV cache, logits, greedy or sampled generation."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, fx

from picompile.artifact import Manifest
from picompile.errors import InputError


class Session:
    """Runs an artifact's graph. ``generate`` returns only the new token ids."""

    def __init__(self, root: Path, manifest: Manifest, graph: fx.GraphModule, tokenizer: Any | None,
                 step_fn: Callable[..., tuple[Tensor, ...]] | None = None) -> None:
        self.root = root
        self.manifest = manifest
        self.graph = graph  # the graph as loaded (inspect it, interpret it)
        self.step_fn = step_fn or graph  # what ``step`` calls: the graph, or its compiled form (load(compile=True))
        self.tokenizer = tokenizer
        model = manifest.model
        self.vocab_size: int = int(model["vocab_size"])
        self.max_seq_len: int = int(manifest.build["max_seq_len"])
        self.n_past: int = int(manifest.graph["n_past"])
        self.kv_heads: int = int(model["n_kv_heads"])
        self.head_dim: int = int(model["head_dim"])
        eos = tokenizer.eos_id if tokenizer is not None and tokenizer.eos_id is not None else model["config"].get("eos_token_id")
        self.eos_id: int | None = eos[0] if isinstance(eos, list) else eos
        self.last_logits: Tensor | None = None  # [n_generated, vocab]: what each generated token was chosen from

    @property
    def compiled(self) -> bool:
        """Whether ``step`` runs the graph's torch.compile'd form (``load(compile=True)``)."""
        return self.step_fn is not self.graph

    @property
    def hybrid_mode(self) -> str:
        """How the FFN partitions run: "off" (the graph as built) | "inline" | "thread" | "cuda"."""
        from picompile.runtime.hybrid import hybrid_mode_of

        return hybrid_mode_of(self.graph)

    @property
    def hybrid_skipped(self) -> list[str]:
        """Why FFN layers were left unscheduled by the hybrid scheduler (empty when all were scheduled)."""
        from picompile.runtime.hybrid import SKIPPED_KEY

        return list(self.graph.meta.get(SKIPPED_KEY, []))

    # -- low level -------------------------------------------------------------------------
    def empty_past(self) -> tuple[Tensor, ...]:
        with torch.inference_mode():  # like every later past (step runs in inference mode): one compiled guard
            return tuple(torch.zeros(1, self.kv_heads, 0, self.head_dim) for _ in range(self.n_past))

    def step(self, ids: Tensor, past: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One graph call: ids [1, seq] after ``past`` → (logits [seq, vocab], presents)."""
        with torch.inference_mode():
            out = self.step_fn(ids, *past)
        return out[0][0], tuple(out[1:])

    def _ids(self, prompt_or_ids: str | Sequence[int] | Tensor) -> list[int]:
        if isinstance(prompt_or_ids, str):
            if self.tokenizer is None:
                raise InputError("this artifact has no tokenizer: pass token ids instead of text")
            ids = list(self.tokenizer.encode(prompt_or_ids))
        elif isinstance(prompt_or_ids, Tensor):
            ids = [int(i) for i in prompt_or_ids.reshape(-1).tolist()]
        else:
            ids = [int(i) for i in prompt_or_ids]
        if not ids:
            raise InputError("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) > self.max_seq_len:
            raise InputError(f"the prompt has {len(ids)} tokens; this artifact's context is {self.max_seq_len} tokens")
        return ids

    # -- public ----------------------------------------------------------------------------
    def logits(self, ids: str | Sequence[int] | Tensor) -> Tensor:
        """Logits [seq, vocab] for ``ids`` from an empty cache (one prefill)."""
        tokens = self._ids(ids)
        logits, _ = self.step(torch.tensor([tokens]), self.empty_past())
        return logits

    def generate(
        self,
        prompt_or_ids: str | Sequence[int] | Tensor,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_at_eos: bool = True,
    ) -> list[int]:
        """Prefill the prompt, then decode up to ``max_new_tokens`` (greedy when temperature is 0)."""
        tokens = self._ids(prompt_or_ids)
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(tokens) + max_new_tokens > self.max_seq_len:
            raise InputError(
                f"the prompt has {len(tokens)} tokens and {max_new_tokens} new tokens were asked for, but this artifact's "
                f"context is {self.max_seq_len} tokens (at most {self.max_seq_len - len(tokens)} new tokens fit)"
            )
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out: list[int] = []
        chosen: list[Tensor] = []
        if max_new_tokens == 0:
            self.last_logits = torch.empty(0, self.vocab_size)
            return out
        logits, past = self.step(torch.tensor([tokens]), self.empty_past())
        last = logits[-1]  # [vocab]
        while True:
            chosen.append(last)
            nxt = self._pick(last, temperature, top_k, gen)
            out.append(nxt)
            if len(out) >= max_new_tokens or (stop_at_eos and nxt == self.eos_id):
                break
            logits, past = self.step(torch.tensor([[nxt]]), past)
            last = logits[-1]
        self.last_logits = torch.stack(chosen)
        return out

    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: int, gen: torch.Generator | None) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        scores = logits / temperature
        if top_k > 0:
            kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids))

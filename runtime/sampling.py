"""Choosing the next token and turning tokens into text as they come.

``SamplingParams`` (temperature, top-k, top-p, min-p, repetition / presence / frequency penalties, a seed, stop
strings), ``Sampler`` (one per request: its own seeded generator and token counts, so a request's choices
never depend on another's), ``TextStream`` (token ids → text deltas, never splitting a UTF-8 character or a
word-piece's leading space) and ``StopText`` (holds back text that may be the start of a stop string, cuts
at the first one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from picompile.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens. temperature 0 = greedy (argmax after the penalties)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    min_p: float = 0.0  # drop tokens below min_p × the top token's probability
    repetition_penalty: float = 1.0  # CTRL / transformers: logit / p if > 0 else logit * p, for seen tokens
    presence_penalty: float = 0.0  # OpenAI: − presence_penalty for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: − frequency_penalty × its count among the generated tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def check(self) -> "SamplingParams":
        """Raise ``InputError`` naming the first parameter out of range; returns self."""
        rules: list[tuple[str, float, float, float]] = [
            ("temperature", self.temperature, 0.0, 1e4), ("top_p", self.top_p, 0.0, 1.0),
            ("min_p", self.min_p, 0.0, 1.0), ("repetition_penalty", self.repetition_penalty, 1e-3, 1e3),
            ("presence_penalty", self.presence_penalty, -2.0, 2.0), ("frequency_penalty", self.frequency_penalty, -2.0, 2.0)]
        for name, v, lo, hi in rules:
            if not (isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi):
                raise InputError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        if self.top_p <= 0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.top_k <= 1 << 20:
            raise InputError(f"top_k must be in 0..{1 << 20}, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise InputError(f"seed must be in 0..2^63-1, got {self.seed!r}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s or len(s) > 256 for s in self.stop):
            raise InputError("stop must be at most 16 non-empty strings of at most 256 characters")
        return self


class Sampler:
    """One request's token choice: penalties over the tokens it has seen, then greedy or sampled with its own
    generator (seeded: the same seed gives the same tokens, whatever else runs)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self.params = params.check()
        self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                 else int(torch.randint(0, 1 << 62, ()).item()))
        self.seen: set[int] = set(int(t) for t in prompt)  # repetition penalty: prompt and generated tokens
        self.counts: dict[int, int] = {}  # presence / frequency penalties: generated tokens only

    def penalized(self, logits: Tensor) -> Tensor:
        """logits [vocab] with the penalties applied (a copy when any applies)."""
        p = self.params
        if p.repetition_penalty != 1.0 and self.seen:
            logits = logits.clone()
            idx = torch.tensor(sorted(self.seen), dtype=torch.long)
            vals = logits[idx]
            logits[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            logits = logits.clone()
            idx = torch.tensor(list(self.counts), dtype=torch.long)
            cnt = torch.tensor(list(self.counts.values()), dtype=logits.dtype)
            logits[idx] -= p.frequency_penalty * cnt + p.presence_penalty
        return logits

    def pick(self, logits: Tensor) -> int:
        """The next token from logits [vocab]; records it as seen."""
        p = self.params
        scores = self.penalized(logits.float())
        if p.temperature <= 0:
            tid = int(torch.argmax(scores))
        else:
            scores = scores / p.temperature
            if p.top_k > 0:
                kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = torch.softmax(scores, -1)
            if p.min_p > 0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            if p.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each
                sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)  # the top token always stays
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            tid = int(torch.multinomial(probs, 1, generator=self.gen))
        self.seen.add(tid)
        self.counts[tid] = self.counts.get(tid, 0) + 1
        return tid


class TextStream:
    """Token ids → text deltas, as the tokens are produced (the way text-generation-inference does it): a window
    of the last tokens is decoded with and without the new ones and the difference is the delta, held back
    while it ends in an incomplete UTF-8 character (U+FFFD)."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = [int(t) for t in context]
        self.read = len(self.ids)  # the ids before this are emitted
        self.prefix = max(0, self.read - 6)  # a few tokens of context: leading-space rules, merges

    def push(self, tid: int) -> str:
        self.ids.append(int(tid))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end: as U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


@dataclass
class StopText:
    """Text deltas in, text out: cut at the first stop string (not included), and hold back any tail that could
    still become one."""

    stops: tuple[str, ...] = ()
    text: str = ""  # all text pushed so far
    sent: int = 0  # characters of text already released
    stopped: bool = field(default=False)

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]  # held back: none before
        if hits:
            cut = min(hits)
            self.stopped = True
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out
        hold = 0
        for s in self.stops:  # the longest tail of text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        safe = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = ("" if self.stopped else self.text[self.sent:]), len(self.text)
        return out


class Generation:
    """One request's generation, step by step: ``advance(logits)`` picks the next token, releases its text
    (``delta``), and ends the request on EOS, a stop string or ``max_tokens`` (``finish_reason`` "stop" or
    "length"). The EOS token is counted but neither fed back nor shown."""

    def __init__(self, tokenizer: Any | None, prompt: Sequence[int], max_tokens: int, params: SamplingParams,
                 eos_ids: set[int] | None = None) -> None:
        self.sampler = Sampler(params, prompt)
        self.text_stream = TextStream(tokenizer, prompt) if tokenizer is not None else None
        self.stop = StopText(tuple(params.stop))
        self.max_tokens = max_tokens
        self.eos_ids = set(eos_ids or ())
        self.tokens: list[int] = []  # generated, EOS included
        self.text = ""  # released so far
        self.delta = ""  # released by the last advance
        self.finish_reason: str | None = None if max_tokens > 0 else "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def advance(self, logits: Tensor) -> int:
        tid = self.sampler.pick(logits)
        self.tokens.append(tid)
        self.delta = ""
        if tid in self.eos_ids:
            self.finish_reason = "stop"
            self._release(self.stop.flush() if self.text_stream is None else self.stop.push(self.text_stream.flush()) + self.stop.flush())
            return tid
        if self.text_stream is not None:
            self._release(self.stop.push(self.text_stream.push(tid)))
        else:  # no tokenizer: the ids, space-separated (as ``picompile run`` prints them)
            self._release(self.stop.push(f"{' ' if len(self.tokens) > 1 else ''}{tid}"))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
            if self.text_stream is not None:
                self._release(self.stop.push(self.text_stream.flush()))
                self.finish_reason = "stop" if self.stop.stopped else "length"
            self._release(self.stop.flush())
        return tid

    def _release(self, text: str) -> None:
        self.delta += text
        self.text += text

"""A loaded artifact: prefill + decode with a KV cache, logits, greedy or sampled generation."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, fx

from picompile.errors import InputError
from picompile.formats.artifact import Manifest
from picompile.runtime.compute_dtype import choose_for as choose_prefill_dtype
from picompile.runtime.compute_dtype import resolve as resolve_compute_dtype
from picompile.runtime.kv_cache import KVArenas
from picompile.runtime.load_pipeline import LoadOptions, LoadRun, LoadState, session_steps
from picompile.runtime.logit_rows import LogitRows
from picompile.runtime.sampling import Generation, SamplingParams
from picompile.runtime.threads import torch_weight_reads, with_decode_threads


class Session:
    """Runs an artifact's graph. ``generate`` returns only the new token ids.

    Steps run on the KV cache in place (``runtime/kv_cache.py``: one preallocated buffer per past input,
    ``max_seq_len`` positions) unless the graph's cache is not the pattern that form replaces
    (``kv_reason`` says why). ``decoder()`` appends to that cache without copying it; ``step(ids, past)``
    keeps its functional contract (it returns presents of its own). Prefill (several tokens in one step)
    is dense: every FFN neuron, no predictor (``dense_prefill``); decode (one token) runs the masks.
    ``prefill_dtype="bfloat16"`` computes prefill's GEMMs in bfloat16 on copies of their weights
    (``runtime/compute_dtype.py``: AMX / AVX512-BF16 CPUs; faster, coarser, more memory); decode is unchanged.
    ``"auto"`` / None (default): bfloat16 where ``compute_dtype.choose`` finds it pays, else the weights' dtype.
    """

    def __init__(self, root: Path, manifest: Manifest, graph: fx.GraphModule, tokenizer: Any | None, *,
                 compile: bool = False, kv_in_place: bool = True, dense_prefill: bool = True,
                 prefill_dtype: str | None = None, load_run: LoadRun | None = None,
                 prefill_reason: str | None = None, native: bool = True, sparse_prefill: bool = True) -> None:
        self.root = root
        self.manifest = manifest
        self.graph = graph  # the graph as loaded (inspect it, interpret it): functional, past in, presents out
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
        resolve_compute_dtype(prefill_dtype)  # a bad dtype, or no fast path on this CPU: fails before any step
        if prefill_reason is None:  # not chosen by picompile.load: "auto" / None decided here
            prefill_dtype, prefill_reason = choose_prefill_dtype(prefill_dtype, manifest, root)
        self.prefill_dtype: str | None = prefill_dtype  # the prompt's GEMM dtype ("bfloat16"), None: the weights'
        self.prefill_reason: str = prefill_reason  # why (runtime/compute_dtype.choose)
        self._compiled = compile
        state = self._run_steps(LoadOptions(dense_prefill=dense_prefill, prefill_dtype=prefill_dtype,
                                            sparse_prefill=sparse_prefill,
                                            kv_in_place=kv_in_place, compile=compile, native=native,
                                            kernels=bool(manifest.sections.get("kernels"))), load_run)
        notes = state.notes
        self.dense_prefill: bool = bool(notes.get("dense_prefill", False))  # prefill runs a mask-free copy
        # FFN parts whose prefill computes up / down only where a ReLU gate fired (runtime/prefill_sparse.py)
        self.sparse_prefill_parts: int = int(notes.get("sparse_prefill_parts", 0))
        self.sparse_prefill_skipped: list[str] = list(notes.get("sparse_prefill_skipped", []))  # why not, per FFN
        if self.sparse_prefill_parts and self.prefill_dtype in ("float32", "bfloat16"):
            self.prefill_reason += (f"; {self.sparse_prefill_parts} ReLU FFN parts computed where their gate fires: "
                                    "of their weights only the gates were copied")
        self.kv: KVArenas | None = notes.get("kv")  # the in-place KV cache (None: every step concatenates the past)
        self.kv_reason: str = notes.get("kv_reason", "kv_in_place=False")
        # lm_head for the last prompt position only, when a caller asks (runtime/logit_rows.py; None: every row)
        self.logit_rows: LogitRows | None = notes.get("logit_rows")
        assert state.decode is not None and state.prefill is not None
        decode_run, prefill_run = state.decode, state.prefill
        # the forms runtime/batch.py builds on: prefill as steps run it, decode before native-calls (the C++ kernel
        # ops take one token; batch.py batches the picompile ops)
        self.decode_graph, self.prefill_graph = notes.get("batch_decode", decode_run), prefill_run
        self.step_graphs: tuple[fx.GraphModule, ...] = tuple(  # every distinct graph a step may run or read
            {id(g): g for g in (prefill_run, decode_run, self.decode_graph)}.values())
        if compile:
            from picompile.runtime.compile import compile_step

            self.step_fn = compile_step(decode_run, prefill_run)  # dispatches on the token count itself
            self.step_fn.attention_rewrites = notes.get("attention_rewrites", 0)  # type: ignore[attr-defined]
            self.exec_reason = "compile=True"
        else:
            decode_fn: Callable[..., Any] = decode_run
            self.exec_reason = "native=False" if not native else "no native decode graph"
            if native and notes.get("native_calls"):  # every node an operator: the graph run from C++
                from picompile.runtime.graph_exec import exec_step

                program, self.exec_reason = exec_step(decode_run)
                decode_fn = program if program is not None else decode_run
            self.step_fn = lambda ids, *past: (prefill_run if ids.shape[-1] > 1 else decode_fn)(ids, *past)
        self.native_calls: int = int(notes.get("native_calls", 0))  # decode's kernel calls made C++ ops (native.py)
        self.native_reason: str = notes.get("native_reason", "native=False")  # why none were ("" when some were)
        self.step_fn.native_calls = self.native_calls  # type: ignore[attr-defined]
        self.step_fn.native_reason = self.native_reason  # type: ignore[attr-defined]
        # decode on one torch thread where TVM kernels read every weight (runtime/threads.py), judged on the
        # eager decode form (the compiler's copy calls the same kernels through C++ ops)
        self.torch_weight_reads = torch_weight_reads(self.kv.graph if self.kv is not None else graph)
        self.decode_torch_threads: int | None = None if self.torch_weight_reads else 1
        self.step_fn = with_decode_threads(self.step_fn, self.decode_torch_threads)
        self._kv_version = 0  # bumped by every step on the arenas: what they hold changes
        self._kv_handed: tuple[tuple[Tensor, ...], int] | None = None  # step()'s last presents, at that version

    def _run_steps(self, options: LoadOptions, run: LoadRun | None) -> LoadState:
        """The session steps (``load_pipeline.session_steps``) on this session's graph: its prefill and decode
        forms. ``run``: the load they are part of (``picompile.load``), else a run of their own."""
        names = session_steps(options)
        run = run if run is not None else LoadRun(names)
        state = LoadState(graph=self.graph, prefill=self.graph, decode=self.graph, options=options,
                          n_past=self.n_past, max_seq_len=self.max_seq_len)
        run.run(state, names)
        self.load_steps: list[str] = list(run.steps)  # every step of the load that made this session, in order
        self.load_seconds: dict[str, float] = dict(run.seconds)  # per step
        self.load_rss_bytes: dict[str, int] = dict(run.rss_bytes)  # resident memory after each step
        return state

    @property
    def compiled(self) -> bool:
        """Whether steps run the graph's torch.compile'd form (``load(compile=True)``)."""
        return self._compiled

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
        """One step: ids [1, seq] after ``past`` → (logits [seq, vocab], presents). Functional: ``past`` is
        only read, the presents are new tensors (on the in-place cache, copies of its first positions; the
        cache is refilled from ``past`` unless it already holds it, i.e. past is the previous step's result)."""
        if self.kv is None:
            with torch.inference_mode():
                out = self.step_fn(ids, *past)
            return out[0][0], tuple(out[1:])
        start = int(past[0].shape[2]) if past else 0
        held = self._kv_handed is not None and self._kv_handed[1] == self._kv_version and len(past) == len(
            self._kv_handed[0]) and all(a is b for a, b in zip(past, self._kv_handed[0]))
        self._check_room(start, ids.shape[-1])
        with torch.inference_mode():
            if start and not held:
                for arena, p in zip(self.kv.arenas, past):
                    arena[:, :, :start].copy_(p)
            logits = self._advance(ids, start)
            presents = tuple(v.clone() for v in self.kv.views(start + ids.shape[-1]))
        self._kv_handed = (presents, self._kv_version)
        return logits, presents

    def decoder(self) -> "Decoder":
        """A decoder over this session's KV cache: ``feed(ids)`` appends tokens and returns their logits,
        without copying the cache (one decoder at a time per session: any other step overwrites it)."""
        return Decoder(self)

    def _check_room(self, start: int, n: int) -> None:
        if start + n > self.max_seq_len:
            raise InputError(f"{start} cached tokens and {n} new ones exceed this artifact's context of "
                             f"{self.max_seq_len} tokens")

    def _advance(self, ids: Tensor, start: int, last_only: bool = False) -> Tensor:
        """Run ids [1, T] on the in-place cache after its first ``start`` positions → logits [T, vocab]
        (``last_only``: the last position's [1, vocab], lm_head computed for it alone where the prefill graph
        allows: ``logit_rows``)."""
        assert self.kv is not None
        rows = self.logit_rows if last_only and ids.shape[-1] > 1 else None
        with torch.inference_mode(), (rows.last_only() if rows is not None else contextlib.nullcontext()):
            out = self.step_fn(ids, *self.kv.views(start))
        self._kv_version += 1
        logits = out[0][0]
        return logits[-1:] if last_only else logits

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
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> list[int]:
        """Prefill the prompt, then decode up to ``max_new_tokens`` (greedy when temperature is 0)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repetition_penalty, seed=seed)
        run = self.stream(prompt_or_ids, max_new_tokens, params, stop_at_eos=stop_at_eos, keep_logits=True)
        for _ in run:
            pass
        return list(run.generation.tokens)

    def stream(self, prompt_or_ids: str | Sequence[int] | Tensor, max_new_tokens: int, params: SamplingParams,
               *, stop_at_eos: bool = True, decoder: "Decoder | None" = None, keep_logits: bool = False) -> "Stream":
        """Generate token by token: iterate the result for each step's ``Generation`` (its ``delta`` is the new
        text, ``tokens`` the ids so far); ``.stats`` has the counts and timings once it is exhausted.
        ``decoder``: continue that decoder's cache (its length tokens are kept: only the rest of the prompt is
        prefilled); the prompt is then the whole sequence, cached part included."""
        tokens = self._ids(prompt_or_ids)
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(tokens) + max_new_tokens > self.max_seq_len:
            raise InputError(
                f"the prompt has {len(tokens)} tokens and {max_new_tokens} new tokens were asked for, but this artifact's "
                f"context is {self.max_seq_len} tokens (at most {self.max_seq_len - len(tokens)} new tokens fit)"
            )
        eos = {self.eos_id} if stop_at_eos and self.eos_id is not None else set()
        gen = Generation(self.tokenizer, tokens, max_new_tokens, params, eos)
        return Stream(self, tokens, gen, decoder, keep_logits)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids))


class Decoder:
    """Stateful decoding: ``feed(ids)`` appends ids to what was fed before and returns their logits
    [len(ids), vocab]. On the session's in-place KV cache nothing is copied; a session without one keeps
    the presents of its last step. Any other step of the same session (``step``, ``logits``, another
    decoder) reuses the cache, and a later ``feed`` then raises ``InputError``."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.length = 0  # tokens fed so far
        self.history: list[int] = []  # the ids fed so far, in order
        self._version: int | None = None  # the session's cache version after this decoder's last feed
        self._past: tuple[Tensor, ...] | None = None  # sessions without the in-place cache

    def feed(self, ids: Sequence[int] | Tensor, last_only: bool = False) -> Tensor:
        """Append ``ids`` → their logits [len(ids), vocab]; ``last_only``: only the last one's, [1, vocab]
        (prefill then computes lm_head for that position alone: what generation reads)."""
        s = self.session
        tokens = s._ids(ids)
        batch = torch.tensor([tokens])
        s._check_room(self.length, len(tokens))
        if s.kv is None:
            rows = s.logit_rows if last_only and len(tokens) > 1 else None
            with rows.last_only() if rows is not None else contextlib.nullcontext():
                logits, self._past = s.step(batch, self._past if self._past is not None else s.empty_past())
            logits = logits[-1:] if last_only else logits
        else:
            if self.length and self._version != s._kv_version:
                raise InputError("this decoder's KV cache was overwritten by another step of its session "
                                 "(one decoder at a time per session; start a new one with session.decoder())")
            logits = s._advance(batch, self.length, last_only)
            self._version = s._kv_version
        self.length += len(tokens)
        self.history += tokens
        return logits

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` tokens fed; the next ``feed`` continues after them."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot truncate a decoder of {self.length} tokens to {length}")
        if self._past is not None:
            self._past = tuple(p[:, :, :length] for p in self._past)
        self.length = length
        del self.history[length:]


@dataclass
class StreamStats:
    """What one ``Session.stream`` did: tokens prefilled (``cached``: already in the decoder's cache, not
    recomputed), tokens generated, and the seconds of each phase."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str | None = None

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.new_tokens - 1  # the first token comes from the prefill's logits
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else 0.0


class Stream:
    """The iterator ``Session.stream`` returns: one ``Generation`` per new token."""

    def __init__(self, session: Session, tokens: list[int], generation: Generation, decoder: "Decoder | None",
                 keep_logits: bool) -> None:
        self.session, self.tokens, self.generation = session, tokens, generation
        self.decoder = decoder if decoder is not None else session.decoder()
        self.stats = StreamStats(prompt_tokens=len(tokens))
        self._keep = keep_logits
        self._it = self._run()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Generation:
        return next(self._it)

    def _run(self) -> Iterator[Generation]:
        s, gen, dec, st = self.session, self.generation, self.decoder, self.stats
        chosen: list[Tensor] = []
        if gen.done:  # max_new_tokens == 0
            s.last_logits = torch.empty(0, s.vocab_size)
            st.finish_reason = gen.finish_reason
            return
        keep = 0
        if dec.length:  # continue a conversation: keep the cached prefix the new prompt shares
            keep = common_prefix(dec.history, self.tokens)
            keep = min(keep, len(self.tokens) - 1)  # at least one token is fed: its logits pick the next
            dec.truncate(keep)
        st.cached_tokens = keep
        t0 = time.perf_counter()
        last = dec.feed(self.tokens[keep:], last_only=True)[-1]  # [vocab]
        st.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            if self._keep:
                chosen.append(last)
            tid = gen.advance(last)
            st.new_tokens = len(gen.tokens)
            st.decode_seconds = time.perf_counter() - t1
            yield gen
            if gen.done:
                break
            last = dec.feed([tid])[-1]
        st.decode_seconds = time.perf_counter() - t1
        st.finish_reason = gen.finish_reason
        if self._keep:
            s.last_logits = torch.stack(chosen)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

"""The engines ``picompile bench`` times, each a prefill + greedy decode loop behind one interface.

:class:`Engine` is one way of running the model; the makers here build them: a picompile session
(:func:`session_engine`, with :func:`dense_view` / :func:`compiled_view` of the same weights), HF eager
PyTorch (:func:`pytorch_engine`, run in a child process by :class:`WorkerEngine`), ONNX Runtime
(:func:`ort_engine`) and llama.cpp through llama-cpp-python (:func:`llama_cpp_engine`, a GGUF converted once by
:func:`auto_gguf`; for its greedy tokens: llama.cpp's speed is measured by its own ``llama-bench``,
:mod:`picompile.tools.llama_bench`, an engine that times itself).
An optional engine that cannot start is returned as the reason (a string), never raised.
"""
from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from picompile.errors import PicompileError


@dataclass
class Engine:
    """One way of running the model: ``prefill(ids) -> (next_token, state)``, ``decode(tok, state) -> (next, state)``."""

    name: str
    label: str
    prefill: Callable[[list[int]], tuple[int, Any]]
    decode: Callable[[int, Any], tuple[int, Any]]
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # engine-specific facts for the result (e.g. the GGUF file)
    # an engine that times itself (llama-bench): (prompt, n) -> (prefill seconds, decode seconds); no tokens
    timed: Callable[[list[int], int], tuple[float, float]] | None = None
    # an untimed prefill before each timed one: its weights back in the page cache after another engine's files
    # pushed them out (the files of a 7B's engines together exceed the memory)
    warm: bool = False

    def run(self, prompt: list[int], n: int, record: bool = True) -> None:
        if self.timed is not None:
            pf, dc = self.timed(prompt, n)
            if record:
                self.prefill_s.append(pf)
                self.decode_s.append(dc)
            return
        if self.warm and record:
            _, state = self.prefill(prompt)
            del state
        t0 = time.perf_counter()
        tok, state = self.prefill(prompt)
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n):
            tok, state = self.decode(tok, state)
            out.append(tok)
        t2 = time.perf_counter()
        del state
        if record:
            self.prefill_s.append(t1 - t0)
            self.decode_s.append(t2 - t1)
            self.tokens = out

    def rates(self, prompt_len: int, n: int) -> tuple[float, float]:
        """(prefill tokens/s, decode tokens/s) from the median round."""
        return prompt_len / statistics.median(self.prefill_s), n / statistics.median(self.decode_s)


def greedy_token(logits: Any) -> int:
    """The argmax of the last position's logits (greedy decoding)."""
    t = torch.as_tensor(logits)
    return int(torch.argmax(t.reshape(-1, t.shape[-1])[-1]))


def session_engine(name: str, label: str, session: Any) -> Engine:
    """A picompile session as ``generate`` runs it: a decoder over its KV cache (in place where it can be)."""
    def prefill(ids: list[int]) -> tuple[int, Any]:
        dec = session.decoder()
        return greedy_token(dec.feed(ids, last_only=True)), dec  # lm_head for the last position: as generate

    def decode(tok: int, dec: Any) -> tuple[int, Any]:
        return greedy_token(dec.feed([tok])), dec

    return Engine(name, label, prefill, decode)


def pytorch_engine(model: torch.nn.Module) -> Engine:
    """HF eager: one forward for the prompt, then one per token, with a DynamicCache."""
    from transformers import DynamicCache

    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"

    def step(ids: Tensor, cache: Any) -> int:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, **{cache_kw: cache})
        return int(torch.argmax(out.logits[0, -1]))

    def prefill(ids: list[int]) -> tuple[int, Any]:
        cache = DynamicCache(config=model.config)
        return step(torch.tensor([ids]), cache), cache

    def decode(tok: int, cache: Any) -> tuple[int, Any]:
        return step(torch.tensor([[tok]]), cache), cache

    return Engine("pytorch", "PyTorch eager", prefill, decode)


def dense_view(session: Any) -> Any:
    """The artifact's dense reference (every FFN neuron) sharing the session's weights.

    Same as ``picompile.load(art, dense=True)``, without a second copy of the weights: the graph is
    copied, its buffers are the same tensors.
    """
    from picompile.runtime import Session
    from picompile.runtime.loader import without_masks

    return Session(session.root, session.manifest, without_masks(session.graph), session.tokenizer)


def compiled_view(session: Any) -> Any:
    """The session's step through torch.compile (``load(art, compile=True)``), sharing its weights."""
    from picompile.runtime import Session

    return Session(session.root, session.manifest, session.graph, session.tokenizer, compile=True)


def ort_engine(source: str, cache_dir: Path, threads: int) -> Engine | str:
    """ONNX Runtime on the same weights, or the reason it is skipped."""
    try:
        from picompile.tools import ort_reference  # noqa: F401  (another module; may be absent)
    except ImportError as e:
        return f"picompile.tools.ort_reference is not available ({e})"
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed"
    try:
        accepts_threads = "threads" in inspect.signature(ort_reference.OrtDenseSession).parameters
        sess = ort_reference.OrtDenseSession(source, cache_dir, **({"threads": threads} if accepts_threads else {}))
    except Exception as e:  # an optional extra never fails the benchmark
        return f"could not set up ONNX Runtime: {type(e).__name__}: {e}"

    def empty() -> Any:
        return sess.empty_past() if hasattr(sess, "empty_past") else None

    def prefill(ids: list[int]) -> tuple[int, Any]:
        logits, past = sess.step([ids], empty())
        return greedy_token(logits), past

    def decode(tok: int, past: Any) -> tuple[int, Any]:
        logits, past = sess.step([[tok]], past)
        return greedy_token(logits), past

    return Engine("onnxruntime", "ONNX Runtime", prefill, decode)


GGUF_TYPES: tuple[str, ...] = ("f32", "f16")
GGUF_FILE_TYPES: dict[int, str] = {0: "f32", 1: "f16", 2: "q4_0", 7: "q8_0", 32: "bf16"}  # general.file_type -> name


def _stale(out: Path, checkpoint_dir: Path) -> bool:
    """Whether ``out`` is missing or older than a file of the checkpoint it was converted from."""
    if not out.is_file():
        return True
    sources = [checkpoint_dir / "config.json", *checkpoint_dir.glob("*.safetensors")]
    return any(f.stat().st_mtime > out.stat().st_mtime for f in sources if f.is_file())


def auto_gguf(source: str, gguf_type: str, cache_dir: Path, emit: Callable[[str], None] = lambda s: None) -> Path | str:
    """``--gguf auto``: the source checkpoint as ``cache_dir/gguf/NAME-TYPE.gguf`` (converted once), or why not."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        return "--gguf auto needs the 'gguf' package (pip install 'picompile[bench]')"
    from picompile.formats.gguf_export import export_gguf, read_hparams

    ckpt = Path(source)
    try:
        read_hparams(ckpt)
    except PicompileError as e:
        return f"--gguf auto cannot convert the source model: {e}"
    out = cache_dir / "gguf" / f"{ckpt.resolve().name}-{gguf_type}.gguf"
    if not _stale(out, ckpt):
        return out
    emit(f"converting {ckpt} to {out} ({gguf_type}) for llama.cpp")
    try:
        return export_gguf(ckpt, out, gguf_type, emit=emit)
    except Exception as e:  # an optional extra never fails the benchmark
        return f"--gguf auto: converting {ckpt} failed: {type(e).__name__}: {e}"


def llama_cpp_engine(gguf: Path | str | None, n_ctx: int, threads: int, *, source: str = "", gguf_type: str = "f32",
                     cache_dir: Path | None = None, emit: Callable[[str], None] = lambda s: None) -> Engine | str:
    """llama.cpp through llama-cpp-python on a GGUF file (``"auto"``: see :func:`auto_gguf`), or the reason it is skipped.

    ``threads`` for both decode and batch (prefill); the KV cache is f32 for ``gguf_type`` f32, else f16.
    """
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp (llama-cpp-python) is not installed (pip install 'picompile[bench]')"
    if gguf is None:
        return ("no GGUF given: pass --gguf auto (converts the source checkpoint) or --gguf FILE (the same "
                "weights as a GGUF)")
    converted = str(gguf) == "auto"
    if converted:
        from picompile.config import default_cache_dir

        made = auto_gguf(source, gguf_type, cache_dir or default_cache_dir(), emit)
        if isinstance(made, str):
            return made
        gguf = made
    if not Path(gguf).is_file():
        return f"GGUF file {gguf} does not exist"
    worker = WorkerEngine.start("llama.cpp", Path(gguf), n_ctx, threads, "f32" if gguf_type == "f32" else "f16")
    if isinstance(worker, str):
        return f"llama.cpp could not load {gguf}: {worker}"
    file_type = str(worker.info.get("file_type", ""))
    ftype = GGUF_FILE_TYPES.get(int(file_type), "GGUF") if file_type.isdigit() else "GGUF"
    label = f"llama.cpp {ftype} (dense; SiLU kernel{', same weights' if converted else ''})"
    info = {"gguf": str(gguf), "gguf_file_type": ftype, "kv_type": gguf_type, "converted": converted,
            "ffn_activation": "silu (llama.cpp's llama architecture)"}
    return worker.engine("llama.cpp", label, info)


def peer_env() -> dict[str, str]:
    """This process's environment with the user's own ``OMP_WAIT_POLICY`` (picompile sets PASSIVE for itself;
    the peers run as their users run them)."""
    import picompile

    env = dict(os.environ)
    if picompile.USER_OMP_WAIT_POLICY is None:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = picompile.USER_OMP_WAIT_POLICY
    return env


class WorkerEngine:
    """An engine in a ``picompile/tools/engine_worker.py`` child process, run with the user's own OpenMP settings
    (this process runs with ``OMP_WAIT_POLICY=PASSIVE``, under which PyTorch's and llama.cpp's OpenMP
    barriers sleep: see that module). A request costs a pipe round trip (~0.1 ms) against 50-300 ms per
    token; the child's memory is its own (PyTorch: a second copy of the fp32 weights, as before)."""

    def __init__(self, proc: Any, info: dict[str, Any], omp_policy: str | None) -> None:
        import weakref

        self.proc, self.info, self.omp_policy = proc, info, omp_policy
        weakref.finalize(self, WorkerEngine._stop, proc)

    @staticmethod
    def _stop(proc: Any) -> None:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()

    @classmethod
    def start(cls, kind: str, *args: object) -> "WorkerEngine | str":
        """Start the worker for ``kind`` ("llama.cpp" or "pytorch"); the reason as a string if it fails."""
        import subprocess

        env = peer_env()
        script = Path(__file__).with_name("engine_worker.py")
        proc = subprocess.Popen([sys.executable, "-P", str(script), kind, *map(str, args)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1, env=env)
        hello = proc.stdout.readline() if proc.stdout else ""
        try:
            msg = json.loads(hello)
        except json.JSONDecodeError:
            cls._stop(proc)
            return f"the {kind} worker process ended without answering (exit code {proc.poll()})"
        if "error" in msg:
            cls._stop(proc)
            return str(msg["error"])
        return cls(proc, dict(msg.get("info") or {}), env.get("OMP_WAIT_POLICY"))

    def eval(self, ids: list[int], reset: bool) -> int:
        self.proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "reset": reset}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker process ended (exit code {self.proc.poll()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(str(msg["error"]))
        return int(msg["tok"])

    def engine(self, name: str, label: str, info: dict[str, Any] | None = None) -> Engine:
        def prefill(ids: list[int]) -> tuple[int, Any]:
            return self.eval(ids, reset=True), None

        def decode(tok: int, state: Any) -> tuple[int, Any]:
            return self.eval([tok], reset=False), None

        process = f"its own (picompile/tools/engine_worker.py), OMP_WAIT_POLICY {self.omp_policy or 'unset'}"
        return Engine(name, label, prefill, decode, info={**(info or {}), "process": process})

"""``picompile bench ART``: end-to-end prefill and decode speed of an artifact against dense PyTorch eager.

Every engine runs on the same prompt (seeded random token ids) and decodes greedily:

* ``picompile-compiled`` (``--compile``) the same step through ``torch.compile`` (``load(art, compile=True)``),
                       sharing the weights; listed first, the headline ratios are then its own;
* ``picompile``        the artifact as built (predictors + sparse kernels);
* ``picompile-dense``  the same graph with every FFN neuron computed (``load(art, dense=True)``; it shares
                       the weights of the first, so it costs no memory);
* ``pytorch``          the HF model the artifact was built from (``manifest.model["source"]``), float32,
                       eager, a manual prefill + decode loop with its KV cache, ``torch.inference_mode()``,
                       in a process of its own (``picompile/engine_worker.py``: the user's OpenMP settings,
                       not the PASSIVE wait policy picompile sets for itself, which slows eager PyTorch ~8 %);
* optional extras, skipped with a printed reason when not installed: ONNX Runtime on the same weights
  (``picompile.tools.ort_reference.OrtDenseSession``) and llama.cpp (``llama_cpp`` with a GGUF given by ``--gguf``;
  ``--gguf auto`` converts the source checkpoint with ``picompile.formats.gguf_export`` into
  ``<cache>/gguf/NAME-TYPE.gguf``, reused while newer than the checkpoint; ``--gguf-type`` f32 (default,
  as the artifact's weights) or f16; ``pip install 'picompile[bench]'``). llama.cpp runs the same thread
  count as the other engines, its KV cache in the ``--gguf-type``, in a process of its own
  (``picompile/llama_worker.py``) with the user's OpenMP settings rather than this process's PASSIVE. Its ``llama`` architecture computes
  SiLU in the FFN whatever the checkpoint's activation: for a ReLU model it is a dense-speed baseline
  (same weights, bytes and FLOPs per token), not the same outputs.

Rounds are interleaved (A B C, then C B A, …; ``--repeats`` rounds after one untimed warm-up round),
so load from other processes hits every engine alike; rates are medians over rounds (each engine's best
round is reported too: on a busy machine it is the steadier figure). A round times one prefill of
``--prompt-len`` tokens and ``--tokens`` decode steps after it.

Bytes per token: the weight bytes one decode step reads, from the loaded graph: every tensor the graph
reads in full (attention, norms, predictors, lm_head), one embedding row, and of each FFN the rows of
the neurons computed: the mask counts measured on a separate decode of the same prompt (fallback: the
manifest's per-layer ``predicted_active``), plus the KV cache read at the mean decode position. The
bound is the memory bandwidth divided by it; the bandwidth is ``dst.copy_(src)`` of a buffer much
larger than the caches, measured once per round (read + write bytes / time, median) — the convention
of ``benchmarks/kernels.py``.
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
from torch import Tensor, fx

from picompile.errors import PicompileError

REQUIRED_KEYS: tuple[str, ...] = (
    "decode_tokens_per_s", "dense_decode_tokens_per_s", "decode_speedup",
    "prefill_tokens_per_s", "dense_prefill_tokens_per_s", "prefill_speedup",
    "bytes_per_token", "bound_tokens_per_s", "bandwidth_gbs",
)

OPTIONAL: tuple[str, ...] = ("onnxruntime", "llama.cpp")  # engines whose failure only skips them
FFN_OPS: dict[str, int] = {"ffn": 8, "sparse_ffn": 5, "tvm_sparse_ffn": 5}  # op -> position of its mask


# -- engines ---------------------------------------------------------------------------------------
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

    def run(self, prompt: list[int], n: int, record: bool = True) -> None:
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


def _argmax(logits: Any) -> int:
    t = torch.as_tensor(logits)
    return int(torch.argmax(t.reshape(-1, t.shape[-1])[-1]))


def session_engine(name: str, label: str, session: Any) -> Engine:
    """A picompile session as ``generate`` runs it: a decoder over its KV cache (in place where it can be)."""
    def prefill(ids: list[int]) -> tuple[int, Any]:
        dec = session.decoder()
        return _argmax(dec.feed(ids)), dec

    def decode(tok: int, dec: Any) -> tuple[int, Any]:
        return _argmax(dec.feed([tok])), dec

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
        return _argmax(logits), past

    def decode(tok: int, past: Any) -> tuple[int, Any]:
        logits, past = sess.step([[tok]], past)
        return _argmax(logits), past

    return Engine("onnxruntime", "ONNX Runtime", prefill, decode)


GGUF_TYPES: tuple[str, ...] = ("f32", "f16")
GGUF_FILE_TYPES: dict[int, str] = {0: "f32", 1: "f16", 32: "bf16"}  # general.file_type -> name


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

    ``threads`` for both decode and batch (prefill); the KV cache is ``gguf_type`` (f32 or f16).
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
    worker = WorkerEngine.start("llama.cpp", Path(gguf), n_ctx, threads, gguf_type)
    if isinstance(worker, str):
        return f"llama.cpp could not load {gguf}: {worker}"
    file_type = str(worker.info.get("file_type", ""))
    ftype = GGUF_FILE_TYPES.get(int(file_type), "GGUF") if file_type.isdigit() else "GGUF"
    label = f"llama.cpp {ftype} (dense; SiLU kernel{', same weights' if converted else ''})"
    info = {"gguf": str(gguf), "gguf_file_type": ftype, "kv_type": gguf_type, "converted": converted,
            "ffn_activation": "silu (llama.cpp's llama architecture)"}
    return worker.engine("llama.cpp", label, info)


class WorkerEngine:
    """An engine in a ``picompile/engine_worker.py`` child process, run with the user's own OpenMP settings
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

        import picompile

        env = dict(os.environ)
        if picompile.USER_OMP_WAIT_POLICY is None:
            env.pop("OMP_WAIT_POLICY", None)
        else:
            env["OMP_WAIT_POLICY"] = picompile.USER_OMP_WAIT_POLICY
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

        process = f"its own (picompile/engine_worker.py), OMP_WAIT_POLICY {self.omp_policy or 'unset'}"
        return Engine(name, label, prefill, decode, info={**(info or {}), "process": process})


# -- bytes per token -------------------------------------------------------------------------------
def _op_name(target: object) -> str | None:
    from picompile.ir.ops import is_picompile_op

    for name in FFN_OPS:
        if is_picompile_op(target, name):
            return name
    return None


def _attr(gm: fx.GraphModule, node: Any) -> Tensor | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return obj if isinstance(obj, Tensor) else None
    return None


def skips_inactive(op: str | None, args: tuple[Any, ...] | list[Any]) -> bool:
    """Whether an FFN node's one-token call runs a CPU kernel (``args[10]``, its key) that reads only the
    deciding rows (gate; no gate: up, b_up) of a selected neuron whose ReLU is 0 (``kernels.skips_inactive``)."""
    from picompile.kernels import skips_inactive as kernel_skips

    if op != "tvm_sparse_ffn" or len(args) <= 10 or not args[10]:
        return False
    return kernel_skips("ffn_gated" if args[3] is not None else "ffn_relu", str(args[6]))


def weight_bytes(gm: fx.GraphModule, active: dict[int, float] | None,
                 fired: dict[int, float] | None = None) -> dict[str, Any]:
    """Weight bytes one decode token reads through ``gm``.

    ``active``: per FFN layer, the fraction of neurons computed (``None``, or a layer missing: all of
    them, as in a graph without masks). ``fired``: per layer, the fraction of neurons selected *and*
    firing (ReLU output non-zero); where a kernel skips the rest of a selected row that does not fire
    (:func:`skips_inactive`), only its deciding rows count at ``active``, the others at ``fired``.
    Returns {"total", "ffn", "ffn_full", "other"} in bytes.
    """
    uses: dict[int, float] = {}  # tensor start address -> bytes read (max over its uses)
    ffn_ptrs: set[int] = set()
    ffn_full = 0.0

    def use(t: Tensor, nbytes: float, ffn: bool = False) -> None:
        key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        uses[key] = max(uses.get(key, 0.0), float(nbytes))
        if ffn:
            ffn_ptrs.add(key)

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = _op_name(node.target)
        if op is not None:
            layer = int(node.args[7])
            has_mask = len(node.args) > FFN_OPS[op] and node.args[FFN_OPS[op]] is not None
            frac = (active or {}).get(layer, 1.0) if has_mask else 1.0
            w_up = _attr(gm, node.args[1])
            n_rows = int(w_up.shape[0]) if w_up is not None else 0
            later: tuple[int, ...] = ()  # positions read only for the selected rows that fire
            if has_mask and fired and layer in fired and skips_inactive(op, node.args):
                later = (1, 2, 4) if node.args[3] is not None else (4,)
            for pos in range(1, 6 if op == "ffn" else 5):
                t = _attr(gm, node.args[pos]) if pos < len(node.args) else None
                if t is None:
                    continue
                nbytes = t.numel() * t.element_size()
                if op == "ffn" and pos == 4:  # w_down [d_model, n_neurons]: a column per neuron
                    row_sparse = t.dim() == 2 and t.shape[1] == n_rows
                elif op == "ffn" and pos == 5:  # down bias: read in full
                    row_sparse = False
                else:  # w_up, b_up, w_gate, w_down_t: a row per neuron
                    row_sparse = t.shape[0] == n_rows
                ffn_full += nbytes
                f = (fired or {}).get(layer, frac) if pos in later else frac
                use(t, nbytes * f if row_sparse else nbytes, ffn=True)
            continue
        if node.target is torch.ops.aten.embedding.default:
            t = _attr(gm, node.args[0])
            if t is not None:
                use(t, t.shape[-1] * t.element_size())  # one row per token
            continue
        for arg in list(node.args) + list(node.kwargs.values()):
            t = _attr(gm, arg)
            if t is not None:
                use(t, t.numel() * t.element_size())
    total = sum(uses.values())
    ffn = sum(v for k, v in uses.items() if k in ffn_ptrs)
    return {"total": total, "ffn": ffn, "ffn_full": ffn_full, "other": total - ffn}


class _MaskCounter(fx.Interpreter):
    """Runs a graph and counts, per FFN layer, the neurons its masks select (decode tokens)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.selected: dict[int, int] = {}
        self.fired: dict[int, int] = {}  # selected rows whose ReLU output is not 0 (kernels that skip the rest)
        self.rows: dict[int, int] = {}

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        op = _op_name(target)
        if op is not None and len(args) > FFN_OPS[op] and isinstance(args[FFN_OPS[op]], Tensor):
            layer = int(args[7])
            mask = args[FFN_OPS[op]]
            self.selected[layer] = self.selected.get(layer, 0) + int(mask.sum())
            self.rows[layer] = self.rows.get(layer, 0) + int(mask.numel())
            if skips_inactive(op, args):  # the deciding value of each selected row, as the kernel forms it
                rows = mask.reshape(-1).nonzero().squeeze(1)  # [k]
                x = args[0].reshape(-1).float()  # one token  # [d_model]
                w_gate, w_up, b_up = args[3], args[1], args[2]
                z = (w_gate if w_gate is not None else w_up)[rows].float() @ x  # [k]
                if w_gate is None and b_up is not None:
                    z = z + b_up[rows].float()
                n_fired = int((z > 0).sum())
            else:
                n_fired = int(mask.sum())
            self.fired[layer] = self.fired.get(layer, 0) + n_fired
        return super().call_function(target, args, kwargs)


def measured_active(session: Any, prompt: list[int], n: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per FFN layer, the fraction of neurons the masks select over ``n`` greedy decode steps after ``prompt``,
    and the fraction selected and firing (see :func:`weight_bytes`)."""
    logits, past = session.step(torch.tensor([prompt]), session.empty_past())
    tok = _argmax(logits)
    counter = _MaskCounter(session.graph)
    with torch.inference_mode():
        for _ in range(n):
            out = counter.run(torch.tensor([[tok]]), *past)
            tok, past = _argmax(out[0][0]), tuple(out[1:])
    layers = [layer for layer in counter.rows if counter.rows[layer]]
    return ({layer: counter.selected[layer] / counter.rows[layer] for layer in layers},
            {layer: counter.fired[layer] / counter.rows[layer] for layer in layers})


def manifest_active(manifest: Any) -> dict[int, float] | None:
    out = {}
    for layer in manifest.layers:
        for key in ("predicted_active", "true_active"):
            if layer.get(key) is not None:
                out[int(layer["index"])] = float(layer[key])
                break
    return out or None


def kv_bytes(session: Any, context: float) -> float:
    """KV-cache bytes one decode step reads at ``context`` past tokens (float32)."""
    return float(session.n_past * session.kv_heads * session.head_dim * 4 * context)


def copy_bandwidth(src: Tensor, dst: Tensor, tries: int = 3) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting read + write: the best of ``tries`` back-to-back
    copies. (The first copy after the engines ran is often 3-5x slower on this machine kind: threads
    other libraries leave spinning, cores woken from idle; a decode step is continuous work, so the
    bound it is compared with is the warm figure.)"""
    best = 0.0
    for _ in range(max(1, tries)):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * src.element_size() / (time.perf_counter() - t0))
    return best


# -- the benchmark ---------------------------------------------------------------------------------
def run_bench(
    artifact: str | Path,
    tokens: int = 32,
    prompt_len: int = 64,
    repeats: int = 5,
    threads: int | None = None,
    *,
    dense_artifact: bool = True,
    extras: bool = True,
    gguf: Path | str | None = None,
    gguf_type: str | None = None,
    copy_mib: int = 256,
    seed: int = 0,
    mask_tokens: int = 8,
    compile: bool = False,
    prefill_dtype: str | None = None,
    emit: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Measure ``artifact`` against dense PyTorch eager; return the result dict (see the module doc)."""
    import picompile
    from picompile.config import default_cache_dir

    if tokens < 1 or prompt_len < 1 or repeats < 1:
        raise PicompileError(f"--tokens, --prompt-len and --repeats must be >= 1, got {tokens}, {prompt_len}, {repeats}")
    if copy_mib < 1:
        raise PicompileError(f"--copy-mib must be >= 1, got {copy_mib}")
    if gguf_type is not None and gguf_type not in GGUF_TYPES:
        raise PicompileError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    threads = threads or _default_threads()
    if threads < 1:
        raise PicompileError(f"--threads must be >= 1, got {threads}")
    load_before = os.getloadavg()
    torch.set_num_threads(threads)
    emit(f"loading {artifact}")
    session = picompile.load(artifact, hybrid="off")  # its byte and mask accounting reads the unscheduled parts
    compiled = compiled_view(session) if compile else None
    manifest = session.manifest
    gguf_type = gguf_type or ("f16" if manifest.weights.get("dtype") == "float16" else "f32")  # as the artifact
    if manifest.sections.get("kernels"):
        from picompile.kernels import set_num_threads

        set_num_threads(threads)
    if prompt_len + tokens > session.max_seq_len:
        raise PicompileError(f"--prompt-len {prompt_len} + --tokens {tokens} exceed this artifact's context "
                             f"({session.max_seq_len} tokens)")
    from picompile.formats.provenance import resolve_source

    source = resolve_source(manifest.model) or str(manifest.model.get("source") or "")
    if not source or not Path(source).exists():
        raise PicompileError(f"the artifact's source model {source!r} is not present here; the PyTorch baseline needs it")
    emit(f"loading the PyTorch baseline {source} (in a process of its own)")
    pt_worker = WorkerEngine.start("pytorch", source, threads)
    if isinstance(pt_worker, str):  # the baseline is required: say why it could not start
        raise PicompileError(f"the PyTorch baseline could not load {source}: {pt_worker}")
    engines = [session_engine("picompile", "picompile", session)]
    if compiled is not None:  # first, so it is the one every ratio is about; the eager step stays beside it
        engines.insert(0, session_engine("picompile-compiled", "picompile compile=True", compiled))
    dense_session = dense_view(session) if dense_artifact else None
    low = None
    if prefill_dtype is not None:  # the same step with the prompt's GEMMs in prefill_dtype, beside the default
        from picompile.runtime import Session

        low = Session(session.root, manifest, session.graph, session.tokenizer, compile=compile,
                      prefill_dtype=prefill_dtype)
        engines.insert(1, session_engine(f"picompile-{prefill_dtype}-prefill",
                                         f"picompile prefill_dtype={prefill_dtype}{' compile=True' if compile else ''}",
                                         low))
    if dense_session is not None:
        dense_run = compiled_view(dense_session) if compile else dense_session
        engines.append(session_engine("picompile-dense", f"picompile dense=True{' compile=True' if compile else ''}", dense_run))
    engines.append(pt_worker.engine("pytorch", "PyTorch eager"))
    skipped: dict[str, str] = {}
    if extras:
        for name, made in (("onnxruntime", lambda: ort_engine(source, default_cache_dir(), threads)),
                           ("llama.cpp", lambda: llama_cpp_engine(gguf, prompt_len + tokens + 8, threads, source=source,
                                                                  gguf_type=gguf_type, emit=emit))):
            emit(f"setting up {name}")
            eng = made()
            if isinstance(eng, str):
                skipped[name] = eng
            else:
                engines.append(eng)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, session.vocab_size, (prompt_len,), generator=gen).tolist()

    src = torch.ones(copy_mib << 18)  # float32: copy_mib MiB
    dst = torch.zeros_like(src)
    failed: dict[str, str] = {}

    def run(eng: Engine, n: int, record: bool = True) -> None:
        try:
            eng.run(prompt, n, record=record)
        except Exception as e:
            if eng.name not in OPTIONAL:  # optional extras never fail the benchmark
                raise
            failed[eng.name] = f"{type(e).__name__}: {e}"
            engines.remove(eng)

    emit("warm-up round")
    for eng in list(engines):
        run(eng, min(tokens, 2), record=False)
    copy_bandwidth(src, dst)
    bandwidth: list[float] = []
    for r in range(repeats):
        emit(f"round {r + 1}/{repeats}")
        for eng in list(engines if r % 2 == 0 else engines[::-1]):
            run(eng, tokens)
        bandwidth.append(copy_bandwidth(src, dst))
    del src, dst

    emit("counting the neurons the masks select")
    active, fired = measured_active(session, prompt, min(tokens, mask_tokens)) if mask_tokens > 0 else ({}, {})
    from_manifest = manifest_active(manifest)
    used = active or from_manifest
    sparse_w = weight_bytes(session.graph, used, fired or None)
    dense_w = weight_bytes((dense_session or dense_view(session)).graph, None)
    kv = kv_bytes(session, prompt_len + (tokens - 1) / 2)
    bw = statistics.median(bandwidth)
    rates = {eng.name: eng.rates(prompt_len, tokens) for eng in engines}
    pf, dc = rates[engines[0].name]  # the compiled step when compile=True, else the eager one
    dpf, ddc = rates["pytorch"]
    bytes_tok = sparse_w["total"] + kv
    dense_bytes = dense_w["total"] + kv
    result: dict[str, Any] = {
        "artifact": str(artifact),
        "source": source,
        "synthetic": bool(manifest.model.get("config", {}).get("picompile_synthetic")),
        "decode_tokens_per_s": dc,
        "dense_decode_tokens_per_s": ddc,
        "decode_speedup": dc / ddc,
        "prefill_tokens_per_s": pf,
        "dense_prefill_tokens_per_s": dpf,
        "prefill_speedup": pf / dpf,
        "bytes_per_token": bytes_tok,
        "bound_tokens_per_s": bw / bytes_tok,
        "bandwidth_gbs": bw / 1e9,
        "dense_bytes_per_token": dense_bytes,
        "dense_bound_tokens_per_s": bw / dense_bytes,
        "kv_bytes_per_token": kv,
        "ffn_bytes_per_token": sparse_w["ffn"],
        "ffn_bytes_dense": sparse_w["ffn_full"],
        "other_bytes_per_token": sparse_w["other"],
        "ffn_active_fraction": _mean(active) if active else None,
        "ffn_fired_fraction": _mean(fired) if fired else None,
        "ffn_active_fraction_manifest": _mean(from_manifest) if from_manifest else None,
        "active_source": "measured masks" if active else ("manifest predicted_active" if from_manifest else "none (dense)"),
        "engines": {eng.name: {"label": eng.label, "prefill_tokens_per_s": rates[eng.name][0],
                               "decode_tokens_per_s": rates[eng.name][1],
                               "decode_vs_pytorch": rates[eng.name][1] / ddc,
                               "prefill_vs_pytorch": rates[eng.name][0] / dpf,
                               # best round: less sensitive to other processes than the median
                               "best_prefill_tokens_per_s": prompt_len / min(eng.prefill_s),
                               "best_decode_tokens_per_s": tokens / min(eng.decode_s),
                               "prefill_s": eng.prefill_s, "decode_s": eng.decode_s, **eng.info}
                    for eng in engines},
        "best_decode_speedup": min(_by_name(engines, "pytorch").decode_s) / min(engines[0].decode_s),
        "skipped": {**skipped, **{k: f"failed: {v}" for k, v in failed.items()}},
        "same_tokens_as_pytorch": _common_prefix(engines[0].tokens, _by_name(engines, "pytorch").tokens),
        "tokens": tokens,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "threads": threads,
        "gguf": str(gguf) if gguf is not None else None,  # as given; the file used: engines["llama.cpp"]["gguf"]
        "gguf_type": gguf_type,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "compiled": compile,
        "kernels": bool(manifest.sections.get("kernels")),
        "bandwidth_samples_gbs": [b / 1e9 for b in bandwidth],
        "load_average": [load_before[0], os.getloadavg()[0]],
        "target": manifest.target.get("name"),
        "predictor": manifest.build.get("predictor"),
        "weight_dtype": manifest.weights.get("dtype", "float32"),
    }
    if compile:
        assert compiled is not None
        result["native_kernel_calls"] = compiled.step_fn.native_calls  # per decode step, as C++ ops
        result["native_reason"] = compiled.step_fn.native_reason
        result["same_tokens_as_eager"] = _common_prefix(engines[0].tokens, _by_name(engines, "picompile").tokens)
        result["eager_decode_tokens_per_s"] = rates["picompile"][1]
        result["eager_prefill_tokens_per_s"] = rates["picompile"][0]
    if low is not None:
        result["prefill_dtype"] = prefill_dtype
        result["low_prefill_tokens_per_s"], result["low_decode_tokens_per_s"] = rates[f"picompile-{prefill_dtype}-prefill"]
        result["low_prefill_speedup"] = result["low_prefill_tokens_per_s"] / dpf
        result["low_prefill_logits"] = logits_agreement(compiled if compiled is not None else session, low, prompt)
    if "llama.cpp" in rates:
        result["llama_cpp_decode_tokens_per_s"] = rates["llama.cpp"][1]
        result["decode_vs_llama_cpp"] = dc / rates["llama.cpp"][1]
    if dense_artifact:
        apf, adc = rates["picompile-dense"]
        result["artifact_dense_decode_tokens_per_s"] = adc
        result["artifact_dense_prefill_tokens_per_s"] = apf
    return result


def logits_agreement(ref: Any, other: Any, prompt: list[int]) -> dict[str, float]:
    """How ``other``'s prompt logits compare with ``ref``'s: relative error (Frobenius) and the share of
    positions whose top token agrees."""
    want, got = ref.decoder().feed(prompt), other.decoder().feed(prompt)  # [prompt_len, vocab] each
    return {"relative_error": float((got - want).norm() / want.norm()),
            "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean())}


def _by_name(engines: list[Engine], name: str) -> Engine:
    return next(e for e in engines if e.name == name)


def _mean(d: dict[int, float]) -> float:
    return sum(d.values()) / len(d)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _default_threads() -> int:
    try:
        from picompile.kernels import physical_cores

        return int(physical_cores())
    except Exception:
        return os.cpu_count() or 1


# -- printing --------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.3f} GB" if x >= 1e8 else f"{x / 1e6:.3f} MB"


def print_report(result: dict[str, Any], console: Any | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(highlight=False)
    title = escape(f"{result['artifact']}  (threads {result['threads']}, prompt {result['prompt_len']}, "
             f"decode {result['tokens']} tokens, {result['repeats']} interleaved rounds, medians)")
    table = Table(title=title, title_justify="left")
    for col in ("engine", "prefill tok/s", "decode tok/s", "prefill vs PyTorch", "decode vs PyTorch", "best decode tok/s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for eng in result["engines"].values():
        table.add_row(escape(eng["label"]), f"{eng['prefill_tokens_per_s']:.2f}", f"{eng['decode_tokens_per_s']:.2f}",
                      f"{eng['prefill_vs_pytorch']:.2f}x", f"{eng['decode_vs_pytorch']:.2f}x",
                      f"{eng['best_decode_tokens_per_s']:.2f}")
    console.print(table)
    for name, why in result["skipped"].items():
        console.print(escape(f"{name}: skipped ({why})"))
    lcpp = result["engines"].get("llama.cpp")
    if lcpp:
        console.print(f"[dim]llama.cpp: {escape(lcpp['gguf'])} (weights {lcpp['gguf_file_type']}, KV cache "
                      f"{lcpp['kv_type']}); its llama architecture computes SiLU in the FFN: a dense-speed baseline "
                      "on the same weights (same bytes and FLOPs per token), not the same outputs[/dim]")
    act = result["ffn_active_fraction"] if result["ffn_active_fraction"] is not None else result["ffn_active_fraction_manifest"]
    console.print(
        f"bytes/token: {_gb(result['bytes_per_token'])} (FFN {_gb(result['ffn_bytes_per_token'])} of "
        f"{_gb(result['ffn_bytes_dense'])} dense, masks select {'%.1f%%' % (100 * act) if act is not None else 'all'} "
        f"of the neurons ({result['active_source']})"
        + (f", {100 * result['ffn_fired_fraction']:.1f}% selected and firing (the rest cost only their gate rows)"
           if result.get("ffn_fired_fraction") is not None and act is not None and result["ffn_fired_fraction"] < act
           else "")
        + f"; other weights {_gb(result['other_bytes_per_token'])}, "
        f"KV {_gb(result['kv_bytes_per_token'])}); dense {_gb(result['dense_bytes_per_token'])}")
    console.print(
        f"copy bandwidth {result['bandwidth_gbs']:.2f} GB/s → bound {result['bound_tokens_per_s']:.2f} tok/s "
        f"(dense bound {result['dense_bound_tokens_per_s']:.2f}); picompile decode reaches "
        f"{result['decode_tokens_per_s'] / result['bound_tokens_per_s']:.0%} of its bound")
    if result.get("prefill_dtype"):
        agree = result["low_prefill_logits"]
        console.print(f"prefill_dtype={result['prefill_dtype']}: prefill {result['low_prefill_speedup']:.2f}x PyTorch "
                      f"(default {result['prefill_speedup']:.2f}x); its prompt logits against the default's: relative "
                      f"error {agree['relative_error']:.1e}, top token equal at {agree['top1_agreement']:.0%} of positions")
    if result.get("compiled"):
        native = (f"{result['native_kernel_calls']} kernel calls per decode step as C++ ops" if result["native_kernel_calls"]
                  else f"kernel calls through Python ({result['native_reason']})")
        console.print(f"compiled step: {native}; greedy tokens equal to the eager step's: first "
                      f"{result['same_tokens_as_eager']} of {result['tokens'] + 1}")
    console.print(f"[dim]greedy tokens equal to PyTorch's: first {result['same_tokens_as_pytorch']} of "
                  f"{result['tokens'] + 1}; load average {result['load_average'][0]:.2f} → {result['load_average'][1]:.2f}"
                  f"{'; SYNTHETIC model' if result['synthetic'] else ''}[/dim]")
    if result["kernels"] and (result["omp_wait_policy"] or "").upper() != "PASSIVE":
        console.print(f"[dim]note: OMP_WAIT_POLICY={result['omp_wait_policy']}: torch's OpenMP workers spin after "
                      "each op and take the cores the TVM kernels need (picompile defaults it to PASSIVE)[/dim]")


# -- command line ----------------------------------------------------------------------------------

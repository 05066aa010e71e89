"""``picompile bench ART``: end-to-end prefill and decode speed of an artifact against dense PyTorch eager.

Every engine runs on the same prompt (seeded random token ids) and decodes greedily:

* ``picompile-compiled`` (``--compile``) the same step through ``torch.compile`` (``load(art, compile=True)``),
                       sharing the weights; listed first, the headline ratios are then its own;
* ``picompile``        the artifact as built (predictors + sparse kernels);
* ``picompile-dense``  the same graph with every FFN neuron computed (``load(art, dense=True)``; it shares
                       the weights of the first, so it costs no memory);
* ``pytorch``          the HF model the artifact was built from (``manifest.model["source"]``), float32,
                       eager, a manual prefill + decode loop with its KV cache, ``torch.inference_mode()``,
                       in a process of its own (``picompile/tools/engine_worker.py``: the user's OpenMP settings,
                       not the PASSIVE wait policy picompile sets for itself, which slows eager PyTorch ~8 %);
* optional extras, skipped with a printed reason when not installed or not asked for: ONNX Runtime on the
  same weights (``picompile.tools.ort_reference.OrtDenseSession``; ``onnxruntime=False`` skips it) and
  llama.cpp measured by its own ``llama-bench`` (``llama_bench=PATH|"auto"``, :mod:`picompile.tools.llama_bench`:
  one ``llama-bench -m GGUF -t THREADS -p PROMPT_LEN -n TOKENS -r 1 -o json`` per round, its pp rate as prefill,
  its tg rate as decode) on a GGUF of the same weights at the artifact's precision (``gguf``: a file, or
  None / "auto": the source checkpoint converted into ``<cache>/gguf/NAME-TYPE.gguf``; ``gguf_type`` overrides
  the precision). Its ``llama`` architecture computes SiLU in the FFN whatever the checkpoint's activation: for
  a ReLU model it is a dense-speed baseline (same weights, bytes and FLOPs per token), not the same outputs.
  ``llama_cpp_python=True`` runs the GGUF once through llama-cpp-python after the rounds, for its greedy
  tokens only (not timed).

Rounds are interleaved (A B C, then C B A, …; ``--repeats`` rounds after one untimed warm-up round),
so load from other processes hits every engine alike; rates are medians over rounds (each engine's best
round is reported too: on a busy machine it is the steadier figure). A round times one prefill of
``--prompt-len`` tokens and ``--tokens`` decode steps after it.

Bytes per token: the weight bytes one decode step reads, from the loaded graph: every tensor the graph
reads in full (attention, norms, predictors, lm_head), one embedding row, and of each FFN the rows of
the neurons computed: the mask counts measured on a separate decode of the same prompt (fallback: the
manifest's per-layer ``predicted_active``), plus the KV cache read at the mean decode position. The
bound is the read bandwidth divided by it: ``buf.sum()`` over a buffer much larger than the caches
(``read_mib``), bytes / time; a decode step reads and hardly writes. The bandwidth a shared machine gives moves
between ~35 and ~65 GB/s within minutes on the 2-core VMs, so each engine's bound uses the read bandwidth
sampled just before and just after each of its own timed runs (median over rounds), not one figure for the
run. The copy bandwidth (``dst.copy_(src)``, read + write, the convention of ``benchmarks/kernel_bandwidth.py``)
is reported beside it, once per round. llama.cpp's bytes per token are its GGUF's, dense
(:func:`picompile.tools.llama_bench.gguf_bytes_per_token`), over the read bandwidth around llama-bench's runs.

The engines are :mod:`picompile.tools.engines`; the byte accounting :mod:`picompile.tools.traffic`.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from picompile.errors import PicompileError
from picompile.tools.engines import (
    Engine,
    WorkerEngine,
    compiled_view,
    dense_view,
    llama_cpp_engine,
    ort_engine,
    session_engine,
)
from picompile.tools.llama_bench import GGUF_TYPES, find_tool, gguf_bytes_per_token, gguf_type_for, llama_bench_engine, peer_gguf
from picompile.tools.traffic import (copy_bandwidth, kv_bytes, manifest_active, measured_active,
                                     measured_input_active, weight_bytes)

REQUIRED_KEYS: tuple[str, ...] = (
    "decode_tokens_per_s", "dense_decode_tokens_per_s", "decode_speedup",
    "prefill_tokens_per_s", "dense_prefill_tokens_per_s", "prefill_speedup",
    "bytes_per_token", "bound_tokens_per_s", "bandwidth_gbs",
)

OPTIONAL: tuple[str, ...] = ("onnxruntime", "llama-bench")  # engines whose failure only skips them

Emit = Callable[[str], None]


@dataclass(frozen=True)
class BenchOptions:
    """What one benchmark measures and how: the arguments of :func:`run_bench` (its defaults)."""

    tokens: int  # decode steps per round
    prompt_len: int
    repeats: int  # timed interleaved rounds
    threads: int | None  # None: the physical cores
    dense_artifact: bool  # the load(dense=True) column
    extras: bool  # ONNX Runtime and (when asked for) llama.cpp
    llama_bench: Path | str | None  # llama.cpp's own llama-bench: a path, "auto" (the cached build) or None (off)
    llama_cpp_python: bool  # llama.cpp through llama-cpp-python, for its greedy tokens (not timed)
    gguf: Path | str | None  # the llama.cpp engines' weights; None or "auto": converted from the source checkpoint
    gguf_type: str | None  # None: the artifact's weight precision (float16 -> f16, int8 -> q8_0, ...)
    copy_mib: int  # bandwidth copy buffer
    read_mib: int  # read-bandwidth buffer (the bound's bandwidth)
    seed: int  # of the prompt
    mask_tokens: int  # decode steps whose masks are counted (0: the manifest's figures)
    compile: bool
    prefill_dtype: str | None
    onnxruntime: bool = True  # with extras: ONNX Runtime too
    pytorch: bool = True  # the PyTorch eager baseline (skipped, with the reason, where its weights cannot stay resident)
    warm_each_round: bool = False  # weights mapped, and an untimed prefill before each timed round of picompile's

    def checked(self) -> "BenchOptions":
        """These options with the thread count resolved; a PicompileError names the first bad one."""
        if self.tokens < 1 or self.prompt_len < 1 or self.repeats < 1:
            raise PicompileError(f"--tokens, --prompt-len and --repeats must be >= 1, got {self.tokens}, "
                                 f"{self.prompt_len}, {self.repeats}")
        if self.copy_mib < 1 or self.read_mib < 1:
            raise PicompileError(f"--copy-mib and --read-mib must be >= 1, got {self.copy_mib}, {self.read_mib}")
        if self.gguf_type is not None and self.gguf_type not in GGUF_TYPES:
            raise PicompileError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")
        threads = self.threads or _default_threads()
        if threads < 1:
            raise PicompileError(f"--threads must be >= 1, got {threads}")
        llama_bench = self.llama_bench
        if llama_bench is not None and self.extras:  # asked for by name: missing is an error, before any loading
            from picompile.config import default_cache_dir

            llama_bench = find_tool(llama_bench, "llama-bench", default_cache_dir())
        if self.gguf not in (None, "auto") and not Path(self.gguf).is_file():
            raise PicompileError(f"--gguf {self.gguf}: no such file")
        return dataclasses.replace(self, threads=threads, llama_bench=llama_bench)


@dataclass
class Lineup:
    """The sessions and the engines timed on them, in report order (the first is the headline)."""

    session: Any  # the artifact as built (hybrid off: its byte and mask accounting reads the unscheduled parts)
    compiled: Any | None  # the same through torch.compile (--compile)
    dense_session: Any | None  # load(dense=True) sharing the weights (--no-dense-artifact: None)
    low: Any | None  # the step with the prompt's GEMMs in --prefill-dtype
    source: str  # the HF checkpoint the artifact was built from
    gguf_type: str  # llama.cpp's weight type (the artifact's precision unless --gguf-type)
    engines: list[Engine]
    skipped: dict[str, str]  # optional engine -> why it is not timed
    gguf: Path | None = None  # the llama.cpp engines' GGUF, once made
    text_peer: Engine | None = None  # llama-cpp-python, run once after the rounds for its greedy tokens


@dataclass
class Traffic:
    """Bytes one decode step reads, sparse and dense, and where the active fractions came from."""

    active: dict[int, float]  # measured: per layer, neurons the masks select
    fired: dict[int, float]  # measured: selected and firing
    from_manifest: dict[int, float] | None
    sparse: dict[str, Any]  # weight_bytes of the artifact's graph
    dense: dict[str, Any]  # weight_bytes of its dense view
    kv: float  # KV-cache bytes at the mean decode position


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
    llama_bench: Path | str | None = None,
    llama_cpp_python: bool = False,
    gguf: Path | str | None = None,
    gguf_type: str | None = None,
    copy_mib: int = 256,
    read_mib: int = 512,
    seed: int = 0,
    mask_tokens: int = 8,
    compile: bool = False,
    prefill_dtype: str | None = None,
    onnxruntime: bool = True,
    pytorch: bool = True,
    warm_each_round: bool = False,
    emit: Emit = lambda s: None,
) -> dict[str, Any]:
    """Measure ``artifact`` against dense PyTorch eager; return the result dict (see the module doc)."""
    opts = BenchOptions(tokens, prompt_len, repeats, threads, dense_artifact, extras, llama_bench, llama_cpp_python, gguf,
                        gguf_type, copy_mib, read_mib, seed, mask_tokens, compile, prefill_dtype, onnxruntime, pytorch,
                        warm_each_round).checked()
    load_before = os.getloadavg()
    lineup = _lineup(artifact, opts, emit)
    gen = torch.Generator().manual_seed(opts.seed)
    prompt = torch.randint(0, lineup.session.vocab_size, (opts.prompt_len,), generator=gen).tolist()
    bandwidth, failed = _rounds(lineup.engines, prompt, opts, emit)
    traffic = _traffic(lineup, prompt, opts, emit)
    rates = {eng.name: eng.rates(opts.prompt_len, opts.tokens) for eng in lineup.engines}
    result = _result(artifact, opts, lineup, rates, bandwidth, failed, traffic, load_before[0])
    result = _with_variants(result, opts, lineup, rates, prompt)
    result = _with_llama_cpp(result, opts, lineup, rates, prompt, emit)
    return _with_gemm_probe(result, lineup)


def _with_gemm_probe(result: dict[str, Any], lineup: Lineup) -> dict[str, Any]:
    """``result`` plus the machine's GEMM rate on the model's prefill shape and prefill's own (``gemm_probe``)."""
    from picompile.tools.gemm_probe import prefill_gemm_rate

    result["sparse_prefill_parts"] = int(getattr(lineup.session, "sparse_prefill_parts", 0))
    try:
        result.update(prefill_gemm_rate(lineup.session.manifest.model.get("config", {}), result["prompt_len"],
                                        result["prefill_tokens_per_s"]))
    except PicompileError:  # a config the shape reader does not know: no probe
        pass
    return result


def _lineup(artifact: str | Path, opts: BenchOptions, emit: Emit) -> Lineup:
    """Load the artifact and start every engine (the PyTorch baseline is required, the extras are not)."""
    import picompile

    assert opts.threads is not None
    torch.set_num_threads(opts.threads)
    emit(f"loading {artifact}")
    # its byte and mask accounting reads the unscheduled parts; warm_each_round: the engines' files exceed the
    # memory together, so the weights stay on the file's mapping (else 13.5 GB of anonymous copies of a 7B leave
    # llama.cpp's mmap a part of the page cache, and it reads from disk every token)
    session = picompile.load(artifact, hybrid="off", weights="mapped" if opts.warm_each_round else "copied")
    compiled = compiled_view(session) if opts.compile else None
    manifest = session.manifest
    try:
        gguf_type = opts.gguf_type or gguf_type_for(str(manifest.weights.get("dtype", "float32")))  # as the artifact
    except PicompileError:
        gguf_type = "f16"  # a precision llama.cpp has no type for: its usual one, and the report says so
    source = _check_session(session, opts)
    lineup = Lineup(session, compiled, None, None, source, gguf_type, [], {})
    _picompile_engines(lineup, opts)
    why_not = pytorch_skip_reason(source, session, opts.pytorch)
    if why_not is not None:
        lineup.skipped["pytorch"] = why_not
    else:
        emit(f"loading the PyTorch baseline {source} (in a process of its own)")
        pt_worker = WorkerEngine.start("pytorch", source, opts.threads)
        if isinstance(pt_worker, str):  # asked for and fits: say why it could not start
            raise PicompileError(f"the PyTorch baseline could not load {source}: {pt_worker}")
        lineup.engines.append(pt_worker.engine("pytorch", "PyTorch eager"))
    if opts.warm_each_round:
        for eng in lineup.engines:
            if eng.name.startswith("picompile"):
                eng.warm = True
    if opts.extras:
        _extra_engines(lineup, opts, emit)
    return lineup


def pytorch_skip_reason(source: str, session: Any, wanted: bool = True,
                        available: int | None = None) -> str | None:
    """Why the PyTorch baseline is not run (None: it is): not asked for, or the source checkpoint's weights
    (HF eager maps them in their stored dtype) and the artifact's together exceed the memory available, so
    interleaving the two would time page-cache refills from disk (a 7B in 16 bits: 2 × 13.5 GB on 24 GiB)."""
    from picompile.formats.manifest_schema import gib
    from picompile.frontend.base import available_memory_bytes

    if not wanted:
        return "--no-pytorch"
    src = Path(source)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors")) if src.is_dir() else 0
    artifact_bytes = sum(p.stat().st_size for p in Path(session.root).rglob("*.safetensors"))
    have = available_memory_bytes() if available is None else available
    if source_bytes + artifact_bytes > have:
        return (f"its checkpoint ({gib(source_bytes)}) and the artifact's weights ({gib(artifact_bytes)}) exceed the "
                f"{gib(have)} available together; timed side by side they would be read from disk (--no-pytorch)")
    return None


def _check_session(session: Any, opts: BenchOptions) -> str:
    """Set the kernels' threads; check the context and that the source model is here; return the source."""
    manifest = session.manifest
    if manifest.sections.get("kernels"):
        from picompile.kernels import set_num_threads

        set_num_threads(opts.threads)
    if opts.prompt_len + opts.tokens > session.max_seq_len:
        raise PicompileError(f"--prompt-len {opts.prompt_len} + --tokens {opts.tokens} exceed this artifact's context "
                             f"({session.max_seq_len} tokens)")
    from picompile.formats.provenance import resolve_source

    source = resolve_source(manifest.model) or str(manifest.model.get("source") or "")
    if (not source or not Path(source).exists()) and opts.pytorch:
        raise PicompileError(f"the artifact's source model {source!r} is not present here; the PyTorch baseline needs it "
                             "(--no-pytorch runs without it)")
    return source


def _picompile_engines(lineup: Lineup, opts: BenchOptions) -> None:
    """The artifact's own engines: compiled (first: every ratio is about it), eager, low-precision prefill, dense."""
    session, compile = lineup.session, opts.compile
    engines = [session_engine("picompile", "picompile", session)]
    if lineup.compiled is not None:  # first, so it is the one every ratio is about; the eager step stays beside it
        engines.insert(0, session_engine("picompile-compiled", "picompile compile=True", lineup.compiled))
    lineup.dense_session = dense_view(session) if opts.dense_artifact else None
    if opts.prefill_dtype is not None:  # the same step with the prompt's GEMMs in prefill_dtype, beside the default
        from picompile.runtime import Session

        lineup.low = Session(session.root, session.manifest, session.graph, session.tokenizer, compile=compile,
                             prefill_dtype=opts.prefill_dtype)
        engines.insert(1, session_engine(f"picompile-{opts.prefill_dtype}-prefill",
                                         f"picompile prefill_dtype={opts.prefill_dtype}{' compile=True' if compile else ''}",
                                         lineup.low))
    if lineup.dense_session is not None:
        dense_run = compiled_view(lineup.dense_session) if compile else lineup.dense_session
        engines.append(session_engine("picompile-dense", f"picompile dense=True{' compile=True' if compile else ''}",
                                      dense_run))
    lineup.engines.extend(engines)


def _extra_engines(lineup: Lineup, opts: BenchOptions, emit: Emit) -> None:
    """ONNX Runtime, and llama.cpp where asked for, where they can start; the reason each other one is skipped."""
    from picompile.config import default_cache_dir

    assert opts.threads is not None
    threads = opts.threads
    eng = ort_engine(lineup.source, default_cache_dir(), threads) if opts.onnxruntime else "--no-onnxruntime"
    if isinstance(eng, str):
        lineup.skipped["onnxruntime"] = eng
    else:
        lineup.engines.append(eng)
    if opts.llama_bench is None:
        lineup.skipped["llama-bench"] = ("not asked for: --llama-bench auto runs llama.cpp's own benchmark (built by "
                                         "benchmarks/build_llama_cpp.py) on the same weights at the same precision")
    if opts.llama_bench is None and not opts.llama_cpp_python:
        return
    gguf = _peer_gguf(lineup, opts, emit)
    if isinstance(gguf, str):
        if opts.llama_bench is not None:
            lineup.skipped["llama-bench"] = gguf
        if opts.llama_cpp_python:
            lineup.skipped["llama-cpp-python"] = gguf
        return
    lineup.gguf = gguf
    if opts.llama_bench is not None:
        lineup.engines.append(llama_bench_engine(Path(opts.llama_bench), gguf, lineup.gguf_type, threads,
                                                 opts.prompt_len, opts.tokens, info=_peer_info(lineup)))
    if opts.llama_cpp_python:
        emit("setting up llama-cpp-python (greedy tokens only)")
        text = llama_cpp_engine(gguf, opts.prompt_len + opts.tokens + 8, threads, gguf_type=lineup.gguf_type)
        if isinstance(text, str):
            lineup.skipped["llama-cpp-python"] = text
        else:
            lineup.text_peer = text


def _peer_gguf(lineup: Lineup, opts: BenchOptions, emit: Emit) -> Path | str:
    """The llama.cpp engines' GGUF: --gguf FILE as given, else the source checkpoint converted (cached) at
    ``lineup.gguf_type``; or why there is none."""
    from picompile.config import default_cache_dir

    if opts.gguf not in (None, "auto"):
        return Path(str(opts.gguf))
    cache = default_cache_dir()
    try:
        return peer_gguf(lineup.source, lineup.gguf_type, cache,
                         lambda: find_tool(Path(opts.llama_bench).with_name("llama-quantize") if opts.llama_bench
                                           else "auto", "llama-quantize", cache), emit)
    except PicompileError as e:
        return str(e)


def _peer_info(lineup: Lineup) -> dict[str, Any]:
    """What the report says about llama.cpp's side: the precision match and the FFN activation it computes."""
    import json

    dtype = str(lineup.session.manifest.weights.get("dtype", "float32"))
    try:
        act = str(json.loads((Path(lineup.source) / "config.json").read_text()).get("hidden_act", "silu"))
    except (OSError, ValueError):
        act = "unknown"
    try:
        same = gguf_type_for(dtype) == lineup.gguf_type
    except PicompileError:
        same = False
    return {"artifact_weight_dtype": dtype, "same_precision": same, "source_activation": act,
            "ffn_activation": "silu (llama.cpp's llama architecture hard-codes it)"}


@dataclass
class Bandwidth:
    """Samples (bytes/s): read only and copy (read + write), one per round; and per engine, the read bandwidth
    around each of its timed runs (the mean of one sample just before and one just after), the bound's."""

    read: list[float]
    copy: list[float]
    around: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def of(self, engine: str) -> float:
        """The median read bandwidth around ``engine``'s runs (bytes/s; every engine left ran each round)."""
        return statistics.median(self.around[engine])


def read_bandwidth(buf: torch.Tensor, tries: int = 3) -> float:
    """Bytes per second of ``buf.sum()`` (a read of every byte, nothing written): the best of ``tries``. A decode
    step reads its weights and writes almost nothing, so this, not the copy's read + write, is its bound."""
    best = 0.0
    for _ in range(max(1, tries)):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * buf.element_size() / (time.perf_counter() - t0))
    return best


def _rounds(engines: list[Engine], prompt: list[int], opts: BenchOptions, emit: Emit) -> tuple[Bandwidth, dict[str, str]]:
    """One untimed warm-up round, then ``repeats`` interleaved timed rounds, each followed by a read and a copy
    bandwidth sample: (the samples, optional engine -> why it failed; failed engines leave ``engines``)."""
    src = torch.ones(opts.copy_mib << 18)  # float32: copy_mib MiB
    dst = torch.zeros_like(src)
    buf = torch.ones(opts.read_mib << 18)  # float32: read_mib MiB
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
        run(eng, min(opts.tokens, 2), record=False)
    copy_bandwidth(src, dst)
    read_bandwidth(buf)
    bandwidth = Bandwidth([], [])
    for r in range(opts.repeats):
        emit(f"round {r + 1}/{opts.repeats}")
        for eng in list(engines if r % 2 == 0 else engines[::-1]):
            before = read_bandwidth(buf, tries=2)
            run(eng, opts.tokens)
            if eng in engines:  # a failed optional engine left the lineup
                bandwidth.around.setdefault(eng.name, []).append((before + read_bandwidth(buf, tries=2)) / 2)
        bandwidth.read.append(read_bandwidth(buf))
        bandwidth.copy.append(copy_bandwidth(src, dst))
    del src, dst, buf
    return bandwidth, failed


def _traffic(lineup: Lineup, prompt: list[int], opts: BenchOptions, emit: Emit) -> Traffic:
    """Bytes per decode step: the masks counted on a separate decode of the prompt (else the manifest's)."""
    session = lineup.session
    emit("counting the neurons the masks select")
    n = min(opts.tokens, opts.mask_tokens)
    active, fired = measured_active(session, prompt, n) if opts.mask_tokens > 0 else ({}, {})
    inputs = measured_input_active(session, prompt, n) if opts.mask_tokens > 0 else {}  # input sparsity's masks
    from_manifest = manifest_active(session.manifest)
    sparse = weight_bytes(session.graph, active or from_manifest, fired or None, inputs or None)
    dense = weight_bytes((lineup.dense_session or dense_view(session)).graph, None)
    kv = kv_bytes(session, opts.prompt_len + (opts.tokens - 1) / 2)
    return Traffic(active, fired, from_manifest, sparse, dense, kv)


# -- the result ------------------------------------------------------------------------------------
def _result(artifact: str | Path, opts: BenchOptions, lineup: Lineup, rates: dict[str, tuple[float, float]],
            bandwidth: Bandwidth, failed: dict[str, str], traffic: Traffic, load_before: float) -> dict[str, Any]:
    """The result dict (its keys in report order) without the optional columns' keys; ``rates``: per engine,
    (prefill, decode) tokens/s; ``load_before``: the load average when the run began."""
    engines, manifest = lineup.engines, lineup.session.manifest
    pf, dc = rates[engines[0].name]  # the compiled step when compile=True, else the eager one
    dpf, ddc = rates.get("pytorch", (None, None))  # None: the baseline was skipped (result["skipped"] says why)
    pytorch = next((e for e in engines if e.name == "pytorch"), None)
    around = {eng.name: bandwidth.of(eng.name) for eng in engines}  # bytes/s, each engine's bound's
    return {
        "artifact": str(artifact),
        "source": lineup.source,
        "synthetic": bool(manifest.model.get("config", {}).get("picompile_synthetic")),
        "decode_tokens_per_s": dc,
        "dense_decode_tokens_per_s": ddc,
        "decode_speedup": _ratio(dc, ddc),
        "prefill_tokens_per_s": pf,
        "dense_prefill_tokens_per_s": dpf,
        "prefill_speedup": _ratio(pf, dpf),
        **_bytes_fields(traffic, around[engines[0].name]),
        "copy_bandwidth_gbs": statistics.median(bandwidth.copy) / 1e9,
        "engines": {eng.name: _engine_row(eng, rates[eng.name], opts, dpf, ddc) for eng in engines},
        "best_decode_speedup": min(pytorch.decode_s) / min(engines[0].decode_s) if pytorch else None,
        "skipped": {**lineup.skipped, **{k: f"failed: {v}" for k, v in failed.items()}},
        "same_tokens_as_pytorch": _common_prefix(engines[0].tokens, pytorch.tokens) if pytorch else None,
        "tokens": opts.tokens,
        "prompt_len": opts.prompt_len,
        "repeats": opts.repeats,
        "threads": opts.threads,
        "gguf": str(lineup.gguf) if lineup.gguf is not None else None,  # the llama.cpp engines' file
        "gguf_type": lineup.gguf_type,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "compiled": opts.compile,
        "kernels": bool(manifest.sections.get("kernels")),
        "bandwidth_samples_gbs": [b / 1e9 for b in bandwidth.read],
        "engine_bandwidth_gbs": {name: bw / 1e9 for name, bw in around.items()},
        "copy_bandwidth_samples_gbs": [b / 1e9 for b in bandwidth.copy],
        "load_average": [load_before, os.getloadavg()[0]],
        "target": manifest.target.get("name"),
        "predictor": manifest.build.get("predictor"),
        "weight_dtype": manifest.weights.get("dtype", "float32"),
        "weights": "mapped" if opts.warm_each_round else "copied",  # the session's (picompile.load(weights=…))
    }


def _bytes_fields(t: Traffic, bw: float) -> dict[str, Any]:
    """Bytes per token, sparse and dense, and the bandwidth bounds they give (``bw``: bytes/s)."""
    bytes_tok = t.sparse["total"] + t.kv
    dense_bytes = t.dense["total"] + t.kv
    return {
        "bytes_per_token": bytes_tok,
        "bound_tokens_per_s": bw / bytes_tok,
        "bandwidth_gbs": bw / 1e9,
        "dense_bytes_per_token": dense_bytes,
        "dense_bound_tokens_per_s": bw / dense_bytes,
        "kv_bytes_per_token": t.kv,
        "ffn_bytes_per_token": t.sparse["ffn"],
        "ffn_bytes_dense": t.sparse["ffn_full"],
        "other_bytes_per_token": t.sparse["other"],
        "ffn_active_fraction": _mean(t.active) if t.active else None,
        "ffn_fired_fraction": _mean(t.fired) if t.fired else None,
        "ffn_active_fraction_manifest": _mean(t.from_manifest) if t.from_manifest else None,
        "active_source": ("measured masks" if t.active
                          else ("manifest predicted_active" if t.from_manifest else "none (dense)")),
    }


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _engine_row(eng: Engine, rate: tuple[float, float], opts: BenchOptions, dpf: float | None,
                ddc: float | None) -> dict[str, Any]:
    """One engine's entry in ``result["engines"]``: its rates, against PyTorch's, best rounds, raw times."""
    return {"label": eng.label, "prefill_tokens_per_s": rate[0],
            "decode_tokens_per_s": rate[1],
            "decode_vs_pytorch": _ratio(rate[1], ddc),
            "prefill_vs_pytorch": _ratio(rate[0], dpf),
            # best round: less sensitive to other processes than the median
            "best_prefill_tokens_per_s": opts.prompt_len / min(eng.prefill_s),
            "best_decode_tokens_per_s": opts.tokens / min(eng.decode_s),
            "prefill_s": eng.prefill_s, "decode_s": eng.decode_s, **eng.info}


def _with_variants(result: dict[str, Any], opts: BenchOptions, lineup: Lineup, rates: dict[str, tuple[float, float]],
                   prompt: list[int]) -> dict[str, Any]:
    """``result`` plus the keys of the optional columns: compiled step, low-precision prefill, llama.cpp,
    dense artifact."""
    dc, dpf = result["decode_tokens_per_s"], result["dense_prefill_tokens_per_s"]
    engines, compiled = lineup.engines, lineup.compiled
    if opts.compile:
        assert compiled is not None
        result["native_kernel_calls"] = compiled.step_fn.native_calls  # per decode step, as C++ ops
        result["native_reason"] = compiled.step_fn.native_reason
        result["same_tokens_as_eager"] = _common_prefix(engines[0].tokens, _by_name(engines, "picompile").tokens)
        result["eager_decode_tokens_per_s"] = rates["picompile"][1]
        result["eager_prefill_tokens_per_s"] = rates["picompile"][0]
    if lineup.low is not None:
        result["prefill_dtype"] = opts.prefill_dtype
        result["low_prefill_tokens_per_s"], result["low_decode_tokens_per_s"] = rates[f"picompile-{opts.prefill_dtype}-prefill"]
        result["low_prefill_speedup"] = _ratio(result["low_prefill_tokens_per_s"], dpf)
        result["low_prefill_logits"] = logits_agreement(compiled if compiled is not None else lineup.session,
                                                        lineup.low, prompt)
    if opts.dense_artifact:
        apf, adc = rates["picompile-dense"]
        result["artifact_dense_decode_tokens_per_s"] = adc
        result["artifact_dense_prefill_tokens_per_s"] = apf
    return result


def _with_llama_cpp(result: dict[str, Any], opts: BenchOptions, lineup: Lineup, rates: dict[str, tuple[float, float]],
                    prompt: list[int], emit: Emit) -> dict[str, Any]:
    """``result`` plus llama.cpp's side: llama-bench's rates, the ratios picompile / llama.cpp, its bytes per
    token and bound (dense, its GGUF, KV at llama-bench's tg positions), and llama-cpp-python's greedy tokens."""
    pf, dc = result["prefill_tokens_per_s"], result["decode_tokens_per_s"]
    result["bound_share"] = dc / result["bound_tokens_per_s"]
    if "llama-bench" in rates and lineup.gguf is not None:
        lpf, ldc = rates["llama-bench"]
        peer = gguf_bytes_per_token(lineup.gguf, (opts.tokens - 1) / 2)  # tg from an empty context (depth 0)
        bw = result["engine_bandwidth_gbs"]["llama-bench"]  # around its own runs
        bound = bw * 1e9 / peer["total"]
        result.update({
            "llama_cpp_prefill_tokens_per_s": lpf, "llama_cpp_decode_tokens_per_s": ldc,
            "prefill_vs_llama_cpp": pf / lpf, "decode_vs_llama_cpp": dc / ldc,
            "llama_cpp_gguf_type": lineup.gguf_type,
            "llama_cpp_bytes_per_token": peer["total"], "llama_cpp_kv_bytes_per_token": peer["kv"],
            "llama_cpp_bandwidth_gbs": bw, "llama_cpp_bound_tokens_per_s": bound, "llama_cpp_bound_share": ldc / bound,
        })
    if lineup.text_peer is not None:
        emit("llama-cpp-python: greedy tokens")
        try:
            lineup.text_peer.run(prompt, opts.tokens)
        except Exception as e:  # an optional extra never fails the benchmark
            result["skipped"]["llama-cpp-python"] = f"failed: {type(e).__name__}: {e}"
        else:
            head = lineup.engines[0]
            result["llama_cpp_python"] = {
                "label": lineup.text_peer.label, "gguf": str(lineup.gguf),
                "same_tokens_as_picompile": _common_prefix(head.tokens, lineup.text_peer.tokens),
                "same_tokens_as_pytorch": _common_prefix(_by_name(lineup.engines, "pytorch").tokens,
                                                         lineup.text_peer.tokens) if "pytorch" in rates else None}
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

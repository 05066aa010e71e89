"""llama.cpp's own ``llama-bench``, run as its users run it: the pinned build, its JSON, the GGUF per precision.

The build is ``benchmarks/build_llama_cpp.py`` (``CACHE/llama.cpp/<pin>/bin/``). :func:`find_tool` resolves
``--llama-bench PATH|auto``; :func:`gguf_type_for` picks the GGUF type of an artifact's weight dtype;
:func:`peer_gguf` makes that GGUF from the artifact's source checkpoint (f32/f16 by
:mod:`picompile.formats.gguf_export`, q8_0/q4_0 by the built ``llama-quantize`` from the f16 one, as llama.cpp's
users make them); :func:`llama_bench_engine` is the engine ``picompile bench`` interleaves with its own: each
round one ``llama-bench -m GGUF -t THREADS -p PROMPT_LEN -n TOKENS -r 1 -o json`` (llama-bench's defaults
otherwise: flash attention auto, KV cache f16, CPU repacking on), parsed by :func:`parse_llama_bench`.
:func:`gguf_bytes_per_token` is its side of the bandwidth bound.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from picompile.errors import PicompileError
from picompile.formats.gguf_export import QUANT_TYPES

LLAMA_CPP_PYTHON_PIN = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built
TOOLS: tuple[str, ...] = ("llama-bench", "llama-quantize")
BUILD_INFO = "build-info.json"
BUILD_COMMAND = "python benchmarks/build_llama_cpp.py"

# the artifact's weight dtype -> the GGUF type of the same precision (llama.cpp's q8_0 / q4_0 blocks are the
# layout of picompile's int8 / int4, kernels/qformat.py)
GGUF_TYPE_OF_DTYPE: dict[str, str] = {"float32": "f32", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}
GGUF_TYPES: tuple[str, ...] = tuple(GGUF_TYPE_OF_DTYPE.values())

RUN_TIMEOUT_S = 1800.0  # one llama-bench invocation (a 7B pp512 on 2 cores takes minutes)


def llama_cpp_dir(cache: Path) -> Path:
    """Where the pinned build lives: ``cache/llama.cpp/<pin>`` (``bin/``, ``build-info.json``)."""
    return Path(cache) / "llama.cpp" / LLAMA_CPP_PYTHON_PIN


def find_tool(spec: str | Path, name: str, cache: Path) -> Path:
    """``spec`` ("auto": the cached build's ``bin/NAME``; else a path) as an executable; a PicompileError naming
    the build command when it is absent."""
    path = llama_cpp_dir(cache) / "bin" / name if str(spec) == "auto" else Path(spec)
    if not path.is_file() or not os.access(path, os.X_OK):
        where = "no build of llama.cpp" if str(spec) == "auto" else f"{path} is not an executable file"
        raise PicompileError(f"{name}: {where} at {path}; build it with: {BUILD_COMMAND}")
    return path


def build_info(exe: Path) -> dict[str, Any]:
    """The ``build-info.json`` beside ``exe``'s ``bin/`` (the pinned build's facts), or {} for another build."""
    path = exe.parent.parent / BUILD_INFO
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def gguf_type_for(weight_dtype: str) -> str:
    """The GGUF type with the precision of an artifact's weights (float16 -> f16, int8 -> q8_0, ...)."""
    try:
        return GGUF_TYPE_OF_DTYPE[weight_dtype]
    except KeyError:
        raise PicompileError(f"no GGUF type matches weight dtype {weight_dtype!r} (known: "
                             f"{', '.join(GGUF_TYPE_OF_DTYPE)})") from None


# -- the GGUF of the same weights at the same precision --------------------------------------------
def peer_gguf(source: str, gguf_type: str, cache_dir: Path, quantize: Callable[[], Path],
              emit: Callable[[str], None] = lambda s: None) -> Path:
    """``cache_dir/gguf/NAME-TYPE.gguf`` of the checkpoint ``source`` (made once, remade when older than it).

    f32/f16: converted by :func:`picompile.formats.gguf_export.export_gguf`; q8_0/q4_0: the f16 file through
    ``llama-quantize`` (``quantize()`` gives the executable). A PicompileError says why it cannot be made.
    """
    from picompile.tools.engines import auto_gguf

    if gguf_type not in GGUF_TYPES:
        raise PicompileError(f"GGUF type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    made = auto_gguf(source, gguf_type if gguf_type not in QUANT_TYPES else "f16", cache_dir, emit)
    if isinstance(made, str):
        raise PicompileError(made)
    if gguf_type not in QUANT_TYPES:
        return made
    out = made.with_name(made.name[: -len("-f16.gguf")] + f"-{gguf_type}.gguf")
    if out.is_file() and out.stat().st_mtime >= made.stat().st_mtime:
        return out
    from picompile.formats.gguf_export import quantize_gguf

    emit(f"quantizing {made.name} to {gguf_type} with llama-quantize")
    return quantize_gguf(made, out, gguf_type, quantize())


def gguf_bytes_per_token(gguf: Path, mean_position: float) -> dict[str, float]:
    """Bytes one dense decode step of llama.cpp reads from ``gguf``: every tensor but the token embeddings, one
    embedding row (the whole table when it doubles as the output layer), plus the f16 KV cache at
    ``mean_position``. Keys: ``weights``, ``kv``, ``total``, ``file_weights`` (all tensors)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) for t in reader.tensors}  # ggml order: the last dimension counts rows
    weights = float(sum(sizes.values()))
    if "token_embd.weight" in sizes and "output.weight" in sizes:  # untied: the lookup reads one row
        emb = sizes["token_embd.weight"]
        weights -= emb - emb / max(rows["token_embd.weight"], 1)

    def field(key: str) -> int | None:
        f = reader.fields.get(key)
        return int(f.contents()) if f is not None else None

    arch = str(reader.fields["general.architecture"].contents())
    n_layer, n_embd = field(f"{arch}.block_count") or 0, field(f"{arch}.embedding_length") or 0
    n_head = field(f"{arch}.attention.head_count") or 1
    n_head_kv = field(f"{arch}.attention.head_count_kv") or n_head
    head_k = field(f"{arch}.attention.key_length") or n_embd // n_head
    head_v = field(f"{arch}.attention.value_length") or head_k
    kv = 2.0 * n_layer * n_head_kv * (head_k + head_v) * mean_position  # f16 K and V, llama-bench's default
    return {"weights": weights, "kv": kv, "total": weights + kv, "file_weights": float(sum(sizes.values()))}


# -- running llama-bench ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaBenchRun:
    """One ``llama-bench`` invocation: prompt processing and text generation rates, and its JSON rows."""

    pp_tokens_per_s: float
    tg_tokens_per_s: float
    rows: list[dict[str, Any]]


def llama_bench_command(exe: Path, gguf: Path, threads: int, prompt_len: int, tokens: int,
                        extra: tuple[str, ...] = ()) -> list[str]:
    """One round: ``llama-bench -m GGUF -t T -p P -n N -r 1 -o json`` (its defaults otherwise, then ``extra``)."""
    return [str(exe), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_len), "-n", str(tokens), "-r", "1",
            "-o", "json", *extra]


class LlamaBenchCrash(PicompileError):
    """llama-bench died of a signal (a crash, not a bad argument)."""


# When the default run crashes (seen: llama.cpp 0c1e570's AMX path, ``ggml_backend_amx_mul_mat``, segfaults on
# every prompt batch on an Intel AMX VM, while its text generation runs), the round is split: tg with the
# defaults, pp without the repacked weight layouts (``--repack 0``), the nearest setting that runs. Said in the
# engine's info as ``pp_fallback``.
PP_FALLBACK: tuple[str, ...] = ("--repack", "0")


def parse_llama_bench(text: str, prompt_len: int, tokens: int) -> LlamaBenchRun:
    """The pp ``prompt_len`` and tg ``tokens`` rates (``avg_ts``) in llama-bench's ``-o json`` output."""
    try:
        rows = json.loads(text)
    except ValueError as e:
        raise PicompileError(f"llama-bench printed no JSON ({e}): {text[:120]!r}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise PicompileError("llama-bench's JSON is not a list of test results")

    def rate(n_prompt: int, n_gen: int, what: str) -> float:
        for r in rows:
            if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen and isinstance(r.get("avg_ts"), (int, float)):
                if r["avg_ts"] > 0:
                    return float(r["avg_ts"])
        raise PicompileError(f"llama-bench's JSON has no {what} result (n_prompt {n_prompt}, n_gen {n_gen})")

    nan = float("nan")  # a test the command did not ask for (-p 0 or -n 0)
    return LlamaBenchRun(rate(prompt_len, 0, f"pp{prompt_len}") if prompt_len else nan,
                         rate(0, tokens, f"tg{tokens}") if tokens else nan, rows)


def run_llama_bench(cmd: list[str], env: dict[str, str] | None = None,
                    timeout: float = RUN_TIMEOUT_S) -> str:
    """Run one ``llama-bench`` command; its stdout (the JSON), or a PicompileError with its last stderr line."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PicompileError(f"llama-bench did not finish in {timeout:.0f} s: {shlex.join(cmd)}") from None
    except OSError as e:
        raise PicompileError(f"could not run {cmd[0]}: {e}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        kind = LlamaBenchCrash if proc.returncode < 0 else PicompileError
        raise kind(f"llama-bench failed (exit {proc.returncode}): {last}")
    return proc.stdout


def llama_bench_engine(exe: Path, gguf: Path, gguf_type: str, threads: int, prompt_len: int, tokens: int,
                       info: dict[str, Any] | None = None) -> Any:
    """The engine ``picompile bench`` interleaves: each round one llama-bench run (``-r 1``, its own warm-up),
    recorded as the times its pp and tg rates give for ``prompt_len`` and the round's token count."""
    from picompile.tools.engines import Engine, peer_env

    facts: dict[str, Any] = {}  # from the first run's JSON: the build, the CPU, the defaults it ran with
    label = f"llama.cpp {gguf_type} (llama-bench; dense, SiLU kernel)"
    about: dict[str, Any] = {"gguf": str(gguf), "gguf_type": gguf_type, "llama_bench": str(exe),
                             "command": shlex.join(llama_bench_command(exe, gguf, threads, prompt_len, tokens)),
                             "tg_depth": 0, "llama_bench_json": facts, **(info or {})}

    def one(p: int, n: int, extra: tuple[str, ...] = ()) -> LlamaBenchRun:
        return parse_llama_bench(run_llama_bench(llama_bench_command(exe, gguf, threads, p, n, extra), peer_env()),
                                 p, n)

    def timed(prompt: list[int], n: int) -> tuple[float, float]:
        p = len(prompt)
        if "pp_fallback" not in about:  # the default round, until it crashes once
            try:
                tg = pp = one(p, n)
            except LlamaBenchCrash as e:
                about["pp_fallback"] = f"{e}; each round split: tg with the defaults, pp with {' '.join(PP_FALLBACK)}"
        if "pp_fallback" in about:
            tg, pp = one(0, n), one(p, 0, PP_FALLBACK)
        if not facts:
            facts.update({k: tg.rows[0][k] for k in FACTS if k in tg.rows[0]})
        return p / pp.pp_tokens_per_s, n / tg.tg_tokens_per_s

    def untimed(*_: Any) -> tuple[int, Any]:
        raise PicompileError("llama-bench times itself: it has no step to call")

    return Engine("llama-bench", label, untimed, untimed, timed=timed, info=about)


FACTS: tuple[str, ...] = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
                          "model_n_params", "n_threads", "type_k", "type_v", "n_gpu_layers", "flash_attn", "n_batch",
                          "n_ubatch", "repack")  # the llama-bench JSON fields a result keeps

"""The manifest's schema: types, required keys and bounds, checked once (in ``read_manifest``) before use.

A manifest is untrusted input: every field the loader reads is checked here, with a one-line
ArtifactError naming the field (``model.n_layers must be an integer in 1..4096, got -3``). Bounds come
from the model itself where they can (``build.max_seq_len`` ≤ ``model.max_seq_len``, ``graph.n_past`` =
2 × ``model.n_layers``, one ``layers`` entry per FFN layer, each ``d_model`` the model's), and the KV
cache the runtime would allocate must fit this machine's memory. Paths are checked by
:mod:`picompile.formats.paths` (relative, inside the artifact, listed in ``files``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from picompile.errors import ArtifactError
from picompile.formats.paths import check_relative

MAX_LAYERS: int = 4096
MAX_DIM: int = 1 << 17  # d_model, n_neurons per layer
MAX_HEADS: int = 4096
MAX_HEAD_DIM: int = 4096
MAX_VOCAB: int = 1 << 22
MAX_CONTEXT: int = 1 << 22
MAX_FILES: int = 100_000
MAX_FILE_BYTES: int = 1 << 42  # 4 TiB
MAX_NAMES: int = 1_000_000
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TOP_LEVEL: dict[str, type | tuple[type, ...]] = {
    "format": str, "format_version": int, "picompile_version": str, "created": str, "model": dict, "target": dict,
    "build": dict, "pipeline": list, "graph": dict, "weights": dict, "layers": list, "files": dict,
}
OPTIONAL: dict[str, type | tuple[type, ...]] = {"tokenizer": (dict, type(None)), "sections": dict}


def fail(field: str, want: str, got: Any) -> ArtifactError:
    shown = repr(got)
    return ArtifactError(f"manifest field {field} must be {want}, got {shown[:80] + ('…' if len(shown) > 80 else '')}")


def need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ArtifactError(f"manifest lacks the field {where}{key}")
    return d[key]


def integer(d: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    v = need(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise fail(where + key, f"an integer in {lo}..{hi}", v)
    return v


def number(d: dict[str, Any], key: str, where: str, lo: float, hi: float) -> float:
    v = need(d, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise fail(where + key, f"a finite number in [{lo}, {hi}]", v)
    return float(v)


def string(d: dict[str, Any], key: str, where: str, choices: tuple[str, ...] | None = None) -> str:
    v = need(d, key, where)
    if not isinstance(v, str) or (choices is not None and v not in choices):
        raise fail(where + key, "one of " + ", ".join(choices) if choices else "a string", v)
    return v


def strings(v: Any, field: str, max_len: int = MAX_NAMES) -> list[str]:
    if not isinstance(v, list) or len(v) > max_len or not all(isinstance(s, str) for s in v):
        raise fail(field, f"a list of at most {max_len} strings", v)
    return v


def mapping(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = need(d, key, where)
    if not isinstance(v, dict):
        raise fail(where + key, "a JSON object", v)
    return v


def check_top_level(d: dict[str, Any]) -> None:
    for key, types in TOP_LEVEL.items():
        v = need(d, key, "")
        if isinstance(v, bool) or not isinstance(v, types):
            raise fail(key, f"a JSON {types.__name__ if isinstance(types, type) else 'value'}", v)
    for key, types in OPTIONAL.items():
        if key in d and not isinstance(d[key], types):
            raise fail(key, "a JSON object" + (" or null" if key == "tokenizer" else ""), d[key])


def check_model(m: dict[str, Any]) -> None:
    for key in ("architecture", "family", "source", "source_format"):
        string(m, key, "model.")
    integer(m, "n_layers", "model.", 1, MAX_LAYERS)
    integer(m, "d_model", "model.", 1, MAX_DIM)
    integer(m, "vocab_size", "model.", 1, MAX_VOCAB)
    integer(m, "max_seq_len", "model.", 2, MAX_CONTEXT)
    integer(m, "n_kv_heads", "model.", 1, MAX_HEADS)
    integer(m, "head_dim", "model.", 1, MAX_HEAD_DIM)
    config = mapping(m, "config", "model.")
    eos = config.get("eos_token_id")
    eos_ok = eos is None or (isinstance(eos, int) and not isinstance(eos, bool)) or (
        isinstance(eos, list) and eos and all(isinstance(e, int) and not isinstance(e, bool) for e in eos))
    if not eos_ok:
        raise fail("model.config.eos_token_id", "an integer, a list of integers or null", eos)


def check_target(t: dict[str, Any]) -> None:
    string(t, "name", "target.")
    integer(t, "vram_bytes", "target.", 0, 1 << 50)
    for key in ("gpu_bandwidth_gbs", "link_bandwidth_gbs", "cpu_bandwidth_gbs"):
        number(t, key, "target.", 0.0, 1e6)
    arch = need(t, "cuda_arch", "target.")
    if arch is not None and not isinstance(arch, str):
        raise fail("target.cuda_arch", "a string or null", arch)


WEIGHT_FORMATS: tuple[str, ...] = ("float32", "float16", "int8", "int4")  # --weight-dtype
QUANT_FORMATS: tuple[str, ...] = ("int8", "int4")  # picompile.kernels.qformat.QUANT_DTYPES


def check_build(b: dict[str, Any], model: dict[str, Any]) -> None:
    from picompile.kernels.qformat import BLOCKS

    integer(b, "max_seq_len", "build.", 2, model["max_seq_len"])
    if "weight_dtype" in b:
        string(b, "weight_dtype", "build.", WEIGHT_FORMATS)
    if "quant_block" in b:
        block(b, "quant_block", "build.", BLOCKS)


def block(d: dict[str, Any], key: str, where: str, blocks: tuple[int, ...]) -> int:
    v = need(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v not in blocks:
        raise fail(where + key, "one of " + ", ".join(map(str, blocks)), v)
    return v


def check_weights(w: dict[str, Any], weight_keys: list[str]) -> None:
    """``weights``: the file, its format (``dtype``), each quantized weight's format, block and scales tensor
    (both named in ``graph.weights``), and the bytes per token by format."""
    from picompile.kernels.qformat import BLOCKS

    string(w, "file", "weights.")
    check_relative(w["file"], "weights.file")
    if "dtype" in w:
        string(w, "dtype", "weights.", WEIGHT_FORMATS)
    if "block" in w:
        block(w, "block", "weights.", BLOCKS)
    listed = set(weight_keys)
    quantized = w.get("quantized", {})
    if not isinstance(quantized, dict) or len(quantized) > MAX_NAMES:
        raise fail("weights.quantized", f"a JSON object of at most {MAX_NAMES} entries", quantized)
    for key, q in quantized.items():
        where = f"weights.quantized[{key!r}]."
        if key not in listed:
            raise fail(where[:-1], "a tensor named in graph.weights", key)
        if not isinstance(q, dict):
            raise fail(where[:-1], "a JSON object {format, block, scales}", q)
        string(q, "format", where, QUANT_FORMATS)
        block(q, "block", where, BLOCKS)
        if string(q, "scales", where) not in listed:
            raise fail(where + "scales", "a tensor named in graph.weights", q["scales"])
    per_token = w.get("bytes_per_token", {})
    if not isinstance(per_token, dict) or len(per_token) > 16:
        raise fail("weights.bytes_per_token", "a JSON object of at most 16 formats", per_token)
    for fmt in per_token:
        integer(per_token, fmt, "weights.bytes_per_token.", 0, MAX_FILE_BYTES)


def check_graph(g: dict[str, Any], model: dict[str, Any]) -> None:
    check_relative(need(g, "file", "graph."), "graph.file")
    n_past = integer(g, "n_past", "graph.", 0, 2 * MAX_LAYERS)
    if n_past not in (0, 2 * model["n_layers"]):
        raise fail("graph.n_past", f"2 × model.n_layers = {2 * model['n_layers']}", n_past)
    inputs = strings(need(g, "inputs", "graph."), "graph.inputs", 1 + 2 * MAX_LAYERS)
    if len(inputs) != 1 + n_past:
        raise fail("graph.inputs", f"1 + graph.n_past = {1 + n_past} names", inputs)
    strings(need(g, "outputs", "graph."), "graph.outputs", 1 + 2 * MAX_LAYERS)
    strings(need(g, "weights", "graph."), "graph.weights")
    if "kv_shape" in g:
        shape = g["kv_shape"]
        if shape != [1, model["n_kv_heads"], "past", model["head_dim"]]:
            raise fail("graph.kv_shape", "[1, model.n_kv_heads, 'past', model.head_dim]", shape)


def check_layers(layers: list[Any], model: dict[str, Any]) -> None:
    if len(layers) > model["n_layers"]:
        raise fail("layers", f"at most model.n_layers = {model['n_layers']} entries", f"{len(layers)} entries")
    for i, layer in enumerate(layers):
        where = f"layers[{i}]."
        if not isinstance(layer, dict):
            raise fail(where[:-1], "a JSON object", layer)
        integer(layer, "index", where, 0, model["n_layers"] - 1)
        string(layer, "kind", where, ("mlp", "gated"))
        string(layer, "act", where)
        if integer(layer, "d_model", where, 1, MAX_DIM) != model["d_model"]:
            raise fail(where + "d_model", f"model.d_model = {model['d_model']}", layer["d_model"])
        integer(layer, "n_neurons", where, 1, MAX_DIM * 64)


def check_files(files: dict[str, Any]) -> None:
    if len(files) > MAX_FILES:
        raise fail("files", f"at most {MAX_FILES} entries", f"{len(files)} entries")
    for rel, meta in files.items():
        check_relative(rel, f"files[{rel!r}]")
        if not isinstance(meta, dict):
            raise fail(f"files[{rel!r}]", "a JSON object {sha256, bytes}", meta)
        sha = need(meta, "sha256", f"files[{rel!r}].")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise fail(f"files[{rel!r}].sha256", "64 lowercase hex digits", sha)
        integer(meta, "bytes", f"files[{rel!r}].", 0, MAX_FILE_BYTES)


def check_tokenizer(tok: dict[str, Any] | None) -> None:
    if tok is None:
        return
    string(tok, "kind", "tokenizer.", ("llama2c", "hf"))
    files = strings(need(tok, "files", "tokenizer."), "tokenizer.files", 16)
    if not files:
        raise fail("tokenizer.files", "a non-empty list", files)
    for i, rel in enumerate(files):
        check_relative(rel, f"tokenizer.files[{i}]")
    if "sha256" in tok and not isinstance(tok["sha256"], dict):
        raise fail("tokenizer.sha256", "a JSON object", tok["sha256"])
    if "chat_template" in tok and tok["chat_template"] not in files:  # the template file, one of files
        raise fail("tokenizer.chat_template", "one of tokenizer.files", tok["chat_template"])


def check_kernels(entries: Any) -> None:
    if not isinstance(entries, list) or len(entries) > MAX_FILES:
        raise fail("sections.kernels", "a list of kernel entries", entries)
    for i, e in enumerate(entries):
        where = f"sections.kernels[{i}]."
        if not isinstance(e, dict):
            raise fail(where[:-1], "a JSON object", e)
        string(e, "key", where)
        check_relative(need(e, "file", where), where + "file")
        mapping(e, "spec", where)


def check_sections(s: dict[str, Any]) -> None:
    if "kernels" in s and s["kernels"]:
        check_kernels(s["kernels"])
    for name in ("profile", "placement"):
        sec = s.get(name)
        if sec is not None and not isinstance(sec, dict):
            raise fail(f"sections.{name}", "a JSON object", sec)
        if isinstance(sec, dict) and "file" in sec:
            check_relative(sec["file"], f"sections.{name}.file")


def physical_memory_bytes() -> int:
    """This machine's physical memory (bytes); a generous fallback where the OS does not say."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_kv_fits(d: dict[str, Any]) -> None:
    """The KV cache the runtime allocates (float32 K and V per layer over the whole context) fits in memory."""
    m, ctx = d["model"], d["build"]["max_seq_len"]
    kv_bytes = 2 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * ctx * 4
    have = physical_memory_bytes()
    if kv_bytes > have:
        raise ArtifactError(f"manifest implies a KV cache of {gib(kv_bytes)} (model.n_layers "
                            f"{m['n_layers']} × n_kv_heads {m['n_kv_heads']} × head_dim {m['head_dim']} × "
                            f"build.max_seq_len {ctx}); this machine has {gib(have)}")


def gib(n: int) -> str:
    """A byte count for a message: GiB, or TiB past 1024 GiB."""
    return f"{n / 2**40:,.1f} TiB" if n >= 1 << 40 else f"{n / 2**30:.1f} GiB"


CHECKS: tuple[tuple[str, Callable[..., None], bool], ...] = (
    ("model", check_model, False), ("target", check_target, False), ("build", check_build, True),
    ("graph", check_graph, True), ("layers", check_layers, True), ("files", check_files, False),
)


def validate_manifest(d: dict[str, Any]) -> None:
    """Check a decoded manifest.json against the schema; raise a one-line ArtifactError naming the field."""
    check_top_level(d)
    for key, check, with_model in CHECKS:
        if with_model:
            check(d[key], d["model"])
        else:
            check(d[key])
    check_weights(d["weights"], d["graph"]["weights"])
    strings(d["pipeline"], "pipeline", 256)
    check_tokenizer(d.get("tokenizer"))
    check_sections(d.get("sections") or {})
    check_kv_fits(d)

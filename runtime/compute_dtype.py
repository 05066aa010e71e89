"""The prefill graph's GEMMs in another dtype: ``with_compute_dtype(gm, torch.bfloat16)``.

linear / FFN ops reading float16 (or float32) weights → the same ops reading bfloat16 copies of them, which
``picompile.ir.ops.lin`` computes in bfloat16 (activations rounded to bfloat16, float32 accumulation, result
widened back). On a CPU with AMX, torch's bfloat16 GEMM (oneDNN) runs 2.4× its float32 / float16 GEMM
(measured here: 24 against 59 ms for [512, 2048] × [2048, 5632]); float16 GEMMs get no such unit, so a
float16 artifact's prefill runs at float32 speed. Costs: a bfloat16 copy of every weight it converts (the
size of the float16 weights again), and the rounding — ~3e-3 relative error per GEMM output against
~3e-4 for float16 activations. Only the several-token (prefill) graph is rewritten; decode reads the
artifact's own weights through its kernels. A hybrid-scheduled FFN layer becomes one ``PrefillFFN``
(``runtime/prefill_gemm.py``): up and gate of both parts in one GEMM, the down projection in nn.Linear layout.
An input-sparse linear (``sparsify-inputs``: ``w_t`` input-major) becomes ``linear(x · mask)`` on a copy of
``w_tᵀ`` in nn.Linear layout (streamed: ``w_t`` converted per call and read transposed).

Which dtype prefill runs in (``choose``): ``prefill_dtype="auto"`` (the default) is bfloat16 for a float16
artifact on a CPU with a fast bfloat16 GEMM and no AMX-FP16 unit: AVX512-BF16 (AMD Zen 4 / 5, Intel Cooper
Lake), where the alternative is widening every weight to float32 per call, and AMX-BF16 (Intel Sapphire /
Emerald Rapids), where the float16 GEMM runs at 0.4x the bfloat16 one; and for an int8 / int4 artifact on any CPU with a fast
bfloat16 GEMM (AMX or AVX512-BF16), where the alternative dequantizes each weight to float32 per call for a
float32 GEMM (~5-10x slower); elsewhere the weights' own dtype (CPUs with AMX-FP16 keep float16; float32
artifacts keep float32; an artifact without kernels keeps the reference pipeline's exact math). On a CPU
without a fast bfloat16 GEMM (AVX2 only: AMD Zen 2 / 3, older Intel) "auto" takes ``"float32"``: float32 copies
of float16 / int8 / int4 GEMM weights made once at load, in oneDNN's packed layout (``prefill_gemm.gemm_layout``;
~130 GFLOPS on two Zen 2 cores at 64 rows, MKL's ~56–90), where they fit and cost at most 1/``F32_COPY_SHARE``
of the memory (the 1B: ~4 GiB), else the per-call path (AMD Zen 2, 2 threads, 1B, 64-token prompt: int4 18 → 58
tok/s, float16 20 → 57; 16 tokens: float16 10 → 35). Two bfloat16 forms:
``"bfloat16"`` — copies made once at load (quantized weights dequantized, their scales dropped from the prefill
nodes): the memory of a bfloat16 model besides the artifact's (:func:`copy_bytes`, from the weight file's
header); ``"bfloat16-stream"`` — no copies, each weight converted per call into one reused buffer
(``runtime/prefill_stream.py``: the same GEMMs, the same values, ~20 % slower at 64 tokens, ~6 % at 512).
"auto" takes the copies where they fit with ``RESERVE_BYTES`` (or an eighth of the memory) to spare and cost at
most ``1/COPY_SHARE`` of the machine's memory (a small model: 1.9 GiB for the 1B int4), and streams otherwise (a
7B: 13 GiB of copies). ``"weights"`` is the weights' own dtype; ``"bfloat16"`` / ``"bfloat16-stream"`` force
either form.
"""
from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from picompile.errors import InputError
from picompile.ir.graph import get_tensor, shared_copy
from picompile.ir.ops import call_directly, deq
from picompile.ir.patterns import SCALE_ARGS
from picompile.ir.schema import arg_names, args_of, call_args, node_op
from picompile.procinfo import meminfo as _meminfo  # (tests replace it by name)
from picompile.runtime.prefill_gemm import Packed, gemm_layout, node_parts, pack_ffn
from picompile.runtime.prefill_stream import Scratch, StreamedFFN, StreamedLinear

aten = torch.ops.aten
_OPS = torch.ops.picompile

# op name → (the op the rewritten node calls, its weight arguments); the lowered forms become their reference
# ops (their arguments shared by name; the kernel keys go), which take the torch GEMM path for any token count
# (their kernels read float16)
_WEIGHTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear": ("linear", ("w",)),
    "tvm_linear": ("linear", ("w",)),
    "ffn": ("ffn", ("w_up", "w_gate", "w_down")),
    "sparse_ffn": ("sparse_ffn", ("w_up", "w_gate", "w_down_t")),
    "tvm_sparse_ffn": ("sparse_ffn", ("w_up", "w_gate", "w_down_t")),
}
_ATEN_LINEAR = {"input": "x", "weight": "w", "bias": "b"}  # aten.linear's argument names → picompile::linear's

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "bfloat16-stream": torch.bfloat16,
                                           "float32": torch.float32}
STREAMED: tuple[str, ...] = ("bfloat16-stream",)  # no copies: each weight converted per call (prefill_stream.py)
PREFILL_DTYPES: tuple[str, ...] = ("auto", "weights", *COMPUTE_DTYPES)  # what prefill_dtype may name (None: auto)
# memory the "auto" copy must leave available: the larger of this and an eighth of the machine's memory
RESERVE_BYTES = 2 << 30


def has_bf16_gemm() -> bool:
    """Whether torch's bfloat16 GEMM has a fast path here (oneDNN on AMX or AVX512-BF16)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def resolve(name: str | None) -> torch.dtype | None:
    """``prefill_dtype`` → a torch dtype (None: the weights' own, or "auto": decided by :func:`choose`),
    failing with the reason where this CPU has no fast path for it."""
    if name is None or name in ("auto", "weights"):
        return None
    dtype = COMPUTE_DTYPES.get(name)
    if dtype is None:
        raise InputError(f"prefill_dtype must be one of {', '.join(PREFILL_DTYPES)} (or None: auto), got {name!r}")
    if dtype == torch.bfloat16 and not has_bf16_gemm():
        raise InputError(f"prefill_dtype={name!r} needs a CPU with AMX or AVX512-BF16 (this one has neither: "
                         "its bfloat16 GEMMs would be slower than float32 ones)")
    return dtype


QUANTIZED = ("int8", "int4")  # weight dtypes whose prefill dequantizes (``ops.deq``) without a copy


def _fits(copy_bytes: int, loading_bytes: int = 0, kind: str = "bfloat16") -> tuple[bool, str]:
    """Whether a copy of ``copy_bytes``, with ``loading_bytes`` still to come (the artifact's weights, when the
    choice is made before the load reads them), leaves ``RESERVE_BYTES`` (or an eighth of the machine's
    memory, if more) available, and, when not, the sentence saying so."""
    mem = _meminfo()
    spare = mem.get("MemAvailable", 0) - loading_bytes - copy_bytes
    reserve = max(RESERVE_BYTES, mem.get("MemTotal", 0) // 8)
    if spare >= reserve:
        return True, ""
    weights = f" beside the weights ({loading_bytes / 2**30:.1f} GiB)" if loading_bytes else ""
    return False, (f"a {kind} copy ({copy_bytes / 2**30:.1f} GiB){weights} would leave {max(spare, 0) / 2**30:.1f} GiB "
                   f"available, under the {reserve / 2**30:.1f} GiB kept free")


COPY_SHARE = 8  # "auto" takes bfloat16 copies only where they cost at most 1/COPY_SHARE of the machine's memory


def _copy_or_stream(copy_bytes: int, loading_bytes: int, kind: str = "bfloat16", share: int = COPY_SHARE,
                    per_call: str = "converted to bfloat16") -> tuple[bool, str]:
    """Whether "auto" takes the bfloat16 copy (it fits, ``_fits``, and costs at most an eighth of the machine's
    memory: a small model's copies buy ~20 % faster short prompts for little) or streams the weights instead
    (``runtime/prefill_stream.py``: the same GEMMs, no copy), and why it streams. ``kind`` names the copy's dtype,
    ``share`` the memory fraction (1/share) it may cost, ``per_call`` what happens to each weight without it."""
    total = _meminfo().get("MemTotal", 0)
    fits, why = _fits(copy_bytes, loading_bytes, kind)
    if fits and copy_bytes <= total // share:
        return True, ""
    if fits:
        why = (f"a {kind} copy ({copy_bytes / 2**30:.1f} GiB) would be more than 1/{share} of the "
               f"machine's {total / 2**30:.1f} GiB")
    return False, f"{why}: each weight {per_call} per call instead (no copy)"


def choose(name: str | None, weight_dtype: str, copy_bytes: int, kernels: bool = True,
           loading_bytes: int = 0) -> tuple[str | None, str]:
    """The prefill dtype a load runs ("bfloat16": copies, "bfloat16-stream": no copies, or None: the weights'
    own) and why, for ``prefill_dtype``
    ``name`` on an artifact whose GEMM weights are ``weight_dtype``, a bfloat16 copy of which costs
    ``copy_bytes``; ``kernels``: the artifact has TVM kernels (without, it is the reference pipeline's: exact
    reference math); ``loading_bytes``: the weights the load has yet to read (made before the load: its file).

    float16 weights: bfloat16 on any CPU with a fast bfloat16 GEMM but no AMX-FP16 unit: AVX512-BF16 (AMD Zen 4 /
    5), where float16 is widened to float32 per call, and AMX-BF16 (Intel Sapphire / Emerald Rapids), where
    torch's float16 GEMM runs on AVX512-FP16 at 0.4x the bfloat16 one (2.46 against 5.97 ms at 16 rows, 38
    against 88 ms at 512, [2048, 5632] weights, 2 threads); CPUs with AMX-FP16 keep float16.
    int8 / int4 weights: bfloat16 on any CPU with a fast bfloat16 GEMM (AMX or AVX512-BF16): their own path
    dequantizes every weight to float32 per call and runs a float32 GEMM, 5–10x slower on the 1B model here.
    Either with copies only where they fit and are small (``_copy_or_stream``); otherwise streamed: each weight
    converted per call into one buffer (``runtime/prefill_stream.py``). Without a fast bfloat16 GEMM: float32
    copies where they fit (``_float32_copy``), else the weights' own per-call path."""
    if name not in (None, "auto"):
        resolve(name)
        return (None, "prefill_dtype='weights'") if name == "weights" else (name, f"prefill_dtype={name!r}")
    if not kernels:
        return None, "auto: an artifact of reference ops (no kernels) keeps the reference math"
    if weight_dtype in QUANTIZED:
        if not has_bf16_gemm():
            return _float32_copy(weight_dtype, copy_bytes, loading_bytes)
        copy, why = _copy_or_stream(copy_bytes, loading_bytes)
        if not copy:
            return "bfloat16-stream", f"auto: {weight_dtype} weights with a fast bfloat16 GEMM here; {why}"
        return "bfloat16", (f"auto: {weight_dtype} weights with a fast bfloat16 GEMM here; bfloat16 copy "
                            f"{copy_bytes / 2**30:.1f} GiB, dequantized once at load")
    if weight_dtype != "float16":
        return None, f"auto: {weight_dtype} weights keep their dtype"
    if torch.cpu._is_amx_fp16_supported():
        return None, "auto: this CPU has AMX-FP16 (a float16 GEMM unit)"
    if not has_bf16_gemm():
        return _float32_copy(weight_dtype, copy_bytes, loading_bytes)
    unit = "AMX-BF16 without AMX-FP16" if torch.cpu._is_amx_tile_supported() else "AVX512-BF16 without AMX"
    copy, why = _copy_or_stream(copy_bytes, loading_bytes)
    if not copy:
        return "bfloat16-stream", f"auto: {unit}; {why}"
    return "bfloat16", f"auto: {unit}; bfloat16 copy {copy_bytes / 2**30:.1f} GiB"


F32_COPY_SHARE = 4  # "auto" takes float32 copies where they cost at most 1/F32_COPY_SHARE of the memory


def _float32_copy(weight_dtype: str, copy_bytes: int, loading_bytes: int) -> tuple[str | None, str]:
    """A CPU without a fast bfloat16 GEMM (AVX2 machines: AMD Zen 2 / 3, Intel before Cooper Lake): float32
    copies of the GEMM weights made once at load (``copy_bytes`` is the bfloat16 copy's size: twice that) where
    they fit and cost at most 1/``F32_COPY_SHARE`` of the memory; otherwise each weight is widened (float16) or
    dequantized (int8 / int4) to float32 per call, which costs more than the GEMM itself at short prompts
    (AMD Zen 2, 2 threads, a [5632, 2048] weight and 64 tokens: int4 dequantized 45 ms, float16 widened 14 ms,
    the float32 GEMM 26 ms)."""
    how = "dequantized" if weight_dtype in QUANTIZED else "widened"
    copy, why = _copy_or_stream(2 * copy_bytes, loading_bytes, "float32", F32_COPY_SHARE, f"{how} to float32")
    if not copy:
        return None, f"auto: no AMX or AVX512-BF16 here; {why}"
    return "float32", (f"auto: no AMX or AVX512-BF16 here: float32 copy {2 * copy_bytes / 2**30:.1f} GiB, "
                       f"{weight_dtype} weights {how} once at load")


# bytes a weight's bfloat16 copy takes per byte of its quants (int4: two weights a byte)
_COPY_PER_QUANT_BYTE = {"int8": 2, "int4": 4}


def copy_bytes(manifest: Any, root: Path | None = None) -> int:
    """The bytes of the bfloat16 copy prefill would make: for int8 / int4 weights, their dequantized size (read
    from the weight file's header under ``root``; without it bounded from the file's size, everything in it
    counted as quants); for float weights the file's size (a bound: embeddings and norms stay as they are)."""
    file = str(manifest.weights.get("file", ""))
    size = int(manifest.files.get(file, {}).get("bytes", 0))
    wdtype = str(manifest.weights.get("dtype", "float32"))
    if wdtype not in QUANTIZED:
        return size
    quantized = manifest.weights.get("quantized") or {}
    header: dict[str, dict[str, object]] | None = None
    if root is not None and file:
        from picompile.formats.tensorfile import TensorFileError, read_header

        try:
            header = read_header(Path(root) / file)[1]
        except (OSError, TensorFileError):
            header = None  # the load reports a bad file itself
    if header is None:
        return size * _COPY_PER_QUANT_BYTE[wdtype]
    total = 0
    for key, meta in quantized.items():
        entry = header.get(key)
        if entry is None:
            continue
        lo, hi = entry["data_offsets"]  # type: ignore[misc]
        total += (int(hi) - int(lo)) * _COPY_PER_QUANT_BYTE.get(str(meta.get("format")), 2)
    return total


def choose_for(name: str | None, manifest: Any, root: Path | None = None,
               before_load: bool = False) -> tuple[str | None, str]:
    """:func:`choose` for an artifact's manifest (and its directory ``root``, for the copy's exact size);
    ``before_load``: its weights are not read yet, so their file's size counts against the memory too (copied
    or mapped alike: decode makes every page resident)."""
    file = str(manifest.weights.get("file", ""))
    loading = int(manifest.files.get(file, {}).get("bytes", 0)) if before_load else 0
    return choose(name, str(manifest.weights.get("dtype", manifest.build.get("weight_dtype", "float32"))),
                  copy_bytes(manifest, root), bool(manifest.sections.get("kernels")), loading_bytes=loading)


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return "linear"
    op = node_op(node)
    return op if op in _WEIGHTS else None


def _named_args(node: fx.Node) -> dict[str, object]:
    """The arguments of a linear / FFN node by name: a picompile op's (``ir.schema``), or aten.linear's as
    picompile::linear names them."""
    if node.target is not aten.linear.default:
        return args_of(node)
    names = [a.name for a in aten.linear.default._schema.arguments]  # input, weight, bias
    given = dict(zip(names, node.args), **node.kwargs)
    return {"b": None, **{_ATEN_LINEAR[k]: v for k, v in given.items()}}


def _packed_call(gm: fx.GraphModule, node: fx.Node, packed: Packed) -> None:
    """``node`` (an FFN) becomes one ``PrefillFFN`` call per part on its packed weights (registered as buffers
    of ``gm``), summed as ``merge`` does: hot + cold, then the down bias."""
    out: fx.Node | None = None
    with gm.graph.inserting_before(node):
        for i, (fn, weights) in enumerate(packed.parts):
            args: list[object] = [packed.x]
            for key, w in weights.items():
                attr = f"prefill_ffn_{fn.layer}_{i}_{key}"
                while hasattr(gm, attr):  # an unscheduled layer's hot and cold parts are two nodes
                    attr += "_"
                if w is None:
                    args.append(None)
                    continue
                gm.register_buffer(attr, w, persistent=False)
                args.append(gm.graph.get_attr(attr))
            y = gm.graph.call_function(fn, (*args, None))
            out = y if out is None else gm.graph.call_function(operator.add, (out, y))
        assert out is not None
        if packed.bias is not None:
            out = gm.graph.call_function(operator.add, (out, packed.bias))
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _streamed_ffn(gm: fx.GraphModule, node: fx.Node, scratch: Scratch) -> bool:
    """``node`` (an FFN ``node_parts`` takes) becomes one ``StreamedFFN`` call per part with rows on its stored
    weights, summed as ``merge`` does (hot + cold, then the down bias); False (unchanged) for any other node."""
    found = node_parts(node)
    if found is None:
        return False
    parts, x, bias, act, layer = found
    out: fx.Node | None = None
    with gm.graph.inserting_before(node):
        for part in parts:
            w_up = get_tensor(gm, part["w_up"])
            if w_up.shape[0] == 0:
                continue
            down = "w_down_t" if "w_down_t" in part else "w_down"
            for w, s in (("w_up", "s_up"), ("w_gate", "s_gate"), (down, "s_down")):
                if part.get(w) is not None:
                    scratch.prepare(get_tensor(gm, part[w]), None if part.get(s) is None else get_tensor(gm, part[s]))
            fn = StreamedFFN(scratch, layer, act, int(w_up.shape[0]), part["w_gate"] is not None, down_t=down == "w_down_t")
            y = gm.graph.call_function(fn, (x, part["w_up"], part.get("s_up"), part["w_gate"], part.get("s_gate"),
                                            part["b_up"], part[down], part.get("s_down"), None))
            out = y if out is None else gm.graph.call_function(operator.add, (out, y))
        if out is None:
            return False
        if bias is not None:
            out = gm.graph.call_function(operator.add, (out, bias))
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return True


def _input_sparse(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``node`` is an input-sparse linear (``sparsify-inputs``) on a stored float weight other than
    ``dtype``: its several-token form is ``lin(x · mask, w_tᵀ)``, a float16 ``w_t`` transposed, which torch widens
    to float32 per call on a CPU without a native float16 GEMM (a 1B SiLU artifact's 16-token prefill: 1.8 s)."""
    if node.op != "call_function" or node_op(node) != "input_sparse_linear":
        return False
    w_t = args_of(node)["w_t"]
    if not isinstance(w_t, fx.Node) or w_t.op != "get_attr":
        return False
    w = get_tensor(gm, w_t)
    return w.dim() == 2 and w.is_floating_point() and w.dtype != dtype


def _masked_input(gm: fx.GraphModule, node: fx.Node, a: dict[str, Any]) -> Any:
    """An input-sparse linear's ``x · mask`` as a node before ``node`` (``x`` itself without a mask)."""
    if a["mask"] is None:
        return a["x"]
    with gm.graph.inserting_before(node):
        return gm.graph.call_function(aten.mul.Tensor, (a["x"], a["mask"]))


def _streamed(gm: fx.GraphModule) -> fx.GraphModule:
    """``with_compute_dtype(..., streamed=True)``'s rewrite of the copy ``gm``: FFN parts → ``StreamedFFN``,
    linears → ``StreamedLinear`` (float32 weights too, as the copies convert them; FFNs that ``PrefillFFN`` does
    not compute — a mask left, a gate bias, dReLU — keep their weights' path)."""
    scratch = Scratch()
    for node in list(gm.graph.nodes):
        if _streamed_ffn(gm, node, scratch):
            continue
        if _input_sparse(gm, node, torch.bfloat16):
            a = args_of(node)
            scratch.prepare(get_tensor(gm, a["w_t"]), None)
            x = _masked_input(gm, node, a)
            node.target, node.args, node.kwargs = StreamedLinear(scratch, input_major=True), (x, a["w_t"], a["b"], None), {}
            continue
        if _op_name(node) not in ("linear", "tvm_linear"):
            continue
        args = _named_args(node)
        w = args["w"]
        if not isinstance(w, fx.Node) or get_tensor(gm, w).dtype == torch.bfloat16:
            continue  # (what the copies convert: every stored float or quantized weight)
        s = args.get("s")
        scratch.prepare(get_tensor(gm, w), None if s is None else get_tensor(gm, s))  # type: ignore[arg-type]
        node.target, node.args, node.kwargs = StreamedLinear(scratch), (args["x"], w, args.get("b"), s), {}
    gm.graph.eliminate_dead_code()
    return call_directly(gm)


def with_compute_dtype(gm: fx.GraphModule, dtype: torch.dtype, streamed: bool = False,
                       onednn: bool = True) -> fx.GraphModule:
    """A copy of ``gm`` sharing its other tensors whose linear and FFN GEMMs read ``dtype`` copies of their
    weights (``aten.linear`` and the TVM-lowered ops become picompile's reference ops, which compute in the
    weights' dtype). Every weight is converted once, however many nodes read it. ``streamed``: no copies,
    each float16 / int8 / int4 weight converted to bfloat16 per call into one reused buffer instead
    (``runtime/prefill_stream.py``; ``dtype`` must be bfloat16). ``onednn``: float32 copies in oneDNN's packed
    layout (False: input-major, for a graph torch.compile traces; ``prefill_gemm.gemm_layout``)."""
    out = shared_copy(gm)
    if streamed:
        if dtype != torch.bfloat16:
            raise InputError(f"streamed prefill converts to bfloat16, not {dtype}")
        return _streamed(out)
    converted: dict[str, fx.Node] = {}

    def convert(arg: object) -> object:
        if not isinstance(arg, fx.Node) or arg.op != "get_attr":
            return arg
        name = str(arg.target)
        if name not in converted:
            w = getattr(out, name)
            if not w.is_floating_point() or w.dtype == dtype:
                return arg
            attr = f"{name}_{str(dtype).removeprefix('torch.')}"
            out.register_buffer(attr, gemm_layout(w, dtype, onednn) if w.dim() == 2 else w.to(dtype), persistent=False)
            with out.graph.inserting_after(arg):
                converted[name] = out.graph.get_attr(attr)
        return converted[name]

    def dequantized(q: fx.Node, s: fx.Node) -> fx.Node:
        """A quantized weight (int8 / int4 quants + scales) as a dense ``dtype`` copy (option (b) of the
        quantized prefill: the memory of a bfloat16 model for bfloat16 GEMMs)."""
        name = f"{q.target}_dequantized"
        if name not in converted:
            attr = f"{str(q.target)}_{str(dtype).removeprefix('torch.')}"
            out.register_buffer(attr, gemm_layout(deq(getattr(out, str(q.target)), getattr(out, str(s.target))), dtype, onednn),
                                persistent=False)
            with out.graph.inserting_after(q):
                converted[name] = out.graph.get_attr(attr)
        return converted[name]

    def input_major(w_t: fx.Node) -> fx.Node:
        """An input-major weight ``w_t`` [d_in, d_out] as a ``dtype`` copy in nn.Linear layout [d_out, d_in]
        (contiguous: 1.7x the bfloat16 GEMM rate of the transposed view, 19x the float16 one widened per call)."""
        name = f"{w_t.target}_input_major"
        if name not in converted:
            attr = f"{str(w_t.target)}_t_{str(dtype).removeprefix('torch.')}"
            out.register_buffer(attr, getattr(out, str(w_t.target)).t().contiguous().to(dtype), persistent=False)
            with out.graph.inserting_after(w_t):
                converted[name] = out.graph.get_attr(attr)
        return converted[name]

    for node in list(out.graph.nodes):
        packed = pack_ffn(out, node, dtype, onednn)
        if packed is not None:
            _packed_call(out, node, packed)
            continue
        if _input_sparse(out, node, dtype):
            a = args_of(node)
            x = _masked_input(out, node, a)
            node.target = _OPS.linear.default
            node.args, node.kwargs = call_args("linear", {"x": x, "w": input_major(a["w_t"]), "b": a["b"]}), {}
            continue
        op = _op_name(node)
        if op is None:
            continue
        target, weights = _WEIGHTS[op]
        args = _named_args(node)
        values = {k: v for k, v in args.items() if k in arg_names(target)}
        quant = {w: (args[w], args[s]) for w, s in SCALE_ARGS.get(op, {}).items() if args.get(s) is not None}
        values.update({w: dequantized(*quant[w]) if w in quant else convert(args[w]) for w in weights})
        values.update({s: None for s in SCALE_ARGS.get(op, {}).values()})
        node.target, node.args, node.kwargs = getattr(_OPS, target).default, call_args(target, values), {}
    out.graph.eliminate_dead_code()
    return call_directly(out)

"""picompile's runtime: load an artifact and run it (``picompile.load``)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from picompile.runtime.session import Session


def load(path: str | Path, verify: bool = True, dense: bool = False, hybrid: str = "auto",
         compile: bool = False, prefill_dtype: str | None = None, *, print_after: Sequence[str] = (),
         dump_ir: str | Path | None = None, emit: Callable[[str], None] = print, kernels: str = "local",
         weights: str = "copied", native: bool = True, sparse_prefill: bool = True) -> Session:
    """Load an artifact directory: check its manifest version and checksums, bind weights, return a Session.

    ``dense=True`` computes every FFN neuron (predictors dropped): the artifact's own dense reference.
    ``hybrid`` schedules each FFN layer's hot and cold partitions (``picompile.runtime.hybrid``):
    "off" (the graph as built), "inline" (hot then cold on the calling thread), "thread" (the hot part
    on a worker thread, overlapping the cold one), "cuda" (the hot part on the GPU, asynchronously) or
    "auto" (cuda where CUDA is available and the artifact's target has a GPU, else inline).
    ``session.hybrid_mode`` says which one runs.
    ``compile=True`` runs the step through ``torch.compile`` (``picompile.runtime.compile``): the aten glue
    between the kernels is fused into C++ loops at the first prefill and decode call (slow the first time).
    There "auto" resolving to "inline" loads "off" instead: the same computation, which the compiler sees through.
    ``prefill_dtype="bfloat16"`` runs the prompt's GEMMs in bfloat16 (AMX / AVX512-BF16 CPUs only; a
    bfloat16 copy of the weights it converts, ~3e-3 relative error per GEMM; see ``runtime/compute_dtype.py``);
    decode is unchanged; ``"bfloat16-stream"``: the same GEMMs with no copy, each weight converted per call
    (``runtime/prefill_stream.py``). ``"auto"`` (or None, the default) picks bfloat16 for float16 artifacts on
    CPUs with AVX512-BF16 and no native float16 GEMM, and for int8 / int4 artifacts on CPUs with AMX or
    AVX512-BF16 — copies where they cost at most an eighth of the memory, streamed otherwise — and on CPUs with
    neither ``"float32"`` (float32 copies made once at load, where they cost at most a quarter of the memory),
    else the weights' dtype (``"weights"``); ``session.prefill_dtype`` / ``prefill_reason`` say which and why.

    The graph rewrites of the load are a named list of steps (``runtime/load_pipeline.py``), which these
    options decide and ``session.load_steps`` reports: ``print_after`` (step names, or "all") emits the
    graphs a step wrote after it, ``dump_ir`` writes one ``NNN_step.txt`` per step to that directory.
    ``kernels``: "local" (default) compiles the artifact's TVM kernels here from their specs (or takes them from
    the local kernel cache), so no native code of the artifact runs; "artifact" loads its own libraries (for a
    machine without TVM's compiler, and only for an artifact whose builder you trust).
    ``weights``: "copied" (default) copies every weight into aligned anonymous memory (huge pages) for the kernels;
    "mapped" leaves them on a private mapping of the weights file, copying only those not aligned for a kernel
    (``session.graph.meta["realigned_bytes"]``): resident memory is what the page cache holds of the file.
    ``native``: decode calls its CPU kernels through the C++ ops (``runtime/native.py``; default); False keeps
    the Python kernel calls (each one seen by ``picompile.kernels.table.KERNEL_TABLE``: recording, replay).
    ``sparse_prefill``: a ReLU FFN's up and down rows computed in prefill only for the tokens whose gate fired
    (load step ``sparse-prefill-ffn``, ``runtime/prefill_sparse.py``; default; ``session.sparse_prefill_parts``
    counts them, ``sparse_prefill_skipped`` says why not); False keeps the dense GEMMs. The same maths either way
    (int8 / int4 up dot products on int8-quantized x, as decode's kernels).
    """
    from picompile.errors import InputError

    if weights not in ("copied", "mapped"):
        raise InputError(f"weights must be copied or mapped, got {weights!r}")
    from picompile.formats.artifact import read_manifest
    from picompile.runtime.hybrid import check_mode
    from picompile.runtime.load_pipeline import LoadRun, load_steps
    from picompile.runtime.loader import load_graph, load_options

    from picompile.runtime.loader import check_kernel_source

    check_mode(hybrid)  # a bad mode, kernel source or prefill dtype fails before anything is read
    check_kernel_source(kernels)
    from picompile.runtime.compute_dtype import resolve

    resolve(prefill_dtype)
    if compile:
        from picompile.runtime.compile import check_compiler

        check_compiler()
    root = Path(path)
    manifest = read_manifest(root, verify=verify)
    from picompile.runtime.compute_dtype import choose_for

    prefill_dtype, prefill_reason = choose_for(prefill_dtype, manifest, root, before_load=True)  # "auto": per CPU, artifact, memory
    if compile:
        from picompile.runtime.compile import transparent_mode
        from picompile.targets import Target

        hybrid = transparent_mode(hybrid, Target.from_json(manifest.target).has_gpu)
    options = load_options(manifest, dense=dense, hybrid=hybrid, direct=True, compile=compile,
                           prefill_dtype=prefill_dtype, mapped_weights=weights == "mapped", native=native,
                           sparse_prefill=sparse_prefill)
    # an unknown print_after name fails here, before the graph is read
    run = LoadRun(load_steps(options), print_after=list(print_after), dump_ir=_path(dump_ir), emit=emit)
    graph = load_graph(root, manifest, dense=dense, hybrid=hybrid, direct=True, run=run, kernels=kernels,
                       mapped_weights=weights == "mapped")
    tokenizer = None
    if manifest.tokenizer:
        from picompile.formats.tokenizers import load_tokenizer_entry

        tokenizer = load_tokenizer_entry(manifest.tokenizer, root)
    return Session(root, manifest, graph, tokenizer, compile=compile, prefill_dtype=prefill_dtype, load_run=run,
                   prefill_reason=prefill_reason, native=native, sparse_prefill=sparse_prefill)


def _path(p: str | Path | None) -> Optional[Path]:
    return None if p is None else Path(p)


__all__ = ["Session", "load"]

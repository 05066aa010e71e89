"""Load an artifact: read its graph, weights and kernels, then run the load pipeline's graph steps.

Reading the files is kept to the small ``read_*`` / ``load_kernels`` functions; what is then done to the
graph is the named list of ``runtime/load_pipeline.py`` (its steps: ``runtime/load_steps.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import fx

import picompile.ir.ops  # noqa: F401  (registers the ops the graph calls)
from picompile.errors import ArtifactError, InputError
from picompile.formats.archive import check_graph_archive
from picompile.formats.artifact import Manifest, verify_listed
from picompile.formats.paths import inside, listed
from picompile.formats.tensorfile import TensorFileError, map_safetensors
from picompile.ir.graph import placeholders
from picompile.runtime.load_pipeline import LoadOptions, LoadRun, LoadState, graph_steps
from picompile.runtime.masks import drop_masks, without_masks  # noqa: F401  (re-exported: the load's mask rewrites)

WEIGHT_PREFIX = "w"  # bound weight i is the buffer f"w{i}"


# -- reading the files ------------------------------------------------------------------------------
def read_exported(root: Path, manifest: Manifest) -> Any:
    """The manifest's graph file as a torch.export ExportedProgram."""
    file = listed(root, manifest.graph["file"], manifest.files, "graph.file")
    check_graph_archive(file)  # nothing in it is unpickled, exec'd or eval'd (formats/archive.py)
    try:
        return torch.export.load(file)
    except Exception as e:
        raise ArtifactError(f"cannot read the graph {file}: {type(e).__name__}: {str(e)[:200]}") from None


def read_weights(root: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The manifest's weight file's tensors (every one the graph names must be there), mapped from the file
    (private, copy-on-write: nothing is read until used, and nothing is copied here)."""
    wfile = listed(root, manifest.weights["file"], manifest.files, "weights.file")
    try:
        tensors = map_safetensors(wfile)
    except (TensorFileError, OSError, ValueError) as e:
        raise ArtifactError(f"cannot read weights {wfile}: {e}") from None
    missing = [k for k in manifest.graph["weights"] if k not in tensors]
    if missing:
        raise ArtifactError(f"{wfile} lacks {len(missing)} tensors the manifest names, e.g. {missing[:3]}")
    return tensors


# -- the weights' rewrites (load steps bind-weights, align-weights) --------------------------------------
def bind_weights(gm: fx.GraphModule, n_inputs: int, keys: list[str], tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Turn the weight inputs (after the first ``n_inputs``) into buffers the graph reads directly."""
    phs = placeholders(gm)
    if len(phs) != n_inputs + len(keys):
        raise ArtifactError(f"graph takes {len(phs)} inputs but the manifest names {n_inputs} + {len(keys)} weights")
    for i, (ph, key) in enumerate(zip(phs[n_inputs:], keys)):
        check_weight(ph, key, tensors[key])
        name = f"{WEIGHT_PREFIX}{i}"
        gm.register_buffer(name, tensors[key])
        with gm.graph.inserting_before(ph):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(ph.meta)
        ph.replace_all_uses_with(attr)
        gm.graph.erase_node(ph)
    gm.recompile()
    return gm


def check_weight(ph: fx.Node, key: str, tensor: torch.Tensor) -> None:
    """The tensor bound to a weight input has the shape and dtype the graph was exported with."""
    val = ph.meta.get("val")
    if isinstance(val, torch.Tensor) and (tuple(val.shape) != tuple(tensor.shape) or val.dtype != tensor.dtype):
        raise ArtifactError(f"weight {key} is {tuple(tensor.shape)} {tensor.dtype} but the graph takes "
                            f"{tuple(val.shape)} {val.dtype} (graph.weights does not match the weights file)")


def check_vocab(gm: fx.GraphModule, vocab_size: int) -> None:
    """The graph's logits [1, seq, vocab] have the manifest's model.vocab_size (token ids are checked against it)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) and out.args[0] else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.shape and isinstance(val.shape[-1], int) and val.shape[-1] != vocab_size:
        raise ArtifactError(f"manifest field model.vocab_size is {vocab_size} but the graph's logits have "
                            f"{val.shape[-1]} entries")


def align_weights(gm: fx.GraphModule, n_weights: int, mapped: bool = False) -> fx.GraphModule:
    """The bound weights (``bind_weights``' buffers) replaced by aligned copies: the kernels read weights with
    aligned vector loads.

    Every weight is copied, none left on the file's mapping: the weights sit in anonymous memory (huge pages,
    the small ones packed together) and the mapping is released — an aligned tensor used in place kept all
    4.4 GB of a 1B fp32 file resident beside the copies, and a weight the page cache reclaims is read back
    from disk mid-step.

    ``mapped``: the weights stay on the file's mapping (the artifact's writer put each on a 64-byte boundary) and
    only those that are not aligned there are copied; ``gm.meta["realigned_bytes"]`` / ``["mapped_bytes"]`` say
    how much was copied and how much left mapped. Resident memory is then what the page cache holds of the file.
    """
    from picompile.kernels import ALIGNMENT, aligned_copies

    names = [f"{WEIGHT_PREFIX}{i}" for i in range(n_weights)]
    if mapped:
        names = [n for n in names if getattr(gm, n).data_ptr() % ALIGNMENT or not getattr(gm, n).is_contiguous()]
        gm.meta["mapped_bytes"] = sum(getattr(gm, f"{WEIGHT_PREFIX}{i}").nbytes for i in range(n_weights)
                                      if f"{WEIGHT_PREFIX}{i}" not in names)
    from picompile.formats.tensorfile import release_pages
    from picompile.kernels.loader import HUGE_PAGE_MIN_BYTES

    # the small ones packed together on huge pages; each large one copied, swapped in and its file pages released
    # before the next (a 7B's 13.5 GB would otherwise be resident twice, mapping and copies, until the last copy)
    small = [n for n in names if getattr(gm, n).device.type == "cpu" and 0 < getattr(gm, n).nbytes < HUGE_PAGE_MIN_BYTES]
    originals = {name: getattr(gm, name) for name in small}
    copies = aligned_copies(originals)
    realigned = sum(t.nbytes for t in copies.values())
    for name, tensor in copies.items():
        gm.register_buffer(name, tensor)
    # their file pages leave this process too (an int4 7B's scales: ~0.8 GB resident twice until the load ended)
    release_pages([t for name, t in originals.items() if copies[name].data_ptr() != t.data_ptr()])
    del originals
    packed = set(small)
    for name in names:
        if name in packed:
            continue
        original = getattr(gm, name)
        copy = aligned_copies({name: original})[name]
        gm.register_buffer(name, copy)
        realigned += copy.nbytes
        if copy.data_ptr() != original.data_ptr():
            release_pages([original])  # mapped: its pages leave this process (the page cache keeps them)
        del original, copy
    gm.meta["realigned_bytes"] = realigned
    return gm


# -- the graph as the runtime runs it ---------------------------------------------------------------
def load_options(manifest: Manifest, dense: bool = False, hybrid: str = "off", direct: bool = False,
                 **session: Any) -> LoadOptions:
    # session may hold mapped_weights: the weights stay on the file's mapping (see align_weights)
    """The options of a load of ``manifest`` (``session``: the session steps' options, see ``LoadOptions``)."""
    from picompile.targets import Target

    kernels = bool(manifest.sections.get("kernels"))
    return LoadOptions(dense=dense, hybrid=hybrid, target_has_gpu=Target.from_json(manifest.target).has_gpu,
                       direct=direct, aligned=kernels, kernels=kernels, **session)


def load_graph(root: Path, manifest: Manifest, dense: bool = False, hybrid: str = "off",
               direct: bool = False, run: Optional[LoadRun] = None, kernels: str = "local",
               mapped_weights: bool = False) -> fx.GraphModule:
    """The executable decoder-step graph: forward(input_ids, *past) -> (logits, *presents).

    ``dense``: drop the predictor masks, so every neuron is computed (see :func:`drop_masks`).
    ``hybrid``: how each FFN layer's hot and cold partitions run ("off": the graph as built; "auto",
    "inline", "thread", "cuda": see :func:`picompile.runtime.hybrid.schedule_hybrid`).
    ``direct``: picompile ops called past torch's dispatcher (:func:`picompile.ir.ops.call_directly`) and
    torch.export's metadata asserts dropped — for running, not for exporting or printing the graph.
    ``run``: the load these steps are part of (its print_after / dump_ir; by default a run of its own).
    ``kernels``: where the TVM kernels come from (:func:`load_kernels`): "local" (compiled here from their specs)
    or "artifact" (the artifact's own libraries: native code of whoever built it).
    """
    options = load_options(manifest, dense=dense, hybrid=hybrid, direct=direct, mapped_weights=mapped_weights)
    names = graph_steps(options)
    run = run if run is not None else LoadRun(names)
    ep = read_exported(root, manifest)
    tensors = read_weights(root, manifest)
    if not mapped_weights and not options.aligned:  # no align step to copy them: copied here, the mapping released
        tensors = {k: v.clone() for k, v in tensors.items()}
    load_kernels(root, manifest.sections.get("kernels") or [], manifest, source=kernels)
    g = manifest.graph
    state = LoadState(graph=ep.module(), options=options, n_inputs=1 + int(g["n_past"]), weight_keys=list(g["weights"]), tensors=tensors)
    del ep, tensors  # the state holds them until bind-weights binds them (then the file's mapping can go)
    run.run(state, names)
    assert state.graph is not None
    check_vocab(state.graph, int(manifest.model["vocab_size"]))
    return state.graph


def stale_kernels(entries: list[dict[str, Any]]) -> list[str]:
    """The files of the manifest's kernels ("kernels") whose spec has another key under this picompile's kernel
    ABI (``KERNEL_ABI_VERSION``): the artifact was built by a picompile whose kernels compute or take their
    arguments differently, and must be rebuilt."""
    from picompile.kernels import KernelSpec

    try:
        return [str(e["file"]) for e in entries if KernelSpec(**e["spec"]).key() != e["key"]]
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ArtifactError(f"manifest field sections.kernels holds a kernel spec this picompile cannot read "
                            f"({type(e).__name__}: {str(e)[:120]})") from None


KERNEL_SOURCES: tuple[str, ...] = ("local", "artifact")


def check_kernel_source(source: str) -> None:
    if source not in KERNEL_SOURCES:
        raise InputError(f"kernels must be one of {', '.join(KERNEL_SOURCES)}, got {source!r}")


def local_kernel(spec: Any) -> object:
    """The loaded kernel of ``spec`` (a ``KernelSpec``), else compiled on this machine (or taken from the kernel
    cache), loaded and added to the table: the kernels the runtime derives from an artifact's own."""
    from picompile.config import kernel_cache_dir
    from picompile.kernels import build_kernel, load_kernel
    from picompile.kernels.table import add_kernel, find_kernel

    kern = find_kernel(spec.key())
    if kern is None:
        kern = load_kernel(build_kernel(spec, kernel_cache_dir()), spec)
        add_kernel(spec.key(), kern)
    return kern


def load_kernels(root: Path, entries: list[dict[str, Any]], manifest: Manifest | None = None,
                 source: str = "local") -> None:
    """Load the kernels a manifest lists ("kernels") into this process's table (``picompile.kernels.table``,
    where the tvm ops find them; TVM runtime only).

    CUDA kernels are loaded only where a CUDA device is present. ``source="local"`` (the default) loads no
    native code of the artifact's: each kernel is compiled on this machine from its spec (data: kind, shapes,
    dtypes), or taken from the local kernel cache where a build already compiled it, for this CPU;
    the artifact's libraries are still checked (confined, listed, checksums) as evidence the artifact is whole.
    ``source="artifact"`` dlopens the artifact's own libraries: for machines without TVM's compiler, and only
    for artifacts whose builder you trust.
    """
    check_kernel_source(source)
    if not entries:
        return
    from picompile.config import kernel_cache_dir
    from picompile.kernels import KERNEL_ABI_VERSION, KernelSpec, build_kernel, load_kernel
    from picompile.kernels.table import add_kernel, find_kernel

    stale = stale_kernels(entries)
    if stale:
        raise ArtifactError(f"{root} was built by a picompile with another kernel ABI than this one's "
                            f"(version {KERNEL_ABI_VERSION}): {len(stale)} of its {len(entries)} kernels "
                            f"({stale[0]}, …) do not match; rebuild it with `picompile build`")
    cuda = torch.cuda.is_available()
    for entry in entries:
        spec = KernelSpec(**entry["spec"])
        if spec.target != "llvm" and not cuda:
            continue
        if find_kernel(entry["key"]) is not None:
            continue
        # native code: confined, and (with the manifest) listed and its sha256 checked before dlopen, always
        path = inside(root, entry["file"], f"sections.kernels {entry['key']} file")
        if manifest is not None:
            path = verify_listed(root, manifest, entry["file"], f"sections.kernels {entry['key']} file")
            verify_listed(root, manifest, Path(entry["file"]).with_suffix(".json").as_posix(),
                          f"sections.kernels {entry['key']} metadata")
        try:
            if source == "local":
                path = build_kernel(spec, kernel_cache_dir())
            add_kernel(entry["key"], load_kernel(path, spec))
        except Exception as e:
            raise ArtifactError(f"cannot load kernel {entry['file']} of {root}: {type(e).__name__}: {e}") from None

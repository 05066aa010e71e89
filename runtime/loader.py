"""Load an artifact: verify the manifest, deserialize the graph, bind the weights it names."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import fx

from picompile.formats.archive import check_graph_archive
from picompile.formats.artifact import Manifest, verify_listed
from picompile.formats.paths import inside, listed
from picompile.errors import ArtifactError
from picompile.ir.graph import drop_metadata_asserts, flatten_codegen, placeholders, shared_copy
from picompile.ir.ops import call_directly  # importing picompile.ir.ops registers the ops the graph calls


def bind_weights(gm: fx.GraphModule, n_inputs: int, keys: list[str], tensors: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Turn the weight inputs (after the first ``n_inputs``) into buffers the graph reads directly."""
    phs = placeholders(gm)
    if len(phs) != n_inputs + len(keys):
        raise ArtifactError(f"graph takes {len(phs)} inputs but the manifest names {n_inputs} + {len(keys)} weights")
    for i, (ph, key) in enumerate(zip(phs[n_inputs:], keys)):
        check_weight(ph, key, tensors[key])
        name = f"w{i}"
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


# op -> position of its neuron mask argument
MASK_ARGS: dict[str, int] = {"ffn": 8, "sparse_ffn": 5, "tvm_sparse_ffn": 5}


def mask_positions(node: fx.Node) -> tuple[int, ...]:
    """Positions of ``node``'s neuron mask arguments (none unless it is an FFN op or a hybrid scheduler)."""
    from picompile.ir.ops import is_picompile_op
    from picompile.runtime.hybrid import HYBRID_MASK_ARGS, HybridFFN

    if node.op != "call_function":
        return ()
    if isinstance(node.target, HybridFFN):
        return HYBRID_MASK_ARGS
    return tuple(pos for op, pos in MASK_ARGS.items() if is_picompile_op(node.target, op) and len(node.args) > pos)


def drop_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """Compute every neuron: the FFN ops lose their masks (predictors become dead code and go).

    With the placement kept, this is the artifact's exact dense reference (same weights, same split).
    Hybrid-scheduled graphs (``runtime/hybrid.py``) lose the masks of both partitions alike.
    """
    for node in gm.graph.nodes:
        positions = mask_positions(node)
        if positions:
            args = list(node.args)
            for pos in positions:
                args[pos] = None
            node.args = tuple(args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def without_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its weights whose FFN ops compute every neuron (:func:`drop_masks`), or ``gm``
    itself when none of its FFN ops has a mask."""
    if not any(any(node.args[p] is not None for p in mask_positions(node)) for node in gm.graph.nodes):
        return gm
    return drop_masks(shared_copy(gm))


def load_graph(root: Path, manifest: Manifest, dense: bool = False, hybrid: str = "off",
               direct: bool = False) -> fx.GraphModule:
    """The executable decoder-step graph: forward(input_ids, *past) -> (logits, *presents).

    ``dense``: drop the predictor masks, so every neuron is computed (see :func:`drop_masks`).
    ``hybrid``: how each FFN layer's hot and cold partitions run ("off": the graph as built; "auto",
    "inline", "thread", "cuda": see :func:`picompile.runtime.hybrid.schedule_hybrid`).
    ``direct``: picompile ops called past torch's dispatcher (:func:`picompile.ir.ops.call_directly`) and
    torch.export's metadata asserts dropped — for running, not for exporting or printing the graph.
    """
    g = manifest.graph
    gfile = listed(root, g["file"], manifest.files, "graph.file")
    check_graph_archive(gfile)  # nothing in it is unpickled, exec'd or eval'd (formats/archive.py)
    try:
        ep = torch.export.load(gfile)
    except Exception as e:
        raise ArtifactError(f"cannot read the graph {gfile}: {type(e).__name__}: {str(e)[:200]}") from None
    wfile = listed(root, manifest.weights["file"], manifest.files, "weights.file")
    try:
        tensors = load_file(str(wfile))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"cannot read weights {wfile}: {e}") from None
    missing = [k for k in g["weights"] if k not in tensors]
    if missing:
        raise ArtifactError(f"{wfile} lacks {len(missing)} tensors the manifest names, e.g. {missing[:3]}")
    load_kernels(root, manifest.sections.get("kernels") or [], manifest)
    gm = ep.module()
    gm = flatten_codegen(gm)
    check_vocab(gm, int(manifest.model["vocab_size"]))
    if manifest.sections.get("kernels"):
        from picompile.kernels import aligned_copies  # kernels read weights with aligned vector loads

        # every tensor copied, none left on the file's mapping: the weights sit in anonymous memory (huge pages,
        # the small ones packed together) and the mapping is released — an aligned tensor used in place kept all
        # 4.4 GB of a 1B fp32 file resident beside the copies, and a weight the page cache reclaims is read back
        # from disk mid-step
        tensors = aligned_copies(tensors)
    gm = bind_weights(gm, 1 + int(g["n_past"]), list(g["weights"]), tensors)
    if dense:
        gm = drop_masks(gm)
    if hybrid != "off":
        from picompile.runtime.hybrid import schedule_hybrid
        from picompile.targets import Target

        gm = schedule_hybrid(gm, hybrid, target_has_gpu=Target.from_json(manifest.target).has_gpu)
    return call_directly(drop_metadata_asserts(gm)) if direct else gm


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


def load_kernels(root: Path, entries: list[dict[str, Any]], manifest: Manifest | None = None) -> None:
    """Load the kernels a manifest lists ("kernels") into picompile.ir.ops.KERNEL_TABLE (TVM runtime only).

    CUDA kernels are loaded only where a CUDA device is present.
    """
    if not entries:
        return
    from picompile.kernels import KERNEL_ABI_VERSION, KernelSpec, load_kernel
    from picompile.ir.ops import KERNEL_TABLE

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
        if entry["key"] in KERNEL_TABLE:
            continue
        # native code: confined, and (with the manifest) listed and its sha256 checked before dlopen, always
        path = inside(root, entry["file"], f"sections.kernels {entry['key']} file")
        if manifest is not None:
            path = verify_listed(root, manifest, entry["file"], f"sections.kernels {entry['key']} file")
            verify_listed(root, manifest, Path(entry["file"]).with_suffix(".json").as_posix(),
                          f"sections.kernels {entry['key']} metadata")
        try:
            KERNEL_TABLE[entry["key"]] = load_kernel(path, spec)
        except Exception as e:
            raise ArtifactError(f"cannot load kernel {entry['file']} of {root}: {type(e).__name__}: {e}") from None

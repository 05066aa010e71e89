"""picompile's runtime: load an artifact and run it (``picompile.load``)."""
from __future__ import annotations

from pathlib import Path

from picompile.runtime.session import Session


def load(path: str | Path, verify: bool = True, dense: bool = False, hybrid: str = "auto") -> Session:
    """Load an artifact directory: check its manifest version and checksums, bind weights, return a Session.

    ``dense=True`` computes every FFN neuron (predictors dropped): the artifact's own dense reference.
    ``hybrid`` schedules each FFN layer's hot and cold partitions (``picompile.runtime.hybrid``):
    "off" (the graph as built), "inline" (hot then cold on the calling thread), "thread" (the hot part
    on a worker thread, overlapping the cold one), "cuda" (the hot part on the GPU, asynchronously) or
    "auto" (cuda where CUDA is available and the artifact's target has a GPU, else inline).
    ``session.hybrid_mode`` says which one runs.
    """
    from picompile.runtime.hybrid import check_mode
    from picompile.runtime.loader import load_artifact

    check_mode(hybrid)  # a bad mode fails before anything is read
    root, manifest, graph = load_artifact(path, verify=verify, dense=dense, hybrid=hybrid)
    tokenizer = None
    if manifest.tokenizer:
        from picompile.tokenizers import load_tokenizer_entry

        tokenizer = load_tokenizer_entry(manifest.tokenizer, root)
    return Session(root, manifest, graph, tokenizer)


__all__ = ["Session", "load"]

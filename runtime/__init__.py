"""picompile's runtime: load an artifact and run it (``picompile.load``)."""
from __future__ import annotations

from pathlib import Path

from picompile.runtime.session import Session


def load(path: str | Path, verify: bool = True, dense: bool = False) -> Session:
    """Load an artifact directory: check its manifest version and checksums, bind weights, return a Session.

    ``dense=True`` computes every FFN neuron (predictors dropped): the artifact's own dense reference.
    """
    from picompile.runtime.loader import load_artifact

    root, manifest, graph = load_artifact(path, verify=verify, dense=dense)
    tokenizer = None
    if manifest.tokenizer:
        from picompile.tokenizers import load_tokenizer_entry

        tokenizer = load_tokenizer_entry(manifest.tokenizer, root)
    return Session(root, manifest, graph, tokenizer)


__all__ = ["Session", "load"]

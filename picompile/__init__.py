"""picompile: an ahead-of-time compiler for activation-sparse LLM inference (PowerInfer's method).

    picompile.build(model_dir, target="rtx4090", output="out.pic")
    session = picompile.load("out.pic"); session.generate("Once upon a time", 32)
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def build(*args: Any, **kwargs: Any) -> Any:
    """Compile a model into an artifact directory (see :func:`picompile.builder.build`)."""
    from picompile.builder import build as _build

    return _build(*args, **kwargs)


def load(*args: Any, **kwargs: Any) -> Any:
    """Load an artifact into a :class:`picompile.runtime.Session` (see :func:`picompile.runtime.load`)."""
    from picompile.runtime import load as _load

    return _load(*args, **kwargs)


__all__ = ["__version__", "build", "load"]

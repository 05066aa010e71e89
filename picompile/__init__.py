"""picompile: an ahead-of-time compiler for activation-sparse LLM inference (PowerInfer's method).

    picompile.build(model_dir, target="rtx4090", output="out.pic")
    session = picompile.load("out.pic"); session.generate("Once upon a time", 32)
"""
from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"


def _drop_checkout_root() -> None:
    """Take a source checkout's root off ``sys.path`` (``python -m`` / ``-c`` run in it put it first).

    The root holds ``kernels/``, ``passes/`` and ``runtime/``, installed as ``picompile.kernels`` … by pyproject's
    package-dir. As top-level names they shadow installed packages: transformers imports the PyPI package
    ``kernels``, and found ``kernels/`` instead ("cannot import name 'CUDAProperties' from 'kernels'"). picompile
    itself is reached through its (editable) install, never through this entry.
    """
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return  # an installed copy: parents[1] is site-packages
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]


_drop_checkout_root()

# The runtime alternates torch ops (OpenMP pool) with TVM kernels (TVM's own pool) on the same cores.
# libgomp's workers spin after each parallel region and then steal the cores TVM's workers need:
# measured here, a 10%-active FFN kernel ran at 38% of copy bandwidth right after torch ops with the
# default policy and at 87% with PASSIVE. It only takes effect if set before torch starts OpenMP, so it
# is set when picompile is imported (the CLI imports picompile first); an explicit value is kept.
# The user's own value is kept for engines measured beside picompile (PyTorch, llama.cpp: picompile.tools.bench),
# and passed on to child processes, which inherit the PASSIVE set here ("" in the variable: it was unset).
_USER_KEY = "PICOMPILE_USER_OMP_WAIT_POLICY"
os.environ.setdefault(_USER_KEY, os.environ.get("OMP_WAIT_POLICY", ""))
USER_OMP_WAIT_POLICY: str | None = os.environ[_USER_KEY] or None  # as the user gave it (None: unset)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build(*args: Any, **kwargs: Any) -> Any:
    """Compile a model into an artifact directory (see :func:`picompile.builder.build`)."""
    from picompile.builder import build as _build

    return _build(*args, **kwargs)


def load(*args: Any, **kwargs: Any) -> Any:
    """Load an artifact into a :class:`picompile.runtime.Session` (see :func:`picompile.runtime.load`)."""
    from picompile.runtime import load as _load

    return _load(*args, **kwargs)


__all__ = ["__version__", "build", "load"]

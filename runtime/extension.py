"""Build and load picompile's C++ extensions (``graph_exec.cpp``, ``native_ops.cpp``) with torch's
``cpp_extension.load``, safe against a builder that was killed.

torch guards a build directory with a baton file (``<build dir>/lock``, created before compiling, removed after)
and makes every other process wait while it exists, forever: a process killed mid-build (Ctrl-C during a first
``picompile.load``) left every later load hanging with no message. Here each build first takes an ``flock`` on a
side file of the same directory, which the kernel releases when its holder dies; a baton found while holding it
belongs to no live picompile build, so it is removed before torch looks.
"""
from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

FLOCK_NAME: str = ".picompile-build.flock"
BATON_NAME: str = "lock"  # torch.utils.file_baton's file in the build directory


def build_directory(name: str) -> Path:
    """torch's build directory for extension ``name`` (``TORCH_EXTENSIONS_DIR`` or its cache), created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def load_extension(name: str, sources: list[str], **kwargs: Any) -> Any:
    """``torch.utils.cpp_extension.load(name, sources, verbose=False, **kwargs)`` under the directory's flock, a
    dead builder's baton removed first."""
    from torch.utils.cpp_extension import load

    build = build_directory(name)
    with open(build / FLOCK_NAME, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build / BATON_NAME).unlink(missing_ok=True)
            return load(name=name, sources=sources, verbose=False, **kwargs)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

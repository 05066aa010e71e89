"""Path confinement: every path an artifact's manifest names stays inside the artifact.

A manifest is untrusted input. A relative path it names (``graph.file``, ``weights.file``, kernel and
tokenizer files, the keys of ``files``) must be a plain POSIX relative path — no absolute path, no
drive, no ``..``, no backslash, no empty or ``.`` component — and, once symlinks are resolved, must
still lie under the artifact root. :func:`inside` checks one; :func:`listed` also requires the file to
be one the manifest's ``files`` table lists (so its size and sha256 are known before it is opened).
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from picompile.errors import ArtifactError

MAX_PATH_CHARS: int = 512


def check_relative(rel: Any, what: str) -> str:
    """``rel`` as a string if it is a safe relative POSIX path (syntactically), else ArtifactError naming ``what``."""
    if not isinstance(rel, str) or not rel:
        raise ArtifactError(f"manifest field {what} must be a non-empty relative path, got {rel!r}")
    if len(rel) > MAX_PATH_CHARS:
        raise ArtifactError(f"manifest field {what} is a path of {len(rel)} characters (at most {MAX_PATH_CHARS})")
    if "\\" in rel or "\x00" in rel or ":" in rel or any(ord(c) < 32 for c in rel):
        raise ArtifactError(f"manifest field {what} names {rel!r}: backslashes, colons and control characters "
                            "are not allowed in artifact paths")
    if rel.startswith("/"):
        raise ArtifactError(f"manifest field {what} names the absolute path {rel!r}; artifact paths are relative "
                            "to the artifact")
    parts = PurePosixPath(rel).parts
    if any(p in ("..", ".") for p in rel.split("/")) or "" in rel.split("/"):
        raise ArtifactError(f"manifest field {what} names {rel!r}, which leaves or escapes the artifact "
                            "('..', '.' or empty components)")
    assert parts and not PurePosixPath(rel).is_absolute()
    return rel


def inside(root: Path, rel: Any, what: str) -> Path:
    """``root / rel`` after checking that it stays inside ``root`` (symlinks resolved)."""
    rel = check_relative(rel, what)
    base = Path(os.path.realpath(root))
    path = Path(os.path.realpath(base / rel))
    if path != base and base not in path.parents:
        raise ArtifactError(f"manifest field {what} names {rel!r}, which resolves outside the artifact "
                            "(a symlink leaves it)")
    return base / rel


def listed(root: Path, rel: Any, files: Mapping[str, Any], what: str) -> Path:
    """:func:`inside`, and ``rel`` must be a key of the manifest's ``files`` table (verified when read)."""
    path = inside(root, rel, what)
    if rel not in files:
        raise ArtifactError(f"manifest field {what} names {rel!r}, which its files table does not list "
                            "(every file the runtime opens must be listed with its checksum)")
    if not path.is_file():
        raise ArtifactError(f"artifact {root} is missing {rel}, which its manifest names ({what})")
    return path

"""Where an artifact came from, recorded without the build machine's paths.

The manifest names the source model (and a calibration file) by file name and content hash
(``model.source``, ``model.source_sha256``), never by an absolute path, so that two builds of the same
inputs on different machines or directories give the same bytes and an artifact reveals nothing of the
machine that built it. The build also notes, in this machine's cache
(``<cache>/sources/<sha256>.json``), where that content was found: tools that need the source itself
(``bench``'s PyTorch column, ``eval --sweep``) find it there with :func:`resolve_source` — on the build
machine, as before; elsewhere only a hub id (or an older artifact's path) resolves.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from picompile.frontend.base import ModelInfo

# config keys the HF loader fills with the path it read the checkpoint from
MACHINE_CONFIG_KEYS: tuple[str, ...] = ("_name_or_path", "name_or_path", "_commit_hash")
# section keys that hold timings (they differ from run to run): left out of the manifest
TIMING_SUFFIXES: tuple[str, ...] = ("_time_s", "_seconds", "_secs")


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (sources, tokenizer files, GGUF caches)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def source_digest(path: Path) -> str:
    """sha256 of a source file, or of a checkpoint directory's files (names and contents, top level, sorted)."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def index_dir() -> Path:
    from picompile.config import default_cache_dir

    return default_cache_dir() / "sources"


# what this process has recorded (also found when the cache directory changed since the build)
RECORDED: dict[str, str] = {}


def record_source(digest: str, path: Path) -> None:
    """Note in this machine's cache (and this process) that content ``digest`` was read from ``path`` (best effort)."""
    RECORDED[digest] = str(path.absolute())
    try:
        d = index_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{digest}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"path": str(path.absolute())}))
        tmp.replace(d / f"{digest}.json")
    except OSError:
        pass


def recorded_path(digest: Any) -> str | None:
    """The path this machine's cache records for content ``digest`` (:func:`record_source`), if it still exists."""
    if not (isinstance(digest, str) and len(digest) == 64 and digest.isalnum()):
        return None
    if digest in RECORDED and Path(RECORDED[digest]).exists():
        return RECORDED[digest]
    try:
        path = Path(json.loads((index_dir() / f"{digest}.json").read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(path) if path.exists() else None


def resolve_source(model: dict[str, Any]) -> str | None:
    """The source a manifest's ``model`` section names, as something a frontend can load: a path recorded on
    this machine for its content hash, a path (older artifacts) or hub id that exists as given, else None."""
    source = model.get("source")
    digest = model.get("source_sha256")
    if recorded_path(digest):
        return recorded_path(digest)
    if not isinstance(source, str) or not source:
        return None
    if Path(source).exists() or (digest is None and "/" in source):
        return source  # an older artifact's path, or a hub id
    return None


def portable_model(info: "ModelInfo") -> dict[str, Any]:
    """``info.to_json()`` with the source named by file name and content hash instead of its path."""
    d = info.to_json()
    src = Path(info.source)
    d["config"] = {k: v for k, v in d["config"].items() if k not in MACHINE_CONFIG_KEYS}
    if isinstance(d.get("extra"), dict):
        d["extra"] = {k: v for k, v in d["extra"].items() if k != "source"}
    if src.exists():
        digest = d.get("extra", {}).get("sha256") if src.is_file() else None
        digest = digest or source_digest(src)
        record_source(digest, src)
        d["source"] = src.absolute().name
        d["source_sha256"] = digest
    return d


def portable_sections(sections: dict[str, Any]) -> dict[str, Any]:
    """The passes' manifest sections without timings and with a calibration file named by name and hash."""
    out = _without_timings(copy.deepcopy(sections))
    corpus = (out.get("profile") or {}).get("corpus") if isinstance(out.get("profile"), dict) else None
    if isinstance(corpus, dict) and isinstance(corpus.get("source"), str) and corpus.get("sha256"):
        path = Path(corpus["source"])
        if path.is_absolute() or path.exists():
            if path.exists():
                record_source(str(corpus["sha256"]), path)
            corpus["source"] = path.name
    return out


def _without_timings(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_timings(v) for k, v in obj.items() if not str(k).endswith(TIMING_SUFFIXES)}
    if isinstance(obj, list):
        return [_without_timings(v) for v in obj]
    return obj

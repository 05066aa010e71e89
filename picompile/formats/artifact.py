"""The artifact: a directory whose versioned manifest.json is the only contract with the runtime.

out.pic/
  manifest.json          format, versions, model, target, build options, graph I/O, layers[], files{}
  graph.pt2              the transformed decoder-step graph (torch.export; weights are inputs)
  weights.safetensors    every tensor the graph reads, keyed by the names the manifest lists
  tokenizer/…            optional tokenizer files
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from picompile.errors import ArtifactError, PicompileError
from picompile.formats.paths import inside, listed
from picompile.formats.staging import STAGING_MARKER

FORMAT: str = "picompile-artifact"
FORMAT_VERSION: int = 1
MANIFEST: str = "manifest.json"
MACHINE_FIELDS: tuple[str, ...] = ("created", "measured")  # manifest fields of the build run, not of the content


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Manifest:
    """manifest.json, field for field. ``files`` maps each relative path to its sha256 and size."""

    model: dict[str, Any]
    target: dict[str, Any]
    build: dict[str, Any]
    pipeline: list[str]
    graph: dict[str, Any]  # {"file", "inputs": [...], "n_past": int, "weights": [keys in input order], "outputs"}
    weights: dict[str, Any]  # {"file"}
    layers: list[dict[str, Any]]  # one object per FFN layer: index, n_neurons, d_model, kind, act, …
    tokenizer: dict[str, Any] | None = None
    sections: dict[str, Any] = field(default_factory=dict)  # what later passes add (profile, placement, …)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    # what the build machine measured (peak_rss_bytes, build_seconds): like ``created``, outside content_hash
    measured: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    picompile_version: str = ""
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        head = {k: d.pop(k) for k in ("format", "format_version", "picompile_version", "created")}
        if not d["measured"]:
            del d["measured"]
        return {**head, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> "Manifest":
        fmt, ver = d.get("format"), d.get("format_version")
        if fmt != FORMAT:
            raise ArtifactError(f"{where} is not a picompile artifact manifest (format {fmt!r})")
        if ver != FORMAT_VERSION:
            raise ArtifactError(
                f"{where} has format_version {ver!r}; this picompile reads version {FORMAT_VERSION}: rebuild the artifact"
            )
        known = set(cls.__dataclass_fields__)
        missing = [k for k in ("model", "target", "build", "pipeline", "graph", "weights", "layers", "files") if k not in d]
        if missing:
            raise ArtifactError(f"{where} lacks the fields {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in known})


def write_manifest(root: Path, manifest: Manifest) -> Manifest:
    """Checksum every file under root (but the manifest) into manifest.files and write manifest.json."""
    from picompile import __version__

    manifest.files = {
        p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, STAGING_MARKER)
    }
    manifest.picompile_version = __version__
    manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (root / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return manifest


def record_measured(root: Path, measured: dict[str, Any]) -> None:
    """Add the build's measurements to ``root``'s manifest.json (no file it lists changes)."""
    path = Path(root) / MANIFEST
    data = json.loads(path.read_text())
    data["measured"] = {**data.get("measured", {}), **measured}
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_manifest(root: Path, verify: bool = True, schema: bool = True) -> Manifest:
    """Read and check an artifact: format version, schema (picompile.formats.manifest_schema), every
    listed file inside the artifact and present with its size, and (``verify``) its sha256.

    Without ``verify`` the sha256 of data files is not computed; kernel libraries (native code) are
    still verified before they are loaded (:func:`verify_listed`). ``schema=False`` (for tools that only read
    a manifest's numbers, such as ``plan``, never its files) skips the schema and the files table.
    """
    from picompile.formats.manifest_schema import validate_manifest

    root = Path(root)
    if not root.exists():
        raise ArtifactError(f"artifact {root} does not exist")
    if not root.is_dir() or not (root / MANIFEST).is_file():
        raise ArtifactError(f"{root} is not a picompile artifact (no {MANIFEST})")
    data = read_manifest_json(root)
    manifest = Manifest.from_json(data, str(root / MANIFEST))
    if not schema:
        return manifest
    validate_manifest(data)
    for rel, meta in manifest.files.items():
        path = inside(root, rel, f"files[{rel!r}]")
        if not path.is_file():
            raise ArtifactError(f"artifact {root} is missing {rel}, which its manifest lists")
        if path.stat().st_size != meta["bytes"]:
            raise ArtifactError(f"size mismatch for {rel} in {root}: the file is corrupt or was changed")
        if verify and sha256_file(path) != meta["sha256"]:
            raise ArtifactError(f"checksum mismatch for {rel} in {root}: the file is corrupt or was changed")
    return manifest


MAX_MANIFEST_BYTES: int = 64 << 20


def read_manifest_json(root: Path) -> dict[str, Any]:
    """manifest.json decoded (a JSON object, at most MAX_MANIFEST_BYTES), or a one-line ArtifactError."""
    path = Path(root) / MANIFEST
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path} is {path.stat().st_size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{path} is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} does not hold a JSON object")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def verify_listed(root: Path, manifest: Manifest, rel: Any, what: str) -> Path:
    """The path of a file the manifest names (``what``), confined, listed in ``files``, and its sha256 checked.

    For files the runtime cannot treat as data (kernel libraries it dlopens): checked even without verify.
    """
    path = listed(root, rel, manifest.files, what)
    meta = manifest.files[rel]
    if path.stat().st_size != meta["bytes"] or sha256_file(path) != meta["sha256"]:
        raise ArtifactError(f"checksum mismatch for {rel} in {root}: the file is corrupt or was changed")
    return path


def content_hash(root: Path) -> str:
    """sha256 of the artifact's content: its manifest (which holds every file's sha256) without ``created``.

    Two builds of the same inputs with the same options and picompile version have the same hash.
    """
    data = read_manifest_json(Path(root))
    for key in MACHINE_FIELDS:
        data.pop(key, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes the staging dir private and safetensors writes 0600 files: give them the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for p in root.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def is_artifact(path: Path) -> bool:
    """Whether ``path`` is a directory whose manifest.json says ``"format": "picompile-artifact"``."""
    try:
        data = read_manifest_json(Path(path)) if (Path(path) / MANIFEST).is_file() else None
    except (ArtifactError, OSError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """Yield an empty staging dir beside ``output``; on success it replaces ``output`` atomically.

    On any error, Ctrl-C, SIGTERM or SIGHUP the staging dir is removed and ``output`` is left as it was.
    An existing artifact is replaced only after the new one is complete; any other non-empty path is
    refused. Staging dirs of dead builds (their recorded pid gone) beside ``output`` are swept first.
    """
    from picompile.formats.staging import (create_staging, make_staging, remove_marker, staging_name, sweep_stale,
                                           termination_as_interrupt)

    output = Path(output).absolute()
    if output.exists() or output.is_symlink():
        if not is_artifact(output) and not (output.is_dir() and not any(output.iterdir())):
            raise PicompileError(f"output {output} exists and is not a picompile artifact; refusing to overwrite it "
                                 f"(only a directory whose manifest.json says \"format\": \"{FORMAT}\" is replaced)")
    output.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(output.parent)
    with termination_as_interrupt():
        staging = staging_name(output, "partial")  # named first: a signal while it is made still finds it
        try:
            create_staging(staging)
            yield staging
            remove_marker(staging)
            _normal_permissions(staging)
            if output.exists():
                old = make_staging(output, "old")
                output.rename(old / "a")  # keep the old artifact until the new one is in place
                staging.rename(output)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staging.rename(output)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

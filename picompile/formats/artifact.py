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
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from picompile.errors import ArtifactError, PicompileError

FORMAT: str = "picompile-artifact"
FORMAT_VERSION: int = 1
MANIFEST: str = "manifest.json"


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
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    picompile_version: str = ""
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        head = {k: d.pop(k) for k in ("format", "format_version", "picompile_version", "created")}
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
        if p.is_file() and p.name != MANIFEST
    }
    manifest.picompile_version = __version__
    manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (root / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return manifest


def read_manifest(root: Path, verify: bool = True) -> Manifest:
    """Read and check an artifact: format version, every listed file present with its checksum."""
    root = Path(root)
    if not root.exists():
        raise ArtifactError(f"artifact {root} does not exist")
    if not root.is_dir() or not (root / MANIFEST).is_file():
        raise ArtifactError(f"{root} is not a picompile artifact (no {MANIFEST})")
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{root / MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{root / MANIFEST} does not hold a JSON object")
    manifest = Manifest.from_json(data, str(root / MANIFEST))
    if verify:
        for rel, meta in manifest.files.items():
            path = root / rel
            if not path.is_file():
                raise ArtifactError(f"artifact {root} is missing {rel}, which its manifest lists")
            if path.stat().st_size != meta.get("bytes") or sha256_file(path) != meta.get("sha256"):
                raise ArtifactError(f"checksum mismatch for {rel} in {root}: the file is corrupt or was changed")
    return manifest


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes the staging dir private and safetensors writes 0600 files: give them the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for p in root.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def is_artifact(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """Yield an empty staging dir beside ``output``; on success it replaces ``output`` atomically.

    On any error (or Ctrl-C) the staging dir is removed and ``output`` is left as it was. An existing
    artifact is replaced only after the new one is complete; any other non-empty path is refused.
    """
    output = Path(output).absolute()
    if output.exists():
        if not is_artifact(output) and not (output.is_dir() and not any(output.iterdir())):
            raise PicompileError(f"output {output} exists and is not a picompile artifact; refusing to overwrite it")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        yield staging
        _normal_permissions(staging)
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
            output.rename(old / "a")  # keep the old artifact until the new one is in place
            staging.rename(output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)

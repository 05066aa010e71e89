"""graph.pt2 checked as untrusted data before ``torch.export.load`` reads it: no path to pickle or exec.

``torch.export.load`` has several ways to run code from a crafted archive (torch 2.13): a
``sample_inputs``/legacy ``.pt`` member is ``torch.load``-ed with a fallback to ``weights_only=False``;
``use_pickle`` weights and constants, ``custom_obj_*`` and ``opaque_obj_*`` constants are unpickled;
the model JSON's ``guards_code`` strings are ``exec``-ed by ``ExportedProgram.module()``; every
``expr_str`` goes through ``sympy.sympify`` (which ``eval``s); and a node's target may name any
callable attribute of ``torch`` (``torch.load``, ``torch.ops.load_library``…), called when the graph
runs. :func:`check_graph_archive` refuses all of these with one ArtifactError naming the member or
field, and lets through only what picompile's ``package`` pass writes: the fixed bookkeeping members,
one JSON model, empty payload configs (or raw tensor records, read by torch without pickle), an
empty sample-inputs record, guards that compare input sizes, srepr'd shape expressions over symbols,
and node targets among aten/picompile operators and a few arithmetic functions.
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any, Iterator

from picompile.errors import ArtifactError

MAX_MODEL_JSON_BYTES: int = 1 << 30
MAX_MEMBERS: int = 100_000
# bookkeeping members torch.export.save writes beside the model, each a few bytes
FIXED_MEMBERS: frozenset[str] = frozenset({"archive_format", "archive_version", ".data/version", "byteorder",
                                           ".data/serialization_id"})
_MODEL = re.compile(r"^models/(\w+)\.json$")
_CONFIG = re.compile(r"^data/(weights|constants)/(\w+)_(weights|constants)_config\.json$")
_SAMPLE = re.compile(r"^data/sample_inputs/(\w+)\.pt$")
_RECORD = re.compile(r"^data/(weights|constants)/(weight|tensor)_\d+$")
_OPERATOR_OK: frozenset[str] = frozenset({
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "abs", "eq", "ne", "lt",
    "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift",
})
_OP_NAMESPACES: tuple[str, ...] = ("torch.ops.aten.", "torch.ops.picompile.")
_ATEN_DENIED: frozenset[str] = frozenset({"from_file"})  # reads a file named by a string argument
_SYM_TARGET = re.compile(r"^torch\.(sym_(int|float|max|min|not|ite|sum|sqrt)|_sym_sqrt)$")
_MATH_TARGET = re.compile(r"^math\.(floor|ceil|trunc|sqrt|log|exp|sin|cos)$")
# sympy srepr of a shape expression: Add(Mul(Integer(32), Symbol('s70', positive=True, integer=True)), …)
_EXPR_NAMES: frozenset[str] = frozenset({
    "Add", "Mul", "Pow", "Integer", "Rational", "Float", "Symbol", "Max", "Min", "Mod", "FloorDiv", "CeilDiv",
    "CleanDiv", "PythonMod", "IntTrueDiv", "FloatTrueDiv", "TruncToInt", "CeilToInt", "FloorToInt", "RoundToInt",
    "ToFloat", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "true", "false", "True", "False", "oo",
    "int_oo", "Infinity", "NegativeInfinity", "IntInfinity", "NegativeIntInfinity", "Abs", "sympy_abs",
    "positive", "integer", "nonnegative", "negative", "real", "finite", "precision", "Sqrt", "OpaqueUnaryFn_sqrt",
    "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or", "Identity", "LShift", "RShift", "PowByNatural",
    "FloatPow", "Piecewise", "ExprCondPair",
})
_EXPR_QUOTED = re.compile(r"'[A-Za-z_][A-Za-z0-9_]*'|'-?[0-9][0-9.eE+\-]*'")  # symbol names, float literals
_EXPR_CHARS = re.compile(r"^[A-Za-z0-9_ (),=.\-+]*$")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a guard compares input sizes: (L['past_2'].size()[2] + L['input_ids'].size()[1]) == (…)
_GUARD_TERM = re.compile(r"L\['[A-Za-z_][A-Za-z0-9_]*'\]\.(size|stride)\(\)\[\d+\]")
_GUARD_REST = re.compile(r"^[\d\s()+\-*/%<>=!,A-Za-z_]*$")
_GUARD_NAMES: frozenset[str] = frozenset({"min", "max", "abs", "and", "or", "not", "True", "False"})


def bad(path: Path, what: str) -> ArtifactError:
    return ArtifactError(f"refusing the graph {path.name}: {what} (an artifact's graph is data; this one could run "
                         "code when loaded)")


def split_root(path: Path, names: list[str]) -> tuple[str, list[str]]:
    """The archive's one top-level folder and the member names below it."""
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or any("/" not in n for n in names):
        raise bad(path, f"its members are not all under one folder ({', '.join(sorted(roots)[:3])})")
    root = roots.pop()
    return root, [n.split("/", 1)[1] for n in names]


def check_member_names(path: Path, zf: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """The members by name below the root folder; anything outside the allowed set is refused."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise bad(path, f"it has {len(infos)} members")
    root, rels = split_root(path, [i.filename for i in infos])
    members: dict[str, zipfile.ZipInfo] = {}
    for rel, info in zip(rels, infos):
        if info.compress_type != zipfile.ZIP_STORED:
            raise bad(path, f"member {info.filename} is compressed (torch.export writes stored members)")
        if rel in members:
            raise bad(path, f"member {info.filename} appears twice")
        known = rel in FIXED_MEMBERS or _MODEL.match(rel) or _CONFIG.match(rel) or _SAMPLE.match(rel) or _RECORD.match(rel)
        if not known:
            raise bad(path, f"member {info.filename} is not one picompile writes (only the model JSON, payload "
                            "configs, raw tensor records and bookkeeping files are read)")
        if rel in FIXED_MEMBERS and info.file_size > 64:
            raise bad(path, f"member {info.filename} is {info.file_size} bytes")
        if _SAMPLE.match(rel) and info.file_size != 0:
            raise bad(path, f"member {info.filename} holds pickled sample inputs ({info.file_size} bytes); "
                            "picompile writes none")
        members[rel] = info
    models = [r for r in members if _MODEL.match(r)]
    if models != ["models/model.json"]:
        raise bad(path, f"it must hold exactly one model, {root}/models/model.json (found {len(models)})")
    return members


def check_payload_config(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, records: set[str]) -> None:
    """A weights/constants config: every payload a raw tensor record (no pickle, no custom or opaque object)."""
    try:
        config = json.loads(zf.read(info))
        entries = config["config"]
        assert isinstance(entries, dict)
    except Exception:
        raise bad(path, f"member {info.filename} is not a payload config") from None
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise bad(path, f"{info.filename} entry {str(fqn)[:60]!r} would be unpickled (use_pickle)")
        name = meta.get("path_name")
        if not isinstance(name, str) or not re.match(r"^(weight|tensor)_\d+$", name):
            raise bad(path, f"{info.filename} entry {str(fqn)[:60]!r} names payload {str(name)[:60]!r} "
                            "(custom and opaque objects are unpickled)")
        folder = info.filename.split("/")[-2]
        if f"data/{folder}/{name}" not in records:
            raise bad(path, f"{info.filename} entry {str(fqn)[:60]!r} names a missing record {name}")


def walk(obj: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of a decoded JSON document, depth first (list items keep their list's key)."""
    stack: list[tuple[str, Any]] = [(key, obj)]
    while stack:
        k, o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.items())
        elif isinstance(o, list):
            stack.extend((k, v) for v in o)
        yield k, o


def check_expr(path: Path, expr: Any) -> None:
    """A shape expression ``sympy.sympify`` will evaluate: only srepr syntax over allowed names."""
    if not isinstance(expr, str) or len(expr) > 10_000:
        raise bad(path, f"a shape expression is not a short string: {str(expr)[:60]!r}")
    bare = _EXPR_QUOTED.sub("0", expr)
    if not _EXPR_CHARS.match(bare) or "__" in bare or re.search(r"(?<!\d)\.|\.(?!\d)", bare):
        raise bad(path, f"shape expression {expr[:80]!r} is not a plain sympy expression")
    unknown = sorted({n for n in _IDENT.findall(bare) if n not in _EXPR_NAMES and not re.match(r"^e\d*$", n)})
    if unknown:
        raise bad(path, f"shape expression {expr[:80]!r} calls {', '.join(unknown[:3])}")


def check_guard(path: Path, guard: Any) -> None:
    """A guard ``ExportedProgram.module()`` compiles with exec: only arithmetic and comparisons of input sizes
    (with min, max, abs, and, or, not) — no other name, no attribute, no string."""
    bare = _GUARD_TERM.sub("0", guard) if isinstance(guard, str) else ""
    if (not isinstance(guard, str) or len(guard) > 10_000 or not _GUARD_REST.match(bare)
            or any(name not in _GUARD_NAMES for name in _IDENT.findall(bare))):
        raise bad(path, f"guard {str(guard)[:80]!r} is not a comparison of input sizes")


def check_target(path: Path, target: Any) -> None:
    """A node's operator: aten (but from_file) and picompile ops, arithmetic from _operator/math, sym ops."""
    if not isinstance(target, str):
        raise bad(path, f"a node target is not a string: {str(target)[:60]!r}")
    if target.startswith(_OP_NAMESPACES):
        parts = target.split(".")
        if len(parts) == 5 and all(re.match(r"^\w+$", p) for p in parts) and not (
                parts[2] == "aten" and parts[3] in _ATEN_DENIED):
            return
    elif target.startswith("_operator.") and target.split(".", 1)[1] in _OPERATOR_OK:
        return
    elif _SYM_TARGET.match(target) or _MATH_TARGET.match(target):
        return
    raise bad(path, f"node target {target[:80]!r} is not an aten or picompile operator")


def check_model_json(path: Path, data: bytes) -> None:
    try:
        model = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise bad(path, "its model JSON does not parse") from None
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise bad(path, "its model JSON is not an exported program")
    for guard in model.get("guards_code") or []:
        check_guard(path, guard)
    for key, value in walk(model):
        if key == "expr_str":
            check_expr(path, value)
        elif key == "target" and not isinstance(value, (dict, list)):
            check_target(path, value)
    for name in (model.get("range_constraints") or {}):
        if not isinstance(name, str) or not re.match(r"^[a-z]+\d+$", name):
            raise bad(path, f"range constraint {str(name)[:60]!r} is not a symbol name")


def check_graph_archive(path: Path) -> None:
    """Refuse a graph.pt2 that ``torch.export.load`` could not read without pickle, exec or eval."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = check_member_names(path, zf)
            records = {rel for rel in members if _RECORD.match(rel)}
            root = zf.infolist()[0].filename.split("/", 1)[0]
            for rel, info in members.items():
                if _CONFIG.match(rel):
                    check_payload_config(path, zf, info, records)
            model = members["models/model.json"]
            if model.file_size > MAX_MODEL_JSON_BYTES:
                raise bad(path, f"its model JSON is {model.file_size} bytes")
            check_model_json(path, zf.read(f"{root}/models/model.json"))
    except ArtifactError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as e:
        raise ArtifactError(f"cannot read the graph {path.name}: not a valid archive ({type(e).__name__}: {e})") from None


SERIALIZATION_ID: str = ".data/serialization_id"


def pin_serialization_id(path: Path) -> None:
    """Replace the random serialization id torch.export.save writes with one derived from the archive's other
    members (same length, decimal digits), so the same graph gives the same bytes. Patched in place: the
    member's data and its CRC-32 in the local header and the central directory (offsets are unchanged)."""
    import hashlib
    import struct
    import zlib

    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        target = next(i for i in infos if i.filename.endswith("/" + SERIALIZATION_ID))
        digest = hashlib.sha256()
        for info in infos:
            if info is not target:
                digest.update(info.filename.encode() + b"\0" + zf.read(info))
        start_dir = zf.start_dir
    width = target.file_size
    new = str(int.from_bytes(digest.digest(), "big"))[:width].rjust(width, "0").encode()
    crc = zlib.crc32(new)
    with open(path, "r+b") as f:
        f.seek(target.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            raise ArtifactError(f"{path.name}: unexpected zip layout")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(target.header_offset + 14)
        f.write(struct.pack("<I", crc))
        f.seek(target.header_offset + 30 + name_len + extra_len)
        f.write(new)
        f.seek(start_dir)
        name = target.filename.encode()
        while True:
            entry = f.read(46)
            if entry[:4] != b"PK\x01\x02":
                raise ArtifactError(f"{path.name}: {target.filename} is not in the central directory")
            n, e, c = struct.unpack("<HHH", entry[28:34])
            entry_name = f.read(n)
            if entry_name == name:
                f.seek(f.tell() - n - 46 + 16)
                f.write(struct.pack("<I", crc))
                break
            f.seek(e + c, 1)

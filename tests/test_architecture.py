"""The package layout the README describes, checked against the source (fast: `ast` and `tomllib` only).

* every package on disk is in pyproject.toml's `packages` and in README.md's "Code layout" table, and the
  table names no package that does not exist;
* passes never import each other (only `picompile.passes.registry`);
* no lower layer imports an upper one (imports inside functions count too);
* the CLI finds its subcommands by plain imports, never `importlib.import_module`;
* picompile op arguments are read by name (`picompile.ir.schema`), never by position: no `X.args[<int>]` in
  passes/, runtime/, picompile/tools/, picompile/formats/ but on aten-guarded or output nodes, or in the
  few allowlisted modules that match aten patterns (POSITIONAL_ALLOWED).

Nothing here imports picompile: the source is parsed, not executed.
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# -- the source tree ----------------------------------------------------------------------------------
def package_dirs() -> dict[str, Path]:
    """pyproject's `[tool.setuptools] package-dir`: top package name -> its directory."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / d for name, d in setuptools["package-dir"].items()}


def declared_packages() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def packages_on_disk() -> set[str]:
    """Every directory with an `__init__.py` under a mapped root, by its dotted name."""
    found: set[str] = set()
    for name, top in package_dirs().items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top)
            if all((top / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(len(rel.parts) + 1)):
                found.add(".".join([name, *rel.parts]))
    return found


def unpackaged_source_dirs() -> list[Path]:
    """Directories under a mapped root that hold .py files but no `__init__.py` (setuptools would skip them)."""
    return sorted({py.parent for top in package_dirs().values() for py in top.rglob("*.py")
                   if not (py.parent / "__init__.py").is_file()})


@dataclass(frozen=True)
class Module:
    name: str  # dotted: picompile.passes.split_ffn
    path: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules() -> list[Module]:
    """Every .py file under the mapped roots, named as it is imported."""
    found = []
    for name, top in package_dirs().items():
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append(Module(".".join([name, *parts]), path))
    return found


def modules_in(prefix: str) -> list[Module]:
    return [m for m in modules() if within(m.name, prefix)]


def within(name: str, prefix: str) -> bool:
    """`name` is the module `prefix` or lies inside it (dotted-component prefix)."""
    return name == prefix or name.startswith(prefix + ".")


# -- imports ------------------------------------------------------------------------------------------
def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(dotted name, line) of everything the source imports, anywhere in it (function bodies, TYPE_CHECKING
    blocks); `from X import a` gives `X.a` (a submodule or a name of X: either way X is imported), relative
    imports resolved against `module`."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - (node.level - (1 if is_package else 0))]
                base = ".".join(parent + ([node.module] if node.module else []))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def module_imports(m: Module) -> list[tuple[str, int]]:
    return imported_names(m.path.read_text(), m.name, m.is_package)


@dataclass(frozen=True)
class Layer:
    """`package` (and everything in it) imports nothing inside any of `forbidden`."""

    package: str
    forbidden: tuple[str, ...]

    def violations(self) -> list[str]:
        return [f"{m.path.relative_to(ROOT)}:{line} imports {name}"
                for m in modules_in(self.package) for name, line in module_imports(m)
                if any(within(name, f) for f in self.forbidden)]


def _of(*names: str) -> tuple[str, ...]:
    return tuple(f"picompile.{n}" for n in names)


# lowest first: errors/targets/config -> kernels -> ir -> sparsity/formats/frontend -> passes
# -> pipeline/builder -> runtime -> tools -> cli
LAYERS: list[Layer] = [
    Layer("picompile.ir", _of("passes", "runtime", "tools", "cli", "formats", "sparsity", "frontend",
                              "builder", "pipeline")),
    Layer("picompile.formats", _of("passes", "runtime", "tools", "cli", "builder", "pipeline")),
    Layer("picompile.sparsity", _of("passes", "runtime", "tools", "cli", "builder", "pipeline")),
    Layer("picompile.runtime", _of("passes", "tools", "cli", "builder", "pipeline")),
    Layer("picompile.frontend", _of("passes", "runtime", "tools", "cli")),
]


def kernel_violations() -> list[str]:
    """picompile.kernels imports nothing of picompile but itself (it is usable without the compiler)."""
    return [f"{m.path.relative_to(ROOT)}:{line} imports {name}"
            for m in modules_in("picompile.kernels") for name, line in module_imports(m)
            if within(name, "picompile") and not within(name, "picompile.kernels")]


def pass_import_violations(source: str, module: str) -> list[str]:
    """Imports of another pass module by the pass `module` (the registry is shared; nothing else is)."""
    return [f"{module}:{line} imports {name}" for name, line in imported_names(source, module)
            if within(name, "picompile.passes") and not within(name, "picompile.passes.registry")]


def dynamic_import_uses(source: str) -> list[int]:
    """Lines that import a module by a computed name: importlib.import_module, import_module, __import__."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                    (isinstance(f, ast.Name) and f.id in ("import_module", "__import__")):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "importlib" and \
                any(a.name == "import_module" for a in node.names):
            lines.append(node.lineno)
    return lines


# -- positional op arguments --------------------------------------------------------------------------
# Positions are fine on nodes that are not picompile ops; the scan recognises two such cases by themselves:
# a node guarded by `if X.target is / == / in <aten…>:` (X's args in that test and body), and the graph's
# output node (a name bound to an expression that tests `… == "output"`). Modules whose aten matching has no
# such guard at the subscript are listed here; everything else reads picompile op arguments by name.
POSITIONAL_ALLOWED: dict[str, str] = {
    "passes/canonicalize_ffn.py": "matches aten linear / matmul / addmm / activation subgraphs, before any "
                                  "picompile op exists, through helpers (_other, match_activation)",
    "passes/fold_kv_repeat.py": "follows aten sdpa(reshape(expand(unsqueeze(k)))) chains after a negated guard",
    "runtime/kv_cache.py": "reads aten.cat nodes (`_CAT`) and their list of parts",
    "runtime/graph_exec.py": "runs any torch operator node by its own schema (written arguments, views, "
                             "getitem's index, the output tuple); it matches no picompile op",
    "runtime/native_glue.py": "matches the aten RMSNorm (pow/mean/add/rsqrt/mul), rotate-half (slice/neg/cat), "
                              "head split (slice/view/transpose) and KV cache write (slice/copy_) subgraphs and "
                              "the native ops it made itself; picompile ops are read with args_of",
}
POSITIONAL_SCANNED: tuple[str, ...] = ("passes", "runtime", "picompile/tools", "picompile/formats")


def _int_constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to an integer literal (`PART_MASK_ARG: int = 5`): positions under a name."""
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign):
            targets, value = [stmt.target], stmt.value
        else:
            continue
        if isinstance(value, ast.Constant) and type(value.value) is int:
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _is_position(node: ast.expr | None, constants: set[str]) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.BinOp):  # args[MASK + 1:]
        return _is_position(node.left, constants) or _is_position(node.right, constants)
    return (isinstance(node, ast.Constant) and type(node.value) is int) or \
        (isinstance(node, ast.Name) and node.id in constants)


def _aten_guarded(tree: ast.Module) -> set[int]:
    """ids of the `X.args[…]` subscripts inside `if X.target is / == / in <…aten…>:` (its test and body)."""
    guarded: set[int] = set()
    for branch in (n for n in ast.walk(tree) if isinstance(n, ast.If)):
        tests = branch.test.values if isinstance(branch.test, ast.BoolOp) else [branch.test]
        names = {t.left.value.id for t in tests
                 if isinstance(t, ast.Compare) and isinstance(t.left, ast.Attribute) and t.left.attr == "target"
                 and isinstance(t.left.value, ast.Name) and isinstance(t.ops[0], (ast.Is, ast.Eq, ast.In))
                 and "aten" in ast.unparse(t.comparators[0])}
        for part in [branch.test, *branch.body]:
            guarded |= {id(sub) for sub in ast.walk(part) if _args_subscript_of(sub) in names}
    return guarded


def _output_nodes(tree: ast.Module) -> set[str]:
    """Names bound to the graph's output node: `out = next(n for n in g.nodes if n.op == "output")`."""
    return {stmt.targets[0].id for stmt in ast.walk(tree)
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and any(isinstance(c, ast.Compare) and any(isinstance(x, ast.Constant) and x.value == "output"
                                                       for x in [c.left, *c.comparators])
                    for c in ast.walk(stmt.value))}


def _args_subscript_of(node: ast.AST) -> str | None:
    """X when ``node`` is `X.args[…]` with X a plain name (None otherwise)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "args" \
            and isinstance(node.value.value, ast.Name):
        return node.value.value.id
    return None


def positional_args(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `X.args[<int>]` / `X.args[<int>:…]` / `X.args[:<int>]` subscript, the integer
    a literal or a module-level integer constant, except on aten-guarded and output nodes (see above). (The
    scan cannot tell an fx node from, say, an exception: read an exception's message with `str(e)`.)"""
    tree = ast.parse(source)
    constants, guarded, outputs = _int_constants(tree), _aten_guarded(tree), _output_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "args"):
            continue
        if id(node) in guarded or _args_subscript_of(node) in outputs:
            continue
        s = node.slice
        bounds = [s.lower, s.upper] if isinstance(s, ast.Slice) else [s]
        if any(_is_position(b, constants) for b in bounds):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


# -- README -------------------------------------------------------------------------------------------
PACKAGE_NAME = re.compile(r"`(picompile(?:\.[A-Za-z_]\w*)*)`")


def layout_table_packages(readme: str) -> set[str]:
    """Package names in backticks in the first column of README.md's "Code layout" table."""
    section = readme.split("\n## Code layout", 1)
    assert len(section) == 2, "README.md has no '## Code layout' section"
    body = section[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|") and not set(line) <= set("|-: ")]
    return {name for row in rows[1:] for name in PACKAGE_NAME.findall(row.split("|")[1])}


# -- the tests ----------------------------------------------------------------------------------------
def test_pyproject_lists_exactly_the_packages_on_disk() -> None:
    on_disk, declared = packages_on_disk(), declared_packages()
    assert on_disk == declared, (f"on disk, not in pyproject's packages: {sorted(on_disk - declared)}; "
                                 f"in pyproject, not on disk: {sorted(declared - on_disk)}")
    assert not unpackaged_source_dirs(), f"Python files outside any package: {unpackaged_source_dirs()}"


def test_readme_layout_table_names_every_package_and_only_those() -> None:
    named, on_disk = layout_table_packages((ROOT / "README.md").read_text()), packages_on_disk()
    assert not on_disk - named, f"packages missing from README.md's layout table: {sorted(on_disk - named)}"
    assert not named - on_disk, f"README.md's layout table names packages that do not exist: {sorted(named - on_disk)}"


def test_passes_import_no_other_pass() -> None:
    bad = [v for m in modules_in("picompile.passes") if not m.is_package
           for v in pass_import_violations(m.path.read_text(), m.name)]
    assert not bad, "passes share picompile.ir.patterns, never each other:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.package)
def test_no_lower_layer_imports_an_upper_one(layer: Layer) -> None:
    assert modules_in(layer.package), f"no modules found for {layer.package}"
    bad = layer.violations()
    assert not bad, f"{layer.package} must not import {', '.join(layer.forbidden)}:\n" + "\n".join(bad)


def test_kernels_import_nothing_of_picompile_but_themselves() -> None:
    assert modules_in("picompile.kernels")
    bad = kernel_violations()
    assert not bad, "picompile.kernels stands alone:\n" + "\n".join(bad)


def test_cli_imports_no_module_by_computed_name() -> None:
    bad = [f"{m.path.relative_to(ROOT)}:{line}" for m in modules_in("picompile.cli")
           for line in dynamic_import_uses(m.path.read_text())]
    assert modules_in("picompile.cli")
    assert not bad, "the CLI imports its subcommand modules plainly:\n" + "\n".join(bad)


def test_picompile_op_arguments_are_read_by_name() -> None:
    for path in POSITIONAL_ALLOWED:
        assert (ROOT / path).is_file(), f"allowlisted {path} does not exist"
    bad = [f"{path.relative_to(ROOT)}:{line}: {text}"
           for root in POSITIONAL_SCANNED for path in sorted((ROOT / root).rglob("*.py"))
           if str(path.relative_to(ROOT)) not in POSITIONAL_ALLOWED
           for line, text in positional_args(path.read_text())]
    assert not bad, "read picompile op arguments with picompile.ir.schema (arg, args_of, set_args), not " \
                    "by position:\n" + "\n".join(bad)


# -- the scanners themselves catch what they are for ---------------------------------------------------
def test_pass_import_scan_sees_imports_inside_functions() -> None:
    src = "from picompile.passes.registry import register_pass\ndef f():\n    from picompile.passes import split_ffn\n"
    assert pass_import_violations(src, "picompile.passes.fuse") == [
        "picompile.passes.fuse:3 imports picompile.passes.split_ffn"]


def test_import_scan_resolves_relative_imports() -> None:
    rel = imported_names("from ..runtime import loader\nfrom . import x\n", "picompile.formats.onnx_export")
    assert rel == [("picompile.runtime.loader", 1), ("picompile.formats.x", 2)]
    assert imported_names("from . import ops\n", "picompile.ir", is_package=True) == [("picompile.ir.ops", 1)]
    assert within("picompile.passes.x", "picompile.passes") and not within("picompile.passes_x", "picompile.passes")


def test_dynamic_import_scan() -> None:
    assert dynamic_import_uses("import importlib\nm = importlib.import_module('picompile.cli.' + n)\n") == [2]
    assert dynamic_import_uses("from importlib import import_module\n__import__('x')\n") == [1, 2]
    assert dynamic_import_uses("from picompile.cli import build\n") == []


def test_positional_scan_sees_literals_constants_and_slices() -> None:
    src = ("K: int = 5\na = n.args[0]\nb = n.args[1:K]\nc = n.args[K + 1:]\nd = n.args[i]\n"
           "e = n.args[:3]\nf = n.kwargs['x']\ng = n.args[-1]\n")
    assert [line for line, _ in positional_args(src)] == [2, 3, 4, 6, 8]


def test_positional_scan_spares_aten_guarded_and_output_nodes_only() -> None:
    src = ("if n.target is aten.embedding.default:\n    w = n.args[0]\n"          # 2: aten, spared
           "if n.target == aten.permute.default and list(n.args[1]) == [1, 0]:\n    x = 1\n"  # 3: spared
           "if is_picompile_op(n.target, 'merge'):\n    h = n.args[0]\n"         # 6: picompile op
           "if n.target is aten.mm.default:\n    y = m.args[0]\n"                # 8: another node
           "out = next(x for x in g.nodes if x.op == 'output')\nr = out.args[0]\nq = other.args[0]\n")
    assert [line for line, _ in positional_args(src)] == [6, 8, 11]


def test_layout_table_parse_reads_the_first_column_of_its_section_only() -> None:
    table = ("x `picompile.a`\n## Code layout\n\n| package | what |\n|---|---|\n"
             "| `picompile.ir` (`picompile/ir/`) | `picompile.x` |\n| `picompile.passes` = `passes/` | y |\n\n"
             "## Next\n| `picompile.z` | |\n")
    assert layout_table_packages(table) == {"picompile.ir", "picompile.passes"}

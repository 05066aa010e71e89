"""An artifact is data, not code (issue #22): each finding reproduced on a copy of a built artifact.

1 pickle / exec / eval through graph.pt2 · 2 paths outside the artifact · 3 kernels dlopen'd unchecked ·
4 build -o replacing a non-artifact · 5 interrupted builds leaving .partial dirs · 6 malformed manifests
and numeric options · 7 absurd model configs · 8 reproducible builds; then a seeded fuzz test of the loader.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest

import picompile
from picompile.cli import main
from picompile.errors import ArtifactError, PicompileError

PACKAGE_DIRS = [Path(picompile.__file__).parent, *(Path(picompile.__file__).parents[1] / d for d in ("passes", "runtime", "kernels"))]


# ----------------------------------------------------------------------------- helpers

def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def manifest_of(art: Path) -> dict[str, Any]:
    return json.loads((art / "manifest.json").read_text())


def write_manifest(art: Path, m: dict[str, Any], resum: bool = True) -> None:
    """Write ``m`` as the manifest, with every listed file's size and sha256 recomputed (as an attacker would)."""
    if resum:
        for rel in m.get("files", {}):
            p = art / rel
            if p.is_file() and not p.is_symlink():
                m["files"][rel] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
    (art / "manifest.json").write_text(json.dumps(m, indent=1))


def rewrite_graph(art: Path, edit: Callable[[dict[str, bytes]], None]) -> None:
    """Rewrite graph.pt2's members (name -> bytes) through ``edit``, stored uncompressed as torch writes them."""
    path = art / "graph.pt2"
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    edit(members)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    write_manifest(art, manifest_of(art))


def fails(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(args)
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and needle in err, err
    assert "Traceback" not in err
    return err


class Payload:
    """Unpickling it creates ``marker`` (stands for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


# ----------------------------------------------------------------------------- 1. no pickle, exec or eval

def test_crafted_sample_inputs_do_not_run(default_artifact: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "evil.pic")
    marker = tmp_path / "pwned"
    rewrite_graph(art, lambda m: m.update({"graph/data/sample_inputs/model.pt": pickle.dumps(Payload(marker))}))
    # the finding: torch.export.load itself runs the payload (weights_only=True fails, the fallback unpickles)
    import torch

    try:
        torch.export.load(art / "graph.pt2")
    except Exception:
        pass
    assert marker.exists(), "the crafted archive no longer reproduces the finding on this torch"
    marker.unlink()
    fails(["run", str(art), "--ids", "1,2", "-n", "1"], "refusing the graph graph.pt2: member "
          "graph/data/sample_inputs/model.pt holds pickled sample inputs", capsys)
    fails(["inspect", str(art), "--graph"], "refusing the graph graph.pt2", capsys)
    fails(["run", str(art), "--ids", "1", "--no-verify"], "refusing the graph", capsys)
    assert not marker.exists()


def _model_json(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, bytes]], None]:
    def apply(members: dict[str, bytes]) -> None:
        model = json.loads(members["graph/models/model.json"])
        edit(model)
        members["graph/models/model.json"] = json.dumps(model).encode()
    return apply


def _first_node(model: dict[str, Any]) -> dict[str, Any]:
    return model["graph_module"]["graph"]["nodes"][0]


def _set_expr(model: dict[str, Any], expr: str) -> None:
    from picompile.formats.archive import walk

    for key, value in walk(model):
        if isinstance(value, dict) and "expr_str" in value:
            value["expr_str"] = expr
            return
    raise AssertionError("no shape expression in the graph")


EVIL = "__import__('pathlib').Path('{marker}').touch()"
CRAFTED: dict[str, tuple[Callable[[Path], Callable[[dict[str, bytes]], None]], str]] = {
    "opaque constant": (lambda mk: lambda m: m.update({
        "graph/data/constants/model_constants_config.json": json.dumps({"config": {"c": {
            "path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}}}).encode(),
        "graph/data/constants/opaque_obj_0": pickle.dumps(Payload(mk))}), "is not one picompile writes"),
    "use_pickle weight": (lambda mk: lambda m: m.update({
        "graph/data/weights/model_weights_config.json": json.dumps({"config": {"w": {
            "path_name": "weight_0", "is_param": True, "use_pickle": True, "tensor_meta": None}}}).encode(),
        "graph/data/weights/weight_0": pickle.dumps(Payload(mk))}), "would be unpickled (use_pickle)"),
    "legacy weights file": (lambda mk: lambda m: m.update({"graph/data/weights/model.pt": pickle.dumps(Payload(mk))}),
                            "is not one picompile writes"),
    "guards code": (lambda mk: _model_json(lambda j: j.update({"guards_code": [EVIL.format(marker=mk)]})),
                    "is not a comparison of input sizes"),
    "sympy expression": (lambda mk: _model_json(lambda j: _set_expr(j, EVIL.format(marker=mk))),
                         "is not a plain sympy expression"),
    "callable target": (lambda mk: _model_json(lambda j: _first_node(j).update({"target": "torch.load"})),
                        "node target 'torch.load' is not an aten or picompile operator"),
    "aten.from_file": (lambda mk: _model_json(lambda j: _first_node(j).update(
        {"target": "torch.ops.aten.from_file.default"})), "is not an aten or picompile operator"),
    "extra member": (lambda mk: lambda m: m.update({"graph/extra/notes.txt": b"hi"}), "is not one picompile writes"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_graph_refused(name: str, default_artifact: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "evil.pic")
    marker = tmp_path / "pwned"
    craft, needle = CRAFTED[name]
    rewrite_graph(art, craft(marker))
    err = fails(["run", str(art), "--ids", "1,2", "-n", "1"], needle, capsys)
    assert err.count("error:") == 1
    assert not marker.exists()


@pytest.mark.parametrize("guard,ok", [
    ("L['past_1'].size()[2] == L['past_6'].size()[2]", True),
    ("min(16*L['past_2'].size()[2] + 16*L['input_ids'].size()[1], 32) >= 2 and not 1 > 2", True),
    ("__import__('os').system('id')", False), ("exec(chr(49))", False), ("L['a'].size()[1].__class__", False),
    ("L['a'].size()[1] == eval", False), ("L[__import__('os')].size()[0] == 1", False),
])
def test_guard_grammar(guard: str, ok: bool) -> None:
    from picompile.formats.archive import check_guard

    if ok:
        check_guard(Path("graph.pt2"), guard)
    else:
        with pytest.raises(ArtifactError, match="is not a comparison of input sizes"):
            check_guard(Path("graph.pt2"), guard)


@pytest.mark.parametrize("expr,ok", [
    ("Add(Mul(Integer(32), Symbol('s13', positive=True, integer=True)), Symbol('s70', positive=True, integer=True))", True),
    ("Float('1.5', precision=53)", True), ("Float('1.5'+chr(95))", False), ("Symbol('s1').__class__", False), ("eval('1')", False),
    ("Integer(chr(95))", False), ("Max(Symbol('s1'), Integer(2))", True),
])
def test_shape_expression_grammar(expr: str, ok: bool) -> None:
    from picompile.formats.archive import check_expr

    if ok:
        check_expr(Path("graph.pt2"), expr)
    else:
        with pytest.raises(ArtifactError, match="shape expression"):
            check_expr(Path("graph.pt2"), expr)


def test_built_graph_passes_the_check(default_artifact: Path, artifacts: dict) -> None:
    from picompile.formats.archive import check_graph_archive

    for art in [default_artifact, *artifacts.values()]:
        check_graph_archive(art / "graph.pt2")  # what picompile writes is what it reads


def test_no_pickle_in_the_load_path() -> None:
    """No module of the package imports pickle or calls torch.load without weights_only=True."""
    pattern = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b|pickle\.loads?\(|_pickle_load|"
                         r"torch\.load\((?![^)]*weights_only\s*=\s*True)", re.M)
    hits = [f"{p}:{m.group(0)}" for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))
            for m in pattern.finditer(p.read_text())]
    assert hits == []


# ----------------------------------------------------------------------------- 2. paths confined to the artifact

@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    s = tmp_path / "outside" / "secret.txt"
    s.parent.mkdir()
    s.write_text("the user's secret\n")
    return s


def _set(m: dict[str, Any], path: str, value: Any) -> None:
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    obj: Any = m
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value


@pytest.mark.parametrize("field", ["graph.file", "weights.file", "sections.kernels.0.file", "tokenizer.files.0"])
@pytest.mark.parametrize("form", ["absolute", "dotdot"])
def test_manifest_paths_confined(field: str, form: str, default_artifact: Path, tmp_path: Path, secret: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    m = manifest_of(art)
    value = str(secret) if form == "absolute" else "../outside/secret.txt"
    _set(m, field, value)
    write_manifest(art, m)
    needle = "absolute path" if form == "absolute" else "leaves or escapes the artifact"
    fails(["run", str(art), "--ids", "1", "-n", "1"], f"manifest field {field.split('.0')[0]}", capsys)
    with pytest.raises(ArtifactError, match=needle):
        picompile.load(art)


def test_files_table_is_no_oracle(default_artifact: Path, tmp_path: Path, secret: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A files entry naming an outside file is refused for its path, whatever the checksum says."""
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    m = manifest_of(art)
    for guess in (secret.read_bytes(), b"wrong guess"):
        m["files"]["../outside/secret.txt"] = {"sha256": hashlib.sha256(guess).hexdigest(), "bytes": len(guess)}
        write_manifest(art, m, resum=False)
        err = fails(["inspect", str(art)], "leaves or escapes the artifact", capsys)
        assert "checksum" not in err


def test_symlink_out_of_the_artifact(default_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    outside = tmp_path / "outside.safetensors"
    shutil.move(art / "weights.safetensors", outside)
    (art / "weights.safetensors").symlink_to(outside)  # same bytes, same checksum: only the path gives it away
    fails(["run", str(art), "--ids", "1", "-n", "1"], "resolves outside the artifact (a symlink leaves it)", capsys)


def test_unlisted_file_is_not_opened(default_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    shutil.copy(art / "weights.safetensors", art / "other.safetensors")
    m = manifest_of(art)
    m["weights"]["file"] = "other.safetensors"
    write_manifest(art, m)
    fails(["run", str(art), "--ids", "1", "-n", "1"], "which its files table does not list", capsys)


# ----------------------------------------------------------------------------- 3. kernels checked before dlopen

@pytest.fixture(scope="module")
def constructor_library(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A shared library whose constructor creates a marker file (what a swapped kernel would run)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    d = tmp_path_factory.mktemp("so")
    marker = d / "constructor-ran"
    (d / "evil.c").write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                              f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "evil.so"), str(d / "evil.c")], check=True)
    return d / "evil.so", marker


@pytest.mark.parametrize("how", ["no-verify", "unlisted", "outside"])
def test_swapped_kernel_not_loaded(how: str, default_artifact: Path, tmp_path: Path,
                                   constructor_library: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.kernels.table import KERNEL_TABLE

    lib, marker = constructor_library
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    m = manifest_of(art)
    entry = m["sections"]["kernels"][0]
    saved = dict(KERNEL_TABLE)
    KERNEL_TABLE.clear()  # as in a fresh process: nothing loaded yet
    try:
        if how == "no-verify":  # the library swapped (same size), the manifest untouched, checksums skipped
            target = art / entry["file"]
            evil, size = lib.read_bytes(), target.stat().st_size
            if len(evil) > size:
                pytest.skip("the stand-in library is larger than the kernel it would replace")
            target.write_bytes(evil + b"\0" * (size - len(evil)))
            fails(["run", str(art), "--ids", "1", "-n", "1", "--no-verify"], f"checksum mismatch for {entry['file']}",
                  capsys)
        elif how == "unlisted":
            shutil.copy(lib, art / "kernels" / "extra.so")
            shutil.copy(art / entry["file"].replace(".so", ".json"), art / "kernels" / "extra.json")
            entry["file"] = "kernels/extra.so"
            write_manifest(art, m)
            fails(["run", str(art), "--ids", "1", "-n", "1"], "which its files table does not list", capsys)
        else:
            entry["file"] = str(lib)
            write_manifest(art, m)
            fails(["run", str(art), "--ids", "1", "-n", "1"], "sections.kernels[0].file", capsys)
    finally:
        KERNEL_TABLE.clear()
        KERNEL_TABLE.update(saved)
    assert not marker.exists()


def test_resummed_kernel_swap_runs_no_code_by_default(default_artifact: Path, tmp_path: Path,
                                                      constructor_library: tuple[Path, Path]) -> None:
    """The attack checksums cannot stop: a kernel library swapped and every sum recomputed. By default the
    runtime compiles its kernels here from their specs (kernels="local"), so the artifact's library never
    runs; only --trust-kernels (kernels="artifact") dlopens it, and then its constructor runs."""
    from picompile.kernels.table import KERNEL_TABLE

    lib, marker = constructor_library
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    m = manifest_of(art)
    for entry in m["sections"]["kernels"]:
        shutil.copy(lib, art / entry["file"])
    write_manifest(art, m)
    saved = dict(KERNEL_TABLE)
    KERNEL_TABLE.clear()  # as in a fresh process: nothing loaded yet
    try:
        assert main(["run", str(art), "--ids", "1,2,3", "-n", "4"]) == 0
        assert not marker.exists()
        KERNEL_TABLE.clear()
        main(["run", str(art), "--ids", "1", "-n", "1", "--trust-kernels"])  # the stand-in exports no kernel
        assert marker.exists()
    finally:
        KERNEL_TABLE.clear()
        KERNEL_TABLE.update(saved)
        marker.unlink(missing_ok=True)


def test_local_kernels_equal_the_artifacts(default_artifact: Path) -> None:
    """Both kernel sources compute the same logits (the local ones are the same specs compiled here)."""
    from picompile.kernels.table import KERNEL_TABLE

    saved = dict(KERNEL_TABLE)
    try:
        out = {}
        for source in ("local", "artifact"):
            KERNEL_TABLE.clear()
            out[source] = picompile.load(default_artifact, hybrid="off", kernels=source).logits([1, 5, 9, 2])
        assert (out["local"] - out["artifact"]).abs().max().item() == 0.0
        with pytest.raises(PicompileError, match="kernels must be one of local, artifact"):
            picompile.load(default_artifact, kernels="elsewhere")
    finally:
        KERNEL_TABLE.clear()
        KERNEL_TABLE.update(saved)


# ----------------------------------------------------------------------------- 4. build -o never replaces user data

@pytest.mark.parametrize("manifest", ['{"name": "my notes"}', '{"format": "other-tool"}', "not json", "[1, 2]"])
def test_build_refuses_foreign_manifest(manifest: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    (out / "thesis.tex").write_text("years of work")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fails(["build", "-o", str(out), "-q"], "is not a picompile artifact; refusing to overwrite it", capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


# ----------------------------------------------------------------------------- 5. interrupted builds leave nothing

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _staging(parent: Path, name: str, pid: int, marker: bool = True) -> Path:
    d = parent / f".{name}.{pid}.abc123.partial"
    d.mkdir()
    (d / "weights.safetensors").write_bytes(b"half")
    if marker:
        (d / ".picompile-partial").write_text(f"{pid}\n")
    return d


def test_stale_partials_swept_live_ones_kept(tmp_path: Path) -> None:
    from picompile.formats.artifact import staged_output

    dead = _staging(tmp_path, "out.pic", _dead_pid())
    live = _staging(tmp_path, "other.pic", os.getpid())  # another build, still running
    foreign = _staging(tmp_path, "x.pic", _dead_pid(), marker=False)  # not picompile's: no marker
    with staged_output(tmp_path / "out.pic") as staging:
        assert (staging / ".picompile-partial").read_text().strip() == str(os.getpid())
        assert str(os.getpid()) in staging.name
        (staging / "manifest.json").write_text('{"format": "picompile-artifact"}')
    assert not dead.exists() and live.exists() and foreign.exists()
    assert sorted(p.name for p in (tmp_path / "out.pic").iterdir()) == ["manifest.json"]  # the marker is gone


# the CLI in a child whose build holds its staging directory open (a tiny build would otherwise finish between
# two polls of the parent, and the signal would find nothing to clean up)
HELD_BUILD = """
import contextlib, sys, time
import picompile.builder as builder
real = builder.staged_output
@contextlib.contextmanager
def held(output):
    with real(output) as staging:
        time.sleep(60)
        yield staging
builder.staged_output = held
from picompile.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_cleans_up(sig: int, checkpoints: dict, tmp_path: Path) -> None:
    out = tmp_path / "t.pic"
    # the child's signal starts at its default: under nohup (SIGHUP ignored, which a build respects) it would run on
    proc = subprocess.Popen([sys.executable, "-c", HELD_BUILD, "build", str(checkpoints[("llama", "relu")]), "-o",
                             str(out), "-q", "--pipeline", "dense"], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    deadline = time.time() + 120
    while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.time() < deadline, "the build ended before its staging dir appeared"
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 6. malformed manifests (numeric options: test_bad_input.py)

BAD_MANIFESTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "layers not a list": (lambda m: m.update(layers={"a": 1}), "manifest field layers must be a JSON list"),
    "missing model": (lambda m: m.pop("model"), "lacks the fields model"),
    "n_layers string": (lambda m: m["model"].update(n_layers="4"), "model.n_layers must be an integer in 1..4096"),
    "negative heads": (lambda m: m["model"].update(n_kv_heads=-6), "model.n_kv_heads must be an integer"),
    "huge context": (lambda m: (m["model"].update(max_seq_len=1 << 22), m["build"].update(max_seq_len=1 << 22),
                                m["model"].update(n_layers=4096, head_dim=4096, n_kv_heads=4096)),
                     "manifest field graph.n_past"),
    "768 TB KV cache": (lambda m: (m["model"].update(max_seq_len=1 << 22, n_kv_heads=4096, head_dim=4096),
                                   m["build"].update(max_seq_len=1 << 22), m["graph"].pop("kv_shape")),
                        "manifest implies a KV cache of"),
    "context beyond model": (lambda m: m["build"].update(max_seq_len=10 ** 6), "build.max_seq_len must be an integer"),
    "n_past float": (lambda m: m["graph"].update(n_past=8.0), "graph.n_past must be an integer"),
    "bad sha": (lambda m: m["files"]["graph.pt2"].update(sha256=7), "sha256 must be 64 lowercase hex digits"),
    "negative bytes": (lambda m: m["files"]["graph.pt2"].update(bytes=-1), "bytes must be an integer in 0.."),
    "layer d_model": (lambda m: m["layers"][0].update(d_model=7), "layers[0].d_model must be model.d_model"),
    "kernel spec junk": (lambda m: m["sections"]["kernels"][0].update(spec={"kind": 3}), "kernel spec"),
    "tokenizer kind": (lambda m: m["tokenizer"].update(kind="pickle"), "tokenizer.kind must be one of"),
    "target nan": (lambda m: m["target"].update(cpu_bandwidth_gbs=float("nan")), "is not valid JSON"),
}


@pytest.mark.parametrize("name", list(BAD_MANIFESTS))
def test_malformed_manifest(name: str, default_artifact: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    art = copy_artifact(default_artifact, tmp_path / "a.pic")
    m = manifest_of(art)
    edit, needle = BAD_MANIFESTS[name]
    edit(m)
    write_manifest(art, m, resum=False)  # no file changed: the sums stand
    err = fails(["run", str(art), "--ids", "1", "-n", "1"], needle, capsys)
    assert err.count("error:") == 1


def test_non_utf8_prompt(default_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = b"ROMEO \xff\xfe:".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    fails(["run", str(default_artifact), "--prompt", prompt, "-n", "1"], "the prompt is not valid UTF-8", capsys)


# ----------------------------------------------------------------------------- 7. absurd model configs

@pytest.mark.parametrize("config,needle", [
    ({"num_hidden_layers": 300_000, "hidden_size": 64}, "num_hidden_layers must be an integer in 1..4096"),
    ({"num_hidden_layers": 4096, "hidden_size": 65536, "intermediate_size": 262144, "vocab_size": 32000},
     "of float32 weights to build; this machine has"),
    ({"num_hidden_layers": 2, "hidden_size": -64}, "hidden_size must be an integer"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": "big"}, "vocab_size must be an integer"),
])
def test_absurd_config_refused_early(config: dict[str, Any], needle: str, checkpoints: dict, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(checkpoints[("llama", "relu")], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    fails(["build", str(d), "-o", str(tmp_path / "a.pic"), "-q"], needle, capsys)
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "a.pic").exists()


# ----------------------------------------------------------------------------- 8. reproducible builds

def test_strip_build_metadata_drops_run_dependent_annotations() -> None:
    """torch.export annotates node.meta["custom"] with the name of the dynamo-disabled function it went through
    ("trace" or "dispatch_trace", depending on what the process traced before): package drops those keys (a
    second build in one process wrote a different graph.pt2), and keeps any other custom annotation."""
    import torch

    from picompile.passes.package import DYNAMO_ANNOTATIONS, strip_build_metadata

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) + 1

    ep = torch.export.export(M(), (torch.ones(3),), strict=False)
    nodes = [n for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    nodes[0].meta["custom"] = {**dict.fromkeys(DYNAMO_ANNOTATIONS, "trace"), "mine": 1}
    nodes[1].meta["custom"] = dict.fromkeys(DYNAMO_ANNOTATIONS, "dispatch_trace")
    nodes[1].meta["stack_trace"] = "/home/someone/model.py:3"
    strip_build_metadata(ep)
    assert nodes[0].meta["custom"] == {"mine": 1}
    assert "custom" not in nodes[1].meta and "stack_trace" not in nodes[1].meta


def test_builds_are_reproducible(default_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from picompile.builder import default_model

    again = picompile.build(default_model(), output=tmp_path / "again.pic", emit=lambda s: None, progress=False)
    files = sorted(p.relative_to(default_artifact).as_posix() for p in default_artifact.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again).as_posix() for p in again.rglob("*") if p.is_file())
    differ = [f for f in files if (default_artifact / f).read_bytes() != (again / f).read_bytes()]
    assert differ in ([], ["manifest.json"])
    a, b = manifest_of(default_artifact), manifest_of(again)
    for key in ("created", "measured"):  # the build run's: timestamp, peak RSS, seconds
        a.pop(key, None), b.pop(key, None)
    assert a == b
    hashes = []
    for art in (default_artifact, again):
        assert main(["inspect", str(art), "--json"]) == 0
        hashes.append(json.loads(capsys.readouterr().out)["content_hash"])
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
    # no path of the build machine in any file: the source is named by name and content hash
    machine = [str(Path(default_model()).parent), str(tmp_path), str(Path.home()), str(Path(picompile.__file__).parents[1])]
    for f in files:
        data = (again / f).read_bytes()
        assert not [p for p in machine if p.encode() in data], f
    assert b["model"]["source"] == "default_model" and len(b["model"]["source_sha256"]) == 64


# ----------------------------------------------------------------------------- fuzz: every case a one-line PicompileError

HOSTILE_PATHS: list[str] = ["../outside/secret.txt", "{outside}/secret.txt", "kernels/../../outside/secret.txt",
                            "./graph.pt2", "graph.pt2/", "..\\outside\\secret.txt", "C:/outside/secret.txt", "",
                            "tokenizer//tokenizer.json", "../outside/weights.safetensors", "{outside}/graph.pt2", "\x00",
                            "a" * 600]
JUNK: list[Any] = [None, True, -1, 0, 2**63, 1e308, -0.5, "", "x", [], {}, [1, "a"], {"a": None}, "../outside/secret.txt"]


def json_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += json_paths(v, prefix + (i,))
    return out


def set_path(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def path_fields(m: dict[str, Any]) -> list[tuple[Any, ...]]:
    fields: list[tuple[Any, ...]] = [("graph", "file"), ("weights", "file"), ("sections", "profile", "file"),
                                     ("sections", "placement", "file")]
    fields += [("sections", "kernels", i, "file") for i in range(len(m["sections"].get("kernels", [])))]
    fields += [("tokenizer", "files", i) for i in range(len(m["tokenizer"]["files"]))]
    return fields


class Case:
    """One mutation of the artifact in ``work`` (restored from ``base`` before the next)."""

    def __init__(self, rng: Any, base: Path, work: Path, outside: Path) -> None:
        self.rng, self.base, self.work, self.outside = rng, base, work, outside
        self.touched: list[str] = ["manifest.json"]
        self.verify = rng.random() < 0.8
        self.what = ""

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.work / "manifest.json").read_text())

    def hostile(self) -> str:
        return self.rng.choice(HOSTILE_PATHS).format(outside=self.outside)

    def apply(self, kind: str) -> None:
        getattr(self, kind)()
        self.what = f"{kind}: {self.what} (verify={self.verify})"

    def bitflip_manifest(self) -> None:
        data = bytearray((self.work / "manifest.json").read_bytes())
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(data))
            data[i] ^= 1 << self.rng.randrange(8)
        (self.work / "manifest.json").write_bytes(bytes(data))
        self.what = "bits flipped"

    def truncate_manifest(self) -> None:
        data = (self.work / "manifest.json").read_bytes()
        n = self.rng.randrange(len(data))
        (self.work / "manifest.json").write_bytes(data[:n])
        self.what = f"cut at {n}"

    def retype(self) -> None:
        m = self.manifest()
        path = self.rng.choice(json_paths(m))
        value = self.rng.choice(JUNK)
        set_path(m, path, value)
        write_manifest(self.work, m, resum=False)
        self.what = f"{path} = {value!r}"

    def repath(self) -> None:
        m = self.manifest()
        value = self.hostile()
        if self.rng.random() < 0.3:  # a files entry of its own
            m["files"][value] = {"sha256": hashlib.sha256(b"the user's secret\n").hexdigest(), "bytes": 18}
            self.what = f"files[{value!r}]"
        else:
            path = self.rng.choice(path_fields(m))
            set_path(m, path, value)
            self.what = f"{path} = {value!r}"
        write_manifest(self.work, m, resum=False)

    def _victim(self, with_libraries: bool) -> str:
        files = [f for f in self.manifest()["files"] if with_libraries or not f.endswith(".so")]
        data = [f for f in MAIN_FILES if f in files]
        rel = self.rng.choice(data if data and self.rng.random() < 0.6 else files)
        self.touched.append(rel)
        return rel

    def damage_file(self, resum: bool) -> None:
        rel = self._victim(with_libraries=not resum)  # a library with recomputed sums is trusted native code
        p = self.work / rel
        data = bytearray(p.read_bytes())
        if self.rng.random() < 0.5 and data:
            for _ in range(self.rng.randint(1, 16)):
                i = self.rng.randrange(len(data))
                data[i] ^= 1 << self.rng.randrange(8)
            how = "bits flipped"
        else:
            data = data[:self.rng.randrange(max(1, len(data)))]
            how = "truncated"
        p.write_bytes(bytes(data))
        m = self.manifest()
        write_manifest(self.work, m, resum=resum)
        self.what = f"{rel} {how}, sums {'recomputed' if resum else 'kept'}"

    def damage_resummed(self) -> None:
        self.damage_file(resum=True)

    def damage_kept(self) -> None:
        self.damage_file(resum=False)

    def symlink_out(self) -> None:
        rel = self._victim(with_libraries=True)
        copy = self.outside / Path(rel).name
        shutil.copy(self.work / rel, copy)
        (self.work / rel).unlink()
        (self.work / rel).symlink_to(copy)
        self.what = f"{rel} -> {copy}"

    def restore(self) -> None:
        for rel in self.touched:
            dst = self.work / rel
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            shutil.copy(self.base / rel, dst)


KINDS: list[str] = ["bitflip_manifest", "truncate_manifest", "retype", "retype", "repath", "repath",
                    "damage_resummed", "damage_kept", "symlink_out"]
FUZZ_CASES: int = 150
FUZZ_SECONDS: float = 45.0  # stop early past this (slow machine); at least FUZZ_MIN_CASES run
FUZZ_MIN_CASES: int = 40
MAIN_FILES: tuple[str, ...] = ("graph.pt2", "weights.safetensors", "tokenizer/tokenizer.json", "profile.safetensors",
                               "placement.safetensors")


@pytest.fixture()
def guarded_openers(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record every path the loader opens (Python opens via an audit hook; torch.export.load, safetensors,
    kernel and tokenizer loads via wrappers); torch.export.load memoized per archive content (its result is
    the same for the same bytes; it dominates a load's time)."""
    import torch

    import picompile.formats.tokenizers as tokenizers
    import picompile.kernels as kernels
    import picompile.runtime.loader as loader

    state: dict[str, Any] = {"root": None, "opened": []}
    if not getattr(sys, "_picompile_audit", None):
        def hook(event: str, args: tuple[Any, ...]) -> None:
            st = getattr(sys, "_picompile_audit")
            if event == "open" and st["root"] is not None and isinstance(args[0], (str, bytes, os.PathLike)):
                st["opened"].append(os.fsdecode(args[0]))
        sys._picompile_audit = state  # type: ignore[attr-defined]
        sys.addaudithook(hook)
    else:
        sys._picompile_audit = state  # type: ignore[attr-defined]

    def record(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
            state["opened"].append(os.fsdecode(path))
            return fn(path, *args, **kwargs)
        return wrapper

    cache: dict[str, Any] = {}
    real_load = torch.export.load

    def export_load(path: Any, *args: Any, **kwargs: Any) -> Any:
        state["opened"].append(os.fsdecode(path))
        key = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if key not in cache:
            cache[key] = real_load(path, *args, **kwargs)
        return cache[key]

    monkeypatch.setattr(torch.export, "load", export_load)
    monkeypatch.setattr(loader, "map_safetensors", record(loader.map_safetensors))
    monkeypatch.setattr(kernels, "load_kernel", record(kernels.load_kernel))
    monkeypatch.setattr(tokenizers, "load_tokenizer", record(tokenizers.load_tokenizer))
    yield state
    state["root"] = None


def test_fuzz_artifact(default_artifact: Path, tmp_path: Path, guarded_openers: dict[str, Any]) -> None:
    import random

    from picompile.kernels.table import KERNEL_TABLE

    rng = random.Random(22)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the user's secret\n")
    shutil.copy(default_artifact / "graph.pt2", outside / "graph.pt2")
    shutil.copy(default_artifact / "weights.safetensors", outside / "weights.safetensors")
    work = copy_artifact(default_artifact, tmp_path / "work.pic")
    root = os.path.realpath(work)
    saved = dict(KERNEL_TABLE)
    outcomes: dict[str, int] = {"loaded": 0, "refused": 0}
    problems: list[str] = []
    start = time.perf_counter()
    try:
        for i in range(FUZZ_CASES):
            case = Case(rng, default_artifact, work, outside)
            case.apply(KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS))
            KERNEL_TABLE.clear()  # kernels are loaded (or refused) afresh, as in a new process
            guarded_openers["opened"].clear()
            guarded_openers["root"] = root
            try:
                picompile.load(work, verify=case.verify, hybrid="off")
                outcomes["loaded"] += 1
            except PicompileError as e:
                outcomes["refused"] += 1
                if "\n" in str(e) or not str(e):
                    problems.append(f"{case.what}: a message of {str(e).count(chr(10)) + 1} lines")
            except Exception as e:  # noqa: BLE001 - the test's point
                problems.append(f"{case.what}: {type(e).__name__}: {str(e)[:200]}")
            finally:
                guarded_openers["root"] = None
            escaped = sorted({p for p in guarded_openers["opened"] if os.path.realpath(p).startswith(str(outside))})
            if escaped:
                problems.append(f"{case.what}: opened {escaped}")
            case.restore()
            if time.perf_counter() - start > FUZZ_SECONDS and i + 1 >= FUZZ_MIN_CASES:
                break
    finally:
        KERNEL_TABLE.clear()
        KERNEL_TABLE.update(saved)
    assert problems == []
    assert outcomes["refused"] >= FUZZ_MIN_CASES // 2, outcomes


def test_interrupt_while_the_staging_dir_is_made_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal between the staging directory's mkdir and its marker (the window a fast build's SIGTERM hit) still
    finds the directory to remove: staged_output names it before it is made."""
    from picompile.formats import staging as staging_mod
    from picompile.formats.artifact import staged_output

    def interrupted(path: Path) -> Path:
        os.mkdir(path, 0o700)
        raise KeyboardInterrupt  # as BuildTerminated is, from the SIGTERM handler

    monkeypatch.setattr(staging_mod, "create_staging", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with staged_output(tmp_path / "out.pic"):
            pass
    assert list(tmp_path.iterdir()) == []

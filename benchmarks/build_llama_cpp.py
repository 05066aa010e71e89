"""Build llama.cpp's own ``llama-bench`` and ``llama-quantize`` from a pinned source, for ``picompile bench``.

    python benchmarks/build_llama_cpp.py [--cache-dir DIR] [--jobs 2] [--force]

The source is the ``vendor/llama.cpp`` of the pinned llama-cpp-python sdist (``LLAMA_CPP_PYTHON_PIN`` in
``picompile/tools/llama_bench.py``), fetched with ``pip download --no-deps --no-binary :all:`` (so it works
against whatever package index pip is configured with), built the way llama.cpp's users build it for their own
CPU::

    cmake -B BUILD -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build BUILD --target llama-bench llama-quantize -j2

Output: ``CACHE/llama.cpp/<pin>/bin/{llama-bench,llama-quantize}`` and ``build-info.json`` (the sdist, the
llama.cpp commit, the cmake flags, the compiler). Idempotent: a finished build with the same pin and flags is
reused (``--force`` rebuilds). ``picompile bench --llama-bench auto`` finds it there. Takes ~10-20 min on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from picompile.config import default_cache_dir
from picompile.tools.llama_bench import BUILD_INFO, LLAMA_CPP_PYTHON_PIN, TOOLS, llama_cpp_dir

CMAKE_FLAGS: tuple[str, ...] = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
                                # not what changes speed: keep the build to the two tools, self-contained
                                "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                                "-DLLAMA_BUILD_SERVER=OFF")


class BuildError(RuntimeError):
    """A step of the build failed; the message names it."""


def need_tools() -> str:
    """The C++ compiler found; a one-line error naming what is missing otherwise."""
    if shutil.which("cmake") is None:
        raise BuildError("cmake is not installed (apt-get install cmake, or pip install cmake)")
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise BuildError("no C++ compiler found (c++, g++ or clang++; apt-get install build-essential)")
    return cxx


def run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log``; a BuildError naming the step and the log if it fails."""
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise BuildError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed (exit {rc}); log {log}:\n{tail}")


def fetch_source(work: Path, log: Path) -> Path:
    """Download and extract the pinned sdist under ``work``; its ``vendor/llama.cpp`` directory."""
    dl = work / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    archives = sorted(dl.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}.tar.gz"))
    if not archives:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_PIN}", "-d", str(dl)], log)
        archives = sorted(dl.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}.tar.gz"))
    if not archives:
        raise BuildError(f"pip download gave no llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}.tar.gz in {dl}")
    src = work / "src"
    top = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_PIN}"
    if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        with tarfile.open(archives[0]) as tf:
            tf.extractall(src, filter="data")  # no links out of src, no absolute paths
    vendor = top / "vendor" / "llama.cpp"
    if not (vendor / "CMakeLists.txt").is_file():
        raise BuildError(f"{archives[0].name} has no vendor/llama.cpp/CMakeLists.txt")
    return vendor


def llama_cpp_commit(vendor: Path) -> str:
    """The llama.cpp commit the sdist vendors (its git submodule's HEAD), or "unknown"."""
    top = vendor.parent.parent
    for head in (top / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD", vendor / ".git" / "HEAD"):
        if head.is_file():
            text = head.read_text().strip()
            if len(text) == 40 and all(c in "0123456789abcdef" for c in text):
                return text
    return "unknown"


def build(cache: Path, jobs: int, force: bool) -> Path:
    """Build (or reuse) the tools; the directory holding ``bin/`` and ``build-info.json``."""
    out = llama_cpp_dir(cache)
    info_path = out / BUILD_INFO
    if not force and info_path.is_file():
        info = json.loads(info_path.read_text())
        if (info.get("llama_cpp_python") == LLAMA_CPP_PYTHON_PIN and info.get("cmake_flags") == list(CMAKE_FLAGS)
                and all((out / "bin" / t).is_file() for t in TOOLS)):
            print(f"llama.cpp {info.get('llama_cpp_commit', '?')[:12]} already built: {out / 'bin'}")
            return out
    cxx = need_tools()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "build.log"
    log.write_text("")
    t0 = time.time()
    vendor = fetch_source(work, log)
    commit = llama_cpp_commit(vendor)
    bdir = work / "build"
    run(["cmake", "-S", str(vendor), "-B", str(bdir), *CMAKE_FLAGS, f"-DCMAKE_CXX_COMPILER={cxx}"], log)
    run(["cmake", "--build", str(bdir), "--config", "Release", "--target", *TOOLS, f"-j{jobs}"], log)
    (out / "bin").mkdir(exist_ok=True)
    for t in TOOLS:
        found = [p for p in bdir.rglob(t) if p.is_file()]
        if not found:
            raise BuildError(f"the build finished without a {t} binary under {bdir}")
        shutil.copy2(found[0], out / "bin" / t)
    version = subprocess.run([str(out / "bin" / "llama-bench"), "--version"], capture_output=True, text=True)
    info = {"llama_cpp_python": LLAMA_CPP_PYTHON_PIN, "llama_cpp_commit": commit, "cmake_flags": list(CMAKE_FLAGS),
            "compiler": cxx, "version": (version.stdout + version.stderr).strip().splitlines()[:2],
            "built_s": round(time.time() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(bdir, ignore_errors=True)  # ~1 GB of objects; the sdist stays for a rebuild
    print(f"built llama.cpp {commit[:12]} (llama-cpp-python {LLAMA_CPP_PYTHON_PIN}) in {info['built_s']:.0f} s: "
          f"{out / 'bin'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="default $PICOMPILE_CACHE_DIR or ~/.cache/picompile")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="rebuild even if a finished build is there")
    a = ap.parse_args(argv)
    try:
        build(a.cache_dir or default_cache_dir(), a.jobs, a.force)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

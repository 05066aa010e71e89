"""runtime/extension.py: a C++ extension builds although a killed builder left torch's baton behind."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SOURCE = 'extern "C" int picompile_probe() { return 7; }\n'


def test_stale_baton_of_a_killed_build_is_removed(tmp_path: Path) -> None:
    """A build directory holding torch's baton ``lock`` (what a process killed mid-build leaves; torch alone
    would wait for it forever) still builds and loads, in a fresh process, and the baton is gone after."""
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    code = ("import sys\n"
            "from picompile.runtime.extension import build_directory, load_extension\n"
            "d = build_directory('picompile_probe')\n"
            "d.mkdir(parents=True, exist_ok=True)\n"
            "(d / 'lock').write_text('')  # a dead builder's baton\n"
            f"load_extension('picompile_probe', [{str(src)!r}], is_python_module=False)\n"
            "print('baton', (d / 'lock').exists(), 'so', any(d.glob('*.so')))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "baton False so True"

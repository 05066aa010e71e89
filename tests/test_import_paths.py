"""Nothing in this checkout shadows an installed package when Python runs in it.

The checkout's root holds ``kernels/``, ``passes/`` and ``runtime/`` (installed as ``picompile.kernels`` …);
``python -m`` / ``-c`` in the root put it first on ``sys.path``, where ``kernels/`` stood in for the PyPI package
``kernels`` that transformers (5.25 on) imports, and every model load failed with "cannot import name
'CUDAProperties' from 'kernels'". ``python benchmarks/X.py`` puts ``benchmarks/`` first the same way, so no
script there may bear an installed module's name (``benchmarks/kernels.py`` did).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str, cwd: Path, safe_path: bool = False) -> str:
    cmd = [sys.executable, *(["-P"] if safe_path else []), "-c", code, *args]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_picompile_in_the_checkout_root_unshadows_kernels() -> None:
    code = "import importlib.util, picompile\nspec = importlib.util.find_spec('kernels')\nprint(spec and spec.origin)"
    before = _python("import importlib.util; print(importlib.util.find_spec('kernels').origin)", cwd=ROOT)
    assert before == str(ROOT / "kernels" / "__init__.py"), "premise: from the root, its kernels/ is found first"
    origin = _python(code, cwd=ROOT)
    assert origin != str(ROOT / "kernels" / "__init__.py"), origin
    # picompile's own kernels package still comes from the checkout (through the install's package-dir)
    own = _python("import picompile.kernels as k; print(k.__file__)", cwd=ROOT)
    assert own == str(ROOT / "kernels" / "__init__.py")


def test_transformers_loads_a_config_from_the_checkout_root() -> None:
    code = ("import picompile, sys\nfrom transformers import AutoConfig\n"
            "print(type(AutoConfig.from_pretrained(sys.argv[1])).__name__)")
    assert _python(code, str(ROOT / "picompile" / "data" / "default_model"), cwd=ROOT) == "LlamaConfig"


def test_no_benchmark_script_bears_an_installed_module_name() -> None:
    stems = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    code = ("import importlib.util, sys\n"
            "print(' '.join(s for s in sys.argv[1:] if importlib.util.find_spec(s) is not None))")
    shadowed = _python(code, *stems, cwd=ROOT.parent, safe_path=True)
    assert shadowed == "", f"benchmarks/ scripts named like installed modules: {shadowed}"

"""Shared fixtures: tiny seeded checkpoints and artifacts built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from picompile.testing import save_tiny_checkpoint

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# (family, activation) of the tiny models every end-to-end test runs on
FAMILIES: list[tuple[str, str]] = [("opt", "relu"), ("llama", "relu"), ("llama", "silu")]


_SESSION_CACHE: list[str] = []  # the kernel cache directory this process made (the xdist workers inherit it)


def pytest_configure(config: pytest.Config) -> None:
    # compiled TVM kernels go to a cache of this test session, not the user's; removed when the session ends
    import os
    import tempfile

    if "PICOMPILE_CACHE_DIR" not in os.environ:
        os.environ["PICOMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="picompile-test-cache-")
        _SESSION_CACHE.append(os.environ["PICOMPILE_CACHE_DIR"])


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {(f, a): save_tiny_checkpoint(root / f"{f}_{a}", f, a, seed=7) for f, a in FAMILIES}


@pytest.fixture(scope="session")
def artifacts(checkpoints: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    import picompile

    root = tmp_path_factory.mktemp("art")
    return {key: picompile.build(path, output=root / f"{key[0]}_{key[1]}.pic", pipeline="dense") for key, path in checkpoints.items()}


@pytest.fixture(scope="session")
def f16_cpu_artifact(checkpoints: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-relu, trained predictors, float16 weights, TVM kernels (GEMVs, sparse FFNs, predictors), target cpu."""
    import picompile

    out = tmp_path_factory.mktemp("f16") / "f16.pic"
    return picompile.build(checkpoints[("llama", "relu")], output=out, weight_dtype="float16", calibration_tokens=256,
                           max_seq_len=64, emit=lambda s: None, progress=False)


@pytest.fixture(scope="session")
def default_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model built with the default pipeline (TVM kernels, trained predictors), target cpu."""
    import picompile
    from picompile.builder import default_model

    out = tmp_path_factory.mktemp("default") / "default.pic"
    return picompile.build(default_model(), output=out, emit=lambda s: None, progress=False)


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Each test leaves torch's thread count and the environment as it found them (a session or server run
    in-process sets threads for its decode; later tests' float sums, and so reproducibility checks, depend on it)."""
    import os

    import torch

    threads, env = torch.get_num_threads(), dict(os.environ)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)

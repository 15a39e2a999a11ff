"""The package as it installs: a wheel built from this tree carries the benchmark suite (vllm_kimi_dsa.bench, its
peers included), and `python -m vllm_kimi_dsa bench --help` runs from that wheel alone, away from the checkout.

CPU only; builds the wheel from a copy of the tree (setuptools, no build isolation, no network), ~10-20 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ("bench/__init__.py", "bench/suite.py", "bench/prefill.py", "bench/plot.py", "bench/peers/__init__.py",
         "bench/peers/fa3.py", "bench/peers/flashmla.py", "bench/peers/flashmla_prefill.py")


def test_setuptools_finds_the_bench_subpackages() -> None:
    """pyproject's package discovery (include vllm_kimi_dsa*) finds the suite and its peers."""
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(ROOT), include=include))
    assert {"vllm_kimi_dsa.bench", "vllm_kimi_dsa.bench.peers"} <= found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "vllm_kimi_dsa", src / "vllm_kimi_dsa", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not installed in this environment")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("vllm_kimi_dsa-*.whl")
    return built


def test_the_wheel_carries_the_suite_and_its_peers(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in SUITE if f"vllm_kimi_dsa/{f}" not in names]
    assert not missing, f"the wheel lacks {missing}"


def test_bench_help_runs_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "vllm_kimi_dsa", "bench", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: python -m vllm_kimi_dsa bench" in proc.stdout and "--peers" in proc.stdout
    where = subprocess.run([sys.executable, "-c", "import vllm_kimi_dsa.bench.suite as s; print(s.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr

"""`asyncgraph bench` from a non-editable install, with no source checkout in reach (issue 53,
item 6: the command imported the top-level `benchmarks` folder, so a wheel install failed in
one line).

The package is installed the way pip installs a wheel (`pip install --no-deps --target`, from
a copy of the files a build reads, so nothing is written into this checkout) into a folder of
its own, and the command runs from another folder with only that one on PYTHONPATH: the venv
still supplies torch, typer, rich and dask. What is asserted is that the default scenarios run
and report, and that the install has no top-level `benchmarks` package; never a time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a build of the package reads: the metadata, the package (asyncgraph/kernels is a link
# to ../kernels) and benchmarks/, so that an install that took it in would show here.
BUILD_INPUTS = ("pyproject.toml", "README.md", "asyncgraph", "kernels", "benchmarks")
NOT_COPIED = shutil.ignore_patterns("__pycache__", "results", "*.egg-info", "build")

pytestmark = pytest.mark.serial  # a pip build and a benchmark run: tens of seconds of CPU


def _copy_build_inputs(target: Path) -> Path:
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, symlinks=True, ignore=NOT_COPIED)
        else:
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder pip installed the package into, non-editable and without dependencies."""
    source = _copy_build_inputs(tmp_path_factory.mktemp("source"))
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert result.returncode == 0, result.stderr
    return site


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python *args` from `cwd` with only the install on PYTHONPATH (no checkout in reach)."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.timeout(600)
def test_install_has_the_suite_and_no_top_level_benchmarks(installed: Path,
                                                             tmp_path: Path) -> None:
    assert not (installed / "benchmarks").exists(), "the wheel installs a `benchmarks` package"
    result = _run_installed(installed, tmp_path, "-c", (
        "import importlib.util, asyncgraph.bench.suite as suite; "
        "print(suite.__file__); print(importlib.util.find_spec('benchmarks'))"))
    assert result.returncode == 0, result.stderr
    where, benchmarks = result.stdout.split()
    assert Path(where).is_relative_to(installed), where
    assert benchmarks == "None", "a `benchmarks` package is importable: the check proves nothing"


@pytest.mark.timeout(600)
def test_bench_runs_from_an_install_without_a_checkout(installed: Path, tmp_path: Path) -> None:
    result = _run_installed(
        installed, tmp_path, "-m", "asyncgraph.cli.main", "bench", "--quick", "-s", "chain",
        "--json", "--rounds", "1", "--warmup", "0",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert [case["case"] for case in report["cases"]] == ["chain"]
    assert report["mismatches"] == []
    assert all(peer["matched"] for peer in report["cases"][0]["peers"])


@pytest.mark.timeout(600)
def test_an_optional_scenario_of_the_checkout_is_skipped_in_one_line(installed: Path,
                                                                      tmp_path: Path) -> None:
    result = _run_installed(installed, tmp_path, "-m", "asyncgraph.cli.main", "bench",
                            "-s", "onnxruntime", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    [case] = json.loads(result.stdout)["cases"]
    assert case["case"] == "onnxruntime (skipped)"
    assert case["metrics"]["skipped"].startswith(
        "benchmarks.ort is a script of asyncgraph's source checkout (benchmarks/)")

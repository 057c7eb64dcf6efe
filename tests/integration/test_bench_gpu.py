"""Smoke test of benchmarks/gpu.py: without CUDA it says it cannot run and exits 0; its
models export and run through the Executor on the CPU, as they will on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgraph import Executor
from benchmarks import gpu

pytestmark = pytest.mark.usefixtures("leak_check")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.timeout(120)
def test_without_cuda_it_says_it_cannot_run_and_exits_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot run" in proc.stdout and "Nothing was measured" in proc.stdout


@pytest.mark.timeout(120)
async def test_the_benchmark_models_match_eager_through_the_executor() -> None:
    for name, (model, x) in gpu.models().items():
        model.eval()
        small = x[:2]
        ep = torch.export.export(model, (small,))
        async with Executor(ep) as ex:
            out = await ex.execute(small)
        with torch.no_grad():
            torch.testing.assert_close(out, model(small), msg=name)

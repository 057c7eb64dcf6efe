"""What the real-GPU tests share: the skip marker, small models of independent branches, an
Executor's parts run by `run_in_order`, and runs under TORCH_CUDA_SANITIZER in subprocesses.

The subprocesses import this module as `tests.support.real_gpu`, with the repository root
(`ROOT`) first on their sys.path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgraph.cuda.device import CudaRuntime, FrameStreams, run_in_order
from asyncgraph.cuda.streams import stream_plan_for
from asyncgraph.runtime.config import ExecutorConfig

ROOT = str(Path(__file__).resolve().parents[2])

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available())")


class Branches(torch.nn.Module):
    """Independent branches of small matmuls: on one stream they serialise; on several the
    GPU can overlap them."""

    def __init__(self, width: int = 4, depth: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(depth)])
            for _ in range(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.relu(b(x)) for b in self.branches]).sum(0)


def gpu_program(
    model: torch.nn.Module | torch.export.ExportedProgram, x: torch.Tensor, streams: int,
    max_sets: int = 2,
) -> tuple[Any, CudaRuntime]:
    """Executor parts for a CUDA program (a model, exported here, or an exported program),
    run by `run_in_order` (independent of the scheduler)."""
    from asyncgraph.runtime.executor import Executor

    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    else:
        ep = torch.export.export(model, (x,))
    ex = Executor(ep, ExecutorConfig())
    costs = [float(k.cost) for k in ex.kernels]
    sp = stream_plan_for(ex.graph, ex.plan, streams, costs=costs,
                         default_device=torch.cuda.current_device())
    runtime = CudaRuntime(sp, ex.plan.outputs, max_stream_sets=max_sets)
    return ex, runtime


async def run_gpu(ex: Any, state: FrameStreams, x: torch.Tensor) -> list[Any]:
    plan = ex.plan
    values = list(ex.weights.template(plan.weight_slots, plan.num_values))
    for slot in plan.token_slots:
        values[slot] = torch.empty(0)
    (slot,) = plan.user_input_slots
    values[slot] = x
    with torch.inference_mode():
        await run_in_order(state, values)
    outputs = [values[o.arg.id] for o in ex.graph.signature.user_outputs]
    state.protect_outputs(outputs)
    return outputs


class MaskedFillSync(torch.nn.Module):
    """`aten.masked_fill.Tensor` with a 0-dim CUDA value: the CUDA kernel reads the value
    with `.item()`, a host sync inside the op, which fails a CUDA graph capture (the
    capture-failure tests and scripts/gpu_probes.py force the planner to accept it)."""

    fill: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fill", torch.tensor(-1.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(x) * 2.0
        return y.masked_fill(x > 0.5, self.fill), y + 1.0


class TwoBranches(torch.nn.Module):
    """Two independent branches of small matmuls, summed."""

    def __init__(self, dim: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.left = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(depth)])
        self.right = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.left(x)) + torch.sigmoid(self.right(x))


_EXPORT_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    from tests.support.real_gpu import {model}

    torch.manual_seed(0)
    model = {model}().to({device!r}).eval()
    x = torch.randn({shape!r}, device={device!r})
    torch.export.save(torch.export.export(model, (x,)), {program!r})
    """
)


def export_in_subprocess(
    model: str, shape: tuple[int, ...], device: str, program: str
) -> None:
    """Export this module's `model` class (Branches or TwoBranches, seed 0) to the .pt2 file
    `program`, in a process without TORCH_CUDA_SANITIZER: on torch 2.11 the sanitizer aborts
    inside torch.export.export ("terminate called after throwing an instance of
    'python_error'"), before any of our code runs, so the program is exported first and only
    loaded and run under it."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}
    script = _EXPORT_SCRIPT.format(
        root=ROOT, model=model, shape=shape, device=device, program=program,
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def assert_sanitizer_clean(script: str, model: str, shape: tuple[int, ...]) -> None:
    """Export `model` without the sanitizer (`export_in_subprocess`), then run `script`
    (formatted with `root`, the repository root, and `program`, the .pt2 file) under
    TORCH_CUDA_SANITIZER in another subprocess: it must succeed, print "ok" last, and the
    sanitizer must report nothing."""
    with tempfile.TemporaryDirectory() as folder:
        program = os.path.join(folder, "program.pt2")
        export_in_subprocess(model, shape, "cuda", program)
        env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", script.format(root=ROOT, program=program)],
            env=env, capture_output=True, text=True, timeout=300,
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "CSAN" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")

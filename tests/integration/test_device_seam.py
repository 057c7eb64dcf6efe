"""The device seam (runtime/device.py): what the Executor asks of a device plan, on the
simulated GPU of support/cuda_graph_fake.py and on a CPU-only program."""

from __future__ import annotations

import torch

from asyncgraph import Executor, GraphBuilder
from asyncgraph.cuda.backend import CudaPlans
from asyncgraph.testing import LeakChecker
from tests.support.cuda_graph_fake import CaptureGpu, diamond_program, make_executor, running

aten = torch.ops.aten


async def test_device_statistics_are_the_device_plans_statistics(
    leak_check: LeakChecker,
) -> None:
    gpu = CaptureGpu(seed=1)
    ex = make_executor(diamond_program(torch.tensor([2.0, -1.0, 0.5, 3.0])), gpu,
                       cuda_graph_warmup=1)
    async with running(ex, gpu):
        for k in range(3):
            await ex.execute(torch.linspace(-1.0, 1.0, 4) * (k + 1))
        stats = ex.device_statistics()
        assert stats is not None and stats.captures == 1 and stats.replays == 1, stats
        assert stats == ex.cuda_graph_statistics()  # the older name reads the same
    assert isinstance(ex._device, CudaPlans)  # the "cuda" backend's plan, by the registry


async def test_a_cpu_program_has_no_device_plan(leak_check: LeakChecker) -> None:
    b = GraphBuilder()
    b.output(b.call(aten.relu.default, b.input("x"), name="relu"))
    async with Executor(b.build()) as ex:
        assert (await ex.execute(torch.tensor([-1.0, 2.0]))).tolist() == [0.0, 2.0]
        assert ex.device_statistics() is None and ex.stream_plan is None

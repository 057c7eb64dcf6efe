"""Adaptive placement: measured node times decide inline versus worker, per input shapes."""

from __future__ import annotations

import pytest
import torch

import asyncgraph
from asyncgraph import ExecutorConfig, Placement
from asyncgraph.placement import AdaptivePlacement

pytestmark = pytest.mark.usefixtures("leak_check")


class Mixed(torch.nn.Module):
    """One big matmul (worth a thread) followed by tiny elementwise ops (not worth a hop)."""

    def forward(self, x: torch.Tensor, small: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ x).sum(), (small + 1).relu()


async def test_profiled_runs_decide_placement() -> None:
    x, small = torch.randn(384, 384), torch.randn(4)
    ep = torch.export.export(Mixed(), (x, small))
    # one worker thread, so the warm-up execution warms the thread the profiled ones run on
    config = ExecutorConfig(
        max_parallel_ops=1, heavy_op_flops=0, profile_executions=2, heavy_node_us=150
    )
    async with asyncgraph.Executor(ep, config) as ex:
        assert set(ex.placements().values()) == {Placement.WORKER}  # the estimate: all heavy
        for _ in range(4):
            out = await ex.execute(x, small)
        torch.testing.assert_close(out, Mixed()(x, small))
        placements = ex.placements()
        stats = ex.placement_statistics()
    matmul = next(n for n in placements if n.startswith("matmul") or n.startswith("mm"))
    assert placements[matmul] is Placement.WORKER  # a 384^3 matmul takes milliseconds
    assert placements["add"] is Placement.INLINE and placements["relu"] is Placement.INLINE
    assert stats is not None and stats.decided == 1 and stats.profiling_runs == 2


def test_new_shapes_are_profiled_again() -> None:
    ep = torch.export.export(
        Mixed(), (torch.randn(8, 8), torch.randn(4)),
        dynamic_shapes=({0: torch.export.Dim("n"), 1: torch.export.Dim("n")}, None),
    )
    ex = asyncgraph.Executor(ep)
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, profile_executions=1)
    first = [torch.randn(8, 8), torch.randn(4)]
    assert adaptive.choose(first)[1] is None  # the warm-up execution is not profiled
    _, times = adaptive.choose(first)
    assert times is not None
    adaptive.finished(first, times)
    assert adaptive.choose(first)[1] is None  # decided for this signature
    second = [torch.randn(16, 16), torch.randn(4)]
    adaptive.choose(second)
    assert adaptive.choose(second)[1] is not None  # a new signature is profiled afresh
    assert adaptive.statistics().signatures == 2


def test_decide_moves_only_cpu_nodes_without_hints() -> None:
    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda v: v, x, name="pinned", placement="worker"))
    ex = asyncgraph.Executor(b.build())
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels)
    assert adaptive.decide([0.0]) == (Placement.WORKER,)

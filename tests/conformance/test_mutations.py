"""What concurrent executions see when a program mutates a buffer (docs/support.md, Mutations).

Sequential calls follow the graph signature exactly as ep.module() does (the corpus checks
that). Concurrent calls are not serialized: an execution reads the buffer version that was
current when it took its frame, and its write-back at the end makes a new version - the last
execution to finish wins, so read-modify-write updates of overlapping executions are lost.
These tests pin that contract down, and the way to get eager's sequence under concurrency:
max_concurrent_executions=1.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgraph import ExecutorConfig
from conformance.harness import cached_export, close_all, make_executor

pytestmark = pytest.mark.usefixtures("leak_check")

CALLERS = 8


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x + self.count


def _program() -> torch.export.ExportedProgram:
    return cached_export(
        ("mutations", "counter"),
        lambda: torch.export.export(Counter(), (torch.zeros(3, dtype=torch.int64),)),
    )


async def test_serialized_executions_match_sequential_eager() -> None:
    ep = _program()
    reference = Counter()
    expected = [reference(torch.zeros(3, dtype=torch.int64)) for _ in range(CALLERS)]
    config = ExecutorConfig(max_parallel_ops=2, heavy_op_flops=0, max_concurrent_executions=1)
    ex = make_executor(ep, config)
    try:
        outs = await asyncio.gather(
            *[ex.execute(torch.zeros(3, dtype=torch.int64)) for _ in range(CALLERS)]
        )
        assert [o.tolist() for o in outs] == [e.tolist() for e in expected]
        assert int(ex.weights.tensors["count"]) == CALLERS
    finally:
        await close_all(ex)


@pytest.mark.parametrize("heavy_op_flops", [0, 200_000])
async def test_concurrent_executions_each_see_one_snapshot(heavy_op_flops: int) -> None:
    """Each execution sees one version; the final buffer is some execution's write.

    With every op on a worker the executions overlap and updates are lost (the count ends
    below CALLERS); with inline ops each execution runs to its end before the next starts.
    Both are allowed by the contract; what is checked is what the contract promises.
    """
    ep = _program()
    config = ExecutorConfig(max_parallel_ops=2, heavy_op_flops=heavy_op_flops)
    ex = make_executor(ep, config)
    try:
        outs = await asyncio.gather(
            *[ex.execute(torch.zeros(3, dtype=torch.int64)) for _ in range(CALLERS)]
        )
        seen = [int(o[0]) for o in outs]
        for o in outs:  # one snapshot per execution: every element saw the same count
            assert len(set(o.tolist())) == 1
        written = set(seen)
        for value in seen:  # each read a version that existed: the initial one or a write
            assert value - 1 == 0 or value - 1 in written, seen
        final = int(ex.weights.tensors["count"])
        assert final in written
        assert ex.weights.version == CALLERS  # every execution wrote back a version
        assert 1 <= final <= CALLERS
    finally:
        await close_all(ex)

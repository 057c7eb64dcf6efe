"""Bounded memory under overload: the frame pool's waiters and the batcher's queue each hold at
most their bound; the next caller gets OverloadedError at once, naming the bound; nothing leaks
and the executor keeps serving once the load drops."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch
from torch.export import Dim

import asyncgraph
from asyncgraph import BatchingConfig, Executor, ExecutorConfig, OverloadedError
from asyncgraph.graph.builder import GraphBuilder
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.testing import FaultInjector

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]

WAIT_S = 20.0


class Held:
    """An async kernel that holds every call until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        await self.release.wait()
        return x + 1


def held_graph(kernel: Held) -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(kernel, x, name="held")
    b.output(y)
    graph = b.build()
    spec = TensorSpec(torch.float32, torch.device("cpu"), (2,), (1,))
    graph.values[x.id].spec = graph.values[y.id].spec = spec
    return graph


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_the_error_is_public_and_names_its_bound() -> None:
    error = asyncgraph.OverloadedError("full", bound="ExecutorConfig.max_frame_waiters", limit=3)
    assert isinstance(error, asyncgraph.AsyncGraphError)
    assert (error.bound, error.limit) == ("ExecutorConfig.max_frame_waiters", 3)


@pytest.mark.parametrize("bound", [0, 3])
async def test_frame_waiters_are_bounded(bound: int) -> None:
    kernel = Held()
    config = ExecutorConfig(max_concurrent_executions=1, max_frame_waiters=bound)
    async with Executor(held_graph(kernel), config) as ex:
        x = torch.zeros(2)
        running = asyncio.create_task(ex.execute(x))
        waiting = [asyncio.create_task(ex.execute(x)) for _ in range(bound)]
        await settle()
        assert ex.statistics().frames.waiters == bound  # exactly `bound` may wait
        with pytest.raises(OverloadedError, match=r"max_frame_waiters=" + str(bound)) as info:
            await ex.execute(x)
        assert (info.value.bound, info.value.limit) == ("ExecutorConfig.max_frame_waiters", bound)
        assert kernel.calls == 1
        kernel.release.set()
        for out in await asyncio.gather(running, *waiting):
            torch.testing.assert_close(out, x + 1)
        torch.testing.assert_close(await ex.execute(x), x + 1)  # still serving
        stats = ex.statistics()
    assert stats.frames.refused == 1 and stats.frames.waiters == stats.frames.in_use == 0
    assert stats.completed == bound + 2 and stats.failed == 0


async def test_a_cancelled_frame_waiter_frees_its_place() -> None:
    kernel = Held()
    config = ExecutorConfig(max_concurrent_executions=1, max_frame_waiters=1)
    async with Executor(held_graph(kernel), config) as ex:
        x = torch.zeros(2)
        running = asyncio.create_task(ex.execute(x))
        gone = asyncio.create_task(ex.execute(x))
        await settle()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        kept = asyncio.create_task(ex.execute(x))  # takes the place the cancelled one left
        await settle()
        kernel.release.set()
        await asyncio.gather(running, kept)
    assert ex.statistics().frames.refused == 0


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@pytest.fixture(scope="module")
def scale_program() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(
            Scale().eval(), (torch.randn(2, 4),), dynamic_shapes=({0: Dim("batch", max=64)},)
        )


def gated_batching(ep: Any, **batching: Any) -> tuple[Executor, Any]:
    """One batch at a time, its multiply held behind a gate on a worker thread."""
    faults = FaultInjector()
    gate = faults.block("mul")
    config = ExecutorConfig(heavy_op_flops=0, adaptive_placement=False,
                            batching=BatchingConfig(max_concurrent_batches=1, **batching))
    return Executor(ep, config, kernel_factory=faults.kernel_factory()), gate


async def test_the_batcher_queue_is_bounded(scale_program: Any) -> None:
    ex, gate = gated_batching(scale_program, max_queued_requests=3)
    xs = [torch.full((1, 4), float(i)) for i in range(5)]
    async with ex:
        try:
            running = asyncio.create_task(ex.execute(xs[0]))
            await gate.wait_entered(1, within_s=WAIT_S)
            queued = [asyncio.create_task(ex.execute(x)) for x in xs[1:4]]
            await settle()
            stats = ex.batching_statistics()
            assert stats is not None and stats.queued == 3  # exactly the bound may wait
            with pytest.raises(OverloadedError, match=r"max_queued_requests=3") as info:
                await ex.execute(xs[4])
            assert info.value.bound == "BatchingConfig.max_queued_requests"
        finally:
            gate.open()
        outs = await asyncio.gather(running, *queued)
        for x, out in zip(xs[:4], outs, strict=True):
            torch.testing.assert_close(out, x * 2)
        torch.testing.assert_close(await ex.execute(xs[4]), xs[4] * 2)  # still serving
        stats = ex.batching_statistics()
    assert stats is not None and stats.refused == 1 and stats.queued == 0
    assert stats.requests == 5  # the refused request never queued


async def test_a_request_cancelled_in_the_batcher_queue_frees_its_place(
    scale_program: Any,
) -> None:
    ex, gate = gated_batching(scale_program, max_queued_requests=1)
    x = torch.ones(1, 4)
    async with ex:
        try:
            running = asyncio.create_task(ex.execute(x))
            await gate.wait_entered(1, within_s=WAIT_S)
            gone = asyncio.create_task(ex.execute(x))
            await settle()
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            kept = asyncio.create_task(ex.execute(x))  # the cancelled one still sits in the
            await settle()  # deque, but no longer counts against the bound
            assert not kept.done()
        finally:
            gate.open()
        await asyncio.gather(running, kept)
        stats = ex.batching_statistics()
    assert stats is not None and stats.refused == 0 and stats.cancelled_in_queue == 1


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_frame_waiters": -1}, "max_frame_waiters"),
])
def test_executor_config_rejects_a_negative_bound(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(**kw)


def test_batching_config_rejects_an_empty_queue() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        BatchingConfig(max_queued_requests=0)

"""LoopBudget: one inline-kernel slice per loop iteration, shared by every execution."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.loop_budget import LoopBudget, loop_budget
from tests.loop_turns import LoopTurns

pytestmark = pytest.mark.usefixtures("leak_check")


async def test_a_slice_lasts_until_the_next_iteration() -> None:
    budget = LoopBudget(asyncio.get_running_loop(), slice_s=0.001)
    first = budget.deadline()
    assert first is not None
    assert budget.deadline() == first  # the same slice within this iteration
    while time.perf_counter() < first:
        pass
    assert budget.deadline() is None  # spent: the work defers to the next iteration
    await asyncio.sleep(0)  # the close scheduled with call_soon runs
    second = budget.deadline()
    assert second is not None and second > first
    assert budget.statistics().slices == 2


async def test_the_budget_is_shared_per_loop_with_the_smallest_slice() -> None:
    loop = asyncio.get_running_loop()
    a = loop_budget(loop, 0.002)
    b = loop_budget(loop, 0.001)
    assert a is b and a.slice_s == 0.001


async def test_deferred_work_runs_in_order_one_slice_per_iteration() -> None:
    budget = LoopBudget(asyncio.get_running_loop(), slice_s=1e-9)
    ran: list[int] = []

    def work(k: int) -> None:
        budget.deadline()  # opens a slice, which the next check finds spent
        ran.append(k)

    for k in range(3):
        budget.defer(work, k)
    assert ran == []
    await asyncio.sleep(0)
    assert ran == [0]  # the slice was spent after the first: the rest waits a turn
    await asyncio.sleep(0)
    assert ran == [0, 1]
    await asyncio.sleep(0)
    assert ran == [0, 1, 2]
    assert budget.statistics().deferred == 3


async def test_a_failing_deferred_callback_does_not_strand_the_rest() -> None:
    loop = asyncio.get_running_loop()
    seen: list[object] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context.get("exception")))
    try:
        budget = LoopBudget(loop, slice_s=10.0)
        ran: list[int] = []

        def fail() -> None:
            raise RuntimeError("boom")

        budget.defer(fail)
        budget.defer(ran.append, 1)
        for _ in range(3):
            await asyncio.sleep(0)
        assert ran == [1]
        assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    finally:
        loop.set_exception_handler(None)


def spin(x: int) -> int:
    """An inline kernel that holds the loop thread for 100 us."""
    end = time.perf_counter() + 1e-4
    while time.perf_counter() < end:
        pass
    return x + 1


async def test_many_callers_share_one_slice_per_iteration() -> None:
    b = GraphBuilder()
    v = b.input("x")
    for i in range(4):
        v = b.call(spin, v, name=f"spin{i}", placement="inline")
    b.output(v)
    # Slices shorter than a node: each iteration runs one unit of one execution, so the
    # heartbeat gets a turn per unit; without a shared budget all 32 callers would run in
    # one iteration between two ticks.
    config = ExecutorConfig(
        max_fused_nodes=1, loop_slice_s=1e-6, adaptive_placement=False,
        max_concurrent_executions=32,
    )
    async with Executor(b.build(), config) as ex, LoopTurns() as turns:
        before = turns.count
        results = await asyncio.gather(*(ex.execute(k) for k in range(32)))
        during = turns.count - before
    assert results == [k + 4 for k in range(32)]
    units = 32 * 4
    assert during >= units // 2, f"{during} heartbeat turns for {units} units"

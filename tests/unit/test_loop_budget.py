"""LoopBudget: one inline-kernel slice per loop iteration, shared by every execution."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from typing import Any

import pytest

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.runtime.loop_budget import _BUDGETS, LoopBudget, _shows_its_queues, loop_budget
from asyncgraph.testing import LeakChecker, LeakError
from tests.support.loop_turns import LoopTurns

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.serial]


async def test_a_slice_lasts_until_the_next_iteration() -> None:
    loop = asyncio.get_running_loop()
    budget = LoopBudget(loop, slice_s=0.001)
    loop.call_soon(lambda: None)  # other work waits: a spent slice is not extended
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


async def test_a_measured_unit_that_would_overrun_the_slice_waits_for_the_next() -> None:
    """Once node times are measured, a unit that would end after the slice waits for the
    next iteration instead of stretching this one: with 0.6 ms nodes and a 1 ms slice, no two
    run in one iteration (without the check the second starts at 0.6 ms and ends at 1.2)."""
    iteration = 0
    ran_in: dict[str, int] = {}

    def slow(name: str) -> object:
        def fn(x: int) -> int:
            ran_in[name] = iteration
            end = time.thread_time() + 6e-4  # CPU time: what profiling measures
            while time.thread_time() < end:
                pass
            return x + 1

        fn.__name__ = name
        return fn

    async def count_iterations() -> None:
        nonlocal iteration
        while True:
            iteration += 1
            await asyncio.sleep(0)

    b = GraphBuilder()
    v = b.input("x")
    for i in range(4):
        v = b.call(slow(f"slow{i}"), v, placement="inline")
    b.output(v)
    config = ExecutorConfig(loop_slice_s=1e-3, profile_executions=1)
    counter = asyncio.create_task(count_iterations())
    try:
        async with Executor(b.build(), config) as ex:
            for _ in range(2):  # a warm-up and one profiled execution decide the placement
                assert await ex.execute(0) == 4
            stats = ex.placement_statistics()
            assert stats is not None and stats.decided == 1
            ran_in.clear()
            assert await ex.execute(0) == 4
    finally:
        counter.cancel()
    iterations = [ran_in[f"slow{i}"] for i in range(4)]
    assert len(set(iterations)) == 4, f"nodes ran in iterations {iterations}"


def _runs_that_each_use_an_executor(count: int) -> None:
    """`count` asyncio.run calls, each building an Executor and executing it once."""
    b = GraphBuilder()
    b.output(b.call(spin, b.input("x"), name="spin", placement="inline"))
    graph = b.build()

    async def once() -> None:
        async with Executor(graph) as ex:
            assert await ex.execute(1) == 2

    for _ in range(count):
        asyncio.run(once())


def _closed_loops_with_budgets() -> int:
    gc.collect()
    return sum(1 for loop in list(_BUDGETS) if loop.is_closed())


async def test_a_budget_does_not_keep_its_loop_alive() -> None:
    """Regression: the budget held its loop strongly, so the weak-keyed table never dropped
    an entry and every loop an Executor ever ran on stayed alive."""
    before = _closed_loops_with_budgets()
    await asyncio.to_thread(_runs_that_each_use_an_executor, 20)  # asyncio.run needs a thread
    assert _closed_loops_with_budgets() == before


async def test_a_closed_executor_still_referenced_does_not_keep_its_loop_alive() -> None:
    """Regression: the CLI and tests keep closed Executors around (the leak checker itself
    lists them); each held the loop it ran on, so the closed loop stayed alive."""
    kept: list[Executor] = []

    def run_and_keep_the_executor() -> None:
        b = GraphBuilder()
        b.output(b.call(lambda x: x + 1, b.input("x"), name="inc", placement="inline"))

        async def once() -> None:
            async with Executor(b.build()) as ex:
                assert await ex.execute(1) == 2
            kept.append(ex)

        asyncio.run(once())

    before = _closed_loops_with_budgets()
    await asyncio.to_thread(run_and_keep_the_executor)
    assert kept and _closed_loops_with_budgets() == before


async def test_the_leak_checker_reports_a_closed_loop_left_alive() -> None:
    kept: list[asyncio.AbstractEventLoop] = []

    def run_and_keep_the_loop() -> None:
        async def once() -> None:
            kept.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            loop_budget(asyncio.get_running_loop(), 0.001)

        asyncio.run(once())

    checker = LeakChecker()
    async with checker:
        pass  # nothing leaked: no error
    with pytest.raises(LeakError, match="1 closed event loop"):
        async with LeakChecker(settle_s=0.2):
            await asyncio.to_thread(run_and_keep_the_loop)
    kept.clear()
    # held for a moment only (a thread on its way out): no error
    release = threading.Timer(0.1, kept.clear)
    async with LeakChecker(settle_s=2.0):
        await asyncio.to_thread(run_and_keep_the_loop)
        release.start()
    release.join()
    assert not kept


async def test_a_schedule_is_compiled_off_the_loop_once_for_concurrent_misses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache miss compiles code (12 ms for a 1,000-node chain): on a thread, while the loop
    goes on. The build waits for a loop turn that could not happen if it ran on the loop."""
    import threading

    import asyncgraph.runtime.schedule as schedule_module

    turned = threading.Event()
    builds: list[bool] = []
    build = schedule_module.build_schedule

    def build_waiting_for_the_loop(*args: Any, **kwargs: Any) -> Any:
        builds.append(turned.wait(10))
        return build(*args, **kwargs)

    async def turn() -> None:
        await asyncio.sleep(0)
        turned.set()

    import asyncgraph.runtime.build as build_module

    monkeypatch.setattr(schedule_module, "build_schedule", build_waiting_for_the_loop)
    monkeypatch.setattr(schedule_module, "INLINE_BUILD_NODES", 0)  # as a large graph does
    # a miss in a request: not the first placement's, which the Executor builds when it is made
    monkeypatch.setattr(build_module, "prebuild_schedules", lambda *args, **kwargs: None)
    b = GraphBuilder()
    b.output(b.call(spin, b.input("x"), name="spin", placement="inline"))
    config = ExecutorConfig(adaptive_placement=False, max_concurrent_executions=2)
    async with Executor(b.build(), config) as ex:
        ticker = asyncio.create_task(turn())
        assert await asyncio.gather(ex.execute(1), ex.execute(2)) == [2, 3]
        await ticker
        assert builds == [True]  # one build for both, and the loop turned meanwhile
        assert ex.statistics().schedules.built == 1


async def test_a_small_graph_builds_its_schedule_in_the_call_that_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Up to INLINE_BUILD_NODES nodes the build costs less than a thread hop: it happens on
    the loop, within the first call, so that call's timing is the same on every run."""
    import threading

    import asyncgraph.runtime.schedule as schedule_module

    threads: list[int] = []
    build = schedule_module.build_schedule

    def recording_build(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return build(*args, **kwargs)

    monkeypatch.setattr(schedule_module, "build_schedule", recording_build)
    b = GraphBuilder()
    b.output(b.call(spin, b.input("x"), name="spin", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        assert await ex.execute(1) == 2
    assert threads == [threading.get_ident()]


async def test_start_says_whether_work_fits_what_is_left_of_the_slice() -> None:
    """`start(seconds)`: the clock read at which work of that length may start, opening the
    slice if none is open; None once it would end after the slice or the slice is spent."""
    loop = asyncio.get_running_loop()
    budget = LoopBudget(loop, slice_s=0.01)
    loop.call_soon(lambda: None)  # other work waits: a spent slice is not extended
    before = time.perf_counter()
    start = budget.start(0.001)
    assert start is not None and start >= before
    assert budget.is_open and budget.statistics().slices == 1
    assert budget.start(0.02) is None  # longer than what is left of the slice
    deadline = budget.deadline()
    assert deadline is not None
    while time.perf_counter() < deadline:
        pass
    assert budget.start(0.0) is None  # spent
    await asyncio.sleep(0)  # the close runs: the next call opens a new slice
    assert budget.start(0.001) is not None
    assert budget.statistics().slices == 2


def _spend(budget: LoopBudget) -> None:
    deadline = budget.deadline()
    assert deadline is not None
    while time.perf_counter() < deadline:
        pass


async def test_a_spent_slice_is_extended_only_while_nothing_else_waits() -> None:
    """On asyncio's own loop, a spent slice is extended while no other callback is ready, no
    timer is due and no I/O is ready; any of them ends it. uvloop does not show its queues:
    there a spent slice always ends."""
    loop = asyncio.get_running_loop()
    budget = LoopBudget(loop, slice_s=0.001)
    _spend(budget)
    if not _shows_its_queues(loop):  # uvloop
        assert budget.deadline() is None and budget.start(0.0) is None
        assert budget.statistics().extended == 0
        return
    extended = budget.deadline()  # nothing else waits: a fresh slice from now
    assert extended is not None and extended > time.perf_counter()
    assert budget.start(0.0005) is not None
    assert budget.statistics().extended == 1
    assert budget.statistics().slices == 1  # still this iteration's slice

    _spend(budget)
    handle = loop.call_soon(lambda: None)  # a ready callback
    assert budget.deadline() is None and budget.start(0.0) is None
    handle.cancel()
    await asyncio.sleep(0)

    _spend(budget)
    timer = loop.call_later(0.0001, lambda: None)  # a timer, due once the slice is spent
    due = time.perf_counter() + 0.0002
    while time.perf_counter() < due:
        pass
    assert budget.deadline() is None
    timer.cancel()
    await asyncio.sleep(0)

    reader, writer = socket.socketpair()  # I/O ready
    try:
        loop.add_reader(reader.fileno(), lambda: None)
        writer.send(b"x")
        _spend(budget)
        assert budget.deadline() is None
        reader.recv(1)
        assert budget.deadline() is not None  # read: nothing waits any more
    finally:
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
    assert budget.statistics().extended == 2


async def test_a_lone_caller_runs_a_long_straight_line_in_one_call() -> None:
    """Nothing else on the loop: a straight line longer than the slice runs through in the
    call, its slices extended, none deferred to a later iteration (on uvloop, whose queues
    are not shown, the slices end and the rest is deferred)."""
    from tests.unit.test_straight_line import _Spin, _spin_chain

    kernel = _Spin(0.0004)
    async with Executor(_spin_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(3):
            assert await ex.execute(0) == 8
        await asyncio.sleep(0)  # a fresh iteration: no slice open
        budget = loop_budget(asyncio.get_running_loop(), 0.001)
        before = budget.statistics()
        assert await ex.execute(0) == 8
        after = budget.statistics()
        extended, deferred = after.extended - before.extended, after.deferred - before.deferred
        if _shows_its_queues(asyncio.get_running_loop()):
            assert extended >= 2 and deferred == 0  # 3.2 ms of units in 1 ms slices
        else:
            assert extended == 0 and deferred >= 2


async def test_the_first_placements_schedules_are_built_with_the_executor() -> None:
    """The first requests find their schedules built (runtime/build.py's prebuild_schedules):
    the fused one, and the unfused one that profiled runs take."""
    b = GraphBuilder()
    b.output(b.call(spin, b.input("x"), name="spin", placement="inline"))
    async with Executor(b.build(), ExecutorConfig()) as ex:
        assert ex.statistics().schedules.built == 2
        assert await ex.execute(1) == 2
        assert ex.statistics().schedules.built == 2

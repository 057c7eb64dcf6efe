"""The straight-line path (asyncgraph/runtime/straight.py) and execute's cancellation check.

An all-inline schedule with measured unit times that fit the loop's slice runs as one loop
over its units. These tests pin down when that path is taken, that it gives the dataflow
path's results, frees and errors, and that `execute` still takes no frame when its caller is
already cancelled, now that it no longer starts with `await asyncio.sleep(0)`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.runtime.config import usable_cpus
from asyncgraph.runtime.loop_budget import LoopBudget
from asyncgraph.runtime.modes import Mode
from asyncgraph.runtime.schedule import straight_line
from asyncgraph.runtime.scheduler import Scheduler
from asyncgraph.testing import introspect

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]


class Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x) + 1
        z = y * 2
        return torch.tanh(z) - y


def _count_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Executions by path: "straight" (all units at once: Scheduler.run_now, with a frame or
    without one, then also counted in "frameless"), "sliced" (the straight line over loop
    slices) and "dataflow" (the WorkUnits)."""
    counts = {"straight": 0, "sliced": 0, "dataflow": 0, "frameless": 0}
    run_now, start, alone = Scheduler.run_now, Scheduler._start, Executor._run_alone

    def at_once(self: Scheduler, *args: Any) -> None:
        counts["straight"] += 1
        run_now(self, *args)

    def frameless(self: Executor, *args: Any) -> Any:
        counts["frameless"] += 1
        return alone(self, *args)

    def started(self: Scheduler, frame: Any, mode: Mode) -> None:
        if mode is Mode.DATAFLOW:
            counts["dataflow"] += 1
        elif mode is Mode.LINE_SLICED:
            counts["sliced"] += 1
        start(self, frame, mode)

    monkeypatch.setattr(Scheduler, "run_now", at_once)
    monkeypatch.setattr(Executor, "_run_alone", frameless)
    monkeypatch.setattr(Scheduler, "_start", started)
    return counts


async def test_a_measured_all_inline_graph_runs_straight_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = _count_paths(monkeypatch)
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    config = ExecutorConfig(profile_executions=2)
    async with Executor(ep, config) as ex:
        for _ in range(6):
            await asyncio.sleep(0)  # a fresh slice (the eager check spends the last one's)
            x = torch.randn(4, 8)
            torch.testing.assert_close(await ex.execute(x), Chain()(x))
    # the warm-up and profiled executions take the dataflow path (their times are measured)
    assert counts["dataflow"] >= 3
    assert counts["straight"] >= 2


async def test_the_straight_path_drops_values_after_their_last_reader() -> None:
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    async with Executor(ep, ExecutorConfig(max_fused_nodes=1, profile_executions=1)) as ex:
        for _ in range(4):
            await ex.execute(torch.randn(4, 8))
        schedule = introspect.cached_schedule(ex, fused=False)  # the current placement's
        assert schedule is not None
        line = straight_line(schedule)
        assert line is not None
        dropped = {v for drops in line.drops for v in drops}
        outputs = {o.arg.id for o in ex.graph.signature.user_outputs}
        assert dropped and not dropped & outputs  # intermediates go, outputs stay


async def test_a_kernel_error_on_the_straight_path_names_its_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = _count_paths(monkeypatch)
    fail = {"now": False}

    def maybe_fail(x: int) -> int:
        if fail["now"]:
            raise ValueError("boom")
        return x + 1

    b = GraphBuilder()
    b.output(b.call(maybe_fail, b.input("x"), name="maybe_fail", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(4):
            assert await ex.execute(1) == 2
        before = counts["straight"]
        fail["now"] = True
        await asyncio.sleep(0)  # a fresh slice: the four calls above may have spent this one
        with pytest.raises(ValueError, match="boom") as info:
            await ex.execute(1)
        assert counts["straight"] == before + 1
        assert any("maybe_fail" in note for note in getattr(info.value, "__notes__", []))
        fail["now"] = False
        assert await ex.execute(1) == 2  # the executor stays usable
        assert ex.statistics().frames.in_use == 0


def test_a_schedule_with_a_worker_unit_has_no_straight_line() -> None:
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(torch.mm, b.call(torch.relu, x, name="r", placement="inline"), x,
                    name="mm", placement="worker"))
    ex = Executor(b.build())
    schedule = introspect.schedule(ex, ex.plan.placement, fused=True)
    assert straight_line(schedule) is None


async def test_a_call_made_while_cancelled_takes_no_frame() -> None:
    b = GraphBuilder()
    b.output(b.call(lambda x: x + 1, b.input("x"), name="inc", placement="inline"))
    async with Executor(b.build()) as ex:
        started = asyncio.Event()
        go_on = asyncio.Event()

        async def caller() -> Any:
            started.set()
            await go_on.wait()
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            return await ex.execute(1)  # cancelled before it could take a frame

        task = asyncio.create_task(caller())
        await started.wait()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.statistics().started == 0
        assert await ex.execute(1) == 2


async def test_a_tight_loop_of_inline_executions_still_lets_the_loop_run() -> None:
    """No checkpoint at the start of execute: the loop's slice still makes a caller that
    never waits for anything yield, so a timer set before the loop fires during it."""
    b = GraphBuilder()
    b.output(b.call(lambda x: x + 1, b.input("x"), name="inc", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(loop_slice_s=0.0005)) as ex:
        fired = asyncio.Event()
        asyncio.get_running_loop().call_soon(fired.set)
        calls = 0
        while not fired.is_set():
            await ex.execute(1)
            calls += 1
            assert calls < 1_000_000, "the loop never got a turn"


async def test_a_call_on_a_bound_executor_made_while_cancelled_takes_no_frame() -> None:
    """Once bound, execute reads the calling task from its bound loop (without
    asyncio.current_task()): it must be the caller's own task, whose cancellation is due."""
    b = GraphBuilder()
    b.output(b.call(lambda x: x + 1, b.input("x"), name="inc", placement="inline"))
    async with Executor(b.build()) as ex:
        assert await ex.execute(1) == 2  # binds the loop

        async def caller() -> Any:
            assert introspect.calling_task(ex) is asyncio.current_task()
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            return await ex.execute(1)  # cancelled before it could take a frame

        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(caller())
        assert ex.statistics().started == 1


async def test_dataflow_executions_after_straight_ones_get_fresh_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The straight line leaves the frame's producer and read counts alone; a later
    execution on the same frame through the dataflow (a recheck round: profiled) loads them
    (run_dataflow)."""
    counts = _count_paths(monkeypatch)
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    config = ExecutorConfig(profile_executions=1, placement_recheck_after=3)
    async with Executor(ep, config) as ex:
        for _ in range(2):  # warm-up, profiled
            await ex.execute(torch.randn(4, 8))
        before = dict(counts)
        for _ in range(8):  # straight, then the recheck round, then straight again
            await asyncio.sleep(0)  # a new slice: the execution fits it
            x = torch.randn(4, 8)
            torch.testing.assert_close(await ex.execute(x), Chain()(x))
        assert counts["straight"] - before["straight"] >= 5
        assert counts["dataflow"] - before["dataflow"] >= 1
        assert ex.statistics().frames.total == 1  # one frame took both paths


async def _warm_straight(ex: Executor) -> None:
    for _ in range(4):  # warm-up, profiled, then straight
        await asyncio.sleep(0)  # each in a fresh slice
        await ex.execute(torch.randn(4, 8))


async def test_a_spent_slice_sends_the_execution_straight_after_one_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused by a spent slice, an execution that a fresh slice holds waits one loop
    iteration (a callback made before it runs first) and then runs straight, not through
    the dataflow."""
    counts = _count_paths(monkeypatch)
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    async with Executor(ep, ExecutorConfig(profile_executions=1)) as ex:
        await _warm_straight(ex)
        start = LoopBudget.start
        refused = [0]

        def spent_once(self: LoopBudget, seconds: float) -> float | None:
            if not refused[0]:
                refused[0] += 1
                return None
            return start(self, seconds)

        monkeypatch.setattr(LoopBudget, "start", spent_once)
        ran_first = asyncio.Event()
        asyncio.get_running_loop().call_soon(ran_first.set)
        seen: list[bool] = []
        run_now = Scheduler.run_now

        def at_once(self: Scheduler, *args: Any) -> None:
            seen.append(ran_first.is_set())
            run_now(self, *args)

        monkeypatch.setattr(Scheduler, "run_now", at_once)
        before = dict(counts)
        x = torch.randn(4, 8)
        torch.testing.assert_close(await ex.execute(x), Chain()(x))
        assert seen == [True]  # ran straight, once the loop had run the earlier callback
        assert counts["dataflow"] == before["dataflow"]
        assert counts["sliced"] == before["sliced"]
        assert ex.statistics().frames.in_use == 0


async def test_a_spent_slice_retries_once_then_runs_the_straight_line_in_slices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused again after its iteration's wait, the execution runs its straight line in
    slices (no second wait); one that no slice could hold goes there at once."""
    counts = _count_paths(monkeypatch)
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    asked = [0]

    def always_spent(self: LoopBudget, seconds: float) -> float | None:
        asked[0] += 1
        return None

    for slice_s, starts in ((0.001, 2), (1e-9, 1)):
        # no node is heavy however a loaded machine times it, so none leaves the loop (a heavy
        # node measured past a 1e-9 s slice would go to a worker: no straight line at all)
        config = ExecutorConfig(profile_executions=1, loop_slice_s=slice_s, heavy_node_us=1e9)
        async with Executor(ep, config) as ex:
            await _warm_straight(ex)
            with monkeypatch.context() as patch:
                patch.setattr(LoopBudget, "start", always_spent)
                asked[0] = 0
                before = dict(counts)
                x = torch.randn(4, 8)
                torch.testing.assert_close(await ex.execute(x), Chain()(x))
            assert asked[0] == starts, slice_s
            assert counts["sliced"] == before["sliced"] + 1
            assert counts["dataflow"] == before["dataflow"]


async def test_a_cancellation_during_the_wait_for_a_fresh_slice_frees_the_frame(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    async with Executor(ep, ExecutorConfig(profile_executions=1)) as ex:
        await _warm_straight(ex)
        with monkeypatch.context() as patch:
            patch.setattr(LoopBudget, "start", lambda self, seconds: None)
            task = asyncio.create_task(ex.execute(torch.randn(4, 8)))
            await asyncio.sleep(0)  # the task runs up to the wait for a fresh slice
            assert ex.statistics().modes["LINE_NEXT"] == 1 and ex.statistics().in_flight == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ex.statistics().frames.in_use == 0 and ex.statistics().cancelled == 1
        x = torch.randn(4, 8)
        torch.testing.assert_close(await ex.execute(x), Chain()(x))


class _Spin:
    """An inline kernel that holds the loop for `seconds`, counting its calls; raises on the
    call numbered `fail_at`."""

    def __init__(self, seconds: float, fail_at: int = 0) -> None:
        self.seconds = seconds
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, x: int) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("spin failed")
        until = time.perf_counter() + self.seconds
        while time.perf_counter() < until:
            pass
        return x + 1


def _spin_chain(kernel: _Spin, length: int) -> Any:
    b = GraphBuilder()
    value = b.input("x")
    for i in range(length):
        value = b.call(kernel, value, name=f"spin{i}", placement="inline")
    b.output(value)
    return b.build()


async def _ticks_during(awaitable: Any) -> tuple[Any, int]:
    """The awaitable's result, and how many loop iterations another task saw meanwhile."""
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is waiting for its next turn
    try:
        result = await awaitable
    finally:
        done = True
        await task
    return result, ticks


async def test_a_straight_line_longer_than_the_slice_runs_over_several_iterations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight 0.4 ms units against a 1 ms slice: in order, with the loop's other tasks run
    between slices, and without the dataflow."""
    counts = _count_paths(monkeypatch)
    kernel = _Spin(0.0004)
    async with Executor(_spin_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(2):  # warm-up, profiled (dataflow)
            assert await ex.execute(0) == 8
        before = dict(counts)
        result, ticks = await _ticks_during(ex.execute(0))
        assert result == 8
        assert counts["sliced"] == before["sliced"] + 1
        assert (counts["straight"], counts["dataflow"]) == (before["straight"], before["dataflow"])
        assert ticks >= 2  # at least three slices: the loop ran between them
        assert ex.statistics().frames.in_use == 0


async def test_a_cancelled_sliced_execution_runs_no_further_unit() -> None:
    kernel = _Spin(0.0004)
    async with Executor(_spin_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(2):
            await ex.execute(0)
        kernel.calls = 0
        task = asyncio.create_task(ex.execute(0))
        for _ in range(100):  # the task runs a slice (at most three units), defers the rest
            await asyncio.sleep(0)
            if kernel.calls:
                break
        assert 0 < kernel.calls < 8
        task.cancel()  # between two slices
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 0 < kernel.calls < 8
        assert ex.statistics().frames.in_use == 0 and ex.statistics().cancelled == 1
        assert await ex.execute(0) == 8


async def test_a_kernel_error_in_a_later_slice_names_its_node() -> None:
    kernel = _Spin(0.0004)
    async with Executor(_spin_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(2):
            await ex.execute(0)
        kernel.calls, kernel.fail_at = 0, 7
        with pytest.raises(ValueError, match="spin failed") as info:
            await ex.execute(0)
        assert any("spin6" in note for note in getattr(info.value, "__notes__", []))
        assert kernel.calls == 7  # the unit after it never ran
        kernel.fail_at = 0
        assert await ex.execute(0) == 8
        assert ex.statistics().frames.in_use == 0


class _ThreadSpin(_Spin):
    """A _Spin that records the thread of each call. With `hold_off_loop_at` n, its n-th
    call off the loop thread (counted as calls start, on any worker) waits for `gate` (a
    test cancels the execution meanwhile); with `fail_off_loop_at` n, that call raises."""

    def __init__(self, seconds: float, fail_at: int = 0) -> None:
        super().__init__(seconds, fail_at)
        self.threads: list[int] = []
        self.loop_thread = threading.get_ident()
        self.hold_off_loop_at = self.fail_off_loop_at = 0
        self.gate = threading.Event()
        self.held = threading.Event()
        self._off_loop = itertools.count(1)

    def clear(self) -> None:
        """Forget the calls so far: the next call off the loop is the first again."""
        self.threads.clear()
        self._off_loop = itertools.count(1)

    def __call__(self, x: int) -> int:
        me = threading.get_ident()
        if me != self.loop_thread:
            off_loop = next(self._off_loop)  # atomic under the GIL
            if off_loop == self.hold_off_loop_at:
                self.held.set()
                assert self.gate.wait(10)
            if off_loop == self.fail_off_loop_at:
                raise ValueError("spin failed off the loop")
        self.threads.append(me)
        return super().__call__(x)


def _movable_chain(kernel: _Spin, length: int) -> Any:
    """A chain without placement hints: adaptive placement may move every node."""
    b = GraphBuilder()
    value = b.input("x")
    for i in range(length):
        value = b.call(kernel, value, name=f"spin{i}")
    b.output(value)
    return b.build()


needs_two_cpus = pytest.mark.skipif(
    usable_cpus() < 2, reason="a line on a worker overlaps the loop only on a second CPU, and "
    "the pool has a thread per CPU (two are needed)"
)


async def _warm(ex: Executor, runs: int = 3) -> None:
    for _ in range(runs):  # profiled, then decided: every node inline (a straight line)
        assert await ex.execute(0) == 8


@needs_two_cpus
async def test_overlapping_long_executions_run_one_straight_line_on_a_worker() -> None:
    """Two executions of 8 x 0.4 ms units at once: the first runs on the loop in slices, the
    second (which overlaps it) as one work item of a worker thread; same results."""
    kernel = _ThreadSpin(0.0004)
    async with Executor(_movable_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        await _warm(ex)
        kernel.clear()
        assert await asyncio.gather(ex.execute(0), ex.execute(0)) == [8, 8]
        loop_thread = threading.get_ident()
        assert kernel.threads.count(loop_thread) == 8
        others = [t for t in kernel.threads if t != loop_thread]
        assert len(others) == 8 and len(set(others)) == 1  # one worker ran the whole line
        stats = ex.statistics()
        assert stats.worker_executions == 1 and stats.frames.in_use == 0
        kernel.clear()
        assert await ex.execute(0) == 8  # alone, it stays on the loop
        assert set(kernel.threads) == {loop_thread}
        assert ex.statistics().worker_executions == 1


async def _four_callers_reach_a_worker(ex: Executor, kernel: _ThreadSpin) -> LoopBudget:
    """Alone, the 2-node line never left the loop; four callers of it at once: some run on a
    worker (lines queue for the workers, however many run there already), and no frame
    stays in use. The loop's budget, after."""
    assert ex.statistics().worker_executions == 0
    kernel.clear()
    assert await asyncio.gather(*(ex.execute(0) for _ in range(4))) == [2] * 4
    stats = ex.statistics()
    assert stats.worker_executions >= 1 and stats.frames.in_use == 0
    loop_thread = threading.get_ident()
    assert any(t != loop_thread for t in kernel.threads)  # some on a worker
    budget = ex._scheduler.state.budget
    assert budget is not None
    return budget


@needs_two_cpus
@pytest.mark.asyncio(loop_factories=["asyncio"])  # a loop whose queues the budget can see
async def test_a_short_line_that_finds_the_loop_contended_goes_to_a_worker() -> None:
    """Four callers at once of a 0.6 ms line (under a 1 ms slice): a line that finds the slice
    spent with the other callers waiting runs on a worker beside the loop rather than wait a
    loop iteration. One caller alone never leaves the loop."""
    kernel = _ThreadSpin(0.0003)
    config = ExecutorConfig(profile_executions=1, loaded_heavy_node_us=1e9)  # whole lines only
    async with Executor(_movable_chain(kernel, 2), config) as ex:
        for _ in range(3):
            assert await ex.execute(0) == 2
        for _ in range(20):  # back to back, alone: the slice is extended, nothing waits
            assert await ex.execute(0) == 2
        budget = await _four_callers_reach_a_worker(ex, kernel)
        assert budget.statistics().slices >= 1


@needs_two_cpus
@pytest.mark.asyncio(loop_factories=["asyncio"])  # a loop whose queues the budget can see
async def test_with_callers_queued_a_line_that_fits_the_slice_goes_to_an_idle_worker() -> None:
    """A slice far longer than four 0.6 ms lines, so none ever finds it spent: with other
    callers queued for the loop and no line on a worker, a line goes to the idle worker
    (both CPUs work) instead of running on the loop while the worker waits. One caller alone
    never leaves the loop."""
    kernel = _ThreadSpin(0.0003)
    config = ExecutorConfig(profile_executions=1, loaded_heavy_node_us=1e9, loop_slice_s=0.05)
    async with Executor(_movable_chain(kernel, 2), config) as ex:
        for _ in range(20):
            assert await ex.execute(0) == 2
        budget = await _four_callers_reach_a_worker(ex, kernel)
        assert budget.statistics().deferred == 0  # never spent


@needs_two_cpus
@pytest.mark.asyncio(loop_factories=["asyncio"])  # a loop whose queues the budget can see
async def test_lines_queue_for_the_workers_while_one_runs_there() -> None:
    """With one line held on a worker, the next contended line still goes to the workers
    (the other thread takes it), not to the loop: a cap of lines on workers left the loop
    running segments while a worker that finished waited for it (StraightRunner)."""
    kernel = _ThreadSpin(0.0003)
    config = ExecutorConfig(profile_executions=1, loaded_heavy_node_us=1e9, loop_slice_s=0.05)
    async with Executor(_movable_chain(kernel, 2), config) as ex:
        for _ in range(20):
            assert await ex.execute(0) == 2
        kernel.clear()
        kernel.hold_off_loop_at = 1  # the first unit off the loop waits for the gate
        calls = [asyncio.create_task(ex.execute(0)) for _ in range(4)]
        try:
            assert await asyncio.to_thread(kernel.held.wait, 10)
            loop_thread = threading.get_ident()
            deadline = time.monotonic() + 10
            while not any(t != loop_thread for t in kernel.threads):  # the held one records
                assert time.monotonic() < deadline, "no second line reached a worker"  # later
                await asyncio.sleep(0.005)
        finally:
            kernel.gate.set()
        assert await asyncio.gather(*calls) == [2] * 4
        stats = ex.statistics()
        assert stats.worker_executions >= 2 and stats.frames.in_use == 0


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_where_the_loop_hides_its_queues_a_waiting_line_stands_for_them() -> None:
    """uvloop does not show what waits on it: one caller's line refused by a spent slice
    retries on the loop after one iteration, but once a line waits for that iteration the
    next ones go to the workers (64 callers otherwise all waited and ran on the loop's one
    core: 0.83x ONNX Runtime via `to_thread` on the encoder)."""
    kernel = _ThreadSpin(0.0003)
    async with Executor(_movable_chain(kernel, 2), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(3):
            assert await ex.execute(0) == 2
        assert ex.statistics().worker_executions == 0  # one caller never leaves the loop
        assert await asyncio.gather(*(ex.execute(0) for _ in range(4))) == [2] * 4
        stats = ex.statistics()
        assert stats.modes["LINE_NEXT"] >= 1 and stats.worker_executions >= 1, stats.modes


@pytest.mark.parametrize("config", [
    {"worker_execution_node_us": None},  # turned off
    {"worker_execution_node_us": 1000.0},  # the nodes are 400 us: under the bar
])
async def test_the_bar_keeps_overlapping_executions_on_the_loop(config: dict[str, Any]) -> None:
    kernel = _ThreadSpin(0.0004)
    config["loaded_heavy_node_us"] = 1e9  # nor does a loaded loop send single nodes away
    async with Executor(
        _movable_chain(kernel, 8), ExecutorConfig(profile_executions=1, **config)
    ) as ex:
        await _warm(ex)
        kernel.clear()
        assert await asyncio.gather(ex.execute(0), ex.execute(0)) == [8, 8]
        assert set(kernel.threads) == {threading.get_ident()}
        assert ex.statistics().worker_executions == 0


async def test_a_placement_hint_keeps_the_straight_line_on_the_loop() -> None:
    kernel = _ThreadSpin(0.0004)
    async with Executor(_spin_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        await _warm(ex)  # every node hinted "inline": the loop thread is asked for
        kernel.clear()
        assert await asyncio.gather(ex.execute(0), ex.execute(0)) == [8, 8]
        assert set(kernel.threads) == {threading.get_ident()}
        assert ex.statistics().worker_executions == 0


@needs_two_cpus
async def test_a_cancelled_straight_line_on_a_worker_runs_no_further_unit() -> None:
    """Cancelled while its worker runs unit 3, the execution runs no unit after it, raises
    CancelledError once the worker has let go of the frame, and the executor goes on."""
    kernel = _ThreadSpin(0.0004)
    async with Executor(_movable_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        await _warm(ex)
        kernel.clear()
        kernel.hold_off_loop_at = 3
        tasks = {asyncio.create_task(ex.execute(0)) for _ in range(2)}
        assert await asyncio.to_thread(kernel.held.wait, 10)  # a worker is at unit 3
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        assert [t.result() for t in done] == [8]  # the one on the loop
        (on_worker,) = pending
        on_worker.cancel()
        await asyncio.sleep(0.01)
        assert not on_worker.done()  # the worker still holds its frame
        kernel.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await on_worker
        stats = ex.statistics()
        assert stats.worker_executions == 1
        assert stats.cancelled == 1 and stats.frames.in_use == 0
        assert kernel.threads.count(threading.get_ident()) == 8
        assert len(kernel.threads) == 8 + 3  # the cancelled line ran no unit after the 3rd
        assert await ex.execute(0) == 8


@needs_two_cpus
async def test_a_kernel_error_on_a_worker_straight_line_names_its_node() -> None:
    kernel = _ThreadSpin(0.0004)
    async with Executor(_movable_chain(kernel, 8), ExecutorConfig(profile_executions=1)) as ex:
        await _warm(ex)
        kernel.clear()
        kernel.fail_off_loop_at = 6  # the worker's 6th unit
        results = await asyncio.gather(ex.execute(0), ex.execute(0), return_exceptions=True)
        assert 8 in results  # the one on the loop
        error = results[1 - results.index(8)]
        assert isinstance(error, ValueError) and "spin failed off the loop" in str(error)
        assert any("spin5" in note for note in getattr(error, "__notes__", []))
        assert ex.statistics().worker_executions == 1
        assert len(kernel.threads) == 8 + 5  # the units after it never ran
        kernel.fail_off_loop_at = 0
        assert await ex.execute(0) == 8
        assert ex.statistics().frames.in_use == 0 and ex.statistics().failed == 1


# =============================================================================================
# Without a frame (straight.py: run_alone; Executor._run_alone)
# =============================================================================================


async def test_a_straight_execution_runs_without_a_frame_while_one_is_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = _count_paths(monkeypatch)
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    async with Executor(ep, ExecutorConfig(profile_executions=1)) as ex:
        await _warm_straight(ex)
        before, stats_before = dict(counts), ex.statistics()
        for _ in range(5):
            await asyncio.sleep(0)  # a fresh slice: the execution fits it
            x = torch.randn(4, 8)
            torch.testing.assert_close(await ex.execute(x), Chain()(x))
        stats = ex.statistics()
        assert counts["frameless"] - before["frameless"] == 5
        assert stats.frameless_executions - stats_before.frameless_executions == 5
        assert stats.completed - stats_before.completed == 5
        assert stats.frames.created == stats_before.frames.created  # no frame taken for them
        assert all(v is None for v in introspect.frameless_values(ex))


async def test_a_kernel_error_without_a_frame_names_its_node_and_keeps_no_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = _count_paths(monkeypatch)
    fail = {"now": False}
    made: list[Any] = []

    class Token:
        """What the first node makes: alive only while an execution holds it."""

    def make(x: int) -> Token:
        made.append(weakref.ref(token := Token()))
        return token

    def maybe_fail(token: Token) -> int:
        if fail["now"]:
            raise ValueError("boom")
        return 1

    b = GraphBuilder()
    b.output(b.call(maybe_fail, b.call(make, b.input("x"), name="make", placement="inline"),
                    name="maybe_fail", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(4):
            await asyncio.sleep(0)
            assert await ex.execute(1) == 1
        before, tried = ex.statistics(), counts["frameless"]
        fail["now"] = True
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="boom") as info:
            await ex.execute(1)
        after = ex.statistics()
        assert counts["frameless"] == tried + 1  # it failed on the frameless path
        assert after.frameless_executions == before.frameless_executions  # counts successes
        assert (after.failed, after.started) == (before.failed + 1, before.started + 1)
        assert any("maybe_fail" in note for note in getattr(info.value, "__notes__", []))
        del info
        assert made[-1]() is None  # the failed execution's value went with it
        assert all(v is None for v in introspect.frameless_values(ex))
        fail["now"] = False
        await asyncio.sleep(0)
        assert await ex.execute(1) == 1
        assert ex.statistics().frameless_executions == before.frameless_executions + 1


async def test_with_no_frame_free_an_execution_waits_for_one_instead() -> None:
    """The frames bound how many executions run: one that finds none free waits its turn
    (FIFO) and runs with the frame it gets, not beside the others without one."""
    ep = torch.export.export(Chain(), (torch.randn(4, 8),))
    config = ExecutorConfig(profile_executions=1, max_concurrent_executions=1)
    async with Executor(ep, config) as ex:
        await _warm_straight(ex)
        held = introspect.take_frame(ex)
        task = asyncio.create_task(ex.execute(x := torch.randn(4, 8)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done() and ex.statistics().frames.waiters == 1
        before = ex.statistics().frameless_executions
        introspect.return_frame(ex, held)
        torch.testing.assert_close(await task, Chain()(x))
        assert ex.statistics().frameless_executions == before


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2


async def test_a_program_that_mutates_a_buffer_keeps_taking_frames() -> None:
    """A frame does more than hold the values where a program mutates its buffers (the
    Executor's weights take the new values after the execution): no run without one."""
    ep = torch.export.export(WithBuffer(), (torch.randn(2),))
    async with Executor(ep, ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(6):
            await asyncio.sleep(0)
            await ex.execute(torch.randn(2))
        assert ex.statistics().frameless_executions == 0
        assert ex.statistics().completed == 6

"""Faults of the runtime itself, not of kernels: every step of an execution may raise.

An internal error (in the scheduler's bookkeeping, tracing, a hand-off, placement or schedule
compilation) must fail that execution with the error, return its frame only once no unit of it
can still write the frame, and leave the Executor usable with consistent statistics. The
failures are injected by patching the runtime's own methods.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.instrument import UnitObserver
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.placement import AdaptivePlacement
from asyncgraph.runtime.schedule import ScheduleCache
from asyncgraph.runtime.scheduler import Scheduler
from asyncgraph.runtime.workers import WorkerPool
from asyncgraph.testing import Gate

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]


class InternalFault(RuntimeError):
    """The error injected into a runtime step."""


def _fail_once(
    monkeypatch: pytest.MonkeyPatch,
    owner: type,
    name: str,
    when: Callable[[], bool] = lambda: True,
) -> list[int]:
    """Make `owner.name` raise InternalFault the first time it is called while `when()`;
    returns a list that records each injected failure."""
    original = getattr(owner, name)
    raised: list[int] = []
    lock = threading.Lock()

    def patched(*args: Any, **kwargs: Any) -> Any:
        with lock:
            fire = not raised and when()
            if fire:
                raised.append(1)
        if fire:
            raise InternalFault(f"injected into {owner.__name__}.{name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)
    return raised


def _on_worker() -> bool:
    return threading.current_thread().name.startswith("asyncgraph-worker")


def _on_loop() -> bool:
    return not _on_worker()


def _assert_statistics(
    ex: Executor, *, completed: int, failed: int = 0, cancelled: int = 0
) -> None:
    stats = ex.statistics()
    assert (stats.completed, stats.failed, stats.cancelled) == (completed, failed, cancelled)
    assert stats.started == completed + failed + cancelled
    assert (stats.in_flight, stats.frames.in_use, stats.frames.waiters) == (0, 0, 0)


def add_one(x: int) -> int:
    return x + 1


def double(x: int) -> int:
    return x * 2


def gated(gate: Gate) -> Callable[[int], int]:
    def blocked_add_one(x: int) -> int:
        gate.wait_sync(timeout=30)
        return x + 1

    return blocked_add_one


def _worker_and_inline_roots(gate: Gate) -> Graph:
    """Two roots: a worker node blocked at `gate`, and an inline one."""
    b = GraphBuilder()
    x = b.input("x")
    b.output([b.call(gated(gate), x, name="blocked", placement="worker"),
              b.call(double, x, name="inline", placement="inline")])
    return b.build()


def _single_frame(**overrides: Any) -> ExecutorConfig:
    """One frame, so the execution after a failed one reuses its frame."""
    options: dict[str, Any] = dict(
        max_concurrent_executions=1, max_parallel_ops=1, adaptive_placement=False
    )
    options.update(overrides)
    return ExecutorConfig(**options)


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    try:
        yield g
    finally:
        g.open()  # a failing test never leaves a worker blocked


async def test_a_frame_returns_only_after_its_worker_units_end(
    monkeypatch: pytest.MonkeyPatch, gate: Gate
) -> None:
    """Regression: an internal error in the first inline root's bookkeeping left `run`
    through its finally while a worker root still ran; the frame went back to the pool and
    the worker then wrote into the next execution's values and counters."""

    def on_loop_once_the_worker_runs() -> bool:
        if not _on_loop():
            return False
        deadline = time.monotonic() + 10  # else the stop would keep the worker from starting
        while not gate.waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        return True

    _fail_once(monkeypatch, Scheduler, "_complete", on_loop_once_the_worker_runs)
    async with Executor(_worker_and_inline_roots(gate), _single_frame()) as ex:
        first = asyncio.create_task(ex.execute(1))
        await gate.wait_entered(1)
        for _ in range(10):
            await asyncio.sleep(0)
        assert not first.done(), "the execution ended while its worker unit still runs"
        assert ex.statistics().frames.in_use == 1
        gate.open()
        with pytest.raises(InternalFault) as info:
            await first
        assert "internal error" in "\n".join(getattr(info.value, "__notes__", []))
        assert await ex.execute(3) == [4, 6]  # the same frame, nothing of the first left
        _assert_statistics(ex, completed=1, failed=1)


def _chain_with_a_branch() -> Graph:
    """inline -> worker -> (worker, worker, inline): units run on both threads, hand-offs
    from the loop and from a worker."""
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(add_one, x, name="a", placement="inline")
    w = b.call(add_one, a, name="w", placement="worker")
    b.output([b.call(double, w, name="left", placement="worker"),
              b.call(add_one, w, name="right", placement="worker"),
              b.call(double, w, name="tail", placement="inline")])
    return b.build()


@pytest.mark.parametrize(
    ("owner", "step", "thread"),
    [
        (Scheduler, "_complete", "loop"),  # bookkeeping after a unit
        (Scheduler, "_complete", "worker"),
        (UnitObserver, "done", "loop"),  # tracing a unit
        (UnitObserver, "done", "worker"),
        (WorkerPool, "submit", "loop"),  # handing units to the workers
        (WorkerPool, "submit", "worker"),
        (LoopState, "account", "loop"),  # the loop's load, after a slice
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
async def test_an_internal_error_fails_the_execution_and_the_executor_goes_on(
    monkeypatch: pytest.MonkeyPatch, owner: type, step: str, thread: str
) -> None:
    raised = _fail_once(monkeypatch, owner, step, _on_worker if thread == "worker" else _on_loop)
    config = _single_frame(max_parallel_ops=2, trace=True)
    async with Executor(_chain_with_a_branch(), config) as ex:
        with pytest.raises(InternalFault):
            await ex.execute(1)
        assert raised == [1]
        assert await ex.execute(1) == [6, 4, 6]
        _assert_statistics(ex, completed=1, failed=1)


@pytest.mark.parametrize(("owner", "step"), [(AdaptivePlacement, "choose"),
                                             (ScheduleCache, "aget")])
async def test_a_failure_before_the_run_returns_the_frame(
    monkeypatch: pytest.MonkeyPatch, owner: type, step: str
) -> None:
    """Regression: placement and schedule compilation ran after the frame was taken but
    before the `try` that returns it; with one frame, the next execution waited for ever."""
    import asyncgraph.runtime.build as build_module

    # the schedule compiled in the request (the first placement's is built with the Executor)
    monkeypatch.setattr(build_module, "prebuild_schedules", lambda *args, **kwargs: None)
    _fail_once(monkeypatch, owner, step)
    async with Executor(_chain_with_a_branch(), _single_frame(adaptive_placement=True)) as ex:
        with pytest.raises(InternalFault):
            await ex.execute(1)
        assert await ex.execute(1) == [6, 4, 6]
        _assert_statistics(ex, completed=1, failed=1)


@pytest.mark.parametrize("by", ["timeout", "cancel"])
async def test_a_cancelled_execution_ends_once_its_units_end_despite_an_internal_error(
    monkeypatch: pytest.MonkeyPatch, gate: Gate, by: str
) -> None:
    """Regression: a worker's internal error went to sys.unraisablehook without ending its
    unit, so `pending` never reached zero and a cancellation (asyncio.timeout, the server's
    504) waited for ever. A cancelled execution still waits for the units in flight (they
    write its frame), then raises the original cancellation."""
    _fail_once(monkeypatch, Scheduler, "_complete", _on_worker)
    b = GraphBuilder()
    b.output(b.call(gated(gate), b.input("x"), name="blocked", placement="worker"))

    timeouts: list[asyncio.Timeout] = []

    async def call(ex: Executor) -> Any:
        async with asyncio.timeout(None) as timeout:
            timeouts.append(timeout)
            return await ex.execute(1)

    async with Executor(b.build(), _single_frame()) as ex:
        caller = asyncio.create_task(call(ex))
        await gate.wait_entered(1)
        if by == "timeout":
            timeouts[0].reschedule(asyncio.get_running_loop().time())  # expires now
        else:
            caller.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert caller.cancelling()
        assert not caller.done(), "the frame was given up while a worker still ran"
        gate.open()
        with pytest.raises(TimeoutError if by == "timeout" else asyncio.CancelledError):
            await caller
        assert await ex.execute(2) == 3
        _assert_statistics(ex, completed=1, cancelled=1)

"""Reliability scenarios 5, 6, 7 and 10: lifecycle, completion storms, loop latency, loops.

5. aclose() with 32 executions in flight completes them all (or, with cancel=True, cancels
   them all); aclose is idempotent, also when called concurrently; new calls fail at once with
   ExecutorClosedError; 100 create/run/close cycles leave the thread count and the traced
   Python memory flat and every Executor collectable.
6. Many worker threads completing nodes at the same moment, handing off to the loop: every
   execution completes with its own correct result; none is lost (a lost completion would hang,
   so every wait has a deadline).
7. While 64 CPU-heavy executions run, the loop keeps running: a heavy kernel, on a worker
   thread, waits for the loop to answer it (a handshake, not a clock: the loop lag under load
   is measured by asyncgraph/bench/concurrency.py).
10. The loop matrix: each test here runs on asyncio in debug mode and on uvloop (conftest);
    the eager task factory exists only on Python 3.12+, where a mini-suite runs with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading
import time
import tracemalloc
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import uvloop

from asyncgraph import Executor, ExecutorClosedError, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import Gate, LeakChecker

pytestmark = pytest.mark.usefixtures("leak_check")


def sleepy_graph(seconds: float = 0.002, gate: threading.Event | None = None) -> Graph:
    """Two worker nodes that sleep; with `gate`, the first waits for it to open, so no
    execution can finish before the test says (a loaded machine runs the sleeps late)."""

    def slow(x: int) -> int:
        if gate is not None:
            gate.wait(30)
        time.sleep(seconds)
        return x + 1

    b = GraphBuilder()
    x = b.input("x")
    y = b.call(slow, x, name="first", placement="worker")
    b.output(b.call(slow, y, name="second", placement="worker"))
    return b.build()


async def _all_inside(ex: Executor, count: int) -> None:
    """Wait until `count` callers have entered: they hold a frame, wait for one, or finished
    (on a loaded machine an execution can finish before the last caller enters)."""
    async with asyncio.timeout(30):
        while True:
            stats = ex.statistics()
            if stats.frames.in_use + stats.frames.waiters + stats.completed == count:
                return
            await asyncio.sleep(0)


def _config() -> ExecutorConfig:
    return ExecutorConfig(max_concurrent_executions=8, max_parallel_ops=2)


# -- scenario 5 -----------------------------------------------------------------------------------


async def test_aclose_completes_executions_in_flight() -> None:
    ex = Executor(sleepy_graph(), _config())
    tasks = [asyncio.create_task(ex.execute(i)) for i in range(32)]
    await _all_inside(ex, 32)
    await ex.aclose()
    assert all(t.done() for t in tasks), "aclose returned before its executions finished"
    assert [t.result() for t in tasks] == [i + 2 for i in range(32)]
    stats = ex.statistics()
    assert stats.closed and stats.completed == 32 and stats.workers.threads == 0
    assert stats.frames.total == 0


async def test_aclose_cancel_cancels_every_execution_in_flight() -> None:
    gate = threading.Event()
    ex = Executor(sleepy_graph(gate=gate), _config())
    tasks = [asyncio.create_task(ex.execute(i)) for i in range(32)]
    await _all_inside(ex, 32)
    closing = asyncio.create_task(ex.aclose(cancel=True))
    await asyncio.sleep(0)  # aclose cancels first, then waits for the blocked workers
    gate.set()
    await closing
    assert all(t.done() for t in tasks)
    outcomes = ["cancelled" if t.cancelled() else "completed" for t in tasks]
    assert outcomes == ["cancelled"] * 32, f"{outcomes.count('completed')} of 32 ran to the end"


async def test_aclose_cancel_cancels_executions_holding_frames() -> None:
    """The part of cancel=True that works today: callers holding a frame are cancelled."""
    gate = threading.Event()
    ex = Executor(sleepy_graph(gate=gate), _config())
    tasks = [asyncio.create_task(ex.execute(i)) for i in range(8)]
    await _all_inside(ex, 8)
    closing = asyncio.create_task(ex.aclose(cancel=True))
    await asyncio.sleep(0)
    gate.set()
    await closing
    assert all(t.cancelled() for t in tasks)
    assert ex.statistics().cancelled == 8 and ex.statistics().frames.in_use == 0


async def test_aclose_is_idempotent_and_concurrent_closes_agree() -> None:
    ex = Executor(sleepy_graph(), _config())
    tasks = [asyncio.create_task(ex.execute(i)) for i in range(12)]
    await _all_inside(ex, 12)
    await asyncio.gather(ex.aclose(), ex.aclose(), ex.aclose())
    assert [t.result() for t in tasks] == [i + 2 for i in range(12)]
    await ex.aclose()
    await ex.aclose(cancel=True)
    assert ex.statistics().closed


async def test_new_calls_fail_at_once_with_a_clear_error() -> None:
    gate = threading.Event()
    ex = Executor(sleepy_graph(gate=gate), _config())
    running = [asyncio.create_task(ex.execute(i)) for i in range(10)]
    await _all_inside(ex, 10)
    closing = asyncio.create_task(ex.aclose())
    await asyncio.sleep(0)
    assert not closing.done(), "aclose should still be draining"
    # while closing and after: refused at once, without waiting for a frame
    for when in ("while closing", "after closing"):
        started = ex.statistics().started
        with pytest.raises(ExecutorClosedError, match="the executor is closed; create a new one"):
            await asyncio.wait_for(ex.execute(1), 1)
        with pytest.raises(ExecutorClosedError):
            await ex.execute_flat([1])
        with pytest.raises(ExecutorClosedError):
            ex.swap_weights({})
        with pytest.raises(ExecutorClosedError):
            async with ex:
                pass
        assert ex.statistics().started == started, f"a call {when} took a frame"
        if when == "while closing":
            gate.set()
            await closing
    assert [t.result() for t in running] == [i + 2 for i in range(10)]


async def test_create_close_cycles_leave_threads_and_memory_flat() -> None:
    def work(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    b = GraphBuilder()
    x = b.input("x")
    y = b.call(work, x, name="left", placement="worker")
    z = b.call(work, x, name="right", placement="worker")
    b.output(b.call(lambda p, q: p + q, y, z, name="join", placement="inline"))
    graph = b.build()
    refs: list[weakref.ref[Executor]] = []

    async def cycle() -> None:
        ex = Executor(graph, ExecutorConfig(max_concurrent_executions=2, max_parallel_ops=2))
        refs.append(weakref.ref(ex))
        out = await ex.execute(torch.ones(4))
        assert float(out.sum()) == 16.0
        await ex.aclose()

    for _ in range(10):  # warm caches (torch, code objects) before measuring
        await cycle()
    gc.collect()
    threads_before = threading.active_count()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            await cycle()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert threading.active_count() == threads_before, "threads grew over the cycles"
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} closed Executor(s) are still referenced"
    assert grown < 512 * 1024, f"traced memory grew by {grown} bytes over 100 cycles"


# -- scenario 6 -----------------------------------------------------------------------------------


def storm_graph(width: int, gate: Gate | None, calls: list[int]) -> Graph:
    """x -> width worker nodes (optionally behind a gate) -> width async nodes -> sum."""

    def branch(i: int) -> Callable[[int], int]:
        def run(x: int) -> int:
            if gate is not None:
                gate.wait_sync(timeout=60)
            calls.append(i)  # list.append is atomic
            return x * 1000 + i

        run.__name__ = f"w{i}"
        return run

    async def hop(v: int) -> int:
        return v + 1

    b = GraphBuilder()
    x = b.input("x")
    outs = []
    for i in range(width):
        w = b.call(branch(i), x, name=f"w{i}", placement="worker")
        outs.append(b.call(hop, w, name=f"hop{i}"))
    b.output(b.call(lambda *vs: sum(vs), *outs, name="total", placement="inline"))
    return b.build()


def storm_expected(x: int, width: int) -> int:
    return sum(x * 1000 + i + 1 for i in range(width))


async def test_thread_to_loop_completion_storm_at_a_gate() -> None:
    """16 threads blocked in kernels are released at once; every completion arrives."""
    width = 16
    gate = Gate()
    calls: list[int] = []
    config = ExecutorConfig(max_parallel_ops=width, max_concurrent_executions=1)
    async with Executor(storm_graph(width, gate, calls), config) as ex:
        for round_ in range(3):
            gate.close()
            task = asyncio.create_task(ex.execute(round_))
            await gate.wait_entered(width, within_s=30)
            gate.open()
            assert await asyncio.wait_for(task, 30) == storm_expected(round_, width)
        assert len(calls) == 3 * width


async def test_completion_storm_many_executions() -> None:
    width, executions = 24, 48
    calls: list[int] = []
    config = ExecutorConfig(max_parallel_ops=8, max_concurrent_executions=16)
    async with Executor(storm_graph(width, None, calls), config) as ex:
        results = await asyncio.wait_for(
            asyncio.gather(*(ex.execute(i) for i in range(executions))), 60
        )
        assert results == [storm_expected(i, width) for i in range(executions)]
        assert len(calls) == width * executions
        stats = ex.statistics()
        assert stats.completed == executions and stats.frames.in_use == 0


# -- scenario 7 -----------------------------------------------------------------------------------


class _LoopProbe:
    """A heavy kernel's handshake with the loop: the first call tells the loop it is running,
    then waits for the loop's answer, which can only come if the loop runs meanwhile."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.running = asyncio.Event()
        self.answered = threading.Event()
        self.threads: set[str] = set()

    def in_kernel(self) -> None:
        self.threads.add(threading.current_thread().name)
        if self.answered.is_set():
            return
        self.loop.call_soon_threadsafe(self.running.set)
        if not self.answered.wait(20):
            raise TimeoutError("the loop never answered while a heavy kernel ran")


def matmul_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = torch.tanh(x @ w)
    return x


def heavy_graph(probe: _LoopProbe) -> Graph:
    def probed_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        probe.in_kernel()
        return matmul_chain(x, w)

    b = GraphBuilder()
    x = b.input("x")
    w = b.input("w")
    branches = [b.call(probed_chain, x, w, name=f"chain{i}", placement="worker")
                for i in range(4)]
    b.output(b.call(lambda *ts: torch.stack(ts).sum(0), *branches, name="join", placement="inline"))
    return b.build()


@pytest.mark.timeout(90)
async def test_event_loop_stays_responsive_under_cpu_load() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=gen)
    w = torch.randn(256, 256, generator=gen) / 16
    expected = 4 * matmul_chain(x, w)
    probe = _LoopProbe(asyncio.get_running_loop())
    config = ExecutorConfig(max_concurrent_executions=8, max_parallel_ops=2)
    async with Executor(heavy_graph(probe), config) as ex:
        runs = asyncio.gather(*(ex.execute(x, w) for _ in range(64)))
        async with asyncio.timeout(20):
            await probe.running.wait()
        for _ in range(5):  # timers fire while the kernel holds its worker thread
            await asyncio.sleep(0.001)
        probe.answered.set()
        outs = await asyncio.wait_for(runs, 60)
    for out in outs:
        torch.testing.assert_close(out, expected)
    assert probe.threads and all(t.startswith("asyncgraph-worker") for t in probe.threads), (
        probe.threads
    )


# -- scenario 10 ----------------------------------------------------------------------------------


async def test_runs_on_the_loop_matrix(request: pytest.FixtureRequest) -> None:
    """conftest runs every async test on asyncio with debug mode and on uvloop."""
    loop = asyncio.get_running_loop()
    if "uvloop" in request.node.name:
        assert isinstance(loop, uvloop.Loop)
    else:
        assert not isinstance(loop, uvloop.Loop)
        # conftest's factory (its slow-callback threshold), in debug mode: pytest-asyncio's
        # runner sets debug from the asyncio_debug ini option, which must stay true
        assert loop.get_debug()
        assert loop.slow_callback_duration == 10.0
    async with Executor(sleepy_graph(0.0), _config()) as ex:
        assert await ex.execute(1) == 3


async def _mini_suite() -> None:
    """A few executor behaviours to repeat under another task factory."""
    async with Executor(sleepy_graph(0.001), _config()) as ex:
        assert await asyncio.gather(*(ex.execute(i) for i in range(20))) == [
            i + 2 for i in range(20)
        ]
        task = asyncio.create_task(ex.execute(0))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert ex.statistics().frames.in_use == 0
        gate = Gate()
        calls: list[int] = []
        async with Executor(storm_graph(4, gate, calls), ExecutorConfig(max_parallel_ops=4)) as s:
            pending = asyncio.create_task(s.execute(1))
            await gate.wait_entered(4)
            gate.open()
            assert await pending == storm_expected(1, 4)


@pytest.mark.skipif(
    not hasattr(asyncio, "eager_task_factory"),
    reason=f"asyncio.eager_task_factory needs Python 3.12+ (running {sys.version.split()[0]})",
)
async def test_mini_suite_with_the_eager_task_factory() -> None:
    loop = asyncio.get_running_loop()
    factory: Any = getattr(asyncio, "eager_task_factory")  # noqa: B009 - absent on 3.11
    previous = loop.get_task_factory()
    loop.set_task_factory(factory)
    try:
        async with LeakChecker():
            await _mini_suite()
    finally:
        loop.set_task_factory(previous)


async def test_mini_suite_on_the_default_task_factory() -> None:
    async with LeakChecker():
        await _mini_suite()


# -- the leak checker itself ----------------------------------------------------------------------


async def test_leak_checker_reports_what_is_left_behind() -> None:
    gate = Gate()
    calls: list[int] = []
    checker = LeakChecker(close_executors=False, settle_s=0.05)
    await checker.__aenter__()
    ex = Executor(storm_graph(1, gate, calls), ExecutorConfig(max_parallel_ops=1))
    stray = threading.Thread(target=gate.wait_sync, name="asyncgraph-stray", daemon=True)
    try:
        running = asyncio.create_task(ex.execute(1))
        await gate.wait_entered(1)
        stray.start()
        with pytest.raises(AssertionError) as info:
            await checker.check()
        text = str(info.value)
        assert "1 frame(s) still in use" in text
        assert "task(s) still pending" in text
        assert "asyncgraph-stray" in text
    finally:
        gate.open()
    assert await running == storm_expected(1, 1)
    stray.join(5)
    await ex.aclose()
    await checker.check()  # clean again once everything is done


_HELD: list[object] = []


def test_the_cuda_report_names_what_holds_a_tensor() -> None:
    """A CUDA growth names the tensors still alive and what refers to each (leaks._holders;
    any object works the same way, so this runs on the CPU), with the objects that
    tests/conftest.py froze in view."""
    from asyncgraph.testing import leaks

    held = types.SimpleNamespace()  # tracked by the collector, as a tensor is
    _HELD.append(held)
    box = {"weight": held}
    try:
        with leaks._nothing_frozen():
            holders = leaks._holders(held)
            assert gc.get_freeze_count() == 0
        assert "list" in holders and "dict['weight']" in holders, holders
        assert gc.get_freeze_count() > 0  # frozen again
    finally:
        _HELD.clear()
    del box

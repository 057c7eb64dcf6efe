"""Host waits that scale with the number of waits outstanding (issue 50, item 4), on the
simulated GPU of support/fake_gpu.py.

- One loop wake per drain: the waiter's threads put completions on one queue per loop and
  wake the loop only when no wake of theirs is pending there; the loop settles them all in one
  callback. N waits completing together wake the loop once, each with its own result or error;
  a wait cancelled with its completion queued leaves nothing behind.
- No loop spinning while another wait is outstanding: a wait that finds another one in
  flight hands off after one query; one spinning alone hands off when another arrives; waits
  queued behind the thread's are polled by the waiter's poll thread, not by the loop. Counted
  per execution with 8 and 64 concurrent executions on a slow GPU: the loop's polls made while
  another wait was outstanding stay at about one per wait, however long the waits last.
- The end of an execution's GPU work is charged to the loop's LoopBudget: executions whose
  waits complete together resume over several loop iterations, about one slice of work each,
  not all in the iteration after the wake.

What a wait does is asserted (wakes, polls, iterations), never how long it takes.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.cuda import device, host_wait
from asyncgraph.cuda.device import PollPolicy, wait_events
from asyncgraph.cuda.host_wait import HostWaiter
from asyncgraph.runtime.loop_budget import loop_budget
from tests.support.backends import run, until
from tests.support.fake_gpu import (
    CudaNodes,
    FakeBackend,
    FakeEvent,
    FakeGpu,
    FakeStream,
    Sim,
    ThreadGpu,
    gpu_running,
    on_event_loop,
    unwrap,
)
from tests.support.gpu_graphs import chain, host_reader_graph, reference

AT_ONCE = PollPolicy(spin_s=0.0, spin_max_s=0.0)  # to the thread after one poll, always
FOREVER = PollPolicy(spin_s=60.0, spin_max_s=60.0)  # alone, a wait would spin for a minute


class CountingLoop:
    """The running loop as cuda/host_wait.py sees it, noting each `call_soon_threadsafe`
    (a wake of the loop from a waiter thread) in `wakes`."""

    def __init__(self, loop: Any, wakes: list[str]) -> None:
        self._loop = loop
        self._wakes = wakes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def call_soon_threadsafe(self, fn: Callable[..., object], /, *args: Any) -> Any:
        self._wakes.append(threading.current_thread().name)
        return self._loop.call_soon_threadsafe(fn, *args)


def count_wakes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The wakes of the loop the waiter's threads ask for, by the thread that asked."""
    wakes: list[str] = []
    real = host_wait.current_loop
    monkeypatch.setattr(host_wait, "current_loop", lambda: CountingLoop(real(), wakes))
    return wakes


class Outcome(FakeEvent):
    """A FakeEvent whose `synchronize`, once the event completed, raises `error` if given
    (a CUDA error the event reports), on whichever thread runs it."""

    def __init__(self, gpu: FakeGpu, error: BaseException | None = None) -> None:
        super().__init__(gpu)
        self.error = error

    def synchronize(self) -> None:
        super().synchronize()
        if self.error is not None:
            raise self.error


def pending_event(
    gpu: FakeGpu, name: str, error: BaseException | None = None
) -> tuple[Outcome, FakeStream]:
    """An event recorded on a stream of its own: it completes when that stream is stepped."""
    stream = gpu.stream(name)
    event = Outcome(gpu, error)
    event.record(stream)
    return event, stream


def hold_the_loop(condition: Callable[[], bool], what: str) -> None:
    """Block the loop's thread, on purpose, until `condition()`: whatever the waiter's
    threads do meanwhile reaches the loop in one later iteration."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.0005)


async def turns(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110 (set by a thread or by the loop's turns)
            await asyncio.sleep(0)


async def settled(waiter: HostWaiter) -> None:
    await until(lambda: not waiter.threads, "the waiter's threads ended")


# -- one loop wake per drain ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 16])
async def test_waits_completing_together_wake_the_loop_once(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """N waits handed to the waiter complete while the loop is busy: the loop is woken once,
    and each wait returns, or raises the error its event reported."""
    wakes = count_wakes(monkeypatch)
    gpu = FakeGpu()
    failing = {1: RuntimeError("CUDA error: an illegal memory access (event 1)")}
    waits = [pending_event(gpu, f"s{k}", failing.get(k)) for k in range(n)]
    waiter = HostWaiter(idle_s=0.05)
    tasks = [asyncio.create_task(wait_events([e], AT_ONCE, waiter)) for e, _ in waits]
    await turns(lambda: waiter.pending == n and gpu.sync_waits >= 1)  # the thread blocks
    for _, stream in waits:
        assert gpu.step_stream(stream)  # every event completes now
    hold_the_loop(lambda: waiter.pending == 0, "every completion reached the loop's queue")
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert len(wakes) == 1, wakes
    assert [repr(o) for o in outcomes] == [repr(failing.get(k)) for k in range(n)]
    assert all(e.synchronized == 1 for e, _ in waits)
    assert waiter.pending == 0
    await settled(waiter)


async def test_a_wait_cancelled_with_its_completion_queued_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled while blocked on by the thread, while queued, and once its completion is on
    the loop's queue but not yet settled: no entry is left, the others get their results."""
    wakes = count_wakes(monkeypatch)
    gpu = FakeGpu()
    waits = [pending_event(gpu, f"s{k}") for k in range(6)]
    waiter = HostWaiter(idle_s=0.05)
    tasks = [asyncio.create_task(wait_events([e], AT_ONCE, waiter)) for e, _ in waits]
    await turns(lambda: waiter.pending == 6 and gpu.sync_waits >= 1)
    tasks[0].cancel()  # the thread blocks on it
    tasks[3].cancel()  # queued
    await turns(lambda: tasks[0].done() and tasks[3].done())
    for _, stream in waits:
        gpu.step_stream(stream)
    hold_the_loop(lambda: waiter.pending == 0, "every completion reached the loop's queue")
    tasks[4].cancel()  # its completion is queued for the loop, not yet settled
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    cancelled = [k for k, o in enumerate(outcomes) if isinstance(o, asyncio.CancelledError)]
    assert cancelled == [0, 3, 4]
    assert [outcomes[k] for k in (1, 2, 5)] == [None, None, None]
    assert waiter.pending == 0 and len(wakes) <= 1
    await settled(waiter)


def test_a_loop_closed_before_its_drain_ran_is_not_kept() -> None:
    """A loop closed with its wake queued (its drain never runs) is not kept by the waiter's
    completion queue: the next delivery, to any loop, drops that queue."""
    gpu = FakeGpu()
    waiter = HostWaiter(idle_s=0.05)
    event, stream = pending_event(gpu, "s1")
    loop = asyncio.new_event_loop()

    async def hand_over() -> asyncio.Task[float]:
        task = asyncio.create_task(waiter.wait([event]))
        await turns(lambda: gpu.sync_waits == 1)
        return task

    task = loop.run_until_complete(hand_over())
    gpu.step_stream(stream)  # completes while the loop is stopped: its wake is queued there
    hold_the_loop(lambda: waiter.pending == 0 and waiter.wakes == 1, "the wake is queued")
    loop.close()  # the drain never runs
    closed = weakref.ref(loop)
    task_ref = weakref.ref(task)
    del loop, task
    second, stream = pending_event(gpu, "s2")

    async def wait_again() -> None:
        waiting = asyncio.create_task(waiter.wait([second]))
        await turns(lambda: gpu.sync_waits == 2)
        gpu.step_stream(stream)
        await waiting

    asyncio.run(wait_again())
    gc.collect()
    assert closed() is None and task_ref() is None
    waiter.close()
    assert waiter.join(10)


# -- no loop spinning while another wait is outstanding -------------------------------------------


async def test_a_wait_spinning_alone_hands_off_when_another_arrives() -> None:
    """Alone, a wait spins (FOREVER: for a minute); a second wait hands off after one query,
    and the first hands off at its next poll: the loop then polls neither."""
    gpu = FakeGpu()
    (first, s1), (second, s2) = pending_event(gpu, "s1"), pending_event(gpu, "s2")
    waiter = HostWaiter(idle_s=0.05)
    spinning = asyncio.create_task(wait_events([first], FOREVER, waiter))
    for _ in range(5):
        await asyncio.sleep(0)
    assert waiter.handed == 0  # alone: it spins
    arriving = asyncio.create_task(wait_events([second], FOREVER, waiter))
    for _ in range(20):
        await asyncio.sleep(0)
    assert waiter.handed == 2
    polled = gpu.loop_queries
    for _ in range(20):
        await asyncio.sleep(0)
    assert gpu.loop_queries == polled  # neither is polled on the loop any more
    gpu.step_stream(s2)
    gpu.step_stream(s1)
    await asyncio.gather(spinning, arriving)
    await settled(waiter)


class Contention:
    """Which tasks are inside `wait_events` now, and the loop's polls made while another
    task's wait was outstanding (`contended`) or none was (`alone`)."""

    def __init__(self) -> None:
        self.in_flight: dict[int, int] = {}
        self.waits = 0
        self.contended = 0
        self.alone = 0

    def others_waiting(self) -> bool:
        me = current_task_id()
        return any(task != me for task in self.in_flight)

    def track(self, monkeypatch: pytest.MonkeyPatch) -> None:
        inner = device.wait_events

        async def tracked(events: Any, *args: Any, **kwargs: Any) -> None:
            me = current_task_id()
            assert me is not None, "wait_events outside a task"
            self.waits += 1
            self.in_flight[me] = self.in_flight.get(me, 0) + 1
            try:
                await inner(events, *args, **kwargs)
            finally:
                self.in_flight[me] -= 1
                if not self.in_flight[me]:
                    del self.in_flight[me]

        monkeypatch.setattr(device, "wait_events", tracked)


def current_task_id() -> int | None:
    """The running task's identity (asyncio or trio); None in a plain loop callback or on a
    thread without a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        trio = sys.modules.get("trio")
        if trio is None or not trio.lowlevel.in_trio_run():
            return None
        return id(trio.lowlevel.current_task())
    task = asyncio.current_task()
    return None if task is None else id(task)


class PollCountingEvent(FakeEvent):
    """A FakeEvent whose queries on the loop's thread are counted in `contention`."""

    contention: Contention

    def query(self) -> bool:
        if on_event_loop():
            if self.contention.others_waiting():
                self.contention.contended += 1
            else:
                self.contention.alone += 1
        return super().query()


class PollCountingBackend(FakeBackend):
    def __init__(self, gpu: ThreadGpu, contention: Contention) -> None:
        super().__init__(gpu)
        self.contention = contention

    def new_event(self) -> PollCountingEvent:
        event = PollCountingEvent(self.gpu)
        event.contention = self.contention
        return event


async def slow_gpu(gpu: ThreadGpu, stop: anyio.Event) -> None:
    """The simulated GPU at a few ops per millisecond of the loop's timers: waits last tens
    of milliseconds, far longer than any spin."""
    while not stop.is_set():
        for _ in range(4):
            gpu.step()
        await anyio.sleep(0.001)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [8, 64])
def test_loop_polls_per_wait_stay_bounded_with_many_waits_outstanding(
    backend: str, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n concurrent executions, each with a host wait and the wait of its end, on a GPU slow
    enough that every wait lasts far beyond the spin: with the default policy, the loop's
    polls made while another wait is outstanding stay at about one per wait (its first
    query), not a number that grows with the time waited."""
    contention = Contention()
    contention.track(monkeypatch)

    async def body() -> None:
        gpu = ThreadGpu(seed=n)
        sim = Sim(gpu)
        graph = host_reader_graph(sim, "inline")
        ex = Executor(graph, ExecutorConfig(adaptive_placement=False,
                                            max_concurrent_executions=n),
                      kernel_factory=CudaNodes(),
                      _cuda_backend=PollCountingBackend(gpu, contention))
        runtime = ex.cuda_runtime
        assert runtime is not None
        waiter = runtime.waiter = HostWaiter(idle_s=0.05)
        results: dict[int, Any] = {}

        async def call(k: int) -> None:
            results[k] = await ex.execute(sim.upload(k))

        stop = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(slow_gpu, gpu, stop)
                async with anyio.create_task_group() as callers:
                    for k in range(n):
                        callers.start_soon(call, k)
                stop.set()
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert results == {k: reference(graph, k)[0] for k in range(n)}
        assert gpu.errors == []
        assert waiter.handed >= n  # the waits did outlast the spin
        # one query per wait_events call, one per host_ready, and one more for a spinner
        # that saw another wait arrive: at most 3 per wait
        assert contention.contended <= 3 * contention.waits, vars(contention)
        await settled(waiter)

    run(body, backend)


# -- the end of an execution is charged to the loop's budget ------------------------------------


async def test_begin_takes_the_loops_slice() -> None:
    """An execution's `begin` opens the loop's slice when none is open: its host work (begin,
    a replay's launch) counts against what inline work may still run in this iteration."""
    gpu = ThreadGpu()
    sim = Sim(gpu)
    ex = Executor(chain(sim, 2), ExecutorConfig(adaptive_placement=False),
                  kernel_factory=CudaNodes(), _cuda_backend=FakeBackend(gpu))
    runtime = ex.cuda_runtime
    assert runtime is not None
    budget = loop_budget(asyncio.get_running_loop(), 1e-3)
    frame = runtime.frame_state([lambda values: None] * runtime.plan.num_nodes)
    try:
        await asyncio.sleep(0)  # a new iteration: no slice open
        assert not budget.is_open
        slices = budget.statistics().slices
        frame.begin()
        assert budget.is_open and budget.statistics().slices == slices + 1
        async with gpu_running(gpu):
            await frame.finish()
    finally:
        async with gpu_running(gpu):
            await ex.aclose()


async def iterations(count: list[int], stop: anyio.Event) -> None:
    """Count the loop's iterations (asyncio) or scheduling batches (trio)."""
    while not stop.is_set():
        count[0] += 1
        await anyio.lowlevel.checkpoint()


@pytest.mark.timeout(60)
def test_executions_whose_gpu_work_ends_together_resume_within_the_loop_budget(
    backend: str,
) -> None:
    """32 executions wait for the end of their GPU work; it ends for all while the loop is
    busy. With a loop slice of 1 us, each loop iteration resumes about one of them (the
    LoopBudget defers the others), where all 32 resumed in one iteration before."""
    n = 32

    async def body() -> None:
        gpu = ThreadGpu(seed=3)
        sim = Sim(gpu)
        graph = chain(sim, 2)
        ex = Executor(graph, ExecutorConfig(adaptive_placement=False, loop_slice_s=1e-6,
                                            max_concurrent_executions=n),
                      kernel_factory=CudaNodes(), _cuda_backend=FakeBackend(gpu))
        runtime = ex.cuda_runtime
        assert runtime is not None
        waiter = runtime.waiter = HostWaiter(idle_s=0.05)
        runtime.poll = AT_ONCE
        ended_at: dict[int, int] = {}
        count = [0]

        async def call(k: int) -> None:
            out = await ex.execute(sim.upload(k))
            ended_at[k] = count[0]
            assert unwrap(out) == reference(graph, k)[0]

        stop = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(iterations, count, stop)
                async with anyio.create_task_group() as callers:
                    for k in range(n):
                        callers.start_soon(call, k)
                    await until(lambda: waiter.pending == n, "every execution awaits its end")
                    gpu.drain()  # the GPU work of all ends at once
                    hold_the_loop(lambda: waiter.pending == 0, "every completion queued")
                stop.set()
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        per_iteration: dict[int, int] = {}
        for at in ended_at.values():
            per_iteration[at] = per_iteration.get(at, 0) + 1
        assert len(ended_at) == n
        assert max(per_iteration.values()) <= 4, sorted(per_iteration.items())
        await settled(waiter)

    run(body, backend)

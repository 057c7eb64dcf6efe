"""The host's wait for GPU events (cuda/device.py `wait_events`, cuda/host_wait.py) on the
simulated GPU of support/fake_gpu.py, whose events' `synchronize` blocks a thread until the
simulation runs their record (and is an error on the loop's thread, which drives it).

What a wait does is asserted, never how long it takes (benchmarks/gpu_wait.py times it):

- a wait that outlasts the spin goes to the waiter thread, which blocks in `synchronize` while
  the loop runs other tasks, and returns once the event completed; one that completes within
  the spin never wakes the thread; every event is synchronized exactly once;
- the wait asks the loop for no timer (asyncio's selector loop and trio round a timeout above
  zero up to 1 ms: issue 36, item 1), where the old policy (`thread=False`) asks for several;
- a site (`WaitSite`) of short waits is polled to completion, one of long waits goes to the
  thread early and is polled again near its expected end, where the loop sees the end
  without the thread's wake; a site learns when the GPU finished, not when the loop woke;
- a cancelled wait leaves no entry and no blocking thread beyond the waiter's one; an
  abandoned event that never completes does not hold up later waits; a wait queued behind a
  longer one returns once its own event completed, found by the waiter's poll thread, not by
  the loop (tests/integration/test_gpu_waits.py: what the loop does with many waits);
- the thread ends when idle, and when the runtime is closed;
- on asyncio and trio, an execution's host waits go through the thread and give the right
  results, and an error `synchronize` raises on the thread fails the node that waited.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.cuda.device import PollPolicy, WaitSite, wait_events
from asyncgraph.cuda.host_wait import THREAD_NAME, HostWaiter, shared_waiter
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
)
from tests.support.gpu_graphs import host_reader_graph, reference
from tests.support.loop_turns import LoopTurns

AT_ONCE = PollPolicy(spin_s=0.0, spin_max_s=0.0)  # to the thread after one poll, always
OLD = PollPolicy(thread=False)  # the sleeping poll of before issue 36


class ThreadEvent(FakeEvent):
    """A FakeEvent that notes the thread each `synchronize` ran on."""

    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__(gpu)
        self.threads: list[str] = []

    def synchronize(self) -> None:
        super().synchronize()
        self.threads.append(threading.current_thread().name)


class GatedEvent(ThreadEvent):
    """A ThreadEvent whose `synchronize` on the waiter thread returns only once `gate` is
    set (after the event completed): the loop, not the thread, sees the completion."""

    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__(gpu)
        self.gate = threading.Event()

    def synchronize(self) -> None:
        if threading.current_thread().name == THREAD_NAME:
            FakeEvent.synchronize(self)
            assert self.gate.wait(30)
            self.threads.append(THREAD_NAME)
        else:
            super().synchronize()


def pending_event(gpu: FakeGpu, name: str) -> tuple[ThreadEvent, FakeStream]:
    """An event recorded on a stream of its own: it completes when that stream is stepped."""
    stream = gpu.stream(name)
    event = ThreadEvent(gpu)
    event.record(stream)
    return event, stream


async def turns(condition: Callable[[], bool]) -> None:
    """Yield to the loop (zero-timeout checkpoints, no timer) until `condition()`."""
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110 (set by a thread or by the loop's turns)
            await asyncio.sleep(0)


async def settled(waiter: HostWaiter) -> None:
    """Until the waiter's thread(s) ended (idle, or closed)."""
    await until(lambda: not waiter.threads, "the waiter thread ended")


# -- where a wait waits ----------------------------------------------------------------------


async def test_a_wait_past_the_spin_blocks_on_the_waiter_thread_while_the_loop_runs() -> None:
    gpu = FakeGpu()
    event, stream = pending_event(gpu, "s")
    waiter = HostWaiter(idle_s=0.05)
    async with LoopTurns() as loop_turns:
        task = asyncio.create_task(wait_events([event], AT_ONCE, waiter))
        await turns(lambda: gpu.sync_waits == 1)  # the thread blocks in synchronize
        assert [t.name for t in waiter.threads] == [THREAD_NAME]
        assert waiter.pending == 1
        before = loop_turns.count
        await turns(lambda: loop_turns.count > before + 5)  # the loop runs other tasks
        assert not task.done()
        assert gpu.step_stream(stream)  # the record runs: synchronize returns, the loop wakes
        await task
    assert event.synchronized == 1 and event.threads == [THREAD_NAME]
    assert (waiter.handed, waiter.started, waiter.pending) == (1, 1, 0)
    await settled(waiter)  # idle for idle_s: the thread ends by itself


async def test_a_wait_completed_within_the_spin_never_wakes_the_thread() -> None:
    gpu = FakeGpu()
    event, stream = pending_event(gpu, "s")
    waiter = HostWaiter()
    task = asyncio.create_task(wait_events([event], PollPolicy(spin_s=60.0), waiter))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done()
    gpu.step_stream(stream)
    await task
    assert event.threads == [threading.current_thread().name]  # the loop's, at once
    assert (waiter.handed, waiter.started, waiter.threads) == (0, 0, [])


async def test_each_event_is_synchronized_once_whoever_waited_for_it() -> None:
    """Three events: one complete before the wait, one during the spin, one on the thread;
    `synchronize` orders the host after each (the CUDA sanitizer's happens-before)."""
    gpu = FakeGpu()
    done, s0 = pending_event(gpu, "s0")
    gpu.step_stream(s0)
    soon, s1 = pending_event(gpu, "s1")
    late, s2 = pending_event(gpu, "s2")
    waiter = HostWaiter(idle_s=0.05)
    task = asyncio.create_task(wait_events([done, soon, late], PollPolicy(spin_s=60.0), waiter))
    await asyncio.sleep(0)
    gpu.step_stream(s1)
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()  # the spin ends only with the events: start over, handing off at once
    with pytest.raises(asyncio.CancelledError):
        await task
    task = asyncio.create_task(wait_events([done, soon, late], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 1)
    gpu.step_stream(s2)
    await task
    loop_thread = threading.current_thread().name
    assert (done.threads, soon.threads, late.threads) == ([loop_thread], [loop_thread],
                                                         [THREAD_NAME])
    await settled(waiter)


async def test_the_wait_asks_the_loop_for_no_timer() -> None:
    """asyncio's selector loop rounds a timer above zero up to 1 ms of epoll_wait (trio's
    does too): the old policy's sleeps asked for one after every poll past the spin; the
    wait now asks for none (its checkpoints are zero-timeout, its wake comes from a thread)."""
    loop = asyncio.get_running_loop()
    if type(loop).__module__.startswith("uvloop"):
        pytest.skip("uvloop's timers are not patchable (a Cython class); asyncio shows it")
    gpu = FakeGpu()
    timers: list[float] = []
    waiting: set[asyncio.Task[Any]] = set()
    call_later = loop.call_later

    def recording_call_later(delay: float, *args: Any, **kwargs: Any) -> Any:
        # the delay asked for, not `when - loop.time()` read later: a preempted test thread
        # would read a timer asked for 12 us as one already due
        if asyncio.current_task() in waiting:
            timers.append(delay)
        return call_later(delay, *args, **kwargs)

    loop.call_later = recording_call_later  # type: ignore[method-assign,assignment]  # sleeps too
    try:
        for policy in (OLD, AT_ONCE):
            timers.clear()
            event, stream = pending_event(gpu, f"s{policy.thread}")
            waiter = HostWaiter(idle_s=0.05)
            task = asyncio.create_task(wait_events([event], policy, waiter))
            waiting.add(task)
            if policy.thread:  # until the thread blocks in synchronize
                await turns(lambda: gpu.sync_waits == 1)
            else:  # until it has slept a few times
                await turns(lambda: len(timers) >= 3)
            gpu.step_stream(stream)
            await task
            if policy.thread:
                assert timers == [] and event.threads == [THREAD_NAME]
            else:
                assert len(timers) >= 3 and all(t > 0 for t in timers)
                assert waiter.handed == 0
            await settled(waiter)
    finally:
        del loop.call_later


# -- how long the loop polls: measured per site --------------------------------------------------


def test_a_site_of_short_waits_is_polled_to_completion_and_one_of_long_waits_is_not() -> None:
    policy = PollPolicy()  # spin_s 100 us, spin_max_s 1 ms
    site = WaitSite()
    assert site.spin_s(policy) == policy.spin_s  # nothing measured yet
    site.record(300e-6)
    assert site.spin_s(policy) == pytest.approx(450e-6)  # past what it lasts: caught on the loop
    for _ in range(20):
        site.record(5e-3)
    assert site.spin_s(policy) == policy.spin_s  # long: to the thread early
    for _ in range(40):
        site.record(20e-6)
    assert site.spin_s(policy) == policy.spin_s  # very short: the minimum
    site.record(5e-3)  # one outlier among the last nine moves nothing
    assert site.spin_s(policy) == policy.spin_s
    for _ in range(5):
        site.record(900e-6)
    assert site.spin_s(policy) == policy.spin_max_s  # 1.5 x 900 us, capped
    assert site.spin_s(PollPolicy(spin_s=0.0, spin_max_s=0.0)) == 0.0
    assert site.resume_s(policy) is None  # short: polled throughout
    long = WaitSite()
    assert long.resume_s(policy) is None  # not measured yet
    long.record(5e-3)
    assert long.resume_s(policy) == pytest.approx(4e-3)  # spin_max_s before the expected end


async def test_a_long_sites_wait_is_caught_by_the_loop_near_its_expected_end() -> None:
    """The wait goes to the thread at once, and the loop polls again from spin_max_s before
    the end its site expects: the event completing then is seen by the loop, which returns
    without the thread's wake; the thread, no longer awaited, is not retired for it."""
    gpu = FakeGpu()
    stream = gpu.stream("s")
    event = GatedEvent(gpu)  # the thread's synchronize returns only once the gate opens
    event.record(stream)
    waiter = HostWaiter(idle_s=60.0)
    policy = PollPolicy(spin_s=0.0, spin_max_s=0.5)  # a window no stall of the host outlasts
    site = WaitSite()
    site.record(0.55)  # polled again 50 ms after the wait began, for at most 1 s
    task = asyncio.create_task(wait_events([event], policy, waiter, site))
    await turns(lambda: gpu.sync_waits == 1 and waiter.resumed == 1)
    assert not task.done() and waiter.pending == 1
    gpu.step_stream(stream)
    await task  # the thread still blocks: the loop saw the event complete
    assert event.threads == [threading.current_thread().name]
    assert (waiter.taken_back, waiter.pending, waiter.started) == (0, 0, 1)
    event.gate.set()
    await turns(lambda: len(event.threads) == 2)  # nobody to wake: the thread goes on
    second, stream = pending_event(gpu, "s2")
    task = asyncio.create_task(wait_events([second], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 2)
    gpu.step_stream(stream)
    await task
    assert second.threads == [THREAD_NAME] and waiter.started == 1  # the same thread
    waiter.close()
    await settled(waiter)


async def test_a_site_learns_when_the_gpu_finished_not_when_the_loop_woke() -> None:
    """A wait the thread took counts until its synchronize returned (HostWaiter.wait's
    result), not until the loop woke: a slow wake does not make a site look long."""
    gpu = FakeGpu()
    event, stream = pending_event(gpu, "s")
    waiter = HostWaiter(idle_s=0.05)
    task = asyncio.create_task(waiter.wait([event]))
    await turns(lambda: gpu.sync_waits == 1)
    stepped = time.perf_counter()
    gpu.step_stream(stream)
    time.sleep(0.2)  # noqa: ASYNC251 (the loop wakes late, on purpose)
    completed = await task
    assert stepped <= completed < stepped + 0.1  # half the late wake: the thread's own wake
    assert time.perf_counter() >= stepped + 0.2
    second, stream = pending_event(gpu, "s2")
    site = WaitSite()
    started = time.perf_counter()
    task = asyncio.create_task(wait_events([second], AT_ONCE, waiter, site))
    await turns(lambda: gpu.sync_waits == 2)
    gpu.step_stream(stream)
    time.sleep(0.2)  # noqa: ASYNC251
    await task
    assert site.waits == 1 and site.expected_s is not None
    # The late wake (0.2 s) is not counted; half of it is the margin for the thread's own
    # wake after the step, which a loaded machine delays (0.4 ms more than the sleep's
    # overshoot failed the tighter bound once).
    assert site.expected_s < time.perf_counter() - started - 0.1
    await settled(waiter)


# -- cancellation, abandoned events, head-of-line -----------------------------------------------


@pytest.mark.parametrize("where", ["blocked on by the thread", "queued"])
async def test_a_cancelled_wait_leaves_no_entry_and_no_extra_thread(where: str) -> None:
    gpu = FakeGpu()
    first, s1 = pending_event(gpu, "s1")
    second, s2 = pending_event(gpu, "s2")
    waiter = HostWaiter(idle_s=0.05)
    head = asyncio.create_task(wait_events([first], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 1)
    if where == "queued":
        cancelled = asyncio.create_task(wait_events([second], AT_ONCE, waiter))
        await turns(lambda: waiter.pending == 2)
    else:
        cancelled = head
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert waiter.pending == (1 if where == "queued" else 0)
    # no second blocking thread; a wait queued behind the first had the poll thread started
    assert (waiter.started, waiter.pollers_started) == (1, int(where == "queued"))
    gpu.step_stream(s1)  # the thread's synchronize returns: it wakes the head, if it waits
    gpu.step_stream(s2)
    if where == "queued":
        await head
    await settled(waiter)
    assert (waiter.pending, waiter.started) == (0, 1)
    assert second.synchronized == 0  # nobody waited for it any more


async def test_a_wait_does_not_queue_behind_an_abandoned_event() -> None:
    """The thread blocks on an event whose wait was cancelled and that does not complete (a
    GPU left paused): the next wait retires that thread and gets a fresh one; the retired
    thread ends once its event completes."""
    gpu = FakeGpu()
    abandoned, s1 = pending_event(gpu, "s1")
    waiter = HostWaiter(idle_s=0.05)
    task = asyncio.create_task(wait_events([abandoned], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    event, s2 = pending_event(gpu, "s2")
    task = asyncio.create_task(wait_events([event], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 2)
    assert (waiter.started, len(waiter.threads), waiter.pending) == (2, 2, 1)
    gpu.step_stream(s2)
    await task
    assert event.threads == [THREAD_NAME] and waiter.taken_back == 0
    gpu.step_stream(s1)
    await settled(waiter)


async def test_a_wait_queued_behind_a_longer_one_returns_when_its_own_event_completes() -> None:
    """Head-of-line: the thread blocks on the first wait's event; the second, queued behind
    it, is polled meanwhile by the waiter's poll thread (not by the loop: another wait is
    outstanding), which takes its entry back once it completed."""
    gpu = FakeGpu()
    long, s1 = pending_event(gpu, "s1")
    short, s2 = pending_event(gpu, "s2")
    waiter = HostWaiter(idle_s=0.05)
    first = asyncio.create_task(wait_events([long], AT_ONCE, waiter))
    await turns(lambda: gpu.sync_waits == 1)
    second = asyncio.create_task(wait_events([short], AT_ONCE, waiter))
    await turns(lambda: waiter.pending == 2)
    polled = gpu.loop_queries
    gpu.step_stream(s2)
    await second
    assert short.threads == [f"{THREAD_NAME}-poll"] and waiter.taken_back == 1
    assert gpu.loop_queries == polled  # the loop did not poll it
    assert not first.done() and waiter.pending == 1
    gpu.step_stream(s1)
    await first
    assert long.threads == [THREAD_NAME]
    await settled(waiter)


# -- the thread's lifetime ---------------------------------------------------------------------


async def test_closing_the_runtime_ends_the_waiter_thread() -> None:
    gpu = ThreadGpu()
    sim = Sim(gpu)
    graph = host_reader_graph(sim, "inline")
    ex = Executor(graph, ExecutorConfig(adaptive_placement=False), kernel_factory=CudaNodes(),
                  _cuda_backend=FakeBackend(gpu))
    runtime = ex.cuda_runtime
    assert runtime is not None and runtime.waiter is shared_waiter()
    waiter = runtime.waiter = HostWaiter(idle_s=3600.0)  # would never end on its own
    runtime.poll = AT_ONCE
    try:
        async with gpu_running(gpu):
            assert await ex.execute(sim.upload(1)) == reference(graph, 1)[0]
        assert waiter.handed >= 1 and len(waiter.threads) == 1
        runtime.close()
        await settled(waiter)
        async with gpu_running(gpu):  # a later wait starts a new one
            assert await ex.execute(sim.upload(2)) == reference(graph, 2)[0]
        assert waiter.started == 2
    finally:
        async with gpu_running(gpu):
            await ex.aclose()
        runtime.close()
    await settled(waiter)


def test_an_idle_waiter_holds_no_thread() -> None:
    waiter = HostWaiter()
    assert waiter.threads == [] and waiter.join(0)
    waiter.close()  # nothing to end
    assert waiter.started == 0


# -- executions, on asyncio and trio -----------------------------------------------------------


def executor(gpu: ThreadGpu, sim: Sim, backend: FakeBackend) -> tuple[Executor, HostWaiter]:
    ex = Executor(host_reader_graph(sim, "inline"), ExecutorConfig(adaptive_placement=False),
                  kernel_factory=CudaNodes(), _cuda_backend=backend)
    assert ex.cuda_runtime is not None
    waiter = ex.cuda_runtime.waiter = HostWaiter(idle_s=0.05)
    ex.cuda_runtime.poll = AT_ONCE
    return ex, waiter


@pytest.mark.timeout(60)
def test_an_executions_host_waits_go_through_the_waiter_thread(backend: str) -> None:
    async def body() -> None:
        gpu = ThreadGpu()
        sim = Sim(gpu)
        ex, waiter = executor(gpu, sim, FakeBackend(gpu))
        try:
            async with gpu_running(gpu):
                results = [await ex.execute(sim.upload(k)) for k in range(4)]
                concurrent: dict[int, Any] = {}

                async def call(k: int) -> None:
                    concurrent[k] = await ex.execute(sim.upload(k))

                async with anyio.create_task_group() as group:
                    for k in range(4, 8):
                        group.start_soon(call, k)
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        assert results == [2 * k + 1 for k in range(4)]
        assert concurrent == {k: 2 * k + 1 for k in range(4, 8)}
        runtime = ex.cuda_runtime
        assert runtime is not None
        assert runtime.finish_site.waits >= 1  # the waits measured per site
        assert sum(s.waits for s in runtime.host_sites if s is not None) >= 1
        assert waiter.handed >= 4 and gpu.errors == []
        await settled(waiter)
        # every handed wait was synchronized by the thread or found complete by its own task
        # first (whether the thread ever blocks depends on how fast the simulation runs)
        assert waiter.synchronized + waiter.taken_back == waiter.handed

    run(body, backend)


class SyncFaultEvent(FakeEvent):
    """An event whose `synchronize` reports a CUDA error once `gpu.sync_fault` is set (the
    error goes to the first synchronize that sees it; `query` never reports it): the error
    reaches the host only through the waiter thread."""

    def synchronize(self) -> None:
        gpu: Any = self.gpu
        gpu.wait_until(lambda: self.query() or gpu.sync_fault)
        if gpu.sync_fault:
            gpu.sync_fault = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().synchronize()


class SyncFaultBackend(FakeBackend):
    def new_event(self) -> SyncFaultEvent:
        return SyncFaultEvent(self.gpu)


@pytest.mark.timeout(60)
def test_an_error_synchronize_raises_on_the_thread_fails_the_node(backend: str) -> None:
    """The GPU faults while the thread blocks on the host node's input: cudaEventSynchronize
    reports it on the thread, and it is the error of the node that waited."""

    async def body() -> None:
        gpu: Any = ThreadGpu()
        gpu.sync_fault = False
        sim = Sim(gpu)
        ex, waiter = executor(gpu, sim, SyncFaultBackend(gpu))
        failures: list[BaseException] = []

        async def call() -> None:
            try:
                await ex.execute(sim.upload(1))
            except RuntimeError as exc:
                failures.append(exc)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await until(lambda: gpu.sync_waits >= 1, "the thread blocks on host_add's input")
                gpu.sync_fault = True
                await until(lambda: not gpu.sync_fault, "the thread saw the fault")
                async with gpu_running(gpu):  # the execution's finish waits for the GPU
                    await until(lambda: bool(failures), "the execution failed")
            [error] = failures
            assert "illegal memory access" in str(error)
            assert any("%host_add" in note for note in getattr(error, "__notes__", []))
            frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
            assert "_serve" in frames  # raised on the waiter thread
            assert "add_one" not in sim.host_threads  # the node never ran
            assert ex.statistics().frames.in_use == 0
            async with gpu_running(gpu):  # the executor is still usable
                assert await ex.execute(sim.upload(2)) == 5
        finally:
            async with gpu_running(gpu):
                await ex.aclose()
        await settled(waiter)

    run(body, backend)

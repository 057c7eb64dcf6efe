"""WorkerPool and its ReadyQueue: order, stop tokens, statistics."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.runtime.workers import ReadyQueue, WorkerPool

pytestmark = pytest.mark.usefixtures("leak_check")


def _noop(frame: Any, unit: int) -> None:
    pass


def _parking() -> threading.Lock:
    """A worker thread's parking lock: held, so that get() blocks on it when nothing is queued."""
    lock = threading.Lock()
    lock.acquire()
    return lock


def test_the_queue_is_fifo_between_submissions_and_by_key_within_one() -> None:
    q = ReadyQueue()
    q.put([(-1.0, (_noop, None, 0)), (-5.0, (_noop, None, 1)), (-1.0, (_noop, None, 2))])
    q.put([(-9.0, (_noop, None, 3)), (-2.0, (_noop, None, 4))])
    assert len(q) == 5
    units = []
    parking = _parking()
    for _ in range(5):
        item = q.get(parking)
        assert item is not None
        units.append(item[2])
    # the first submission before the second; in each the most work ahead first, ties FIFO
    assert units == [1, 0, 2, 3, 4]
    assert len(q) == 0


def test_stop_tokens_come_after_the_items_queued_before() -> None:
    q = ReadyQueue()
    q.put([(0.0, (_noop, None, 7))])
    q.stop(2)
    parking = _parking()
    item = q.get(parking)
    assert item is not None and item[2] == 7
    assert q.get(parking) is None and q.get(parking) is None


def test_a_submission_wakes_the_thread_that_parked_last() -> None:
    """Parked threads are woken latest first: one caller's work stays on one warm thread."""
    q = ReadyQueue()
    taken: list[str] = []

    def take(name: str) -> None:
        parking = _parking()
        while (item := q.get(parking)) is not None:
            taken.append(name)
            item[0](item[1], item[2])

    threads = [threading.Thread(target=take, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for unit in range(12):
            _wait_until(lambda: q.parked == 3)  # the last one back has parked again
            done = threading.Event()
            q.put([(0.0, (lambda frame, unit, done=done: done.set(), None, unit))])
            assert done.wait(10)
        _wait_until(lambda: q.parked == 3)
        assert len(set(taken)) == 1, taken  # FIFO wake-ups went round all three threads
    finally:
        q.stop(3)
        for t in threads:
            t.join(10)
    assert not any(t.is_alive() for t in threads) and q.parked == 0


def _wait_until(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0005)


async def test_a_pool_runs_the_units_of_one_submission_lowest_key_first() -> None:
    pool = WorkerPool(1)
    entered, gate, done = threading.Event(), threading.Event(), threading.Event()
    order: list[int] = []

    def block(frame: Any, unit: int) -> None:
        entered.set()
        gate.wait(10)

    def record(frame: Any, unit: int) -> None:
        order.append(unit)
        if len(order) == 3:
            done.set()

    try:
        pool.submit(block, None, [(0.0, 0)])
        assert entered.wait(10)  # the only thread is busy until the gate opens
        pool.submit(record, None, [(-1.0, 1), (-3.0, 3), (-2.0, 2)])
        assert pool.statistics().queued == 3
        gate.set()
        assert done.wait(10)
        assert order == [3, 2, 1]
    finally:
        gate.set()
        await pool.aclose()
    stats = pool.statistics()
    assert stats.threads == 0 and stats.queued == 0 and stats.items_run == 4


needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread CPU affinity is Linux-only"
)


def _run_one_item_per_thread(
    pool: WorkerPool, probe: Callable[[], Any] = lambda: os.sched_getaffinity(0)
) -> dict[str, Any]:
    """What `probe` (by default the CPU affinity) reads in each thread, all busy at once."""
    barrier = threading.Barrier(pool.size, timeout=10)
    seen: dict[str, Any] = {}
    done = threading.Event()

    def record(frame: Any, unit: int) -> None:
        seen[threading.current_thread().name] = probe()
        barrier.wait()  # every thread takes exactly one item
        if len(seen) == pool.size:
            done.set()

    pool.submit(record, None, [(0.0, i) for i in range(pool.size)])
    assert done.wait(10)
    return seen


@needs_affinity
async def test_pinned_workers_each_run_on_one_cpu_of_their_own() -> None:
    allowed = os.sched_getaffinity(0)
    pool = WorkerPool(2, pin=True)
    try:
        seen = _run_one_item_per_thread(pool)
        cpus = pool.statistics().cpus
    finally:
        await pool.aclose()
    assert all(len(s) == 1 and s <= allowed for s in seen.values()), seen
    assert sorted(c for s in seen.values() for c in s) == sorted(cpus)
    if len(allowed) >= 2:
        assert len(set(cpus)) == 2
    assert pool.statistics().cpus == ()  # closed


@needs_affinity
async def test_workers_are_not_pinned_by_default() -> None:
    pool = WorkerPool(2)
    try:
        seen = _run_one_item_per_thread(pool)
        assert pool.statistics().cpus == ()
    finally:
        await pool.aclose()
    assert all(s == os.sched_getaffinity(0) for s in seen.values())


@needs_affinity
async def test_the_executor_pins_its_workers_when_configured() -> None:
    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda v: v + 1, x, name="step", placement="worker"))
    config = ExecutorConfig(max_parallel_ops=2, pin_workers=True)
    async with Executor(b.build(), config) as ex:
        assert await ex.execute(1) == 2
        assert len(ex.statistics().workers.cpus) == 2


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


@linux_only
async def test_workers_step_back_by_their_nice_and_the_loop_keeps_its_own() -> None:
    base = _own_nice()
    pool = WorkerPool(2, nice=3)
    try:
        seen = _run_one_item_per_thread(pool, _own_nice)
        assert pool.statistics().nice == 3
    finally:
        await pool.aclose()
    assert sorted(seen.values()) == [min(19, base + 3)] * 2
    assert _own_nice() == base  # the calling thread, the loop's, is left as it was


@linux_only
async def test_nice_zero_leaves_workers_as_they_are() -> None:
    pool = WorkerPool(2, nice=0)
    try:
        assert set(_run_one_item_per_thread(pool, _own_nice).values()) == {_own_nice()}
    finally:
        await pool.aclose()


def _own_policy() -> int:
    return os.sched_getscheduler(0)  # 0: the calling thread


@linux_only
async def test_idle_workers_run_under_sched_idle_and_the_loop_keeps_its_policy() -> None:
    policy = _own_policy()
    pool = WorkerPool(2, nice=3, idle=True)
    try:
        seen = _run_one_item_per_thread(pool, lambda: (_own_policy(), _own_nice()))
        stats = pool.statistics()
    finally:
        await pool.aclose()
    assert set(seen.values()) == {(os.SCHED_IDLE, _own_nice())}  # idle, and not niced too
    assert (stats.sched_idle, stats.nice) == (True, 0)
    assert _own_policy() == policy != os.SCHED_IDLE


@linux_only
async def test_executors_default_to_workers_at_nice_five_and_idle_on_request() -> None:
    b = GraphBuilder()
    b.output(b.call(lambda v: v + 1, b.input("x"), name="step", placement="worker"))
    graph = b.build()
    async with Executor(graph) as ex:
        assert await ex.execute(1) == 2
        workers = ex.statistics().workers
        assert not workers.sched_idle and not ExecutorConfig().worker_idle
        assert workers.nice == ExecutorConfig().worker_nice == 5
    async with Executor(graph, ExecutorConfig(worker_idle=True)) as ex:
        assert await ex.execute(1) == 2
        workers = ex.statistics().workers
        assert (workers.sched_idle, workers.nice) == (True, 0)


def _run_items(pool: WorkerPool, count: int, seconds: float) -> None:
    """`count` items that each keep their thread busy for `seconds`, run to the end."""
    done = threading.Semaphore(0)

    def busy(frame: Any, unit: int) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
        done.release()

    pool.submit(busy, None, [(0.0, i) for i in range(count)])
    for _ in range(count):
        assert done.acquire(timeout=10)


needs_sched_yield = pytest.mark.skipif(not hasattr(os, "sched_yield"), reason="POSIX's call")


@needs_sched_yield
async def test_a_worker_steps_aside_once_it_has_run_items_for_its_yield_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append(threading.get_native_id()))
    pool = WorkerPool(1, yield_s=0.002)
    try:
        _run_items(pool, 40, 0.00025)  # 10 ms of items: a yield about every 8
        stats = pool.statistics()
    finally:
        await pool.aclose()
    assert stats.yield_s == 0.002
    assert 2 <= stats.yields == len(calls) <= 20, calls  # not after every item
    assert threading.get_native_id() not in calls  # on the worker, never the caller


@needs_sched_yield
async def test_workers_with_no_yield_time_or_idle_never_step_aside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append(1))
    pools = [WorkerPool(1, yield_s=0.0)]
    if sys.platform == "linux":  # SCHED_IDLE's workers give way at once anyway
        pools.append(WorkerPool(1, yield_s=0.001, idle=True))
    for pool in pools:
        try:
            _run_items(pool, 5, 0.002)
            assert pool.statistics().yields == 0
        finally:
            await pool.aclose()
    assert calls == []


async def test_executors_default_to_workers_that_step_aside_every_two_ms() -> None:
    b = GraphBuilder()
    b.output(b.call(lambda v: v + 1, b.input("x"), name="step", placement="worker"))
    async with Executor(b.build()) as ex:
        assert await ex.execute(1) == 2
        assert ex.statistics().workers.yield_s == ExecutorConfig().worker_yield_s == 0.002
    async with Executor(b.build(), ExecutorConfig(worker_yield_s=0)) as ex:
        assert await ex.execute(1) == 2
        assert ex.statistics().workers.yield_s == 0
    with pytest.raises(ValueError, match="worker_yield_s"):
        ExecutorConfig(worker_yield_s=-1)

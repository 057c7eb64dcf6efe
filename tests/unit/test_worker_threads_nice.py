"""Threads started from a niced worker run at the loop's nice value, not the worker's.

Linux threads start with their creator's nice value, and an unprivileged thread cannot lower
its own again: a helper thread started from a worker (ExecutorConfig.worker_nice) would run
niced for life unless something un-niced starts it (asyncgraph/runtime/threads.py).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.fx

from asyncgraph.compiled import scripted
from asyncgraph.compiled.scripted import ScriptedDelegate
from asyncgraph.runtime.workers import WorkerPool

T = TypeVar("T")
NICE = 3  # what the workers of these tests add to their nice value

ON_ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])  # thread-level: one loop is enough


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _can_step_back() -> bool:
    """Whether a thread of this process may raise its nice value by NICE (not at the ceiling,
    setpriority allowed)."""
    allowed: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICE)
        except OSError:
            allowed.append(False)
            return
        allowed.append(True)

    if _own_nice() + NICE > 19:
        return False
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return allowed == [True]


pytestmark = [
    pytest.mark.usefixtures("leak_check"),
    pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's"),
    pytest.mark.skipif(sys.platform == "linux" and not _can_step_back(),
                       reason="this process's threads cannot raise their nice value"),
    ON_ASYNCIO,
]


def _on_a_worker(pool: WorkerPool, fn: Callable[[], T]) -> T:
    """`fn()` run as a work item of one of `pool`'s threads; what it returned or raised."""
    results: list[T] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def item(frame: Any, unit: int) -> None:
        try:
            results.append(fn())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    pool.submit(item, None, [(0.0, 0)])
    assert done.wait(10), "the work item did not run"
    if errors:
        raise errors[0]
    return results[0]


async def test_a_pool_started_from_a_niced_worker_steps_back_from_the_loop_once() -> None:
    loop_nice = _own_nice()
    outer, inner = WorkerPool(1, nice=NICE), WorkerPool(1, nice=NICE)
    try:
        # an Executor whose first execution runs inside another's worker (asyncio.run in a
        # kernel): its pool starts there, and its workers must not add NICE twice
        seen = _on_a_worker(outer, lambda: _on_a_worker(inner, _own_nice))
    finally:
        await inner.aclose()
        await outer.aclose()
    assert seen == loop_nice + NICE


class _AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x + 1,)


async def test_the_scripted_tracer_started_from_a_worker_runs_at_the_loops_nice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop_nice = _own_nice()
    tracer_nice: list[int] = []

    def trace(module: Any, inputs: Any, **kwargs: Any) -> Any:
        tracer_nice.append(_own_nice())
        return module  # what a refused trace runs: the fx module

    monkeypatch.setattr(scripted, "_TRACE", trace)
    delegate = ScriptedDelegate("segment", torch.fx.symbolic_trace(_AddOne()), [0], ["add"])
    pool = WorkerPool(1, nice=NICE)
    try:
        worker_nice = _on_a_worker(pool, lambda: (delegate(torch.ones(2)), _own_nice())[1])
        assert delegate.wait_idle(10), "the trace did not end"
    finally:
        await pool.aclose()
    assert worker_nice == loop_nice + NICE  # the call did run on a niced worker
    assert tracer_nice == [loop_nice]


async def test_the_onnx_builder_started_from_a_worker_runs_at_the_loops_nice() -> None:
    pytest.importorskip("onnxruntime")
    from asyncgraph.compiled.onnx_delegate import OnnxDelegate
    from asyncgraph.compiled.onnx_export import OnnxModel

    loop_nice = _own_nice()
    model = OnnxModel(b"", ("x",), (False,), ("y",), decomposed=False)
    delegate = OnnxDelegate("segment", torch.fx.symbolic_trace(_AddOne()), model, ["add"])
    builder_nice: list[int] = []
    # the builder thread's target, read when the thread is made: record, build nothing
    delegate._build_pending = lambda: builder_nice.append(_own_nice())  # type: ignore[method-assign]
    pool = WorkerPool(1, nice=NICE)
    try:
        _on_a_worker(pool, lambda: delegate(torch.ones(2)))
        assert delegate.wait_idle(10), "the builder thread did not end"
    finally:
        await pool.aclose()
    assert builder_nice == [loop_nice], "no builder thread ran, or not at the loop's nice"


async def test_a_thread_started_through_start_thread_on_a_niced_worker_is_not_niced() -> None:
    from asyncgraph.runtime.threads import start_thread

    loop_nice = _own_nice()
    seen: list[int] = []

    def started_from_the_worker() -> tuple[int, int]:
        thread = threading.Thread(target=lambda: seen.append(_own_nice()), name="helper")
        start_thread(thread)
        thread.join(10)
        return _own_nice(), len(seen)

    pool = WorkerPool(1, nice=NICE)
    try:
        assert _on_a_worker(pool, started_from_the_worker) == (loop_nice + NICE, 1)
        # and from an un-niced thread, directly
        started_from_the_worker()
    finally:
        await pool.aclose()
    assert seen == [loop_nice, loop_nice]


async def test_a_thread_started_through_start_thread_on_an_idle_worker_is_not_idle() -> None:
    from asyncgraph.runtime.threads import SCHED_IDLE, start_thread

    if SCHED_IDLE is None:
        pytest.skip("no SCHED_IDLE on this platform")
    loop_policy = os.sched_getscheduler(0)
    seen: list[int] = []

    def started_from_the_worker() -> tuple[int, int]:
        thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        start_thread(thread)
        thread.join(10)
        return os.sched_getscheduler(0), len(seen)

    pool = WorkerPool(1, idle=True)
    try:
        assert _on_a_worker(pool, started_from_the_worker) == (SCHED_IDLE, 1)
    finally:
        await pool.aclose()
    assert seen == [loop_policy] and loop_policy != SCHED_IDLE


async def test_a_thread_that_cannot_start_raises_in_its_starter() -> None:
    from asyncgraph.runtime.threads import start_thread

    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    pool = WorkerPool(1, nice=NICE)
    try:
        with pytest.raises(RuntimeError, match="once"):  # "threads can only be started once"
            _on_a_worker(pool, lambda: start_thread(thread))
    finally:
        await pool.aclose()


async def test_only_niced_pools_keep_a_launcher_and_it_ends_with_the_last() -> None:
    def launchers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "asyncgraph-launcher"]

    before = launchers()
    plain = WorkerPool(1, nice=0)
    first, second = WorkerPool(1, nice=NICE), WorkerPool(1, nice=NICE)
    try:
        _on_a_worker(plain, lambda: None)
        assert launchers() == before
        _on_a_worker(first, lambda: None)
        _on_a_worker(second, lambda: None)
        assert len(launchers()) == max(1, len(before))  # one for the process
        await first.aclose()
        assert len(launchers()) == max(1, len(before))  # still held by `second`
    finally:
        await plain.aclose()
        await first.aclose()
        await second.aclose()
    # the leak check (its thread prefix is asyncgraph) sees the launcher gone


class _RecordingEvent:
    """A CUDA event stand-in, complete at once: its synchronize records the thread's nice."""

    def __init__(self) -> None:
        self.nice: list[int] = []

    def query(self) -> bool:
        return bool(self.nice)

    def synchronize(self) -> None:
        self.nice.append(_own_nice())


async def test_the_host_waiter_started_from_a_niced_thread_runs_at_the_loops_nice() -> None:
    import asyncio

    from asyncgraph.cuda.host_wait import HostWaiter

    loop_nice = _own_nice()
    waiter = HostWaiter(idle_s=0.01, name="asyncgraph-cuda-wait-test")
    event = _RecordingEvent()
    pool = WorkerPool(1, nice=NICE)
    try:
        # a loop run inside a kernel on a worker hands its first wait to a new waiter thread
        _on_a_worker(pool, lambda: asyncio.run(waiter.wait([event])))
        waiter.close()
        assert waiter.join(10), "the waiter thread did not end"
    finally:
        await pool.aclose()
    assert event.nice == [loop_nice]

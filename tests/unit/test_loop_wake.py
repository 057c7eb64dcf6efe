"""LoopWake: calls from threads run on the asyncio loop, in order, woken without the GIL let go."""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import gc
import operator
import os
import threading
import time
from typing import Any

import pytest

from asyncgraph import Executor, GraphBuilder
from asyncgraph.runtime.backends import loop_wake
from asyncgraph.runtime.backends.loop_wake import LoopWake, threadsafe_call

ON_ASYNCIO = pytest.mark.asyncio(loop_factories=["asyncio"])  # the loop a LoopWake serves

pytestmark = [
    pytest.mark.usefixtures("leak_check"),
    pytest.mark.skipif(loop_wake._WRITE is None, reason="no C library for ctypes.PyDLL here"),
]


def _wake() -> LoopWake:
    wake = loop_wake.loop_wake(asyncio.get_running_loop())
    assert wake is not None
    return wake


async def _settled(wake: LoopWake) -> None:
    """Until the calls queued so far have run (the drain is one loop iteration away)."""
    for _ in range(100):
        if not wake.statistics().queued:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"calls still queued: {wake.statistics()}")


def test_the_pipe_is_written_by_a_c_call_that_keeps_the_gil() -> None:
    # PyDLL functions carry FUNCFLAG_PYTHONAPI: ctypes calls them without releasing the GIL,
    # which is the point of the module (CDLL's would release it, as socket.send does)
    assert loop_wake._WRITE is not None
    assert loop_wake._WRITE._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


@ON_ASYNCIO
async def test_one_wake_per_loop_and_it_is_the_runtimes_call_soon_threadsafe() -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
    wake = _wake()
    assert loop_wake.loop_wake(loop) is wake
    assert threadsafe_call(loop) == wake.call_soon_threadsafe

    def slow_double(v: int) -> int:
        time.sleep(0.001)  # two branches that overlap on the worker threads
        return 2 * v

    b = GraphBuilder()
    x = b.input("x")
    left = b.call(slow_double, x, name="left", placement="worker")
    right = b.call(slow_double, x, name="right", placement="worker")
    b.output(b.call(operator.add, left, right, name="sum"))
    ex = Executor(b.build())
    try:
        before = wake.statistics().calls
        for _ in range(3):
            assert await ex.execute(3) == 12
        # the worker that ends a branch last wakes the loop through the LoopWake
        assert wake.statistics().calls > before
        assert ex._loop is not None
        assert ex._loop.call_soon_threadsafe == wake.call_soon_threadsafe
    finally:
        await ex.aclose()


@ON_ASYNCIO
async def test_calls_from_threads_run_on_the_loop_in_order() -> None:
    wake = _wake()
    seen: list[tuple[int, int]] = []
    loop_thread = threading.get_ident()
    done = asyncio.Event()

    def record(thread: int, i: int) -> None:
        assert threading.get_ident() == loop_thread
        seen.append((thread, i))
        if len(seen) == 400:
            done.set()

    def producer(thread: int) -> None:
        for i in range(100):
            wake.call_soon_threadsafe(record, thread, i)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    await asyncio.wait_for(done.wait(), 10)
    for t in threads:
        t.join()
    for thread in range(4):  # each thread's calls in the order it made them
        assert [i for t, i in seen if t == thread] == list(range(100))


@ON_ASYNCIO
async def test_a_burst_of_calls_costs_one_wake() -> None:
    wake = _wake()
    before = wake.statistics()
    seen: list[int] = []
    for i in range(10):  # the loop cannot drain in between: this coroutine holds it
        wake.call_soon_threadsafe(seen.append, i)
    assert wake.statistics().queued == 10
    await _settled(wake)
    after = wake.statistics()
    assert seen == list(range(10))
    assert after.drains - before.drains == 1
    assert after.calls - before.calls == 10


@ON_ASYNCIO
async def test_a_call_that_raises_is_reported_and_the_next_ones_run() -> None:
    loop = asyncio.get_running_loop()
    wake = _wake()
    reported: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        seen: list[str] = []

        def boom() -> None:
            raise ValueError("boom")

        wake.call_soon_threadsafe(seen.append, "a")
        wake.call_soon_threadsafe(boom)
        wake.call_soon_threadsafe(seen.append, "b")
        await _settled(wake)
    finally:
        loop.set_exception_handler(old)
    assert seen == ["a", "b"]
    assert len(reported) == 1
    assert isinstance(reported[0]["exception"], ValueError)
    assert "boom" in repr(reported[0]["message"]) or "boom" in repr(reported[0]["exception"])


def test_a_closed_loop_refuses_calls_and_a_collected_one_closes_the_pipe() -> None:
    loop = asyncio.new_event_loop()
    try:
        call = loop.run_until_complete(_call_of_running_loop())
        wake = loop_wake._WAKES[loop]
        fds = (wake._read_fd, wake._write_fd)
        ran: list[int] = []
        loop.run_until_complete(_call_and_wait(call, ran))
        assert ran == [1]
    finally:
        loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(ran.append, 2)  # as asyncio's own call_soon_threadsafe raises
    del call, wake, loop
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


async def _call_of_running_loop() -> Any:
    return threadsafe_call(asyncio.get_running_loop())


async def _call_and_wait(call: Any, ran: list[int]) -> None:
    threading.Thread(target=call, args=(ran.append, 1)).start()
    for _ in range(1000):
        if ran:
            return
        await asyncio.sleep(0.001)


def test_other_loops_keep_their_own_call_soon_threadsafe() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = uvloop.new_event_loop()
    try:
        # uvloop wakes through libuv's uv_async_send with the GIL held already
        assert threadsafe_call(loop) == loop.call_soon_threadsafe
        assert loop_wake.loop_wake(loop) is None
    finally:
        loop.close()


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


@ON_ASYNCIO
async def test_each_call_runs_in_the_context_of_the_thread_that_made_it() -> None:
    wake = _wake()
    seen: list[str] = []

    def from_thread(name: str) -> None:
        REQUEST_ID.set(name)
        wake.call_soon_threadsafe(lambda: seen.append(REQUEST_ID.get()))
        REQUEST_ID.set(f"{name}, later")  # the call took a copy of the context when made

    REQUEST_ID.set("the loop's")  # not what the calls see
    threads = [threading.Thread(target=from_thread, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
        t.join()
    await _settled(wake)
    assert seen == ["a", "b"]

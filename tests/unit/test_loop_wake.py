"""LoopWake: calls from threads run on the asyncio loop, in order, woken without the GIL let go."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import gc
import operator
import os
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
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
        fds = (wake._pipe.read_fd, wake._pipe.write_fd)
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


# -- calls an interrupt leaves behind, and a pipe closed under its writers ----------------------


async def _wake_of_running_loop() -> LoopWake:
    return _wake()


def _interrupt(exc: type[BaseException]) -> None:
    raise exc


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_calls_queued_behind_an_interrupt_run_on_the_next_iteration(
    interrupt: type[BaseException],
) -> None:
    # asyncio's own call_soon_threadsafe leaves them in _ready for the next iteration; a
    # LoopWake that re-raised with no byte left in its pipe left them queued for good
    loop = asyncio.new_event_loop()
    try:
        wake = loop.run_until_complete(_wake_of_running_loop())
        seen: list[str] = []
        wake.call_soon_threadsafe(_interrupt, interrupt)
        wake.call_soon_threadsafe(seen.append, "a")
        wake.call_soon_threadsafe(seen.append, "b")
        with pytest.raises(interrupt):
            loop.run_forever()  # the drain runs the interrupt, which leaves the loop
        assert seen == []
        loop.run_until_complete(_settled(wake))  # no further call wakes the loop
        assert seen == ["a", "b"]
    finally:
        loop.close()


@contextlib.contextmanager
def _pipes_made(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The fd numbers of the pipes that os.pipe makes inside the block."""
    made: list[int] = []
    real_pipe = os.pipe

    def pipe() -> tuple[int, int]:
        fds = real_pipe()
        made.extend(fds)
        return fds

    with monkeypatch.context() as patch:
        patch.setattr(os, "pipe", pipe)
        yield made


def _take_fds(numbers: list[int], path: Path) -> list[int]:
    """Open `path` until the files hold each of `numbers` that is free (os.open takes the
    lowest free number), as a user's files would once the numbers are free again."""
    opened: list[int] = []
    while not set(numbers) <= set(opened):
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        opened.append(fd)
        if fd > max(numbers):  # the ones not taken yet are still open: nothing freed them
            break
    return opened


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _open_and_empty(fd: int) -> bool:
    try:
        return os.fstat(fd).st_size == 0
    except OSError:  # closed by someone else
        return False


def _make_refused(loop: asyncio.AbstractEventLoop) -> pytest.ExceptionInfo[OSError]:
    with pytest.raises(OSError, match="refused") as refused:
        LoopWake(loop)
    return refused  # its traceback holds the half-made LoopWake


def test_an_add_reader_that_fails_closes_the_pipe_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loop = asyncio.new_event_loop()
    files: list[int] = []
    try:
        def refuse(fd: int, callback: Any, *args: Any) -> None:
            raise OSError(f"add_reader refused fd {fd}")

        monkeypatch.setattr(loop, "add_reader", refuse)
        with _pipes_made(monkeypatch) as fds:
            refused = _make_refused(loop)
        assert len(fds) == 2
        files = _take_fds(fds, tmp_path / "user.txt")  # while the error is still held
        del refused
        gc.collect()  # the half-made LoopWake: nothing of it may close a number again
        assert all(_open_and_empty(fd) for fd in files), f"a user's file was closed: {files}"
    finally:
        _close_fds(files)
        loop.close()


def _exit_finalizers(obj: object) -> None:
    """Run what the interpreter's exit runs for `obj` (weakref.finalize._exitfunc: the
    finalizers marked atexit), while daemon threads may still call into it."""
    registry = weakref.finalize._registry  # type: ignore[attr-defined]
    for finalizer, info in list(registry.items()):
        if info.weakref() is obj and info.atexit:
            finalizer()


def _call_from_a_thread(call: Any) -> BaseException | None:
    """What `call(print)` raised on a thread of its own, as a daemon worker would call."""
    raised: list[BaseException] = []

    def late() -> None:
        try:
            call(print)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=late)
    thread.start()
    thread.join(10)
    return raised[0] if raised else None


def test_the_interpreters_exit_leaves_the_pipe_to_late_writers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loop = asyncio.new_event_loop()
    files: list[int] = []
    try:
        with _pipes_made(monkeypatch) as fds:
            wake = loop.run_until_complete(_wake_of_running_loop())
        loop.run_until_complete(_settled(wake))  # no byte pending: the next call writes one
        _exit_finalizers(wake)
        files = _take_fds(fds, tmp_path / "user.txt")
        assert _call_from_a_thread(wake.call_soon_threadsafe) is None  # the loop is open
        assert all(_open_and_empty(fd) for fd in files), "the wake byte went into a user's file"
    finally:
        _close_fds(files)
        loop.close()


def test_a_closed_wake_refuses_late_calls_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loop = asyncio.new_event_loop()
    files: list[int] = []
    try:
        with _pipes_made(monkeypatch) as fds:
            wake = loop.run_until_complete(_wake_of_running_loop())
        wake.close()
        assert not any(_open_and_empty(fd) for fd in fds)  # both ends closed at once
        files = _take_fds(fds, tmp_path / "user.txt")
        raised = _call_from_a_thread(wake.call_soon_threadsafe)
        assert isinstance(raised, RuntimeError) and "closed" in str(raised)
        assert all(_open_and_empty(fd) for fd in files), "the wake byte went into a user's file"
        assert loop_wake.loop_wake(loop) is not wake  # the loop gets a fresh one
    finally:
        _close_fds(files)
        loop.close()


def test_the_first_call_after_the_loop_closed_closes_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.new_event_loop()
    with _pipes_made(monkeypatch) as fds:
        call = loop.run_until_complete(_call_of_running_loop())
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(print)
    # while the Executor that holds `call` lives on: its fds are not kept until collected
    assert not any(_open_and_empty(fd) for fd in fds)


def test_a_collected_wake_closes_its_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.new_event_loop()
    with _pipes_made(monkeypatch) as fds:
        loop.run_until_complete(_call_of_running_loop())
    loop.close()
    del loop
    gc.collect()  # no call after the close: the finalizer closes the pipe
    assert not any(_open_and_empty(fd) for fd in fds)

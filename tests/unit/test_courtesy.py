"""GilCourtesy (asyncgraph/runtime/courtesy.py): a background thread's Python pauses while
the loop serves, runs straight on while it does not, and leaves the thread as it found it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from asyncgraph.runtime.courtesy import GilCourtesy

pytestmark = pytest.mark.timeout(30)


def _python_work(seconds: float) -> int:
    """Python calls for about `seconds` (profile events the courtesy sees)."""
    end, calls = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        calls += len(str(calls))
    return calls


def _run_on_thread(courtesy: GilCourtesy, seconds: float) -> None:
    def work() -> None:
        with courtesy:
            _python_work(seconds)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()


def test_while_the_loop_serves_the_thread_pauses_after_each_slice() -> None:
    courtesy = GilCourtesy(lambda: True, slice_s=0.001, pause_s=0.001)
    _run_on_thread(courtesy, 0.03)
    stats = courtesy.statistics()
    assert stats.pauses >= 5  # 30 ms of work in slices of 1 ms, a pause after each
    assert stats.paused_s >= stats.pauses * 0.001 * 0.9


def test_while_the_loop_is_quiet_the_thread_never_pauses() -> None:
    courtesy = GilCourtesy(lambda: False, slice_s=0.001, pause_s=0.001)
    _run_on_thread(courtesy, 0.02)
    assert courtesy.statistics().pauses == 0


def test_the_threads_profile_function_is_put_back() -> None:
    seen: list[str] = []

    def previous(frame: object, event: str, arg: object) -> None:
        seen.append(event)

    sys.setprofile(previous)
    try:
        with GilCourtesy(lambda: True):
            assert sys.getprofile() is not previous
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert seen  # the previous function ran again after the block


def test_a_paused_thread_leaves_the_gil_to_another() -> None:
    """While the courtesy's thread runs Python, another thread's Python still progresses,
    and more of it than with a thread that never pauses."""
    def share(busy: bool) -> float:
        courtesy = GilCourtesy(lambda: busy, slice_s=0.0005, pause_s=0.002)
        stop = threading.Event()

        def background() -> None:
            with courtesy:
                while not stop.is_set():
                    _python_work(0.001)

        thread = threading.Thread(target=background)
        thread.start()
        try:
            time.sleep(0.01)
            start = time.thread_time()
            wall = time.perf_counter()
            _python_work(0.1)  # this thread's share of the GIL over 100 ms of wall time
            return (time.thread_time() - start) / (time.perf_counter() - wall)
        finally:
            stop.set()
            thread.join(10)

    assert share(busy=True) > share(busy=False)


def test_wait_quiet_waits_for_a_gap_or_gives_up() -> None:
    busy_until = time.perf_counter() + 0.03
    courtesy = GilCourtesy(lambda: time.perf_counter() < busy_until, pause_s=0.001)
    start = time.perf_counter()
    courtesy.wait_quiet(5.0)
    assert 0.03 <= time.perf_counter() - start < 2.0  # the gap came: it went on
    always = GilCourtesy(lambda: False, pause_s=0.001)
    start = time.perf_counter()
    always.wait_quiet(0.02, busy=lambda: True)  # its own signal overridden: none came
    assert time.perf_counter() - start >= 0.02 and always.statistics().pauses >= 1

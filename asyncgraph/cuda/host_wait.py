"""The host's wait for CUDA events: the event loop polls briefly, then one thread blocks.

Why not sleep on the loop: asyncio's default selector loop and trio round every timeout above
zero up to a whole millisecond of `epoll_wait` (`asyncio.sleep(12.5e-6)` takes ~1.1 ms; uvloop
~4 us). A wait that polls and sleeps between polls therefore returns up to 1 ms after the GPU
finished on those loops, whatever the sleep asked for (issue 36, item 1). The loop has only two
exact ways to wait: a zero-timeout checkpoint (it runs again at once, burning the loop while
nothing else is ready), and a wake from another thread (`call_soon_threadsafe` on asyncio and
uvloop, the run's token on trio), which interrupts `epoll_wait` whatever its timeout.

So `wait_events` (cuda/device.py) polls `event.query()` between zero-timeout checkpoints for
`PollPolicy.spin_s`, or for as long as the waits of the same place have been measured to last
when that is short (`WaitSite`, capped by `PollPolicy.spin_max_s`): a short GPU step is caught
exactly, without a thread. It then hands the events still pending to a `HostWaiter`, asking
the task to poll again near the end a long site's waits are expected to have (`resume_at`:
the end is then seen on the loop, without the thread's wake, whose thread switch and wake of
the loop from epoll_wait cost tens of us, more on a virtual machine whose idle CPU halted):

- One thread for every frame and every Executor of the process (`shared_waiter()`), started on
  the first wait handed to it and ended once it has had nothing to do for `idle_s`, so an idle
  process holds no thread and LeakChecker sees it gone. Its queue holds entries (events, wake):
  the thread blocks in `event.synchronize()` on each entry's events in turn, which releases the
  GIL in torch (the loop runs meanwhile), then wakes the awaiting task through its loop.
  Entries are served in the order they came: the order their waits began, which is the order
  their GPU work was enqueued, so the oldest entry is the one the GPU most likely finishes
  first. An entry queued behind another (the thread blocks on an earlier wait, which may
  finish later: head-of-line) is also polled by its own task, with the sleeping backoff the
  loop used before (elapsed/8, capped at `PollPolicy.max_delay_s`), and taken back once its
  events have completed: being queued costs at most what polling cost, never the whole of
  the earlier wait.
- One thread, not one per wait: with the default CUDA flags a `synchronize` spins a CPU core
  until the event completes (cudaDeviceScheduleAuto spins while the process has fewer
  contexts than cores), as eager PyTorch's `.item()` does; one thread bounds that at one core.
- The wake goes through the running loop's `call_soon_threadsafe`
  (asyncgraph.runtime.backend.current_loop: the loop's own method on asyncio and uvloop, the
  run's token on trio) and settles a future of that loop, so it runs on all three.
- A task that saw its events complete itself (queued, or polling near the expected end) takes
  its entry back, or leaves the thread to finish the `synchronize` it is in (which returns at
  once) without waking anyone.
- A cancelled wait takes its entry out of the queue at once. If the thread is already blocked
  on it, the entry is dropped when `synchronize` returns (nobody is woken); a later submission
  that finds the thread blocked on a cancelled entry retires that thread (it ends once its
  `synchronize` returns) and starts a fresh one, so an event that never completes (a GPU left
  paused, a hang) cannot hold up the waits of everyone else. On a GPU, the frame's `finish`
  waits for the same streams before the frame is reused, so such a thread is gone by then.
- An error from `synchronize` (a CUDA error reported by the event: an illegal memory access in
  an earlier kernel) is raised in the awaiting task, as the node's error.
- `close()` ends the thread as soon as its queue is empty (CudaRuntime.close); a later wait
  starts a new one. The thread is a daemon: a GPU that never finishes cannot block the
  interpreter's exit. After `os.fork` the child starts with an empty waiter.

The waiter only calls `synchronize()` on the events it is given (the backend's events), so the
simulated GPU of the tests drives it with fake events whose `synchronize` blocks until the fake
completes them (tests/support/fake_gpu.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from asyncgraph.runtime.backend import current_loop
from asyncgraph.runtime.threads import start_thread

THREAD_NAME = "asyncgraph-cuda-wait"
"""The waiter thread's name: LeakChecker counts threads named asyncgraph*."""

_RESUME_EARLY_S = 200e-6
"""How early a task may start polling before its `resume_at` (HostWaiter.wait)."""

IDLE_S = 0.1
"""How long the waiter thread waits for a new entry before it ends (HostWaiter.idle_s)."""


class SyncEvent(Protocol):
    """What the waiter needs of an event: a `synchronize` that blocks until it completed
    (torch.cuda.Event's releases the GIL) and raises a CUDA error it reports, and `query`
    (a queued entry's own poll)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


_QUEUED, _RUNNING, _CANCELLED, _DETACHED, _DONE = range(5)


class _Entry:
    """One handed-off wait: its events, its loop, and what the waiter thread found.

    The thread wakes the loop with `loop.call_soon_threadsafe(_wake, entry)`; `_wake` runs
    on the loop and settles `entry.future`, the future the task awaits at that moment (a task
    that polls a queued entry awaits a new one per poll).
    """

    __slots__ = ("completed", "error", "events", "future", "loop", "state", "woken")

    def __init__(self, events: tuple[SyncEvent, ...], loop: Any) -> None:
        self.events = events
        self.loop = loop
        self.state = _QUEUED  # changed under the waiter's lock only
        self.woken = False  # set on the loop, by _wake
        self.error: BaseException | None = None
        self.future: Any = None
        self.completed = 0.0  # when the thread's synchronize returned (time.perf_counter)


def _wake(entry: _Entry, error: BaseException | None) -> None:
    """On the loop: the thread has synchronized the entry's events (or one raised)."""
    entry.woken = True
    entry.error = error
    future = entry.future
    if future is not None and not future.done():  # done: cancelled with its task
        future.set_result(None)


def _tick(future: Any) -> None:
    """On the loop: a queued entry's poll is due."""
    if not future.done():
        future.set_result(None)


class HostWaiter:
    """A queue of waits and at most one thread serving it (see the module docstring).

    Args:
        idle_s: how long the thread waits for a new entry before it ends.
        name: the thread's name.
    """

    def __init__(self, *, idle_s: float = IDLE_S, name: str = THREAD_NAME) -> None:
        self.idle_s = idle_s
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[_Entry] = deque()
        self._thread: threading.Thread | None = None  # the active thread
        self._current: _Entry | None = None  # the entry the active thread blocks on
        self._stop: threading.Thread | None = None  # the thread asked to end when idle
        self._threads: set[threading.Thread] = set()  # alive: the active one and retired ones
        self.started = 0  # threads started so far
        self.handed = 0  # waits handed over so far
        self.taken_back = 0  # waits that completed while queued, found by their own poll
        self.synchronized = 0  # waits the thread took from the queue and synchronized
        self.resumed = 0  # waits whose task resumed polling near their expected end

    # -- the loop side -----------------------------------------------------------------------

    async def wait(
        self, events: Sequence[SyncEvent], max_delay_s: float = 1e-3,
        resume_at: float | None = None, resume_for: float = 0.0,
    ) -> float:
        """Return once every event in `events` has completed; raise what a `synchronize`
        raised. Cancellable: a cancelled wait leaves no entry behind. Returns when (by
        `time.perf_counter()`) the events were seen complete: when the thread's `synchronize`
        returned, or the last poll that found them pending (what the GPU took, not what the
        wake took: `WaitSite` learns from it).

        The waiter thread synchronizes the events and wakes the task. Besides:

        - While the entry is queued behind another (the thread blocks on an earlier wait,
          which may finish later), the task polls its own events with sleeps of elapsed/8
          capped at `max_delay_s` and takes the entry back once they have completed: the
          head-of-line wait costs at most what polling costs, never the whole earlier wait.
        - From `resume_at` (`time.perf_counter()`; a loop timer wakes the task then, up to a
          timer's granularity late) for `resume_for` seconds, the task polls its events
          between zero-timeout checkpoints and returns as soon as they have completed,
          without waiting for the thread's wake (a thread switch, and the loop's wake from
          epoll_wait: tens of us, more where an idle virtual CPU halted). `wait_events` asks
          for it near the end a site's waits are expected to have.
        """
        loop = current_loop()
        entry = _Entry(tuple(events), loop)
        behind = self._submit(entry)
        start = pending_at = time.perf_counter()
        resumed = False
        try:
            while not entry.woken:
                future = entry.future = loop.create_future()
                now = time.perf_counter()
                # poll without a timer; from a little early, as a timer for the few us left
                # would wait a whole ms on asyncio's selector loop and trio
                if resume_at is not None and now >= resume_at - _RESUME_EARLY_S:
                    if not resumed:
                        resumed = True
                        self.resumed += 1
                    if all(e.query() for e in entry.events):
                        if self._detach(entry):
                            for e in entry.events:
                                e.synchronize()  # complete: returns at once
                            return pending_at
                        resume_at = None  # the thread is done with it: its wake is queued
                        continue
                    pending_at = now
                    if now >= resume_at + resume_for:
                        resume_at = None  # longer than expected: the thread wakes us
                        continue
                    loop.call_soon(_tick, future)
                    await future
                    continue
                queued = behind and entry.state == _QUEUED
                delay = min(max_delay_s, (now - start) / 8) if queued else None
                if resume_at is not None:
                    delay = resume_at - now if delay is None else min(delay, resume_at - now)
                if delay is None:
                    await future  # the thread is on it, or will be next
                    continue
                # the loop's own timer, not a cancel scope's: anyio's deadline check reads
                # uvloop's millisecond clock, which would stretch a 20 us poll to 1 ms
                timer = loop.call_later(delay, _tick, future)
                try:
                    await future
                finally:
                    timer.cancel()
                if entry.woken or not queued:
                    continue
                polled = time.perf_counter()
                if not all(e.query() for e in entry.events):
                    pending_at = polled
                elif self._take_back(entry):
                    for e in entry.events:
                        e.synchronize()  # complete: returns at once
                    return pending_at
        except BaseException:
            self._cancel(entry)  # nothing to do when it had completed
            raise
        finally:
            entry.future = None
        if entry.error is not None:
            raise entry.error
        return entry.completed

    def _submit(self, entry: _Entry) -> bool:
        """Queue `entry`; True when it waits behind another (the thread is busy)."""
        with self._lock:
            self._queue.append(entry)
            self.handed += 1
            current = self._current
            if self._thread is not None and (current is None or current.state != _CANCELLED):
                self._wakeup.notify()
                return current is not None or len(self._queue) > 1
            # none yet, or the active one blocks on an event nobody awaits any more: retire it
            self._thread = None
            self._current = None
            self._start()
            return len(self._queue) > 1

    def _start(self) -> None:
        """Start the active thread (the lock held)."""
        thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread = thread
        self._threads.add(thread)
        self.started += 1
        try:
            start_thread(thread)  # at the loop's nice value, were the caller niced
        except BaseException:
            self._thread = None
            self._threads.discard(thread)
            raise

    def _cancel(self, entry: _Entry) -> None:
        with self._lock:
            if entry.state == _QUEUED:
                self._queue.remove(entry)
                entry.state = _DONE
            elif entry.state == _RUNNING:
                entry.state = _CANCELLED  # dropped when its synchronize returns

    def _detach(self, entry: _Entry) -> bool:
        """The task saw the entry's events complete: take it out of the queue, or tell the
        thread that blocks on it to wake nobody (its synchronize returns at once: unlike a
        cancelled entry, no reason to retire the thread). False when the thread is done
        with it (its wake is on the way)."""
        if self._take_back(entry):
            return True
        with self._lock:
            if entry.state != _RUNNING:
                return False
            entry.state = _DETACHED
            return True

    def _take_back(self, entry: _Entry) -> bool:
        """Take a queued entry out of the queue (its task found its events complete); False
        when the thread has taken it meanwhile (it will wake the task)."""
        with self._lock:
            if entry.state != _QUEUED:
                return False
            self._queue.remove(entry)
            entry.state = _DONE
            self.taken_back += 1
            return True

    def close(self) -> None:
        """End the thread as soon as its queue is empty (at once if it is); a later wait
        starts a new one. Returns without waiting: `join` waits."""
        with self._lock:
            self._stop = self._thread
            self._wakeup.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no waiter thread is alive (after `close`, or idle); True if none is."""
        for thread in self.threads:
            thread.join(timeout)
        return not self.threads

    # -- what tests and statistics read ------------------------------------------------------

    @property
    def pending(self) -> int:
        """Entries queued or being waited on by the active thread (cancelled ones excluded)."""
        with self._lock:
            running = self._current is not None and self._current.state == _RUNNING
            return len(self._queue) + running

    @property
    def threads(self) -> list[threading.Thread]:
        """The waiter threads alive: the active one and retired ones still blocked."""
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    # -- the thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                entry = self._next(me)
                if entry is None:
                    return
                error: BaseException | None = None
                try:
                    for event in entry.events:
                        event.synchronize()
                except BaseException as exc:
                    error = exc
                entry.completed = time.perf_counter()
                with self._lock:
                    wanted = entry.state == _RUNNING
                    entry.state = _DONE
                    if self._current is entry:
                        self._current = None
                if wanted:  # a loop closed, or a trio run ended, has nobody waiting: suppress
                    with contextlib.suppress(BaseException):
                        entry.loop.call_soon_threadsafe(_wake, entry, error)
                del entry, error
        finally:
            with self._lock:
                self._threads.discard(me)
                if self._thread is me:
                    self._thread = None
                    self._current = None

    def _next(self, me: threading.Thread) -> _Entry | None:
        """The next entry for thread `me`, or None when it is to end (retired, closed and
        idle, or idle for `idle_s`)."""
        with self._lock:
            while True:
                if self._thread is not me:
                    return None  # retired: the active thread serves the queue
                if self._queue:
                    entry = self._queue.popleft()
                    entry.state = _RUNNING
                    self._current = entry
                    self.synchronized += 1
                    return entry
                if self._stop is me or (not self._wakeup.wait(self.idle_s) and not self._queue):
                    if self._thread is me:
                        self._thread = None
                    if self._stop is me:
                        self._stop = None
                    return None


_SHARED = HostWaiter()


def shared_waiter() -> HostWaiter:
    """The process's waiter, which every CudaRuntime uses unless given another."""
    return _SHARED


def _after_fork_in_child() -> None:
    _SHARED._reset()  # the parent's thread does not exist here; its lock may be held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

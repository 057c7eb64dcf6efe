"""The host's wait for CUDA events: the event loop polls briefly, then the waiter's threads.

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
the loop from epoll_wait cost tens of us, more on a virtual machine whose idle CPU halted).

The loop polls only while no other wait is outstanding (issue 50, item 4): with many requests
in flight, a spin, a poll near the expected end or a poll of a queued wait would be loop time
taken from every other request. `HostWaiter.outstanding` counts the waits begun and not ended
(spinning on their loop, or handed over, of every loop); with another one outstanding a wait
hands off after its first query, a wait spinning alone hands off once another begins, and a
handed wait's task only awaits its wake. What the loop did per wait before (a spin of up to
1 ms, sleeps of elapsed/8 while queued, each a task wake-up) grew with the time waited and
the number of waits; now it is one query and one share of a wake.

- Two threads for every frame and every Executor of the process (`shared_waiter()`), started
  on the first wait that needs them and ended once they have had nothing to do for `idle_s`,
  so an idle process holds no thread and LeakChecker sees them gone. The queue holds entries
  (events, loop): the *blocking thread* blocks in `event.synchronize()` on each entry's
  events in turn, which releases the GIL in torch (the loop runs meanwhile). Entries are
  served in the order they came: the order their waits began, which is the order their GPU
  work was enqueued, so the oldest entry is the one the GPU most likely finishes first; once
  its `synchronize` returns, the thread also takes the entries behind it that have completed
  by then, up to the first still pending.
- Head-of-line: an entry queued behind another (the blocking thread waits on an earlier one,
  which may finish later: another Executor's long step, say) is polled by the *poll thread*
  (`<name>-poll`), started while entries queue behind the blocking one: it queries each
  queued entry's events after a quarter of what the entry has waited so far (at least
  `POLL_MIN_S`, at most `max_delay_s`), and takes the entry once they have completed. Being
  queued costs at most a quarter of the wait, never the whole of the earlier one, and no
  loop time (each query holds the GIL briefly, on that thread).
- One blocking thread, not one per wait: with the default CUDA flags a `synchronize` spins a
  CPU core until the event completes (cudaDeviceScheduleAuto spins while the process has
  fewer contexts than cores), as eager PyTorch's `.item()` does; one thread bounds that at one
  core. The poll thread sleeps between its polls.
- One loop wake per drain: a thread that saw entries complete puts them on their loop's
  completion queue (one per loop, keyed by the loop's `native`) and wakes that loop (the
  running loop's `call_soon_threadsafe`: asyncgraph.runtime.backend.current_loop, the loop's
  own method on asyncio and uvloop, the run's token on trio) only if no wake of it is pending;
  the loop's one callback (`_drain`) settles every completion queued by then, each a future
  of that loop. N waits completing together cost the loop one wake, not N (`wakes`,
  `drains`), however many threads saw them.
- A task that saw its events complete itself (polling near the expected end) takes its entry
  back, or leaves the blocking thread to finish the `synchronize` it is in (which returns at
  once) without waking anyone.
- A cancelled wait takes its entry out of the queue at once; a completion already on its
  loop's queue settles nothing. If the blocking thread is already blocked on it, the entry is
  dropped when `synchronize` returns (nobody is woken); a later submission that finds the
  thread blocked on a cancelled entry retires that thread (it ends once its `synchronize`
  returns) and starts a fresh one, so an event that never completes (a GPU left paused, a
  hang) cannot hold up the waits of everyone else. On a GPU, the frame's `finish` waits for
  the same streams before the frame is reused, so such a thread is gone by then.
- An error from `synchronize` (a CUDA error reported by the event: an illegal memory access in
  an earlier kernel; a `query` that raises one is synchronized at once, which raises it) is
  raised in the awaiting task, as the node's error.
- `close()` ends the threads as soon as the queue is empty (CudaRuntime.close); a later wait
  starts new ones. The threads are daemons: a GPU that never finishes cannot block the
  interpreter's exit. A loop closed (or a trio run ended) before its wake has nobody waiting:
  its completions are dropped. After `os.fork` the child starts with an empty waiter.

The waiter only calls `query()` and `synchronize()` on the events it is given (the backend's
events), so the simulated GPU of the tests drives it with fake events whose `synchronize`
blocks until the fake completes them (tests/support/fake_gpu.py).
"""

from __future__ import annotations

import asyncio
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


POLL_MIN_S = 50e-6
"""The poll thread's shortest interval between two polls of one queued entry (about what a
thread's timed sleep lasts at the least on Linux: the kernel's 50 us timer slack)."""

POLL_FRACTION = 4
"""The poll thread polls a queued entry again after 1/POLL_FRACTION of what it has waited
so far (capped at its `max_delay_s`): it sees an entry's completion at most a quarter of its
wait late, with about 20 polls up to 4 ms, then one per `max_delay_s`."""

_QUEUED, _RUNNING, _CANCELLED, _DETACHED, _DONE = range(5)


class _Entry:
    """One handed-off wait: its events, its loop, and what the waiter's threads found.

    A thread that saw its events complete puts `(entry, error)` on its loop's completion
    queue (`HostWaiter._deliver`); the loop's drain (`HostWaiter._drain`) settles
    `entry.future`, the future the task awaits at that moment (a task polling near the
    expected end awaits a new one per poll).
    """

    __slots__ = (
        "completed", "due", "error", "events", "future", "loop", "max_delay_s", "start",
        "state", "woken",
    )

    def __init__(self, events: tuple[SyncEvent, ...], loop: Any, max_delay_s: float) -> None:
        self.events = events
        self.loop = loop
        self.max_delay_s = max_delay_s  # the longest interval of the poll thread's polls
        self.state = _QUEUED  # changed under the waiter's lock only
        self.woken = False  # set on the loop, by _wake
        self.error: BaseException | None = None
        self.future: Any = None
        self.start = time.perf_counter()
        self.due = self.start + POLL_MIN_S  # the poll thread's next poll, while queued
        self.completed = 0.0  # when a thread saw its events complete (time.perf_counter)


def _wake(entry: _Entry, error: BaseException | None) -> None:
    """On the loop: a thread has synchronized the entry's events (or one raised)."""
    entry.woken = True
    entry.error = error
    future = entry.future
    if future is not None and not future.done():  # done: cancelled with its task
        future.set_result(None)


def _completed(entry: _Entry) -> bool:
    """Whether every event of `entry` has completed (a query that raises reports a CUDA
    error, which the entry's `synchronize` then raises: complete, with that error)."""
    try:
        return all(event.query() for event in entry.events)
    except Exception:
        return True


def _synchronize(entry: _Entry) -> BaseException | None:
    """Synchronize the events of a completed entry (each returns at once); the error one
    raised, if any (a CUDA error the event reports)."""
    try:
        for event in entry.events:
            event.synchronize()
    except BaseException as exc:
        return exc
    return None


def _tick(future: Any) -> None:
    """On the loop: a queued entry's poll is due."""
    if not future.done():
        future.set_result(None)


class HostWaiter:
    """A queue of waits, the thread that blocks on them, and the thread that polls the ones
    queued behind it (see the module docstring).

    Args:
        idle_s: how long a thread waits for a new entry before it ends.
        name: the blocking thread's name (the poll thread's has "-poll" after it).
    """

    def __init__(self, *, idle_s: float = IDLE_S, name: str = THREAD_NAME) -> None:
        self.idle_s = idle_s
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)  # the blocking thread's
        self._poll_wakeup = threading.Condition(self._lock)  # the poll thread's
        self._queue: deque[_Entry] = deque()
        self._thread: threading.Thread | None = None  # the active blocking thread
        self._current: _Entry | None = None  # the entry the active thread blocks on
        self._stop: threading.Thread | None = None  # the thread asked to end when idle
        self._poller: threading.Thread | None = None  # the poll thread
        self._stop_poller: threading.Thread | None = None  # the poll thread asked to end
        self._threads: set[threading.Thread] = set()  # alive: active, retired, poll
        # per loop (by the id of its `native`): the loop and the completions it has not
        # drained; a loop is in the table exactly while a wake of it is pending
        self._inboxes: dict[int, tuple[Any, list[tuple[_Entry, BaseException | None]]]] = {}
        self._delivering = 0  # entries a thread took and has not put on a loop's queue yet
        self._outstanding = 0  # waits begun and not ended: spinning on a loop, or handed
        self.started = 0  # blocking threads started so far
        self.pollers_started = 0  # poll threads started so far
        self.handed = 0  # waits handed over so far
        self.taken_back = 0  # waits that completed while queued, found by a poll
        self.synchronized = 0  # waits the blocking thread took from the queue and synchronized
        self.resumed = 0  # waits whose task resumed polling near their expected end
        self.polls = 0  # queries of queued entries by the poll thread
        self.wakes = 0  # wakes of a loop (call_soon_threadsafe): one per drain
        self.drains = 0  # drains run on a loop (one per wake that reached it)

    # -- the loop side -----------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Waits begun and not ended, of every loop: spinning on their loop
        (`count_spinning`), or handed over (`wait`). While another one is outstanding, a wait
        does not spin (cuda/device.py's `wait_events`) and is not polled on its loop."""
        return self._outstanding

    def count_spinning(self, count: int) -> None:
        """A wait starts (1) or stops (-1) spinning on its loop (`wait_events`)."""
        with self._lock:
            self._outstanding += count

    async def wait(
        self, events: Sequence[SyncEvent], max_delay_s: float = 1e-3,
        resume_at: float | None = None, resume_for: float = 0.0,
    ) -> float:
        """Return once every event in `events` has completed; raise what a `synchronize`
        raised. Cancellable: a cancelled wait leaves no entry behind. Returns when (by
        `time.perf_counter()`) the events were seen complete: when the thread's `synchronize`
        returned, or the poll that found them complete (what the GPU took, not what the
        wake took: `WaitSite` learns from it).

        The blocking thread synchronizes the events; while the entry is queued behind
        another, the poll thread polls them, after a quarter of what the entry has waited
        (at least `POLL_MIN_S`, at most `max_delay_s`), and takes the entry once they have
        completed (the head-of-line wait costs at most a quarter of the wait, never the whole
        earlier wait). Either wakes the task through its loop's completion queue. Besides,
        while no other wait is outstanding:

        - From `resume_at` (`time.perf_counter()`; a loop timer wakes the task then, up to a
          timer's granularity late) for `resume_for` seconds, the task polls its events
          between zero-timeout checkpoints and returns as soon as they have completed,
          without waiting for the thread's wake (a thread switch, and the loop's wake from
          epoll_wait: tens of us, more where an idle virtual CPU halted). `wait_events` asks
          for it near the end a site's waits are expected to have. With another wait
          outstanding, the loop does not poll: the threads wake the task.
        """
        loop = current_loop()
        entry = _Entry(tuple(events), loop, max_delay_s)
        self._submit(entry)
        pending_at = entry.start
        resumed = False
        try:
            while not entry.woken:
                future = entry.future = loop.create_future()
                if resume_at is not None and self._outstanding > 1:
                    resume_at = None  # others wait too: no loop time for this one's polls
                if resume_at is None:
                    await future  # a thread wakes us
                    continue
                now = time.perf_counter()
                if now < resume_at - _RESUME_EARLY_S:
                    # the loop's own timer, not a cancel scope's: anyio's deadline check reads
                    # uvloop's millisecond clock, which would stretch a short delay to 1 ms
                    timer = loop.call_later(resume_at - now, _tick, future)
                    try:
                        await future
                    finally:
                        timer.cancel()
                    continue
                # poll without a timer; from a little early, as a timer for the few us left
                # would wait a whole ms on asyncio's selector loop and trio
                if not resumed:
                    resumed = True
                    self.resumed += 1
                if all(e.query() for e in entry.events):
                    if self._detach(entry):
                        for e in entry.events:
                            e.synchronize()  # complete: returns at once
                        return pending_at
                    resume_at = None  # a thread is done with it: its wake is queued
                    continue
                pending_at = now
                if now >= resume_at + resume_for:
                    resume_at = None  # longer than expected: the thread wakes us
                    continue
                loop.call_soon(_tick, future)
                await future
        except BaseException:
            self._cancel(entry)  # nothing to do when it had completed
            raise
        finally:
            entry.future = None
            with self._lock:
                self._outstanding -= 1  # the wait has ended (`_submit` counted it)
        if entry.error is not None:
            raise entry.error
        return entry.completed

    def _submit(self, entry: _Entry) -> None:
        """Queue `entry` for the blocking thread; when it is queued behind another, have the
        poll thread poll it."""
        with self._lock:
            self._queue.append(entry)
            self.handed += 1
            self._outstanding += 1
            current = self._current
            if self._thread is not None and (current is None or current.state != _CANCELLED):
                self._wakeup.notify()
                if current is not None or len(self._queue) > 1:
                    self._poll_queued()
                return
            # none yet, or the active one blocks on an event nobody awaits any more: retire it
            self._thread = None
            self._current = None
            try:
                self._start()
            except BaseException:
                self._queue.remove(entry)
                entry.state = _DONE
                self._outstanding -= 1
                raise
            if len(self._queue) > 1:
                self._poll_queued()

    def _start(self) -> None:
        """Start the active blocking thread (the lock held)."""
        self._thread = self._start_thread(self._serve, self.name)
        self.started += 1

    def _poll_queued(self) -> None:
        """Entries are queued behind the blocking thread's: have the poll thread poll them,
        starting it if none runs (the lock held). A poll thread that cannot start (the
        process is out of threads) is no error: the blocking thread serves every entry
        anyway, only in order."""
        if self._poller is not None:
            self._poll_wakeup.notify()  # it looks at the queue again: a new entry is due soon
            return
        try:
            self._poller = self._start_thread(self._poll, f"{self.name}-poll")
        except RuntimeError:  # "can't start new thread"
            return
        self.pollers_started += 1

    def _start_thread(self, target: Any, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.add(thread)
        try:
            start_thread(thread)  # at the loop's nice value, were the caller niced
        except BaseException:
            self._threads.discard(thread)
            raise
        return thread

    def _cancel(self, entry: _Entry) -> None:
        with self._lock:
            if entry.state == _QUEUED:
                self._queue.remove(entry)
                entry.state = _DONE
                if not self._queue:
                    self._poll_wakeup.notify()  # nothing left to poll
            elif entry.state == _RUNNING:
                entry.state = _CANCELLED  # dropped when its synchronize returns

    def _detach(self, entry: _Entry) -> bool:
        """The task saw the entry's events complete: take it out of the queue, or tell the
        thread that blocks on it to wake nobody (its synchronize returns at once: unlike a
        cancelled entry, no reason to retire the thread). False when a thread is done
        with it (its wake is on the way)."""
        with self._lock:
            if entry.state == _QUEUED:
                self._queue.remove(entry)
                entry.state = _DONE
                self.taken_back += 1
                return True
            if entry.state != _RUNNING:
                return False
            entry.state = _DETACHED
            return True

    def close(self) -> None:
        """End the threads as soon as the queue is empty (at once if it is); a later wait
        starts new ones. Returns without waiting: `join` waits."""
        with self._lock:
            self._stop = self._thread
            self._stop_poller = self._poller
            self._wakeup.notify_all()
            self._poll_wakeup.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no waiter thread is alive (after `close`, or idle); True if none is."""
        for thread in self.threads:
            thread.join(timeout)
        return not self.threads

    # -- what tests and statistics read ------------------------------------------------------

    @property
    def pending(self) -> int:
        """Entries queued, being waited on by the active thread (cancelled ones excluded),
        or completed and not yet on their loop's completion queue."""
        with self._lock:
            running = self._current is not None and self._current.state == _RUNNING
            return len(self._queue) + running + self._delivering

    @property
    def threads(self) -> list[threading.Thread]:
        """The waiter's threads alive: the active one, retired ones still blocked, and the
        poll thread."""
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    # -- the completion queues ---------------------------------------------------------------

    def _deliver(self, done: list[tuple[_Entry, BaseException | None]]) -> None:
        """Put completions (counted in `_delivering`) on their loops' queues; wake a loop
        only where no wake is pending (one wake per drain). A loop closed, or a trio run
        ended, has nobody waiting: its queue is dropped."""
        if not done:
            return
        wake: list[tuple[Any, int]] = []
        with self._lock:
            for entry, error in done:
                key = id(entry.loop.native)  # unique while its queue holds the loop
                queued = self._inboxes.get(key)
                if queued is None:
                    self._drop_closed_loops()
                    queued = self._inboxes[key] = (entry.loop, [])
                    wake.append((entry.loop, key))
                    self.wakes += 1
                queued[1].append((entry, error))
            self._delivering -= len(done)
        for loop, key in wake:
            try:  # the key, not the loop: a wake left queued in a closed loop keeps nothing
                loop.call_soon_threadsafe(self._drain, key)
            except BaseException:
                with self._lock:
                    self._inboxes.pop(key, None)

    def _drop_closed_loops(self) -> None:
        """Drop the queues of asyncio loops closed before their drain ran (a wake queued as
        the loop shut down), which would otherwise keep the loop (the lock held)."""
        closed = [
            key for key, (loop, _) in self._inboxes.items()
            if isinstance(loop.native, asyncio.AbstractEventLoop) and loop.native.is_closed()
        ]
        for key in closed:
            del self._inboxes[key]

    def _drain(self, key: int) -> None:
        """On the loop: settle every completion queued for it, in the order they came."""
        with self._lock:
            queued = self._inboxes.pop(key, None)
            self.drains += 1
        if queued is not None:
            for entry, error in queued[1]:
                _wake(entry, error)

    def _take_completed(
        self, entries: list[_Entry], *, prefix: bool
    ) -> list[tuple[_Entry, BaseException | None]]:
        """Of `entries` (queued when read), those whose events have completed, taken out of
        the queue and synchronized (counted in `_delivering`); with `prefix`, only up to the
        first still pending (the blocking thread's look after its own: the GPU most likely
        finishes them in order). A pending one's next poll is scheduled."""
        seen: list[_Entry] = []
        now = time.perf_counter()
        for entry in entries:
            if not _completed(entry):
                if prefix:
                    break
                waited = now - entry.start
                delay = min(entry.max_delay_s, max(POLL_MIN_S, waited / POLL_FRACTION))
                entry.due = now + delay
                continue
            seen.append(entry)
        if not prefix:
            self.polls += len(entries)
        if not seen:
            return []
        with self._lock:
            taken = [entry for entry in seen if entry.state == _QUEUED]
            for entry in taken:
                self._queue.remove(entry)
                entry.state = _DONE
            self.taken_back += len(taken)
            self._delivering += len(taken)
        done = []
        for entry in taken:
            entry.completed = now
            done.append((entry, _synchronize(entry)))
        return done

    # -- the blocking thread -----------------------------------------------------------------

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
                    self._delivering += wanted
                    queued = list(self._queue)
                done = [(entry, error)] if wanted else []
                del entry, error
                # those queued behind it that have completed meanwhile, in the same drain
                done += self._take_completed(queued, prefix=True)
                self._deliver(done)
                del done, queued
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
                    if self._queue:
                        self._poll_queued()  # the rest wait behind this one
                    return entry
                if self._stop is me or (not self._wakeup.wait(self.idle_s) and not self._queue):
                    if self._thread is me:
                        self._thread = None
                    if self._stop is me:
                        self._stop = None
                    return None

    # -- the poll thread ---------------------------------------------------------------------

    def _poll(self) -> None:
        """Poll the entries queued behind the blocking thread's, each when due, and take
        those complete; end once idle for `idle_s` (or closed) with nothing queued."""
        me = threading.current_thread()
        try:
            while True:
                due = self._due(me)
                if due is None:
                    return
                self._deliver(self._take_completed(due, prefix=False))
                del due
        finally:
            with self._lock:
                self._threads.discard(me)
                if self._poller is me:
                    self._poller = None
                if self._stop_poller is me:
                    self._stop_poller = None

    def _due(self, me: threading.Thread) -> list[_Entry] | None:
        """The queued entries whose poll is due, waiting until one is; None when the poll
        thread `me` is to end."""
        with self._lock:
            idle_since: float | None = None
            while self._poller is me:
                now = time.perf_counter()
                if self._queue:
                    idle_since = None
                    due = [entry for entry in self._queue if entry.due <= now]
                    if due:
                        return due
                    self._poll_wakeup.wait(min(entry.due for entry in self._queue) - now)
                    continue
                if idle_since is None:
                    idle_since = now
                if self._stop_poller is me or now - idle_since >= self.idle_s:
                    self._poller = None
                    return None
                self._poll_wakeup.wait(self.idle_s - (now - idle_since))
            return None


_SHARED = HostWaiter()


def shared_waiter() -> HostWaiter:
    """The process's waiter, which every CudaRuntime uses unless given another."""
    return _SHARED


def _after_fork_in_child() -> None:
    _SHARED._reset()  # the parent's thread does not exist here; its lock may be held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

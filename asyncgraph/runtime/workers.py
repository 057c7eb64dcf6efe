"""WorkerPool: the CPU threads that run heavy kernels while the event loop stays free.

torch releases the GIL inside its kernels, so `size` threads run independent branches truly in
parallel. Work items are plain `(function, frame, unit)` tuples: no Future per item, because
the scheduler does its own completion accounting in the frame.

Items wait in a `ReadyQueue`: first in, first out between submissions; among the units of one
submission (the roots of an execution, or the users one unit made ready), the one with the
most work still ahead of it first (critical path first, as list schedulers since Graham do), so
a long branch starts before the short ones instead of being left for last. Between
submissions, and so between executions, the order stays the order of arrival: no execution's
work overtakes work handed off earlier. The queue orders only what is handed off; a thread
that finishes a unit keeps going along its chain.

Each thread sets torch's intra-op thread count to `intra_op_threads` (the executor passes
ExecutorConfig.intra_op_threads_or_default), or when that is None to the one of the thread that
started the pool: with OpenMP a thread's own count is not changed by `torch.set_num_threads` in
another, and would run every matmul on all cores (two workers on two cores then oversubscribe
them four times over).

With `pin`, each thread binds itself to one CPU, taken round-robin from the CPUs the process
may use by a process-wide counter, so two pools do not stack their first threads on CPU 0.

The threads step back from the event loop's thread, which turns finished work into the next,
so that it gets a core sooner when it wakes. With `nice` (Linux, ExecutorConfig.worker_nice,
5 by default) each thread raises its own nice value by that much. With `idle`
(ExecutorConfig.worker_idle, for a machine the service has to itself) each moves itself to
SCHED_IDLE instead: any other thread that wakes takes its core at once (nice levels did not do
that on Linux 6.18: the loop of 64 tiny BERT callers waited 2-6 ms per 11 ms burst for a core
at nice 5, 10 or 19, and 0-0.7 ms with idle workers), but idle workers run only when no
thread of any process wants the core (ExecutorConfig.worker_idle has the measurements). A
thread inherits its starter's priority and cannot take it back, so the threads are started
through runtime/threads.py's `start_thread` (a pool started from a stepped-back worker steps
back from the loop's priority, not twice), and a stepped-back pool holds that module's
launcher while it runs, which starts the library's helper threads for stepped-back workers;
threads that user code starts in a kernel inherit the worker's priority (the module's doc says
what else).

Neither a nice level nor a shorter scheduler slice makes a woken loop thread preempt a running
worker: it waits for the worker's slice to end. So with `yield_s` (ExecutorConfig.worker_yield_s)
a thread that has run items for that long since it last stepped aside calls `sched_yield`
after its item: where the loop's thread waits for that core, it runs now; where nothing waits,
the call returns at once. Under 64 callers of tiny BERT or the encoder on 2 cores, 2 ms brought the
loop's lag p99 from up to 4.5 ms to at most 1.7 ms and its maximum from up to 11 ms to at most 6
ms, for 4-8% fewer unbatched requests/s (design_measurements.md#workers-that-yield).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from asyncgraph.runtime.threads import (
    SCHED_IDLE,
    hold_launcher,
    release_launcher,
    start_thread,
    step_back,
)

WorkItem = tuple[Callable[[Any, int], None], Any, int]


@dataclass(frozen=True, slots=True)
class WorkerPoolStatistics:
    threads: int
    queued: int
    items_run: int
    cpus: tuple[int, ...] = ()  # the CPU each thread is pinned to; empty when not pinned
    idle: int = 0  # threads parked, waiting for work
    nice: int = 0  # what each thread added to its nice value (0 where it cannot: not Linux)
    sched_idle: bool = False  # the threads run under SCHED_IDLE (Linux: worker_idle)
    yield_s: float = 0.0  # run time after which a thread steps aside (0: never; worker_yield_s)
    yields: int = 0  # sched_yield calls (each hands the core over only where a thread waits)


_NEXT_CPU = itertools.count()  # process-wide: pinned pools spread over the CPUs


def _cpus_to_pin(count: int) -> tuple[int, ...]:
    """`count` CPUs for pinned threads, round-robin over the allowed ones; () where threads
    cannot be pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return ()
    allowed = sorted(os.sched_getaffinity(0))
    return tuple(allowed[next(_NEXT_CPU) % len(allowed)] for _ in range(count))


class ReadyQueue:
    """The work items waiting for a thread: by submission, then lowest key within one.

    A heap under a lock holds the items. A thread with nothing to take parks on a lock of its
    own, and a submission wakes the threads that parked last: while the pool has more threads
    than work, the same thread takes the next item with the caches of the last one still warm.
    (Parked on one shared queue, threads were woken longest-idle first, so one caller's
    executions alternated between two threads: tiny BERT's scripted segment took 656-687 us a
    call that way against 576 us on one thread, its weights moving between the cores' caches.)
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, WorkItem]] = []
        self._lock = threading.Lock()
        self._parked: list[threading.Lock] = []  # the parked threads' locks, the latest last
        self._stops = 0  # threads still to stop once the heap is empty
        self._submissions = itertools.count()

    def put(self, items: Sequence[tuple[float, WorkItem]]) -> None:
        """Queue `(key, item)`s as one submission, all before any thread can take one."""
        with self._lock:
            submission = next(self._submissions)
            for i, (key, item) in enumerate(items):
                heapq.heappush(self._heap, (submission, key, i, item))
            woken = [self._parked.pop() for _ in range(min(len(items), len(self._parked)))]
        for parked in woken:
            parked.release()

    def get(self, parking: threading.Lock) -> WorkItem | None:
        """The first item queued, or None for a thread to stop; blocks on `parking` (a lock
        the calling thread holds, its own) while there is neither."""
        while True:
            with self._lock:
                if self._heap:
                    return heapq.heappop(self._heap)[3]
                if self._stops:
                    self._stops -= 1
                    return None
                self._parked.append(parking)
            parking.acquire()  # released by put() or stop(): a release first is not lost

    def stop(self, threads: int) -> None:
        """Stop `threads` threads once the items queued before are taken."""
        with self._lock:
            self._stops += threads
            woken, self._parked = self._parked, []
        for parked in woken:
            parked.release()

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def parked(self) -> int:
        """Threads waiting for work."""
        return len(self._parked)


class WorkerPool:
    """A fixed set of daemon threads draining one queue; started lazily, joined by aclose."""

    def __init__(
        self,
        size: int,
        name: str = "asyncgraph-worker",
        inference_mode: bool = True,
        pin: bool = False,
        intra_op_threads: int | None = None,
        nice: int = 0,
        idle: bool = False,
        yield_s: float = 0.0,
    ):
        self.size = size
        self.intra_op_threads = intra_op_threads
        self.pin = pin
        self.idle = idle and SCHED_IDLE is not None  # Linux's, as per-thread nice is
        self.nice = nice if sys.platform == "linux" and not self.idle else 0
        # an idle worker gives way at once anyway; sched_yield is POSIX's
        self.yield_s = yield_s if not self.idle and hasattr(os, "sched_yield") else 0.0
        self._cpus: tuple[int, ...] = ()
        self._name = name
        self._inference_mode = inference_mode
        self._queue = ReadyQueue()
        self._threads: list[threading.Thread] = []
        self._items_run: list[int] = []  # one slot per thread: no shared counter to race on
        self._yields: list[int] = []  # the same, for sched_yield calls
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._launcher: object = None  # threads.hold_launcher's, while stepped-back threads run

    def submit(
        self, fn: Callable[[Any, int], None], frame: Any, units: Sequence[tuple[float, int]]
    ) -> None:
        """Run `fn(frame, unit)` for each `(key, unit)` on worker threads: after the items
        submitted before, lowest key first among these. `fn` must not raise."""
        if not self._threads:
            self._start()
        self._queue.put([(key, (fn, frame, unit)) for key, unit in units])

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._items_run[:] = [0] * self.size
            self._yields[:] = [0] * self.size
            intra_op = self.intra_op_threads or torch.get_num_threads()
            self._cpus = _cpus_to_pin(self.size) if self.pin else ()
            # before the first thread steps back; released by aclose, or when the pool is collected
            self._launcher = hold_launcher() if self.nice or self.idle else None
            self._finalizer = weakref.finalize(
                self, _stop_threads, self._queue, self.size, self._launcher)
            for i in range(self.size):
                cpu = self._cpus[i] if self._cpus else None
                thread = threading.Thread(
                    target=_worker_main,
                    args=(self._queue, self._inference_mode, self._items_run, self._yields, i,
                          intra_op, cpu, self.nice, self.idle, self.yield_s),
                    name=f"{self._name}-{i}",
                    daemon=True,
                )
                start_thread(thread)  # not stepped back twice when started from a worker
                self._threads.append(thread)

    async def aclose(self) -> None:
        """Stop the threads after the work already queued, and wait until they are gone."""
        threads, self._threads = self._threads, []
        if not threads:
            return
        launcher, self._launcher = self._launcher, None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._queue.stop(len(threads))
        delay = 0.0005
        while any(t.is_alive() for t in threads):
            await anyio.sleep(delay)  # a blocking join() would stall the event loop
            delay = min(delay * 2, 0.05)
        for thread in threads:
            thread.join()
        release_launcher(launcher)

    def statistics(self) -> WorkerPoolStatistics:
        return WorkerPoolStatistics(
            len(self._threads), len(self._queue), sum(self._items_run),
            self._cpus if self._threads else (), self._queue.parked if self._threads else 0,
            self.nice, self.idle, self.yield_s, sum(self._yields),
        )


def _stop_threads(queue: ReadyQueue, threads: int, launcher: object) -> None:
    """A collected pool's threads end after the work queued; its hold on the launcher ends."""
    queue.stop(threads)
    release_launcher(launcher)


def _worker_main(
    q: ReadyQueue,
    inference_mode: bool,
    items_run: list[int],
    yields: list[int],
    slot: int,
    intra_op_threads: int,
    cpu: int | None,
    nice: int = 0,
    idle: bool = False,
    yield_s: float = 0.0,
) -> None:
    if cpu is not None:
        with contextlib.suppress(OSError):  # the CPU left the process's set: run unpinned
            os.sched_setaffinity(0, {cpu})  # 0: this thread
    if nice or idle:
        step_back(nice, idle)
    torch.set_num_threads(intra_op_threads)
    parking = threading.Lock()
    parking.acquire()  # held: get() blocks on it until a submission releases it
    stepped_aside = time.perf_counter()
    with torch.inference_mode(inference_mode):
        while True:
            item = q.get(parking)
            if item is None:
                return
            fn, frame, unit = item
            items_run[slot] += 1  # counted when taken, so it is exact once the execution ends
            try:
                fn(frame, unit)
            except BaseException:  # the scheduler catches kernel errors; this is a bug
                sys.unraisablehook(_Unraisable(sys.exc_info()[1], fn))  # type: ignore[arg-type]
            del item, fn, frame
            if yield_s:
                now = time.perf_counter()
                if now - stepped_aside >= yield_s:
                    os.sched_yield()  # a woken loop thread waiting for this core runs now
                    stepped_aside = now
                    yields[slot] += 1


class _Unraisable:
    def __init__(self, exc: BaseException | None, obj: Any) -> None:
        self.exc_type = type(exc)
        self.exc_value = exc
        self.exc_traceback = exc.__traceback__ if exc else None
        self.err_msg = "asyncgraph worker: internal error"
        self.object = obj

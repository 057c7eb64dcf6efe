"""WorkerPool: the CPU threads that run heavy kernels while the event loop stays free.

torch releases the GIL inside its kernels, so `size` threads run independent branches truly in
parallel. Work items are plain `(function, frame, node)` tuples on a SimpleQueue: no Future per
item, because the scheduler does its own completion accounting in the frame.

Each thread sets torch's intra-op thread count to the one of the thread that started the pool:
with OpenMP a new thread does not inherit `torch.set_num_threads`, and would run every matmul
on all cores (two workers on two cores then oversubscribe them four times over).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WorkItem = tuple[Callable[[Any, int], None], Any, int]


@dataclass(frozen=True, slots=True)
class WorkerPoolStatistics:
    threads: int
    queued: int
    items_run: int


class WorkerPool:
    """A fixed set of daemon threads draining one queue; started lazily, joined by aclose."""

    def __init__(self, size: int, name: str = "asyncgraph-worker", inference_mode: bool = True):
        self.size = size
        self._name = name
        self._inference_mode = inference_mode
        self._queue: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._items_run: list[int] = []  # one slot per thread: no shared counter to race on
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def submit(self, fn: Callable[[Any, int], None], frame: Any, node: int) -> None:
        """Run `fn(frame, node)` on a worker thread. `fn` must not raise."""
        if not self._threads:
            self._start()
        self._queue.put((fn, frame, node))

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._items_run[:] = [0] * self.size
            intra_op = torch.get_num_threads()
            for i in range(self.size):
                thread = threading.Thread(
                    target=_worker_main,
                    args=(self._queue, self._inference_mode, self._items_run, i, intra_op),
                    name=f"{self._name}-{i}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
            self._finalizer = weakref.finalize(self, _stop_threads, self._queue, self.size)

    async def aclose(self) -> None:
        """Stop the threads after the work already queued, and wait until they are gone."""
        threads, self._threads = self._threads, []
        if not threads:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
        _stop_threads(self._queue, len(threads))
        delay = 0.0005
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(delay)  # a blocking join() would stall the event loop
            delay = min(delay * 2, 0.05)
        for thread in threads:
            thread.join()

    def statistics(self) -> WorkerPoolStatistics:
        return WorkerPoolStatistics(len(self._threads), self._queue.qsize(), sum(self._items_run))


def _stop_threads(q: queue.SimpleQueue[WorkItem | None], count: int) -> None:
    for _ in range(count):
        q.put(None)


def _worker_main(
    q: queue.SimpleQueue[WorkItem | None],
    inference_mode: bool,
    items_run: list[int],
    slot: int,
    intra_op_threads: int,
) -> None:
    torch.set_num_threads(intra_op_threads)
    with torch.inference_mode(inference_mode):
        while True:
            item = q.get()
            if item is None:
                return
            fn, frame, node = item
            items_run[slot] += 1  # counted when taken, so it is exact once the execution ends
            try:
                fn(frame, node)
            except BaseException:  # the scheduler catches kernel errors; this is a bug
                sys.unraisablehook(_Unraisable(sys.exc_info()[1], fn))  # type: ignore[arg-type]
            del item, fn, frame


class _Unraisable:
    def __init__(self, exc: BaseException | None, obj: Any) -> None:
        self.exc_type = type(exc)
        self.exc_value = exc
        self.exc_traceback = exc.__traceback__ if exc else None
        self.err_msg = "asyncgraph worker: internal error"
        self.object = obj

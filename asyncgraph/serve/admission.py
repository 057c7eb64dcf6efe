"""Admission: the server's bounded, first-come-first-served queue in front of one model.

An Executor already makes callers wait for a free frame. The server puts its own gate of the
same width (`capacity_for`) in front of it for two reasons: a request that would wait behind
`max_queue` others is refused at once with 503 (backpressure instead of an unbounded pile of
waiting requests and their input tensors), and the time a request spends queued is measured
exactly, for the `nv_inference_queue_duration_us` metric. Behind the gate the executor finds a
frame free, so its own pool stays the final bound.

With dynamic batching the gate is wider: frames x max_batch_size requests, so enough requests
reach the batcher to fill every frame's batch (a gate of one request per frame would cap every
batch at the frame count). The gate counts requests, not rows: every request has at least one
row, so that many requests always carry enough rows, and the batcher's own bounded queue holds
the requests its running batches have no room for.

State: `running` slots taken, `waiters` FIFO. A slot released goes straight to the oldest
waiter; a waiter cancelled after it was handed a slot passes the slot on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.serve.errors import ProtocolError


def capacity_for(config: ExecutorConfig) -> int:
    """Requests the gate lets into an executor at once: one per frame, or with batching
    enough to fill a batch per frame (see the module docstring)."""
    frames = config.max_concurrent_executions
    batching = config.batching
    return frames if batching is None else frames * batching.max_batch_size


class Admission:
    """At most `capacity` requests run; at most `max_queue` wait; the rest get 503."""

    def __init__(self, model: str, capacity: int, max_queue: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.capacity = capacity
        self.max_queue = max_queue
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def check(self) -> None:
        """Refuse now (503) if a request arriving now would find the queue full."""
        if self.running >= self.capacity and len(self._waiters) >= self.max_queue:
            raise ProtocolError(
                f"model {self.model!r} is overloaded: {self.running} request(s) running and "
                f"{len(self._waiters)} queued (max queue {self.max_queue}); retry later",
                status=503,
            )

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a slot for the block; yields the seconds spent queued."""
        start = time.perf_counter()
        if self.running < self.capacity and not self._waiters:
            self.running += 1
        else:
            self.check()
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter  # the releaser counted us in `running`
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._release()  # handed a slot, then cancelled: pass it on
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        try:
            yield time.perf_counter() - start
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1

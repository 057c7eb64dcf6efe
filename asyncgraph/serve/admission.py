"""Admission: the server's first-come-first-served gate in front of one model.

An Executor already makes callers wait for a free frame. The server puts its own gate of the
same width (`capacity_for`) in front of it so that it can decide, when a request arrives,
whether to take it at all, and so that the time a request spends queued is measured exactly
(the `nv_inference_queue_duration_us` metric). Behind the gate the executor finds a frame free,
so its own pool stays the final bound.

The policy asks whether a request can finish in time, not how many others wait:

- **Deadline.** The gate measures its service rate two ways. Its throughput while backlogged
  (more requests admitted than slots): completions per second of backlogged time, decayed
  sums weighted `THROUGHPUT_EWMA_WEIGHT`; it counts every stage a request passes after
  admission, the body read and JSON decode on the event loop included, which for a small
  model with large JSON bodies is the bottleneck. Until it has a sample (the gate has never
  been backlogged), capacity / the mean time a request holds a slot (an exponentially
  weighted mean, `SERVICE_EWMA_WEIGHT`; Little's law with every slot busy). A request that
  would have to wait behind `ahead` others (admitted, not yet running) expects to wait
  (ahead - free slots + 1) / rate and then to run one mean service time. It is refused
  (503, reason `deadline`) when that exceeds the time left to its deadline: it could not make
  it, and a 503 now lets the client retry elsewhere instead of learning so at its deadline.
  Before the first completion nothing is measured and every request is admitted; a request
  with no deadline is never refused for time; a request that finds a slot free never waits,
  so it is never refused for time either.
- **Memory.** Hard caps bound what waiting requests hold: `max_queue` requests waiting beyond
  the free slots (reason `max_queue`) and `max_queue_bytes` bytes of request bodies not yet
  running (reason `max_queue_bytes`; a lone request is always let in, it is bounded by the
  body size limit already).

A request enters the gate (`enter`, a `Ticket`) before its body is read, so a refusal costs
no read, and holds its place and its bytes until it takes a slot (`slot`) or fails. Once its
body is decoded it may carry a deadline of its own (Triton's `parameters.timeout`); `slot`
checks the deadline again with it, against the requests that queue for a slot ahead of it.

With dynamic batching the gate is wider: frames x max_batch_size requests, so enough requests
reach the batcher to fill every frame's batch (a gate of one request per frame would cap every
batch at the frame count). The gate counts requests, not rows: every request has at least one
row, so that many requests always carry enough rows, and the batcher's own bounded queue holds
the requests its running batches have no room for.

State: `running` slots taken, `waiters` FIFO for a slot, `pending` tickets not yet running
(reading, decoding or waiting) and their bytes. A slot released goes straight to the oldest
waiter; a waiter cancelled after it was handed a slot passes the slot on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType

from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.serve.errors import ProtocolError

#: The weight of the newest service time in the running mean: about the last 10 requests
#: count, so the estimate follows a change of load within a few dozen requests without
#: swinging on one slow request.
SERVICE_EWMA_WEIGHT = 0.1

#: The weight of the newest completion in the backlogged throughput (about the last 20
#: completions count): completions come in bunches with batching, so the rate is a ratio of
#: decayed sums (completions / backlogged seconds), not a mean of single intervals.
THROUGHPUT_EWMA_WEIGHT = 0.05

#: Refusal reasons (the `reason` label of asyncgraph_admission_refusals_total).
DEADLINE = "deadline"
MAX_QUEUE = "max_queue"
MAX_QUEUE_BYTES = "max_queue_bytes"
REASONS = (DEADLINE, MAX_QUEUE, MAX_QUEUE_BYTES)


def capacity_for(config: ExecutorConfig) -> int:
    """Requests the gate lets into an executor at once: one per frame, or with batching
    enough to fill a batch per frame (see the module docstring)."""
    frames = config.max_concurrent_executions
    batching = config.batching
    return frames if batching is None else frames * batching.max_batch_size


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """A snapshot of one gate, for metrics and tests."""

    capacity: int
    running: int
    queued: int
    queued_bytes: int
    admitted: int
    completed: int
    mean_service_s: float | None
    throughput: float | None
    service_rate: float | None
    expected_wait_s: float
    refused: dict[str, int] = field(default_factory=dict)


class Admission:
    """At most `capacity` requests run; the rest wait unless they cannot make their deadline
    or the memory caps are reached (see the module docstring)."""

    def __init__(
        self,
        model: str,
        capacity: int,
        max_queue: int,
        max_queue_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_queue_bytes < 0:
            raise ValueError(f"max_queue_bytes must be >= 0, got {max_queue_bytes}")
        self.model = model
        self.capacity = capacity
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.clock = clock
        self.running = 0
        self.pending = 0
        self.pending_bytes = 0
        self.admitted = 0
        self.completed = 0
        self.mean_service_s: float | None = None
        self._backlog_mark: float | None = None  # since when the gate is backlogged
        self._backlog_s = 0.0  # decayed sums of backlogged seconds and completions in them
        self._backlog_done = 0.0
        self.refused = dict.fromkeys(REASONS, 0)
        self._waiters: deque[asyncio.Future[None]] = deque()

    # -- the estimate -----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests admitted and not yet running (reading, decoding or waiting for a slot)."""
        return self.pending

    @property
    def backlogged(self) -> bool:
        """More requests admitted than slots: some wait, so completions come at full rate."""
        return self.pending + self.running > self.capacity

    @property
    def throughput(self) -> float | None:
        """Completions per second while backlogged; None before the first such completion."""
        if self._backlog_done == 0.0:
            return None
        return self._backlog_done / max(self._backlog_s, 1e-9)

    @property
    def service_rate(self) -> float | None:
        """Requests per second the gate serves when loaded: its backlogged throughput, or
        before that capacity / mean slot time; None before the first completion."""
        throughput = self.throughput
        if throughput is not None:
            return throughput
        mean = self.mean_service_s
        if mean is None:
            return None
        return self.capacity / max(mean, 1e-9)

    def expected_wait_s(self, ahead: int) -> float:
        """Seconds a request expects to wait for a slot behind `ahead` others (0 when a slot
        will be free for it, or before anything is measured)."""
        rate = self.service_rate
        behind_free = ahead - (self.capacity - self.running)
        if rate is None or behind_free < 0:
            return 0.0
        return (behind_free + 1) / rate

    def observe_service(self, seconds: float) -> None:
        """Fold one request's time holding a slot into the running mean, and the completion
        into the backlogged throughput (call it before the slot is released)."""
        mean = self.mean_service_s
        self.mean_service_s = seconds if mean is None else (
            mean + SERVICE_EWMA_WEIGHT * (seconds - mean)
        )
        self.completed += 1
        if self._backlog_mark is not None:
            now = self.clock()
            keep = 1.0 - THROUGHPUT_EWMA_WEIGHT
            self._backlog_s = self._backlog_s * keep + (now - self._backlog_mark)
            self._backlog_done = self._backlog_done * keep + 1.0
            self._backlog_mark = now

    def _track_backlog(self) -> None:
        """Start the backlogged clock when the gate becomes backlogged, stop it when not."""
        if not self.backlogged:
            self._backlog_mark = None
        elif self._backlog_mark is None:
            self._backlog_mark = self.clock()

    # -- entering ---------------------------------------------------------------------------

    def enter(self, nbytes: int = 0, remaining_s: float | None = None) -> Ticket:
        """Admit a request holding `nbytes` of body with `remaining_s` to its deadline (None:
        no deadline), or refuse it now with 503 naming the reason."""
        ahead = self.pending
        free = self.capacity - self.running
        if ahead - free >= self.max_queue:
            self._refuse(MAX_QUEUE, f"{self.running} request(s) running and {ahead} queued "
                                    f"(max queue {self.max_queue}, --max-queue)")
        if ahead and self.pending_bytes + nbytes > self.max_queue_bytes:
            self._refuse(MAX_QUEUE_BYTES, self._bytes_message(nbytes))
        self._check_deadline(ahead, remaining_s)
        self.pending += 1
        self.pending_bytes += nbytes
        self.admitted += 1
        self._track_backlog()
        return Ticket(self, nbytes)

    def _check_deadline(self, ahead: int, remaining_s: float | None) -> None:
        if remaining_s is None or self.mean_service_s is None:
            return
        if ahead < self.capacity - self.running:
            return  # a slot is free for it: it does not wait, so there is nothing to predict
        wait = self.expected_wait_s(ahead)
        finish = wait + self.mean_service_s
        if finish > remaining_s:
            self._refuse(
                DEADLINE,
                f"{ahead} request(s) ahead at {self.service_rate:.1f} req/s: expected to "
                f"finish in {finish * 1e3:.0f} ms (wait {wait * 1e3:.0f} ms + service "
                f"{self.mean_service_s * 1e3:.0f} ms), past its deadline in "
                f"{max(remaining_s, 0.0) * 1e3:.0f} ms",
            )

    def _bytes_message(self, nbytes: int) -> str:
        return (f"{self.pending} queued request(s) hold {self.pending_bytes} bytes; "
                f"{nbytes} more would pass the cap of {self.max_queue_bytes} bytes "
                f"(--max-queue-bytes)")

    def _refuse(self, reason: str, why: str) -> None:
        self.refused[reason] += 1
        raise ProtocolError(f"model {self.model!r} is overloaded: {why}; retry later", 503)

    # -- running ----------------------------------------------------------------------------

    @asynccontextmanager
    async def slot(
        self, ticket: Ticket, remaining_s: float | None = None
    ) -> AsyncIterator[float]:
        """Hold a slot for the block; yields the seconds spent queued. `remaining_s` (the
        request's own deadline, now known) is checked against the requests waiting ahead."""
        start = self.clock()
        if self.running < self.capacity and not self._waiters:
            self.running += 1
        else:
            self._check_deadline(len(self._waiters), remaining_s)
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
        ticket.close()
        started = self.clock()
        try:
            yield started - start
        except BaseException:
            self._release()
            raise
        self.observe_service(self.clock() - started)  # only a finished request measures
        self._release()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
        self._track_backlog()

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            capacity=self.capacity,
            running=self.running,
            queued=self.pending,
            queued_bytes=self.pending_bytes,
            admitted=self.admitted,
            completed=self.completed,
            mean_service_s=self.mean_service_s,
            throughput=self.throughput,
            service_rate=self.service_rate,
            expected_wait_s=self.expected_wait_s(self.pending),
            refused=dict(self.refused),
        )


class Ticket:
    """A request's place at the gate from its arrival until it runs or fails: it counts in
    `queued` and its body's bytes in `queued_bytes`. Close it (or use it as a context
    manager) on every path; closing twice is harmless."""

    __slots__ = ("admission", "nbytes", "open")

    def __init__(self, admission: Admission, nbytes: int) -> None:
        self.admission = admission
        self.nbytes = nbytes
        self.open = True

    def resize(self, nbytes: int) -> None:
        """The body turned out `nbytes` long (no Content-Length, or it inflated): account
        for it, refusing (503, `max_queue_bytes`) if that passes the cap."""
        gate = self.admission
        grow = nbytes - self.nbytes
        others = gate.pending_bytes - self.nbytes
        if grow > 0 and gate.pending > 1 and gate.pending_bytes + grow > gate.max_queue_bytes:
            gate._refuse(MAX_QUEUE_BYTES, (
                f"{gate.pending - 1} other queued request(s) hold {others} bytes; this "
                f"body's {nbytes} bytes would pass the cap of {gate.max_queue_bytes} bytes "
                f"(--max-queue-bytes)"))
        gate.pending_bytes += grow
        self.nbytes = nbytes

    def close(self) -> None:
        if self.open:
            self.open = False
            self.admission.pending -= 1
            self.admission.pending_bytes -= self.nbytes
            self.admission._track_backlog()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""Admission: the server's first-come-first-served gate in front of one model.

An Executor already makes callers wait for a free frame. The server puts its own gate of the
same width (`capacity_for`) in front of it so that it can decide, when a request arrives,
whether to take it at all, and so that the time a request spends queued is measured exactly
(the `nv_inference_queue_duration_us` metric). Behind the gate the executor finds a frame free,
so its own pool stays the final bound.

A request passes two stages after admission, and both are measured; what the measurements
predict (the running means, the rates, the expected wait, calibration) is wait_model.py's
WaitModel, which the gate is:

- **The decode lane.** Decoding a body (JSON above all: 12,800 floats take 3.5-12 ms on 2 loaded
  cores) and encoding a response hold the event loop, so they are serial whatever the slots: for
  a small model with large JSON bodies they are the bottleneck. Decodes take turns in a FIFO
  lane (`decoding`) that gives the loop a turn once they have held it `LANE_SLICE_S`: the loop
  then reads new arrivals, so a request the gate refuses is answered after at most a slice and
  one decode, not after every decode admitted before it, and a completion is not held behind a
  run of decodes, so the slot time measures the execution. Small bodies still decode together in
  one turn, as they arrived, and reach a batcher together. The lane's decode times, and the
  interval from one decode's end to the next when they queue, feed the mean loop time per
  request (wait_model.py).
- **The slots.** At most `capacity` requests execute; the gate measures the time a request
  holds a slot, whose mean gives the slots' rate (wait_model.py).

**Deadline.** A new request expects to wait for the decodes ahead of it and for a slot, the
longer of the two, then to execute one mean slot time (`WaitModel.wait_s`). It is refused
(503, reason `deadline`) when that passes the time left to its deadline: it could not make
it, and a 503 now lets the client retry elsewhere instead of learning so at its deadline. A
request with no deadline is never refused for time, nor one with nothing ahead of it (it
waits for nothing).

**Uncalibrated.** The app calibrates each model's gate at start-up (calibration.py, then
`calibrate`: see wait_model.py), so it predicts from the first request on.
Uncalibrated (the model failed on synthesised inputs, or a mounted app whose lifespan never
ran), the gate has no basis to promise any wait before the first completion: a request with a
deadline is then admitted only while the requests in flight (admitted, not finished) fit the
slots (`first_burst`; with batching, one per frame, not the frames x max_batch_size the
batcher takes), so none of them queues for a slot and the lane holds at most one decode per
slot; the rest of a first burst gets 503 at once (Retry-After) rather than being admitted
blindly to miss its deadline together, which is what a decode-bound first burst did (every
request of it 504).

**Memory.** Hard caps bound what waiting requests hold: `max_queue` requests waiting beyond
the free slots (reason `max_queue`) and `max_queue_bytes` bytes of request bodies not yet
running (reason `max_queue_bytes`; a lone request is always let in, it is bounded by the body
size limit already). The server charges a body's bytes as they arrive (`Ticket.grow`), not
its declared Content-Length: four idle connections declaring 64 MB each filled the default
256 MB cap and every other request got 503 for as long as they stayed open (issue 39).

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
(reading, decoding or waiting) and their bytes, `decoding` tickets in the lane or waiting for
it. A slot released goes straight to the oldest waiter; a waiter cancelled after it was handed
a slot passes the slot on (the slot and the lane wait in runtime/gate.py's HandOffQueue, as
the executor's frame pool does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from types import TracebackType

from asyncgraph.runtime.config import BatchingConfig, ExecutorConfig
from asyncgraph.runtime.gate import HandOffQueue
from asyncgraph.serve.errors import ProtocolError
from asyncgraph.serve.wait_model import SERVICE_EWMA_WEIGHT, Calibration, WaitModel

__all__ = [  # Calibration and SERVICE_EWMA_WEIGHT are wait_model.py's, imported from here too
    "DEADLINE", "LANE_SLICE_S", "MAX_QUEUE", "MAX_QUEUE_BYTES", "REASONS",
    "SERVICE_EWMA_WEIGHT", "Admission", "AdmissionStatistics", "Calibration", "Ticket",
    "WaitModel", "capacity_for",
]

#: Decodes run back to back in one loop turn until they have held the loop this long (wall
#: time, not the gate's clock): small bodies decode together, as they arrived together (so a
#: batcher sees them together), while behind large JSON bodies (3.5-12 ms each) anything that
#: arrives, a request to refuse or a completion, waits at most this plus one decode. Shorter
#: cost throughput in a burst (300 x 253 KB at no deadline took 2.4-3.4 s at 2 ms, 1.4-2.7 s at
#: 20 ms, 1.7-2.5 s without the lane; more loop turns, each reading every busy socket), while
#: the transport alone already delays a 503 by ~100 ms in such a burst.
LANE_SLICE_S = 0.02

#: Refusal reasons (the `reason` label of asyncgraph_admission_refusals_total).
DEADLINE = "deadline"
MAX_QUEUE = "max_queue"
MAX_QUEUE_BYTES = "max_queue_bytes"
REASONS = (DEADLINE, MAX_QUEUE, MAX_QUEUE_BYTES)


def capacity_for(config: ExecutorConfig, batching: BatchingConfig | None) -> int:
    """Requests the gate lets into an executor at once: one per frame, or with batching
    (`Executor.batching`, or before the Executor exists `requested_batching(config)`) enough
    to fill a batch per frame (see the module docstring)."""
    frames = config.max_concurrent_executions
    return frames if batching is None else frames * batching.max_batch_size


@dataclass(frozen=True, slots=True)
class AdmissionStatistics:
    """A snapshot of one gate, for metrics and tests."""

    capacity: int
    running: int
    queued: int
    queued_bytes: int
    decoding: int
    admitted: int
    completed: int
    mean_service_s: float | None
    mean_decode_s: float | None
    mean_encode_s: float | None
    mean_turn_s: float | None
    decode_s_per_byte: float | None
    loop_s: float
    service_rate: float | None
    expected_wait_s: float
    calibration: Calibration | None = None
    refused: dict[str, int] = field(default_factory=dict)


class Admission(WaitModel):
    """At most `capacity` requests run; the rest wait unless they cannot make their deadline
    or the memory caps are reached (see the module docstring). The estimate it admits by,
    and the means it measures into, are its WaitModel's (wait_model.py)."""

    def __init__(
        self,
        model: str,
        capacity: int,
        max_queue: int,
        max_queue_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        lane_slice_s: float = LANE_SLICE_S,
        first_burst: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_queue_bytes < 0:
            raise ValueError(f"max_queue_bytes must be >= 0, got {max_queue_bytes}")
        if first_burst is not None and first_burst < 1:
            raise ValueError(f"first_burst must be >= 1, got {first_burst}")
        super().__init__(capacity)
        self.model = model
        self.first_burst = capacity if first_burst is None else min(first_burst, capacity)
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self.clock = clock
        self.pending_bytes = 0
        self.in_lane = 0  # requests in the decode lane or waiting for it
        self.admitted = 0
        self.refused = dict.fromkeys(REASONS, 0)
        self._waiters: HandOffQueue[None] = HandOffQueue()  # for a slot
        self.lane_slice_s = lane_slice_s
        self._lane_busy = False
        self._lane_waiters: HandOffQueue[None] = HandOffQueue()
        self._slice_end = 0.0  # perf_counter time the current run of decodes yields at

    # -- the counts the estimate reads ------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests admitted and not yet running (reading, decoding or waiting for a slot)."""
        return self.pending

    def _to_decode(self) -> int:
        """Admitted requests that have not been decoded: all pending but the slot waiters."""
        return self.pending - len(self._waiters)

    # -- entering ---------------------------------------------------------------------------

    def enter(
        self, nbytes: int = 0, remaining_s: float | None = None, *,
        expected_bytes: int | None = None,
    ) -> Ticket:
        """Admit a request holding `nbytes` of body with `remaining_s` to its deadline (None:
        no deadline), or refuse it now with 503 naming the reason. `expected_bytes` (its
        Content-Length, when the server charges the body as it arrives with `Ticket.grow`)
        prices its decode; it defaults to `nbytes`."""
        self.arrived += 1
        ahead = self.pending
        free = self.capacity - self.running
        if ahead - free >= self.max_queue:
            self._refuse(MAX_QUEUE, f"{self.running} request(s) running and {ahead} queued "
                                    f"(max queue {self.max_queue}, --max-queue)")
        if ahead and self.pending_bytes + nbytes > self.max_queue_bytes:
            self._refuse(MAX_QUEUE_BYTES, self._bytes_message(nbytes))
        self._check_deadline(
            ahead, remaining_s, to_decode=self._to_decode(),
            nbytes=nbytes if expected_bytes is None else expected_bytes,
        )
        self.pending += 1
        priced = max(nbytes, expected_bytes or 0)
        self.pending_bytes += nbytes
        self.pending_priced_bytes += priced
        self.admitted += 1
        return Ticket(self, nbytes, priced)

    def _check_deadline(
        self, ahead: int, remaining_s: float | None, to_decode: int = 0, nbytes: int = 0
    ) -> None:
        """Refuse (503) a request of `nbytes` that would wait behind `ahead` others for a
        slot and behind `to_decode` for the loop when it cannot finish by `remaining_s`."""
        if remaining_s is None:
            return
        free = self.capacity - self.running
        if ahead < free and to_decode == 0:
            return  # nothing ahead of it: it waits for nothing, so there is nothing to predict
        mean = self.mean_service_s
        if mean is None:
            self._check_unmeasured(ahead)
            return
        wait = self.wait_s(ahead, to_decode, nbytes)
        finish = wait + mean
        if finish > remaining_s:
            self._refuse(
                DEADLINE,
                f"{ahead} request(s) ahead ({to_decode} to decode at "
                f"{self._loop_s_ahead() * 1e3:.1f} ms each; {self.capacity - free} running in "
                f"{self.capacity} slots at {self.slot_rate:.1f} req/s): expected to finish in "
                f"{finish * 1e3:.0f} ms (wait {wait * 1e3:.0f} ms + service {mean * 1e3:.0f} "
                f"ms), past its deadline in {max(remaining_s, 0.0) * 1e3:.0f} ms",
            )

    def _check_unmeasured(self, ahead: int) -> None:
        """Before a completion: admit while the requests in flight fit the first burst (the
        slots, or one request per frame with batching)."""
        in_flight = ahead + self.running
        if in_flight >= self.first_burst:
            self._refuse(
                DEADLINE,
                f"nothing measured yet and {in_flight} request(s) in flight fill its first "
                f"{self.first_burst} place(s): a request that would queue cannot be promised "
                f"its deadline until the first completes",
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
            await self._waiters.wait(self._pass_slot_on)  # the releaser counted us in `running`
        ticket.close()
        started = self.clock()
        try:
            yield started - start
        except BaseException:
            self._release()
            raise
        self.observe_service(self.clock() - started)  # only a finished request measures
        self._release()

    @asynccontextmanager
    async def decoding(self, ticket: Ticket) -> AsyncIterator[None]:
        """Hold the decode lane for the block (decode the body in it): FIFO, one at a time;
        decodes run back to back in one loop turn until they have held the loop for
        `lane_slice_s`, then the next one starts a loop turn of its own (see the module
        docstring). A decode that finishes counts in the mean decode time."""
        self.in_lane += 1
        try:
            waited = await self._enter_lane()  # then it runs in a later loop turn
            try:
                now = time.perf_counter()
                if not waited and now >= self._slice_end:
                    await asyncio.sleep(0)  # the rest of this loop turn runs first
                    now = time.perf_counter()
                if waited or now >= self._slice_end:
                    self._slice_end = now + self.lane_slice_s
                started = self.clock()
                yield
                self.observe_decode(started, self.clock(), ticket.nbytes, waited)
            finally:
                self._leave_lane()
        finally:
            self.in_lane -= 1

    async def _enter_lane(self) -> bool:
        """Take the decode lane, waiting FIFO while it is held; True when it waited.

        A HandOffQueue of futures of the running loop, not an asyncio.Lock: a lock binds to
        the first loop that waits on it, and an app may outlive its loop."""
        if not self._lane_busy and not self._lane_waiters:
            self._lane_busy = True
            return False
        await self._lane_waiters.wait(self._pass_lane_on)  # the leaver handed it over
        return True

    def _leave_lane(self) -> None:
        if not self._lane_waiters.hand_over(None):
            self._lane_busy = False

    def _pass_lane_on(self, _handed: None) -> None:
        """A waiter handed the lane was cancelled before it ran: the lane goes on."""
        self._leave_lane()

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Time the block (encode a response) into the mean encode time, when it finishes."""
        started = self.clock()
        yield
        self.observe_encode(self.clock() - started)

    def _release(self) -> None:
        if not self._waiters.hand_over(None):
            self.running -= 1

    def _pass_slot_on(self, _handed: None) -> None:
        """A waiter handed a slot was cancelled before it ran: the slot goes on."""
        self._release()

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            capacity=self.capacity,
            running=self.running,
            queued=self.pending,
            queued_bytes=self.pending_bytes,
            admitted=self.admitted,
            completed=self.completed,
            decoding=self.in_lane,
            mean_service_s=self.mean_service_s,
            mean_decode_s=self.mean_decode_s,
            mean_encode_s=self.mean_encode_s,
            mean_turn_s=self.mean_turn_s,
            decode_s_per_byte=self.mean_decode_s_per_byte,
            loop_s=self.loop_s,
            service_rate=self.service_rate,
            expected_wait_s=self.arrival_wait_s(self._to_decode()),
            calibration=self.calibration,
            refused=dict(self.refused),
        )


class Ticket:
    """A request's place at the gate from its arrival until it runs or fails: it counts in
    `queued` and its body's bytes in `queued_bytes`. Close it (or use it as a context
    manager) on every path; closing twice is harmless."""

    __slots__ = ("admission", "nbytes", "open", "priced")

    def __init__(self, admission: Admission, nbytes: int, priced: int | None = None) -> None:
        self.admission = admission
        self.nbytes = nbytes
        self.priced = nbytes if priced is None else priced  # its size for the estimate
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
        if nbytes > self.priced:
            gate.pending_priced_bytes += nbytes - self.priced
            self.priced = nbytes

    def grow(self, nbytes: int) -> None:
        """`nbytes` more of the body arrived: charge them (`resize`), as the server does
        while it reads a body, so a client that declares a large body and sends it slowly
        (or not at all) holds only what it sent."""
        self.resize(self.nbytes + nbytes)

    def close(self) -> None:
        if self.open:
            self.open = False
            self.admission.pending -= 1
            self.admission.pending_bytes -= self.nbytes
            self.admission.pending_priced_bytes -= self.priced

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

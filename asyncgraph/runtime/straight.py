"""The straight line: an all-inline schedule run as one loop over its units, without the dataflow.

When every unit of a schedule runs inline on the event loop, the dataflow machinery buys
nothing: producer counts, the frame lock, the ready stack and `pending` all exist to let units
run on several threads and in any ready order. Run on one thread, the units can simply go in
their topological order, storing each result and dropping the values whose last reader it was.
That is nativert's serial executor; here it costs a fraction of a microsecond per unit instead
of about one, which on small graphs is most of an execution's fixed cost. The form (the
units' drops and times: `StraightLine`) is made with the schedule (schedule.py).

An execution takes this path only when it cannot be interleaved with anything: no worker,
task or CUDA unit, no profiling or tracing, no seeded ready order, and measured unit times
(Scheduler decides). It then runs in one of three ways:

- at once, without a coroutine, when it fits what is left of the loop's slice (`run_now`),
  and without a frame where the frame would hold nothing more than the values and a frame
  is free (`run_alone`, the Executor's first try);
  refused only because the slice is spent, it is tried once more after one loop iteration
  (`retry`: the dataflow would defer it as well, at the cost of a future);
- in the loop's slices, deferring between them as the dataflow does, when it is longer
  (`run_in_slices`), so neither stretches a loop iteration beyond what the dataflow would;
- whole, as one work item of a worker thread, when other executions are in flight to overlap
  it and its nodes are mostly kernel time, off the GIL (`takes_worker`, `hand_off`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.failures import add_node_note, fail, internal_error, raise_errors
from asyncgraph.runtime.frame import ExecutionFrame
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.schedule import Schedule, StraightLine, straight_line
from asyncgraph.runtime.workers import WorkerPool

__all__ = ["StraightLine", "StraightRunner", "straight_line"]

# torch.inference_mode() is a Python context manager costing ~3 us per entry; the C++ guard
# behind it (~0.4 us with `with`) enables the mode when made and restores it when freed, and
# its __enter__ and __exit__ do nothing: the straight line makes and frees it without them.
_inference_mode = torch._C._InferenceMode

_FIRST_UNIT = ((0.0, 0),)  # a straight line handed to a worker starts at its first unit

# Why `StraightRunner.admit` does not let a line run at once (else it returns a start time)
RETRY = "retry: a fresh slice holds it"
TO_WORKER = "to a worker: others wait on the loop"
REFUSED = "refused: longer than a slice"


class StraightRunner:
    """Runs straight lines of one Executor's executions (the module docstring's three ways)."""

    def __init__(
        self, graph: Graph, state: LoopState, workers: WorkerPool, config: ExecutorConfig
    ) -> None:
        self.graph = graph
        self.state = state
        self.workers = workers
        self._inference_mode = config.inference_mode
        bar = config.worker_execution_node_us
        self._worker_node_s = float("inf") if bar is None else bar * 1e-6
        self.retry: ExecutionFrame | None = None  # refused for a spent slice: see run_now
        self.to_worker: ExecutionFrame | None = None  # refused for an idle worker: see run_now
        self.worker_executions = 0  # straight lines run on a worker thread (hand_off)

    def admit(self, straight: StraightLine) -> float | str:
        """Whether the line runs at once on the loop: the perf_counter time it starts at when
        it fits what is left of the loop's slice; otherwise why not: RETRY when a fresh slice
        would hold it (try once more after one loop iteration), TO_WORKER when other work
        waits on the loop and the line is worth a worker (the line found the slice spent
        with others waiting, or it fits but other callers queue: it queues for the workers,
        which keep the CPUs busy while the loop serves the others), REFUSED when neither (it
        runs in slices).

        A 0.42 ms compiled BERT segment finds the slice spent every third execution of one
        caller: 3-4% less time per execution with the retry than through the dataflow.
        """
        state = self.state
        budget = state.budget if state.budget is not None else state.bind()
        start = budget.start(straight.seconds)
        if start is None:  # the slice is spent, or left too short for it
            if straight.seconds > budget.slice_s:
                return REFUSED
            if budget.others_wait and self._worth_a_worker(straight):  # extend's peek
                return TO_WORKER
            return RETRY
        if self._worth_a_worker(straight) and budget.others_queued():
            return TO_WORKER
        return start

    def run_now(
        self, frame: ExecutionFrame, straight: StraightLine, admitted: float | str | None = None
    ) -> bool:
        """Run the loaded frame to completion when `admit` lets the line run at once (or
        `admitted`, its answer for this execution already): True once it ran (its error
        raised here). False otherwise, with the frame in `retry` or `to_worker` for the
        dataflow's run to act on."""
        if admitted is None:
            admitted = self.admit(straight)
        if isinstance(admitted, str):
            if admitted is RETRY:
                self.retry = frame
            elif admitted is TO_WORKER:
                self.to_worker = frame
            return False
        self._units(frame, straight, 0)
        self.state.account(admitted, time.perf_counter())
        frame.finish()
        if frame.errors:
            raise_errors(frame)
        return True

    def run_alone(self, schedule: Schedule, values: list[Any], start: float) -> None:
        """Run the schedule's straight line on `values`, with no frame, once `admit` let it
        start at `start`; a kernel error is raised here, its node named.

        A frame's load, finish and clear and the pool's acquire and release are a fixed
        cost per execution: without them a one-node graph ran in 12.2-12.5 us against
        14.7-15.3 us, an 8-layer MLP compiled into one segment in 37-44 against 43-49 us
        (2026-11-27). Run synchronously, nothing interleaves with the line: no cancellation,
        no other execution reading the values, no unit left in flight."""
        straight = schedule.straight
        assert straight is not None
        calls, stores, drops = schedule.calls, schedule.stores, straight.drops
        guard = _inference_mode(self._inference_mode)
        try:
            for unit, call in enumerate(calls):
                try:
                    result = call(values)
                except BaseException as exc:
                    add_node_note(exc, self.graph, schedule.failed_node(unit, exc))
                    raise
                if stores[unit] >= 0:
                    values[stores[unit]] = result
                del result
                for value in drops[unit]:
                    values[value] = None
        finally:
            del guard
        self.state.account(start, time.perf_counter())

    def takes_worker(self, straight: StraightLine, contended: bool = False) -> bool:
        """Whether this straight line runs on a worker thread rather than in the loop's
        slices: another execution is in flight to overlap it, it takes at least a slice (on
        the loop it would span iterations anyway, so the hop is a small part of it), its nodes
        are mostly kernel time, off the GIL (`worker_execution_node_us`), and none of them
        is held to the loop thread by a placement hint or its kind. Adaptive placement keeps
        such a line whole on a loaded loop (AdaptivePlacement._runs_whole_on_worker).

        Lines are not held back while the workers are busy: they queue for them (the frames
        bound how many). Capped at one line on workers fewer than the CPUs, so that the loop
        ran the others itself, 64 unbatched callers of tiny BERT compiled into one segment
        ran 2,581-2,819 requests/s against 3,697 uncapped: a worker that finished waited for
        the loop, busy in a segment, to hand it the next line (alternating storms on a 2-vCPU
        machine, 2026-11-27; batches of 32 rows: 7,625 against 8,015).

        `contended`: run_now found other work waiting on the loop (`to_worker`), so that work
        is there to overlap it and the loop's CPU is taken: a line shorter than a slice goes
        too, and no other execution need be in flight (executions that run straight on the
        loop finish before the next one starts).
        """
        budget = self.state.budget
        return (
            (contended or self.state.running > 1)
            and self._worth_a_worker(straight)
            and budget is not None
            and (contended or straight.seconds >= budget.slice_s)
        )

    def _worth_a_worker(self, straight: StraightLine) -> bool:
        """Whether this line may go to a worker: its nodes are kernel time enough and free to
        leave the loop thread."""
        return straight.node_seconds >= self._worker_node_s and straight.any_thread

    def hand_off(self, frame: ExecutionFrame, straight: StraightLine) -> None:
        """Send the straight line to a worker thread. Never raises: a failed submission
        fails the execution and finishes the frame here."""
        self.worker_executions += 1
        try:
            self.workers.submit(functools.partial(self._on_worker, straight), frame, _FIRST_UNIT)
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker=False)
            frame.finish()

    def _on_worker(self, straight: StraightLine, frame: ExecutionFrame, unit: int) -> None:
        """A straight line as one work item of a worker thread, checking between units for
        a stop (a cancellation); finishes the frame on the loop. Never raises."""
        loop = self.state.loop
        try:
            self._units(frame, straight, unit, on_worker=True)
        except BaseException as exc:
            internal_error(frame, exc, loop, on_worker=True)
        finally:
            assert loop is not None
            loop.call_soon_threadsafe(frame.finish)

    def run_in_slices(
        self, frame: ExecutionFrame, straight: StraightLine, unit: int, waited: bool = False
    ) -> None:
        """The straight line of an execution that does not fit what is left of the loop's
        slice: run its units in order from `unit` until the slice is spent, defer the rest
        to the budget's queue (a later iteration, in turn with other deferred work), and
        finish the frame after the last unit. Never raises.

        The dataflow's loop slices would run it too, with their per-unit bookkeeping
        (producer counts, the frame lock, the ready stack): tiny BERT's 13 units in two
        slices took 5-10% longer that way. `waited`: deferred because `unit` would have
        overrun the slice; it now runs first, fitting or not, as does the first unit of a
        slice this call opens.
        """
        state = self.state
        budget = state.budget
        assert budget is not None
        try:
            if not frame.stopped:  # stopped while deferred (cancelled): nothing more runs
                run_first = waited or not budget.is_open
                deadline = budget.deadline()
                if deadline is None:  # spent: wait for a later iteration, in turn
                    budget.defer(self.run_in_slices, frame, straight, unit)
                    return
                start = time.perf_counter()
                after = self._units(frame, straight, unit, deadline, run_first)
                end = len(frame.calls)
                while after < end and (deadline := budget.extend()) is not None:
                    after = self._units(frame, straight, after, deadline, True)
                state.account(start, time.perf_counter())
                if after < end:
                    budget.defer(self.run_in_slices, frame, straight, after, True)
                    return
        except BaseException as exc:
            internal_error(frame, exc, state.loop, on_worker=False)
        frame.finish()

    def _units(
        self,
        frame: ExecutionFrame,
        straight: StraightLine,
        unit: int,
        deadline: float | None = None,
        run_first: bool = True,
        on_worker: bool = False,
    ) -> int:
        """Run the frame's units in order from `unit`; return the next one to run (the
        number of units once all ran, or one failed: a kernel error stops the execution as
        in the dataflow, and the caller's run raises it).

        With a `deadline` (perf_counter time), stop before a unit whose measured time would
        end after it; the first unit runs regardless when `run_first`. `on_worker`: on a
        worker thread, where a stop (a cancellation) is checked before each unit."""
        schedule = frame.schedule
        assert schedule is not None, "the frame was not loaded"
        calls, stores, drops = frame.calls, schedule.stores, straight.drops
        seconds = straight.unit_seconds
        values = frame.values
        end = len(calls)
        guard = _inference_mode(self._inference_mode)  # on while it lives: no `with` needed
        try:
            while unit < end:
                if on_worker and frame.stopped:
                    break
                if (deadline is not None and not run_first
                        and time.perf_counter() + seconds[unit] > deadline):
                    break
                run_first = False
                try:
                    result = calls[unit](values)
                except BaseException as exc:
                    node = schedule.failed_node(unit, exc)
                    fail(frame, self.graph, node, exc, self.state.loop, on_worker)
                    return end
                store = stores[unit]
                if store >= 0:
                    values[store] = result
                del result
                for value in drops[unit]:
                    values[value] = None
                unit += 1
        finally:
            del guard
        return unit

"""The scheduler: WorkUnits that run a graph as a dataflow over one ExecutionFrame.

Policy (after nativert's ParallelGraphExecutor and WorkUnit::run):

- The frame's Schedule says what a unit is: one node, or a run of inline nodes fused into one
  function (schedule.py). A *work item* runs units on one thread: it runs a unit, drops values
  past their last use, decrements its users' producer counts, and keeps going with the users
  that became ready and may run where it is; the others are handed off: heavy CPU units to the
  worker threads, async ones to tasks on the loop. A chain therefore costs no scheduling round
  trip, and a chain of heavy nodes stays on its worker without a hop back to the loop.
- Heavy units handed off together queue most work ahead first (the schedule's priorities),
  so a long branch is not left for last; between hand-offs the workers' queue is FIFO.
- On the loop thread inline units run within the loop's shared slice (LoopBudget:
  `loop_slice_s` per loop iteration, for all executions together); work that finds the slice
  spent, or overruns it, goes on in a later iteration.
- State: only the frame (values, counts, reads, `pending` units, `stopped`, `errors`). Counters
  change under the frame's lock. The unit that brings `pending` to zero ends the execution and
  wakes the awaiting caller once, on the loop thread.
- Errors and cancellation set `stopped`: nothing new is dispatched, in-flight units drain, and
  the caller is woken only when no thread or task can touch the frame any more.
- Every unit counted in `pending` ends exactly once, on every path: a work item ends its unit
  whatever its run raised, and a hand-off ends the units it could not start. An error of the
  runtime's own steps (bookkeeping, tracing, a hand-off) fails the execution like a kernel
  error, so it never strands `pending` above zero (an execution nothing could end or cancel).
- GPU programs (docs/gpu.md): the frame's unit tables make a CUDA unit enqueue its kernel on
  its stream (it then runs like an inline unit: microseconds, never a host wait) and mark a
  unit reading GPU values HOST_WAIT, which is handed off: it runs at once if the GPU has
  written its inputs, or else after awaiting their events as a task of the frame, so no
  thread ever blocks on the GPU. `run_dataflow` leases the execution's streams before the
  roots start and returns only once the GPU has finished the execution's work as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio.lowlevel
import torch

from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.backend import Loop, TaskLike, current_loop
from asyncgraph.runtime.config import ExecutorConfig, usable_cpus
from asyncgraph.runtime.frame import HOST_WAIT, ExecutionFrame
from asyncgraph.runtime.instrument import Instrument
from asyncgraph.runtime.loop_budget import LoopBudget, loop_budget
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.schedule import Schedule
from asyncgraph.runtime.straight import StraightLine, straight_line
from asyncgraph.runtime.workers import WorkerPool

# torch.inference_mode() is a Python context manager costing ~3 us per entry; the C++ guard
# behind it (~0.4 us with `with`) enables the mode when made and restores it when freed, and
# its __enter__ and __exit__ do nothing: the straight line makes and frees it without them.
_inference_mode = torch._C._InferenceMode

_START = (0, 0)
_MAX_STRAIGHT = 256  # straight-line forms kept, one per schedule in use
_FIRST_UNIT = ((0.0, 0),)  # a straight line handed to a worker starts at its first unit


def _clock() -> tuple[int, int]:
    return time.perf_counter_ns(), time.thread_time_ns()


_INLINE = Placement.INLINE
_WORKER = Placement.WORKER
_TASK = Placement.TASK
_STREAM = Placement.STREAM
_HOST_WAIT = HOST_WAIT


class Scheduler:
    """Runs executions of one ExecutionPlan; shared by all executions of an Executor."""

    def __init__(
        self,
        graph: Graph,
        plan: ExecutionPlan,
        config: ExecutorConfig,
        workers: WorkerPool,
        recorder: Instrument | None = None,
        any_thread: Sequence[bool] | None = None,
    ) -> None:
        self.graph = graph
        self.plan = plan
        self.config = config
        self.workers = workers
        self.recorder = recorder
        self.loop: Loop | None = None  # bound by the Executor (backend.py), or on first run
        self._seed = config.ready_order_seed
        self._loop_busy = 0.0
        self._running = 0  # executions between start and finish
        self._budget: LoopBudget | None = None  # the loop's, once the loop is known
        self._window_start = 0.0
        self._window_busy = 0.0
        # id(schedule) -> (schedule, its straight-line form or None): see _straight_form
        self._straight: dict[int, tuple[Schedule, StraightLine | None]] = {}
        self._hot_schedule: Schedule | None = None  # the last schedule looked up there
        self._hot_straight: StraightLine | None = None  # and its form
        # Seeded orders, profiling and traces go through the dataflow (straight.py).
        self._may_straight = self._seed is None and recorder is None
        self._retry: ExecutionFrame | None = None  # see run_dataflow
        self._inference_mode = config.inference_mode
        self._any_thread = any_thread  # per node: may leave the loop thread (placement.py)
        bar = config.worker_execution_node_us
        self._worker_node_s = float("inf") if bar is None else bar * 1e-6
        self.worker_executions = 0  # straight lines run on a worker thread (_on_worker)
        self._lines_on_workers = 0  # of them, running now
        # The loop keeps a CPU: more runnable threads than CPUs delay its wake-ups (loop lag).
        self._max_lines_on_workers = min(config.max_parallel_ops, usable_cpus() - 1)

    # -- one execution, seen from the caller --------------------------------------------------

    def run_straight(self, frame: ExecutionFrame) -> bool:
        """Run the loaded frame to completion without a coroutine when the execution may take
        the straight line (straight.py): True once it ran (its error raised here); False when
        it may not, and the caller awaits `run_dataflow(frame)` instead. The Executor calls
        this first, then `run_dataflow`: together they run an execution.

        On a one-node graph a coroutine to create and await is a tenth of the execution's
        fixed cost.
        """
        budget = self._budget
        if budget is None:
            budget = self._bind(frame)
        self._retry = None
        straight = self._straight_of(frame)
        if straight is None:
            return False
        start = budget.start(straight.seconds)
        if start is None:  # the slice is spent, or left too short for it
            if straight.seconds <= budget.slice_s:
                self._retry = frame  # a fresh slice would hold it: run_dataflow
            return False  # run_dataflow runs it in slices, over loop iterations
        self._straight_units(frame, straight, 0)
        self._account_loop_time(start, time.perf_counter())
        frame.finish()
        if frame.errors:
            self._raise_errors(frame)
        return True

    async def run_dataflow(self, frame: ExecutionFrame) -> None:
        """Run the loaded frame through the WorkUnits (the path of every execution
        `run_straight` refuses); raise its error, or re-raise a cancellation.

        Returns only when no unit is in flight and, with a GPU, when none of the execution's
        GPU work is (its kernels may still write the frame's tensors), so the caller may
        release the frame. A cancellation while the GPU finishes is absorbed, then re-raised.

        An execution that `run_straight` refused only because this iteration's slice was
        spent, and that a whole slice holds, first waits one loop iteration and tries the
        straight line once more: the dataflow would defer it as well, at the cost of a future
        and a second iteration (a 0.42 ms compiled BERT segment finds the slice spent every
        third execution of one caller: 3-4% less time per execution with the retry).
        """
        if self._retry is frame:
            self._retry = None
            await anyio.lowlevel.checkpoint()  # others' callbacks, I/O and timers run first
            if self.run_straight(frame):
                return
        loop = self.loop
        if loop is None or self._budget is None:
            self._bind(frame)
            loop = self.loop
            assert loop is not None
        straight = self._straight_of(frame)
        if straight is None:
            if self._seed is not None:
                frame.rng = random.Random(self._seed * 1_000_003 + frame.execution_id)
            frame.load_counters()
        await self._run_dataflow(frame, loop, straight)
        if frame.errors:
            self._raise_errors(frame)

    def _bind(self, frame: ExecutionFrame) -> LoopBudget:
        """Bind the running loop (when the Executor has not) and its shared budget."""
        loop = self.loop
        if loop is None:
            loop = self.loop = current_loop()
        if self._budget is None:
            self._budget = loop_budget(loop.native, self.config.loop_slice_s)
        return self._budget

    @staticmethod
    def _raise_errors(frame: ExecutionFrame) -> None:
        errors = list(frame.errors)
        frame.errors.clear()
        if len(errors) == 1:
            raise errors[0]
        raise BaseExceptionGroup(f"{len(errors)} nodes failed in one execution", errors)

    async def _run_dataflow(
        self, frame: ExecutionFrame, loop: Loop, straight: StraightLine | None = None
    ) -> None:
        """The WorkUnits of the execution, across the loop, workers, tasks and streams; or,
        given the schedule's `straight` form, its units in order in the loop's slices
        (`_continue_straight`).

        Cancelled (asyncio's CancelledError, trio's Cancelled), it stops dispatching, waits
        shielded until the units in flight end, then re-raises the original cancellation.
        """
        gpu = frame.gpu
        if gpu is not None:
            gpu.begin()  # lease a stream set, ordered after the caller's stream
        self._running += 1
        on_worker = straight is not None and self._on_worker(straight)
        self._lines_on_workers += on_worker
        cancelled: BaseException | None = None
        try:
            if straight is None:
                self._start(frame)
            elif on_worker:
                self._hand_off_straight(frame, straight)
            else:
                self._continue_straight(frame, straight, 0)
            if not frame.finished:  # made only now: most small graphs finish inside _start
                frame.waiter = loop.create_future()
                await frame.waiter
        except loop.cancelled_exc as exc:
            cancelled = exc
        finally:
            if not frame.finished:  # cancelled, or anything else: nothing may touch the frame
                self._stop(frame)
                with loop.shielded():  # trio cancels every checkpoint of a cancelled scope
                    absorbed = await self._wait_finished(frame, loop)
                cancelled = cancelled or absorbed
            self._running -= 1
            self._lines_on_workers -= on_worker
            if gpu is not None:
                await gpu.finish()  # re-raises a cancellation it absorbed while the GPU ran
        if cancelled is not None:
            raise cancelled

    def _straight_form(self, schedule: Schedule) -> StraightLine | None:
        """The straight-line form of `schedule` (None when it has none), kept per schedule
        and remembered as the hot one: executions of one signature reuse it at the cost of
        one identity test."""
        hit = self._straight.get(id(schedule))
        if hit is None or hit[0] is not schedule:
            if len(self._straight) >= _MAX_STRAIGHT:
                self._straight.clear()  # schedules come and go with shape signatures
            form = straight_line(schedule, self._any_thread)
            hit = self._straight[id(schedule)] = (schedule, form)
        self._hot_schedule, self._hot_straight = hit
        return hit[1]

    def _straight_of(self, frame: ExecutionFrame) -> StraightLine | None:
        """The straight-line form of the frame's schedule when the execution may take it: not
        profiled, no seeded order or trace, no GPU (straight.py)."""
        if frame.times is not None or not self._may_straight or frame.gpu is not None:
            return None
        schedule = _schedule(frame)
        if schedule is self._hot_schedule:  # the schedule of the last straight execution
            return self._hot_straight
        return self._straight_form(schedule)

    def _on_worker(self, straight: StraightLine) -> bool:
        """Whether this straight line runs on a worker thread rather than in the loop's
        slices: another execution is in flight to overlap it, fewer lines than CPUs but one
        run on workers already (the loop keeps a CPU), it takes at least a slice (on
        the loop it would span iterations anyway, so the hop is a small part of it), its nodes
        are mostly kernel time, off the GIL (`worker_execution_node_us`), and none of them
        is held to the loop thread by a placement hint or its kind. Adaptive placement keeps
        such a line whole on a loaded loop (AdaptivePlacement._runs_whole_on_worker).

        Two 32-row batches of tiny BERT from 64 callers then run side by side, one on the
        loop and one on a worker: 4.12x nativert's throughput against 3.87x without, in
        alternating storms on a 2-vCPU machine whose second vCPU adds only ~20% to
        compute-bound threads (two threads of eager batch-32 BERT ran 1.19x one).
        """
        budget = self._budget
        return (
            self._running > 1
            and self._lines_on_workers < self._max_lines_on_workers
            and straight.any_thread
            and straight.node_seconds >= self._worker_node_s
            and budget is not None
            and straight.seconds >= budget.slice_s
        )

    def _hand_off_straight(self, frame: ExecutionFrame, straight: StraightLine) -> None:
        """Send the straight line to a worker thread. Never raises: a failed submission
        fails the execution and finishes the frame here."""
        self.worker_executions += 1
        try:
            self.workers.submit(
                functools.partial(self._straight_on_worker, straight), frame, _FIRST_UNIT
            )
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            frame.finish()

    def _straight_on_worker(
        self, straight: StraightLine, frame: ExecutionFrame, unit: int
    ) -> None:
        """A straight line as one work item of a worker thread, checking between units for
        a stop (a cancellation, `_stop`); finishes the frame on the loop. Never raises."""
        try:
            self._straight_units(frame, straight, unit, on_worker=True)
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=True)
        finally:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(frame.finish)

    def _straight_units(
        self,
        frame: ExecutionFrame,
        straight: StraightLine,
        unit: int,
        deadline: float | None = None,
        run_first: bool = True,
        on_worker: bool = False,
    ) -> int:
        """Run the frame's units in order on the loop from `unit`; return the next one to run
        (the number of units once all ran, or one failed: a kernel error stops the
        execution as in the dataflow path, and `run_dataflow` or `run_straight` raises it).

        With a `deadline` (perf_counter time), stop before a unit whose measured time would
        end after it; the first unit runs regardless when `run_first`. `on_worker`: on a
        worker thread, where a stop (a cancellation) is checked before each unit."""
        schedule = _schedule(frame)
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
                    self._fail(frame, schedule.failed_node(unit, exc), exc, on_worker)
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

    def _continue_straight(
        self, frame: ExecutionFrame, straight: StraightLine, unit: int, waited: bool = False
    ) -> None:
        """The straight line of an execution that does not fit what is left of the loop's
        slice: run its units in order from `unit` until the slice is spent, defer the rest
        to the budget's queue (a later iteration, in turn with other deferred work), and
        finish the frame after the last unit. Never raises.

        Like the dataflow's `_loop_slice` but without its per-unit bookkeeping (producer
        counts, the frame lock, the ready stack): tiny BERT's 13 units in two slices took
        5-10% longer through the dataflow. `waited`: deferred because `unit` would have
        overrun the slice; it now runs first, fitting or not, as does the first unit of a
        slice this call opens.
        """
        budget = self._budget
        assert budget is not None
        try:
            if not frame.stopped:  # stopped while deferred (cancelled): nothing more runs
                run_first = waited or not budget.is_open
                deadline = budget.deadline()
                if deadline is None:  # spent: wait for a later iteration, in turn
                    budget.defer(self._continue_straight, frame, straight, unit)
                    return
                start = time.perf_counter()
                after = self._straight_units(frame, straight, unit, deadline, run_first)
                end = len(frame.calls)
                while after < end and (deadline := budget.extend()) is not None:
                    after = self._straight_units(frame, straight, after, deadline, True)
                self._account_loop_time(start, time.perf_counter())
                if after < len(frame.calls):
                    budget.defer(self._continue_straight, frame, straight, after, True)
                    return
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
        frame.finish()

    async def _wait_finished(self, frame: ExecutionFrame, loop: Loop) -> BaseException | None:
        """Wait until the units in flight have ended (threads write the frame until then).

        Cancellations meanwhile are absorbed and the first returned, for the caller to raise
        once the frame is idle. This ends as soon as the units do: every unit ends on every
        path, so a cancellation waits at most for the kernels running now.
        """
        absorbed: BaseException | None = None
        while not frame.finished:
            frame.waiter = loop.create_future()
            try:
                await frame.waiter
            except loop.cancelled_exc as exc:
                absorbed = absorbed or exc
        return absorbed

    def _stop(self, frame: ExecutionFrame) -> None:
        """Stop dispatching and cancel the frame's async kernels (loop thread)."""
        with frame.lock:
            frame.stopped = True
        self._cancel_tasks(frame)

    # -- units -----------------------------------------------------------------------------

    def _start(self, frame: ExecutionFrame) -> None:
        """Start the execution as a work item of its own (`pending` 1): hand off the roots
        that run elsewhere, then go on as the drain of the inline ones. Never raises."""
        frame.pending = 1
        try:
            stack = self._start_roots(frame)
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        self._run_on_loop(frame, stack)

    def _start_roots(self, frame: ExecutionFrame) -> list[int]:
        """Hand off the root units that do not run on the loop; return the others."""
        stack: list[int] = []
        handoff: list[int] = []
        schedule = _schedule(frame)
        roots = list(schedule.roots)
        if frame.rng is not None:
            frame.rng.shuffle(roots)
        where = frame.where
        for unit in reversed(roots):
            if where[unit] in (_INLINE, _STREAM):
                stack.append(unit)
            else:
                handoff.append(unit)
        if handoff:
            frame.pending += len(handoff)
            self._hand_off(frame, handoff, on_worker=False)
        return stack

    def _run_on_loop(self, frame: ExecutionFrame, stack: list[int], waited: bool = False) -> None:
        """A work item on the loop thread: run `stack`'s inline work in the loop's shared
        slice, or later (`_loop_slice`); end the unit once done, whatever was raised."""
        try:
            if self._loop_slice(frame, stack, waited):
                return  # the item goes on in a later iteration
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
        self._end_unit(frame, on_worker=False)

    def _loop_slice(self, frame: ExecutionFrame, stack: list[int], waited: bool) -> bool:
        """Run inline work within the loop's shared slice, or defer it to the next iteration
        when this iteration's slice is spent (LoopBudget); True when deferred. `waited`: the
        work was deferred because its next unit would have overrun the slice; that unit now
        runs first, fitting or not, so a long unit neither stretches an iteration nor waits
        for ever.

        The first unit of a slice this call opens runs too: nothing else has used the slice,
        and work deferred now would run first in the next iteration anyway, before its
        timers and I/O, so deferring would only add an iteration. Otherwise a preemption or
        a collection between opening the slice and the first check deferred it, and whether
        an execution's inline roots ran in the iteration that started it (before its async
        kernels' first steps) depended on timing.
        """
        budget = self._budget
        assert budget is not None
        first_of_slice = not budget.is_open
        deadline = budget.deadline()
        if deadline is None and stack and not frame.stopped:
            budget.defer(self._run_on_loop, frame, stack, waited)
            return True
        start = time.perf_counter()
        with _inference_mode(self._inference_mode):
            overrun = self._run_units(
                frame, stack, False, deadline or 0.0, waited or first_of_slice
            )
        self._account_loop_time(start, time.perf_counter())
        if overrun:  # the next unit would end after the slice: it goes first next time
            budget.defer(self._run_on_loop, frame, stack, True)
        return overrun

    @property
    def loaded(self) -> bool:
        """Whether executions overlap and the loop spends over half its time in kernels, or
        a straight line runs on a worker (the loop is then idle, the CPUs are not): then
        adaptive placement also sends heavy nodes of the serial spine to workers, where they
        overlap other executions' work (light nodes stay on the loop: they hold the GIL),
        or keeps a line that leaves whole for a worker inline (`_on_worker`)."""
        return self._running > 0 and (self._loop_busy > 0.5 or self._lines_on_workers > 0)

    def _account_loop_time(self, start: float, end: float) -> None:
        """Track the fraction of wall time the loop spends in kernels, per 20 ms window."""
        span = end - self._window_start
        if span > 0.02:
            self._loop_busy = self._window_busy / span
            self._window_start = end
            self._window_busy = 0.0
        self._window_busy += end - start

    def _run_units(
        self,
        frame: ExecutionFrame,
        stack: list[int],
        on_worker: bool,
        deadline: float = 0.0,
        waited: bool = False,
    ) -> bool:
        """The run loop of one work item: run ready units from `stack` until none is left
        here. On the loop, a unit that would end after `deadline` (by its measured time, or
        any unit once the deadline has passed) stops the loop, and True is returned: it goes
        on in a later iteration, with the rest; after `waited`, the first unit runs
        regardless. The caller ends the item's unit."""
        schedule = _schedule(frame)
        calls, stores = frame.calls, schedule.stores
        values = frame.values
        timed = self.recorder is not None or frame.times is not None
        seconds = schedule.seconds  # measured unit times: does the next one fit the slice?
        check = not on_worker and not waited
        while stack:
            if frame.stopped:
                break
            if check:
                expected = seconds[stack[-1]] if seconds is not None else 0.0
                if time.perf_counter() + expected > deadline:
                    return True
            check = not on_worker
            unit = stack.pop()
            start = _clock() if timed else _START
            try:
                result = calls[unit](values)
            except BaseException as exc:
                self._fail(frame, schedule.failed_node(unit, exc), exc, on_worker)
                break
            if timed:
                self._record(frame, schedule.nodes[unit][0], start, result)
            store = stores[unit]
            if store >= 0:
                values[store] = result
            del result
            self._complete(frame, unit, stack, on_worker)
        return False

    def _record(
        self, frame: ExecutionFrame, node: int, start: tuple[int, int], result: Any = None
    ) -> None:
        """Profile by thread CPU time (immune to GIL waits and a loaded machine); trace by
        wall time. Timed executions run unfused schedules: one unit per node."""
        wall, cpu = _clock()
        if frame.times is not None:
            frame.times.add(node, cpu - start[1])
        if self.recorder is not None:
            self.recorder.node_done(frame.execution_id, node, start[0], wall, result)

    def _complete(
        self, frame: ExecutionFrame, unit: int, stack: list[int], on_worker: bool
    ) -> None:
        """Free values past their last use, wake users that became ready, route them.

        Ready inline users go on `stack` (the first ready user on top). On a worker, the
        ready worker user of the highest priority stays on this thread, under the inline
        ones: the chain's last output is hot in this core's cache. The others are handed off.
        Allocation-free unless something is handed off.

        A worker never leaves its chain for a queued unit with more work ahead. Measured on
        16 chains of matmuls: taking the most work ahead first everywhere (breadth-first)
        made each matmul 7-10% slower even on one thread, and doing so only in the end game
        (to finish the last chains together) still cost 4-7% more than it saved.
        """
        schedule = _schedule(frame)
        placement = frame.where
        priority = schedule.priority
        values, counts, reads = frame.values, frame.counts, frame.reads
        handoff: list[int] | None = None
        kept = -1
        with frame.lock:
            for v in schedule.frees[unit]:
                r = reads[v] - 1
                reads[v] = r
                if r == 0:
                    values[v] = None
            users = schedule.users_reversed[unit]
            if frame.rng is not None:
                users = tuple(frame.rng.sample(users, len(users)))
            for user in users:
                c = counts[user] - 1
                counts[user] = c
                if c:
                    continue
                where = placement[user]
                if where in (_INLINE, _STREAM):
                    stack.append(user)
                    continue
                if where == _WORKER and on_worker:
                    if kept < 0:
                        kept = user
                        continue
                    if priority[user] > priority[kept]:
                        kept, user = user, kept
                if handoff is None:
                    handoff = []
                handoff.append(user)
            if kept >= 0:
                stack.insert(0, kept)  # continue the chain here, after the inline users
            if handoff is not None:
                frame.pending += len(handoff)
        if handoff is not None:
            self._hand_off(frame, handoff, on_worker)

    @staticmethod
    def _rank(frame: ExecutionFrame, unit: int) -> float:
        """A handed-off unit's key among those handed off with it: the most work ahead first
        (schedule.py); random in seeded-order runs."""
        if frame.rng is not None:
            return float(frame.rng.random())
        return -_schedule(frame).priority[unit]

    def _hand_off(self, frame: ExecutionFrame, units: list[int], on_worker: bool) -> None:
        """Start a new work item for each unit; `pending` already counts them.

        Async and host-wait units start on the loop: their tasks belong to it. Never raises:
        the units it could not start are ended here and the error fails the execution.
        """
        started = 0
        try:
            where = frame.where
            loop = self.loop
            ranked: list[tuple[float, int]] = []
            for unit in units:
                w = where[unit]
                if w == _TASK:
                    if on_worker:
                        assert loop is not None
                        loop.call_soon_threadsafe(self._start_task, frame, unit)
                    else:
                        self._start_task(frame, unit)
                elif w == _HOST_WAIT:
                    if on_worker:
                        assert loop is not None
                        loop.call_soon_threadsafe(self._start_host_wait, frame, unit, False)
                    else:
                        self._start_host_wait(frame, unit, True)
                else:
                    ranked.append((self._rank(frame, unit), unit))
                    continue
                started += 1
            if ranked:  # one submission: a free thread takes the best of them, not the first
                self.workers.submit(self._run_on_worker_item, frame, ranked)
                started += len(ranked)
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker)
            self._end_unit(frame, on_worker, len(units) - started)

    def _run_on_worker_item(self, frame: Any, unit: int) -> None:
        """A work item on a worker thread; never raises (WorkerPool.submit's contract): an
        error of the runtime fails the execution, and the unit ends on every path."""
        try:
            try:
                self._run_units(frame, [unit], on_worker=True)
            except BaseException as exc:
                self._internal_error(frame, exc, on_worker=True)
        finally:
            self._end_unit(frame, on_worker=True)

    def _end_unit(self, frame: ExecutionFrame, on_worker: bool, count: int = 1) -> None:
        """End `count` units; the last one of the execution wakes the caller, on the loop."""
        if not count:
            return
        with frame.lock:
            frame.pending -= count
            last = frame.pending == 0
        if last:
            if on_worker:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(frame.finish)
            else:
                frame.finish()

    def _fail(self, frame: ExecutionFrame, node: int, exc: BaseException, on_worker: bool) -> None:
        """Record a kernel error with node context and stop the execution."""
        _add_node_note(exc, self.graph, node)
        self._stop_with(frame, exc, on_worker)

    def _internal_error(self, frame: ExecutionFrame, exc: BaseException, on_worker: bool) -> None:
        """An error of the runtime's own steps, not of a kernel: it fails the execution as a
        kernel error does, so the execution still ends and its caller gets the error."""
        with contextlib.suppress(Exception):  # a type refusing attributes keeps its message
            exc.add_note(
                f"asyncgraph internal error in execution {frame.execution_id}: "
                "the execution was stopped"
            )
        self._stop_with(frame, exc, on_worker)

    def _stop_with(self, frame: ExecutionFrame, exc: BaseException, on_worker: bool) -> None:
        """Record the execution's error, stop dispatching and cancel its async kernels."""
        with frame.lock:
            frame.errors.append(exc)
            frame.stopped = True
        if on_worker:
            # Not `if frame.tasks` here: the loop may have checked `stopped` and be about to
            # add a task (_start_task), which this thread would miss. The cancellation runs on
            # the loop after that add, or else the task is never created; the callback comes
            # before this unit's end, hence before the frame can be released.
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._cancel_tasks, frame)
        elif frame.tasks:
            self._cancel_tasks(frame)

    @staticmethod
    def _cancel_tasks(frame: ExecutionFrame) -> None:
        """Cancel the frame's async kernels (loop thread: the only one touching `tasks`)."""
        for task in list(frame.tasks):
            task.cancel()

    # -- async kernels -----------------------------------------------------------------------

    def _start_task(self, frame: ExecutionFrame, unit: int) -> None:
        """An async kernel's unit (always a single node) as a task of the frame; the unit
        ends in the task's done-callback, or here if the task cannot start."""
        if frame.stopped:
            self._end_unit(frame, on_worker=False)
            return
        self._start_frame_task(frame, unit, self._task_done, self._await_kernel, frame, unit)

    def _start_frame_task(
        self,
        frame: ExecutionFrame,
        unit: int,
        done: Callable[[ExecutionFrame, int, TaskLike], None],
        fn: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
    ) -> None:
        """Run `fn(*args)` as a task of the frame (loop thread); `done(frame, unit, task)`,
        its done-callback, goes on with the unit. If the task cannot start, the unit ends here
        and the error fails the execution."""
        assert self.loop is not None
        try:
            task = self.loop.create_task(fn(*args))
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        frame.tasks.add(task)
        # Bookkeeping lives in the done-callback, not in the coroutine: a task cancelled
        # before its first step never runs any of its code, but its callbacks always run.
        task.add_done_callback(functools.partial(done, frame, unit))

    async def _await_kernel(self, frame: ExecutionFrame, unit: int) -> Any:
        start = _clock()
        result = await frame.calls[unit](frame.values)
        self._record(frame, _schedule(frame).nodes[unit][0], start, result)
        return result

    def _task_done(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> None:
        """The task's unit goes on as a work item on the loop (which ends it)."""
        stack: list[int] = []
        try:
            if self._task_failed(frame, unit, task):
                return
            schedule = _schedule(frame)
            if schedule.stores[unit] >= 0:
                frame.values[schedule.stores[unit]] = task.result()
            self._complete(frame, unit, stack, on_worker=False)
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            stack.clear()  # the item only ends its unit
        self._run_on_loop(frame, stack)

    def _task_failed(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> bool:
        """Forget a finished task of the frame; if it failed or was cancelled, account the
        failure, end its unit and return True."""
        frame.tasks.discard(task)
        node = _schedule(frame).nodes[unit][0]
        if task.cancelled():
            if not frame.stopped:  # cancelled by someone else than us: an error of this node
                self._fail(frame, node, asyncio.CancelledError(), on_worker=False)
        elif (exc := task.exception()) is not None:
            self._fail(frame, node, exc, on_worker=False)
        else:
            return False
        self._end_unit(frame, on_worker=False)
        return True

    # -- CPU units reading GPU values --------------------------------------------------------

    def _start_host_wait(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> None:
        """A unit whose node reads GPU values (loop thread): run it once the GPU wrote them.

        If its events have completed it continues at once; otherwise a task of the frame
        awaits them (`FrameStreams.wait_host` polls, the loop never blocks) and the unit
        continues when it is done. A stop cancels that task like an async kernel's.
        """
        if frame.stopped:
            self._end_unit(frame, on_worker=False)
            return
        gpu = frame.gpu
        assert gpu is not None and self.loop is not None
        node = _schedule(frame).nodes[unit][0]
        try:
            ready = gpu.host_ready(node)
        except BaseException as exc:  # a CUDA error surfaces at the first query after it
            self._fail(frame, node, exc, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        if ready:
            try:
                self._continue_unit(frame, unit, in_drain)
            except BaseException as exc:
                self._internal_error(frame, exc, on_worker=False)
                self._end_unit(frame, on_worker=False)
            return
        self._start_frame_task(frame, unit, self._host_wait_done, gpu.wait_host, node)

    def _host_wait_done(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> None:
        try:
            if self._task_failed(frame, unit, task):
                return
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        try:
            self._continue_unit(frame, unit, in_drain=False)
        except BaseException as exc:
            self._internal_error(frame, exc, on_worker=False)
            self._end_unit(frame, on_worker=False)

    def _continue_unit(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> None:
        """Run a host-wait unit whose GPU inputs are ready where its schedule places it.

        An inline unit found ready inside a drain starts on the next loop iteration rather
        than in a nested drain, so chains of CPU and GPU nodes cannot grow the stack.
        """
        where = _schedule(frame).where[unit]
        if where == _TASK:
            self._start_task(frame, unit)
        elif where == _WORKER:
            self.workers.submit(self._run_on_worker_item, frame, [(self._rank(frame, unit), unit)])
        elif in_drain:
            assert self.loop is not None
            self.loop.call_soon(self._run_on_loop, frame, [unit])
        else:
            self._run_on_loop(frame, [unit])


def _schedule(frame: ExecutionFrame) -> Schedule:
    schedule = frame.schedule
    assert schedule is not None, "the frame was not loaded"
    return schedule


def _add_node_note(exc: BaseException, graph: Graph, index: int) -> None:
    """Name the node, its target and the user's source line, as torch.fx does."""
    node = graph.nodes[index]
    line = f"While executing %{node.name} = {node.target_name()}(...) [node {index}]"
    notes = getattr(exc, "__notes__", [])
    if line in notes:
        return
    if node.stack_trace:
        line += "\nOriginal traceback:\n" + node.stack_trace.rstrip()
    with contextlib.suppress(Exception):  # a type refusing attributes keeps its message
        exc.add_note(line)


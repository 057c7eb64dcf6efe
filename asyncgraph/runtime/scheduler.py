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
import functools
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.lowlevel
import torch

from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.backend import Loop, TaskLike
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.failures import cancel_tasks, fail, internal_error, raise_errors
from asyncgraph.runtime.frame import HOST_WAIT, ExecutionFrame
from asyncgraph.runtime.instrument import Instrument
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.schedule import Schedule, StraightLine
from asyncgraph.runtime.straight import StraightRunner
from asyncgraph.runtime.workers import WorkerPool

# torch.inference_mode() is a Python context manager costing ~3 us per entry; the C++ guard
# behind it (~0.4 us with `with`) enables the mode when made and restores it when freed, and
# its __enter__ and __exit__ do nothing: the straight line makes and frees it without them.
_inference_mode = torch._C._InferenceMode

_START = (0, 0)


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
    ) -> None:
        self.graph = graph
        self.plan = plan
        self.config = config
        self.workers = workers
        self.recorder = recorder
        # the loop, its slice budget and its load, shared with the straight line
        self.state = LoopState(config.loop_slice_s)
        self.straight = StraightRunner(graph, self.state, workers, config)
        self._seed = config.ready_order_seed
        # Seeded orders, profiling and traces go through the dataflow (straight.py).
        self._may_straight = self._seed is None and recorder is None
        self._inference_mode = config.inference_mode

    @property
    def loop(self) -> Loop | None:
        """The event loop the executions run on: bound by the Executor, or on first run."""
        return self.state.loop

    @loop.setter
    def loop(self, loop: Loop | None) -> None:
        self.state.loop = loop

    @property
    def loaded(self) -> bool:
        """Whether the loop is loaded, for adaptive placement (LoopState.loaded)."""
        return self.state.loaded

    # -- one execution, seen from the caller --------------------------------------------------

    def run_straight(self, frame: ExecutionFrame, admitted: float | str | None = None) -> bool:
        """Run the loaded frame to completion without a coroutine when the execution may take
        the straight line and it fits the loop's slice (straight.py): True once it ran (its
        error raised here); False when not, and the caller awaits `run_dataflow(frame)`
        instead. The Executor calls this first, then `run_dataflow`: together they run an
        execution.

        On a one-node graph a coroutine to create and await is a tenth of the execution's
        fixed cost. `admitted`: StraightRunner.admit's answer for this execution, when the
        Executor asked already (it tries the line without a frame first: `_run_alone`).
        """
        runner = self.straight
        runner.retry = runner.to_worker = None
        if frame.times is not None or not self._may_straight or frame.gpu is not None:
            return False  # `_straight_of`, inlined: this runs once per execution
        straight = _schedule(frame).straight
        return straight is not None and runner.run_now(frame, straight, admitted)

    async def run_dataflow(self, frame: ExecutionFrame) -> None:
        """Run the loaded frame through the WorkUnits (the path of every execution
        `run_straight` refuses); raise its error, or re-raise a cancellation.

        Returns only when no unit is in flight and, with a GPU, when none of the execution's
        GPU work is (its kernels may still write the frame's tensors), so the caller may
        release the frame. A cancellation while the GPU finishes is absorbed, then re-raised.

        An execution that `run_straight` refused only because this iteration's slice was
        spent, and that a whole slice holds, first waits one loop iteration and tries the
        straight line once more (`retry`); one it refused because other work waits on the
        loop while a worker is free goes to that worker at once (`to_worker`, `contended`:
        StraightRunner.run_now, takes_worker).
        """
        contended = self.straight.to_worker is frame
        if contended:
            self.straight.to_worker = None
        elif self.straight.retry is frame:
            self.straight.retry = None
            await anyio.lowlevel.checkpoint()  # others' callbacks, I/O and timers first
            if self.run_straight(frame):
                return
        state = self.state
        if state.loop is None or state.budget is None:
            state.bind()
        loop = state.loop
        assert loop is not None
        straight = self._straight_of(frame)
        if straight is None:
            if self._seed is not None:
                frame.rng = random.Random(self._seed * 1_000_003 + frame.execution_id)
            frame.load_counters()
        await self._run_dataflow(frame, loop, straight, contended)
        if frame.errors:
            raise_errors(frame)

    async def _run_dataflow(
        self, frame: ExecutionFrame, loop: Loop, straight: StraightLine | None = None,
        contended: bool = False,
    ) -> None:
        """The WorkUnits of the execution, across the loop, workers, tasks and streams; or,
        given the schedule's `straight` form, its units in order in the loop's slices or
        on a worker (straight.py; `contended`: see run_dataflow).

        Cancelled (asyncio's CancelledError, trio's Cancelled), it stops dispatching, waits
        shielded until the units in flight end, then re-raises the original cancellation.
        """
        gpu = frame.gpu
        if gpu is not None:
            gpu.begin()  # lease a stream set, ordered after the caller's stream
        state = self.state
        state.running += 1
        on_worker = straight is not None and self.straight.takes_worker(straight, contended)
        state.lines_on_workers += on_worker
        cancelled: BaseException | None = None
        try:
            if straight is None:
                self._start(frame)
            elif on_worker:
                self.straight.hand_off(frame, straight)
            else:
                self.straight.run_in_slices(frame, straight, 0)
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
            state.running -= 1
            state.lines_on_workers -= on_worker
            if gpu is not None:
                await self._finish_gpu(frame, gpu)
        if cancelled is not None:
            raise cancelled

    @staticmethod
    async def _finish_gpu(frame: ExecutionFrame, gpu: Any) -> None:
        """Await the end of the execution's GPU work (re-raising a cancellation it absorbed).
        A CUDA error is sticky: a node that failed on one may see `finish` raise it again,
        and the node's error, which names the node, is the one the caller gets."""
        try:
            await gpu.finish()
        except Exception as exc:
            if not frame.errors:
                raise
            frame.errors[0].add_note(f"finishing the execution's GPU work also raised: {exc!r}")

    def _straight_of(self, frame: ExecutionFrame) -> StraightLine | None:
        """The straight-line form of the frame's schedule when the execution may take it: not
        profiled, no seeded order or trace, no GPU (straight.py)."""
        if frame.times is not None or not self._may_straight or frame.gpu is not None:
            return None
        return _schedule(frame).straight

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
        cancel_tasks(frame)

    # -- units -----------------------------------------------------------------------------

    def _start(self, frame: ExecutionFrame) -> None:
        """Start the execution as a work item of its own (`pending` 1): hand off the roots
        that run elsewhere, then go on as the drain of the inline ones. Never raises."""
        frame.pending = 1
        try:
            stack = self._start_roots(frame)
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker=False)
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
            internal_error(frame, exc, self.state.loop, on_worker=False)
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
        budget = self.state.budget
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
        self.state.account(start, time.perf_counter())
        if overrun:  # the next unit would end after the slice: it goes first next time
            budget.defer(self._run_on_loop, frame, stack, True)
        return overrun

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
                node = schedule.failed_node(unit, exc)
                fail(frame, self.graph, node, exc, self.state.loop, on_worker)
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
            loop = self.state.loop
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
            internal_error(frame, exc, self.state.loop, on_worker)
            self._end_unit(frame, on_worker, len(units) - started)

    def _run_on_worker_item(self, frame: Any, unit: int) -> None:
        """A work item on a worker thread; never raises (WorkerPool.submit's contract): an
        error of the runtime fails the execution, and the unit ends on every path."""
        try:
            try:
                self._run_units(frame, [unit], on_worker=True)
            except BaseException as exc:
                internal_error(frame, exc, self.state.loop, on_worker=True)
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
                assert self.state.loop is not None
                self.state.loop.call_soon_threadsafe(frame.finish)
            else:
                frame.finish()

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
        assert self.state.loop is not None
        try:
            task = self.state.loop.create_task(fn(*args))
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker=False)
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
            internal_error(frame, exc, self.state.loop, on_worker=False)
            stack.clear()  # the item only ends its unit
        self._run_on_loop(frame, stack)

    def _task_failed(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> bool:
        """Forget a finished task of the frame; if it failed or was cancelled, account the
        failure, end its unit and return True."""
        frame.tasks.discard(task)
        node = _schedule(frame).nodes[unit][0]
        if task.cancelled():
            if not frame.stopped:  # cancelled by someone else than us: an error of this node
                fail(frame, self.graph, node, asyncio.CancelledError(), self.state.loop, False)
        elif (exc := task.exception()) is not None:
            fail(frame, self.graph, node, exc, self.state.loop, on_worker=False)
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
        assert gpu is not None and self.state.loop is not None
        node = _schedule(frame).nodes[unit][0]
        try:
            ready = gpu.host_ready(node)
        except BaseException as exc:  # a CUDA error surfaces at the first query after it
            fail(frame, self.graph, node, exc, self.state.loop, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        if ready:
            try:
                self._continue_unit(frame, unit, in_drain)
            except BaseException as exc:
                internal_error(frame, exc, self.state.loop, on_worker=False)
                self._end_unit(frame, on_worker=False)
            return
        self._start_frame_task(frame, unit, self._host_wait_done, gpu.wait_host, node)

    def _host_wait_done(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> None:
        try:
            if self._task_failed(frame, unit, task):
                return
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker=False)
            self._end_unit(frame, on_worker=False)
            return
        try:
            self._continue_unit(frame, unit, in_drain=False)
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker=False)
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
            assert self.state.loop is not None
            self.state.loop.call_soon(self._run_on_loop, frame, [unit])
        else:
            self._run_on_loop(frame, [unit])


def _schedule(frame: ExecutionFrame) -> Schedule:
    schedule = frame.schedule
    assert schedule is not None, "the frame was not loaded"
    return schedule

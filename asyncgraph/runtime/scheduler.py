"""The scheduler: runs one execution in the Mode the Executor chose, over one ExecutionFrame.

Every mode runs its units through the one run loop (units.py) inside *work items*; one
wrapper, `_item`, owns the error boundary of the runtime's own steps and the item's end.

- A straight line (modes.py) is one work item whose stack holds its units in order: at once on
  the loop (`run_now`), in the loop's slices, or on a worker thread.
- The dataflow (after nativert's ParallelGraphExecutor and WorkUnit::run): a work item runs a
  unit, drops values past their last use, decrements its users' producer counts and keeps
  going with the users that became ready and may run where it is (`_complete`); the others
  are handed off by placement (`_hand_off`'s table): heavy CPU units to the worker threads,
  most work ahead first (the schedule's priorities), async ones to tasks on the loop, units
  reading GPU values to a wait for the GPU. A chain costs no scheduling round trip, and a
  chain of heavy nodes stays on its worker without a hop back to the loop.
- On the loop thread units run within the loop's shared slice (LoopBudget: `loop_slice_s`
  per loop iteration, for all executions together); work that finds the slice spent, or
  would overrun it, goes on in a later iteration.
- State: only the frame (values, counts, reads, `pending` items, `stopped`, `errors`).
  Counters change under the frame's lock. The item that brings `pending` to zero ends the
  execution and wakes the awaiting caller once, on the loop thread.
- Errors and cancellation set `stopped`: nothing new is dispatched, items in flight drain,
  and the caller is woken only when no thread or task can touch the frame any more. Every
  item counted in `pending` ends exactly once, on every path; an error of the runtime's own
  steps (bookkeeping, tracing, a hand-off) fails the execution like a kernel error, so it
  never strands `pending` above zero.
- GPU programs (docs/gpu.md): the frame's unit tables make a device unit enqueue its kernel on
  its stream (it then runs like an inline unit: microseconds, never a host wait) and mark a
  unit reading GPU values HOST_WAIT: it runs at once if the GPU has written its inputs, or
  after awaiting their events as a task of the frame, so no thread ever blocks on the GPU.
  `run` leases the execution's streams first and returns only once the GPU has finished the
  execution's work as well.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio.lowlevel
import torch

from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.backend import Loop, TaskLike
from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.failures import cancel_tasks, fail, internal_error, raise_errors
from asyncgraph.runtime.frame import HOST_WAIT, ExecutionFrame, load_values
from asyncgraph.runtime.instrument import Instrument, UnitObserver
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.modes import Mode
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.schedule import Schedule, StraightLine
from asyncgraph.runtime.units import run_units
from asyncgraph.runtime.workers import WorkerPool

# torch.inference_mode() is a Python context manager costing ~3 us per entry; the C++ guard
# behind it (~0.4 us with `with`) enables the mode when made and restores it when freed.
_inference_mode = torch._C._InferenceMode

_INLINE = Placement.INLINE
_WORKER = Placement.WORKER
_DEVICE = Placement.DEVICE
_FIRST_UNIT = ((0.0, 0),)  # a straight line handed to a worker is one item

Ranked = list[tuple[float, int]]  # units handed off together, each with its key (lowest first)


class Finishing(Protocol):
    """What `wait_finished` waits on: an execution's frame, or a direct call on a worker
    (runtime/direct.py), whose `finished` the loop sets, resolving `waiter`."""

    finished: bool
    waiter: Any


async def wait_finished(item: Finishing, loop: Loop) -> BaseException | None:
    """Wait until `item`'s work in flight has ended (threads write into it until then).

    Cancellations meanwhile are absorbed and the first returned, for the caller to raise
    once the item is idle. This ends as soon as the work does: every work item ends on every
    path, so a cancellation waits at most for the kernels running now.
    """
    absorbed: BaseException | None = None
    while not item.finished:
        item.waiter = loop.create_future()
        try:
            await item.waiter
        except loop.cancelled_exc as exc:
            absorbed = absorbed or exc
    return absorbed


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
        self.workers = workers
        # the loop, its slice budget and its load, shared with the mode chooser (modes.py)
        self.state = LoopState(config.loop_slice_s)
        self._seed = config.ready_order_seed
        self._inference_mode = config.inference_mode
        self._traced = recorder is not None
        self._observer = UnitObserver(recorder)  # profiled and traced executions' timing
        self.worker_executions = 0  # straight lines run on a worker thread
        # The run loop's callbacks, bound once for each side of it (the loop's take the
        # methods' defaults: a plain bound-method call per unit).
        self._complete_on_loop = self._complete
        self._complete_on_worker = functools.partial(self._complete, on_worker=True)
        self._failed_on_loop = self._unit_failed
        self._failed_on_worker = functools.partial(self._unit_failed, on_worker=True)
        # How a unit handed off to the loop starts, by its placement in the frame's table
        # (worker units go to the workers in one submission: `_hand_off`). `in_drain`: started
        # inside a loop-side item (a ready host-wait unit then waits for the next iteration
        # rather than nest a drain); False when a worker handed it over.
        self._starts: dict[int, Callable[[ExecutionFrame, int, bool], None]] = {
            Placement.TASK: self._start_task,
            HOST_WAIT: self._start_host_wait,
        }

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

    def run_now(
        self, frame: ExecutionFrame, start: float, template: list[Any] | None = None,
        inputs: list[Any] | None = None,
    ) -> None:
        """Run the loaded frame's straight line to completion on the loop, without a
        coroutine (Mode.FRAMELESS, LINE_NOW: chosen at `start`); its error raised here.
        Given `inputs`, load them first, with the weights `template`: the Executor's own
        frame (FRAMELESS) is loaded here, as nothing else of it changes between executions."""
        if inputs is not None:
            assert template is not None, "inputs without the weights they run with"
            load_values(frame.values, template, self.plan.user_input_slots, inputs)
        guard = _inference_mode(self._inference_mode)  # on while it lives: no `with` needed
        try:  # the line's drops are the frame's (ExecutionFrame.load)
            stack = list(frame.schedule.straight.stack)  # type: ignore[union-attr]
            run_units(frame, stack, self._failed_on_loop)
        finally:
            del guard
        self.state.account(start, time.perf_counter())
        frame.finished = True  # ran synchronously: nothing awaits it
        if frame.errors:
            raise_errors(frame)

    async def run(self, frame: ExecutionFrame, mode: Mode) -> None:
        """Run the loaded frame in `mode` (any but the at-once ones); raise its error, or
        re-raise a cancellation.

        Returns only when no item is in flight and, with a GPU, when none of the execution's
        GPU work is (its kernels may still write the frame's tensors), so the caller may
        release the frame. Cancelled (asyncio's CancelledError, trio's Cancelled), it stops
        dispatching, waits shielded until the items in flight end, then re-raises."""
        state = self.state
        if mode is Mode.LINE_NEXT:  # a fresh slice holds the line: after others' callbacks
            state.lines_next += 1
            try:
                await anyio.lowlevel.checkpoint()
            finally:
                state.lines_next -= 1
            budget = state.budget if state.budget is not None else state.bind()
            start = budget.start(_line(frame).seconds)
            if start is not None:
                self.run_now(frame, start)
                return
            mode = Mode.LINE_SLICED
        if state.loop is None or state.budget is None:
            state.bind()
        loop = state.loop
        assert loop is not None
        gpu = frame.gpu
        if gpu is not None:
            gpu.begin()  # lease a stream set, ordered after the caller's stream
        on_worker = mode is Mode.LINE_WORKER
        state.running += 1
        state.lines_on_workers += on_worker
        cancelled: BaseException | None = None
        try:
            self._start(frame, mode)
            if not frame.finished:  # made only now: most small graphs finish inside _start
                frame.waiter = loop.create_future()
                await frame.waiter
        except loop.cancelled_exc as exc:
            cancelled = exc
        finally:
            if not frame.finished:  # cancelled, or anything else: nothing may touch the frame
                self._stop(frame)
                with loop.shielded():  # trio cancels every checkpoint of a cancelled scope
                    absorbed = await wait_finished(frame, loop)
                cancelled = cancelled or absorbed
            state.running -= 1
            state.lines_on_workers -= on_worker
            if gpu is not None:
                await self._finish_gpu(frame, gpu)
        if cancelled is not None:
            raise cancelled
        if frame.errors:
            raise_errors(frame)

    def _start(self, frame: ExecutionFrame, mode: Mode) -> None:
        """Start the execution as one work item (`pending` 1): a straight line's units in
        order, on a worker or in the loop's slices; or the dataflow's roots, those that run
        elsewhere handed off, the others run here. Never raises."""
        frame.pending = 1
        if mode is Mode.DATAFLOW:
            frame.drops = None  # the counters free the values
            if self._seed is not None:
                frame.rng = random.Random(self._seed * 1_000_003 + frame.execution_id)
            frame.load_counters()
            if frame.times is not None or self._traced:
                frame.observer = self._observer
            self._item(frame, False, self._roots)
            return
        if mode is Mode.LINE_WORKER:
            self.worker_executions += 1
            self._item(frame, False, self._line_to_worker)
        else:
            self._run_on_loop(frame, list(_line(frame).stack))

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


    def _stop(self, frame: ExecutionFrame) -> None:
        """Stop dispatching and cancel the frame's async kernels (loop thread)."""
        with frame.lock:
            frame.stopped = True
        cancel_tasks(frame)

    # -- work items ------------------------------------------------------------------------

    def _item(
        self, frame: ExecutionFrame, on_worker: bool, body: Callable[..., bool], *args: Any
    ) -> None:
        """A work item: `body(frame, *args)`, which returns True when the item goes on later
        (deferred to a later loop iteration, or handed on). Otherwise the item ends here,
        whatever `body` raised: an error of the runtime's own steps fails the execution as a
        kernel error does. Never raises."""
        try:
            if body(frame, *args):
                return
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker)
        self._end_item(frame, on_worker)

    def _run_on_loop(self, frame: ExecutionFrame, stack: list[int], waited: bool = False) -> None:
        """A work item on the loop thread: `stack`'s units in the loop's slices."""
        self._item(frame, False, self._loop_slice, stack, waited)

    def _run_on_worker(self, frame: ExecutionFrame, unit: int) -> None:
        """A work item on a worker thread, from `unit` (WorkerPool.submit's contract: it
        never raises)."""
        self._item(frame, True, self._worker_units, [unit])

    def _line_on_worker(self, frame: ExecutionFrame, unit: int) -> None:
        """A straight line as one work item of a worker thread (`unit`: its first, 0); a
        stop (a cancellation) is seen between units."""
        self._item(frame, True, self._worker_units, list(_line(frame).stack))

    def _worker_units(self, frame: ExecutionFrame, stack: list[int]) -> bool:
        run_units(frame, stack, self._failed_on_worker, self._complete_on_worker)
        return False

    def _line_to_worker(self, frame: ExecutionFrame) -> bool:
        self.workers.submit(self._line_on_worker, frame, _FIRST_UNIT)
        return True  # the worker's item ends it

    def _roots(self, frame: ExecutionFrame) -> bool:
        """The dataflow's first item: hand off the roots that do not run on the loop, run
        the others here."""
        stack: list[int] = []
        handoff: list[int] = []
        roots = list(_schedule(frame).roots)
        if frame.rng is not None:
            frame.rng.shuffle(roots)
        where = frame.where
        for unit in reversed(roots):
            if where[unit] in (_INLINE, _DEVICE):
                stack.append(unit)
            else:
                handoff.append(unit)
        if handoff:
            frame.pending += len(handoff)
            self._hand_off(frame, handoff, on_worker=False)
        return self._loop_slice(frame, stack, False)

    def _loop_slice(self, frame: ExecutionFrame, stack: list[int], waited: bool) -> bool:
        """Run units within the loop's shared slice, extended while nothing else waits on
        the loop, or defer them to a later iteration when this iteration's slice is spent
        (LoopBudget); True when deferred. `waited`: the work was deferred because its next
        unit would have overrun the slice; that unit now runs first, fitting or not, so a
        long unit neither stretches an iteration nor waits for ever.

        The first unit of a slice this call opens runs too: nothing else has used the slice,
        and work deferred now would run first in the next iteration anyway, before its
        timers and I/O, so deferring would only add an iteration. Otherwise a preemption or
        a collection between opening the slice and the first check deferred it, and whether
        an execution's inline roots ran in the iteration that started it (before its async
        kernels' first steps) depended on timing.
        """
        if not stack or frame.stopped:
            return False
        budget = self.state.budget
        assert budget is not None
        run_first = waited or not budget.is_open
        deadline = budget.deadline()
        if deadline is None:  # spent: wait for a later iteration, in turn
            budget.defer(self._run_on_loop, frame, stack, waited)
            return True
        start = time.perf_counter()
        complete = self._complete_on_loop
        with _inference_mode(self._inference_mode):
            overrun = run_units(frame, stack, self._failed_on_loop, complete, deadline, run_first)
            while overrun and (deadline := budget.extend()) is not None:
                overrun = run_units(frame, stack, self._failed_on_loop, complete, deadline)
        self.state.account(start, time.perf_counter())
        if overrun:  # the next unit would end after the slice: it goes first next time
            budget.defer(self._run_on_loop, frame, stack, True)
        return overrun

    def _end_item(self, frame: ExecutionFrame, on_worker: bool, count: int = 1) -> None:
        """End `count` items; the last one of the execution wakes the caller, on the loop."""
        with frame.lock:
            frame.pending -= count
            last = frame.pending == 0
        if last:
            if on_worker:
                assert self.state.loop is not None
                self.state.loop.call_soon_threadsafe(frame.finish)
            else:
                frame.finish()

    # -- the dataflow's bookkeeping ----------------------------------------------------------

    def _unit_failed(
        self, frame: ExecutionFrame, unit: int, exc: BaseException, on_worker: bool = False
    ) -> None:
        """A kernel's error (the run loop's on_error): name its node, stop the execution."""
        node = _schedule(frame).failed_node(unit, exc)
        fail(frame, self.graph, node, exc, self.state.loop, on_worker)

    def _complete(
        self, frame: ExecutionFrame, unit: int, stack: list[int], on_worker: bool = False
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
                if where in (_INLINE, _DEVICE):
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

    def _hand_off(self, frame: ExecutionFrame, units: list[int], on_worker: bool) -> None:
        """Start a new work item for each unit (`pending` already counts them), by its
        placement. Worker units go in one submission, so that a free thread takes the best
        of them (the most work ahead: random in seeded-order runs); the others start on the
        loop (`_starts`), where their tasks belong. Never raises: the units it could not
        start are ended here and the error fails the execution."""
        started = 0
        try:
            where = frame.where
            ranked: Ranked = []
            for unit in units:
                placement = where[unit]
                if placement == _WORKER:
                    ranked.append((self._rank(frame, unit), unit))
                    continue
                start = self._starts[placement]
                if on_worker:
                    assert self.state.loop is not None
                    self.state.loop.call_soon_threadsafe(start, frame, unit, False)
                else:
                    start(frame, unit, True)
                started += 1
            if ranked:
                self._submit(frame, ranked)
                started += len(ranked)
        except BaseException as exc:
            internal_error(frame, exc, self.state.loop, on_worker)
            self._end_item(frame, on_worker, len(units) - started)

    def _submit(self, frame: ExecutionFrame, ranked: Ranked) -> None:
        self.workers.submit(self._run_on_worker, frame, ranked)

    @staticmethod
    def _rank(frame: ExecutionFrame, unit: int) -> float:
        """A worker unit's key among those handed off with it: the most work ahead first
        (schedule.py); random in seeded-order runs."""
        if frame.rng is not None:
            return float(frame.rng.random())
        return -_schedule(frame).priority[unit]

    # -- async kernels -----------------------------------------------------------------------

    def _start_task(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> None:
        """An async kernel's unit (a single node) as a task of the frame, on the loop; the
        unit ends in its task's done-callback, or here if the task cannot start."""
        self._item(frame, False, self._new_task, unit, self._task_done, self._await_kernel)

    def _new_task(
        self,
        frame: ExecutionFrame,
        unit: int,
        done: Callable[[ExecutionFrame, int, TaskLike], None],
        fn: Callable[..., Any],
        *args: Any,
    ) -> bool:
        """Run `fn(frame, unit, *args)` as a task of the frame (loop thread), unless the
        execution stopped; `done(frame, unit, task)`, its done-callback, goes on with the
        unit. Bookkeeping lives in the done-callback, not in the coroutine: a task cancelled
        before its first step never runs any of its code, but its callbacks always run."""
        if frame.stopped:
            return False
        assert self.state.loop is not None
        task = self.state.loop.create_task(fn(frame, unit, *args))
        frame.tasks.add(task)
        task.add_done_callback(functools.partial(done, frame, unit))
        return True

    async def _await_kernel(self, frame: ExecutionFrame, unit: int) -> Any:
        observer = frame.observer
        if observer is None:
            return await frame.calls[unit](frame.values)
        started = observer.start()
        result = await frame.calls[unit](frame.values)
        observer.done(frame, unit, started, result)
        return result

    def _task_done(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> None:
        """The task's unit goes on as a work item on the loop (which ends it)."""
        self._item(frame, False, self._after_task, unit, task)

    def _after_task(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> bool:
        if self._task_failed(frame, unit, task):
            return False
        store = _schedule(frame).stores[unit]
        if store >= 0:
            frame.values[store] = task.result()
        stack: list[int] = []
        self._complete(frame, unit, stack, on_worker=False)
        return self._loop_slice(frame, stack, False)

    def _task_failed(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> bool:
        """Forget a finished task of the frame; if it failed or was cancelled, fail the
        execution and return True."""
        frame.tasks.discard(task)
        node = _schedule(frame).nodes[unit][0]
        if task.cancelled():
            if not frame.stopped:  # cancelled by someone else than us: an error of this node
                fail(frame, self.graph, node, asyncio.CancelledError(), self.state.loop, False)
            return True
        exc = task.exception()
        if exc is not None:
            fail(frame, self.graph, node, exc, self.state.loop, on_worker=False)
            return True
        return False

    # -- CPU units reading GPU values --------------------------------------------------------

    def _start_host_wait(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> None:
        """A unit whose node reads GPU values (loop thread): it runs once the GPU wrote them;
        if its events have completed it continues at once, otherwise a task of the frame
        awaits them (`wait_host` polls, the loop never blocks) and the unit continues when it
        is done. A stop cancels that task like an async kernel's."""
        self._item(frame, False, self._host_wait, unit, in_drain)

    def _host_wait(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> bool:
        if frame.stopped:
            return False
        gpu = frame.gpu
        assert gpu is not None
        node = _schedule(frame).nodes[unit][0]
        try:
            ready = gpu.host_ready(node)
        except Exception as exc:  # a CUDA error surfaces at the first query after it: its node's
            fail(frame, self.graph, node, exc, self.state.loop, on_worker=False)
            return False
        if ready:
            return self._continue_unit(frame, unit, in_drain)
        return self._new_task(frame, unit, self._host_wait_done, self._wait_host, node)

    @staticmethod
    async def _wait_host(frame: ExecutionFrame, unit: int, node: int) -> None:
        await frame.gpu.wait_host(node)  # type: ignore[union-attr]

    def _host_wait_done(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> None:
        self._item(frame, False, self._after_host_wait, unit, task)

    def _after_host_wait(self, frame: ExecutionFrame, unit: int, task: TaskLike) -> bool:
        if self._task_failed(frame, unit, task):
            return False
        return self._continue_unit(frame, unit, in_drain=False)

    def _continue_unit(self, frame: ExecutionFrame, unit: int, in_drain: bool) -> bool:
        """Run a host-wait unit whose GPU inputs are ready where its schedule places it;
        True: it goes on there (the caller's item does not end it).

        An inline unit found ready inside a drain starts on the next loop iteration rather
        than in a nested drain, so chains of CPU and GPU nodes cannot grow the stack.
        """
        where = _schedule(frame).where[unit]
        if where == Placement.TASK:
            return self._new_task(frame, unit, self._task_done, self._await_kernel)
        if where == _WORKER:
            self._submit(frame, [(self._rank(frame, unit), unit)])
            return True
        if in_drain:
            assert self.state.loop is not None
            self.state.loop.call_soon(self._run_on_loop, frame, [unit])
            return True
        return self._loop_slice(frame, [unit], False)


def _schedule(frame: ExecutionFrame) -> Schedule:
    schedule = frame.schedule
    assert schedule is not None, "the frame was not loaded"
    return schedule


def _line(frame: ExecutionFrame) -> StraightLine:
    """The straight line of the frame's schedule (a line mode's: there is one)."""
    line = _schedule(frame).straight
    assert line is not None, "a line mode without a straight line"
    return line

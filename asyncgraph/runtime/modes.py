"""How one execution runs: the one decision, made once per execution, as a closed value.

An execution of a CPU program whose schedule is all inline runs as a straight line, its units
in order (nativert's serial executor); anything else runs as the WorkUnit dataflow across the
loop, workers, tasks and streams, or, for a GPU program with captures, as a CUDA-graph replay.
`ModeChooser.choose` decides which, and the Executor switches on the answer (executor.py's
`_execute`); nothing else decides, and the answer never travels in a mutable field.

Which straight-line mode (runtime/loop_budget.py's shared slice decides most of it):

- FRAMELESS / LINE_NOW: it fits what is left of the loop's slice: at once, without a
  coroutine; without a frame where a frame would hold nothing more than the values and one
  is free (the Executor says so: `alone`).
- LINE_NEXT: it fits a slice but this one is spent: after one loop iteration, at once if a
  fresh slice then holds it, else in slices (the dataflow would defer it as well, at the cost
  of a future; the retry saves that).
- LINE_SLICED: longer than a slice: in the loop's slices, deferring between them as the
  dataflow does, so neither stretches a loop iteration beyond what the dataflow would.
- LINE_WORKER: whole, as one work item of a worker thread, when there is something to
  overlap it (other executions in flight, or other work waiting on the loop) and its nodes
  are mostly kernel time, off the GIL (`worker_execution_node_us`).

A program that is one delegate call (runtime/direct.py) is placed by the same rule
(`ModeChooser.place`, for a line of the call's measured time): FRAMELESS there runs as
Mode.DIRECT, LINE_NEXT as Mode.DIRECT_NEXT, LINE_WORKER as Mode.DIRECT_WORKER, anything else
takes the general path.

Lines worth a worker queue for the workers however many run there already: held back on the
loop instead, a worker that finished waited for the loop, busy in a line, to hand it the next.
The measurements behind the modes, in benchmarks/results/cpu/:
design_measurements.md#lines-queue-for-the-workers,
design_measurements.md#a-spent-slice-waits-one-iteration,
design_measurements.md#executions-without-a-frame,
design_measurements.md#lines-in-slices-not-the-dataflow,
design_measurements.md#inline-lines-beside-busy-workers (a line that fits the slice runs inline
while no caller queues on the loop, even with the Executor's other lines on the workers).
"""

from __future__ import annotations

import enum

from asyncgraph.runtime.config import ExecutorConfig
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.placement import NodeTimes
from asyncgraph.runtime.schedule import Schedule, StraightLine


class Mode(enum.IntEnum):
    """How one execution runs (the module docstring); an IntEnum, so that counting
    executions by mode is a list index, not an Enum hash."""

    FRAMELESS = 0  # a straight line at once, without a frame
    LINE_NOW = 1  # a straight line at once
    LINE_NEXT = 2  # a straight line after one loop iteration
    LINE_SLICED = 3  # a straight line in the loop's slices
    LINE_WORKER = 4  # a straight line on a worker thread
    CAPTURED = 5  # a CUDA-graph capture or replay (the dataflow while it warms up)
    DATAFLOW = 6  # the WorkUnit dataflow
    DIRECT = 7  # a one-call program's call, at once, without a frame (runtime/direct.py)
    DIRECT_WORKER = 8  # a one-call program's call as one work item of a worker thread
    DIRECT_NEXT = 9  # a one-call program's call in a later iteration's slice


class ModeChooser:
    """Chooses the Mode of each execution of one Executor (shared by all its executions)."""

    def __init__(
        self, state: LoopState, config: ExecutorConfig, *, device: bool, captured: bool,
        traced: bool,
    ) -> None:
        self.state = state
        self._captured = captured
        # Seeded orders, traces and GPU programs run through the dataflow (or are captured).
        self._lines = config.ready_order_seed is None and not traced and not device
        bar = config.worker_execution_node_us
        self._worker_node_s = float("inf") if bar is None else bar * 1e-6
        self._line: StraightLine | None = None  # the line seen last, and whether it is
        self._worth = False  # worth a worker (`_worth_a_worker`)

    def choose(
        self, schedule: Schedule, times: NodeTimes | None, alone: bool = False
    ) -> tuple[Mode, float]:
        """The execution's mode, and for FRAMELESS and LINE_NOW the perf_counter time its
        line starts at (the loop's time it then uses is accounted from there). `times`: the
        node times to record when placement profiles this execution (it then takes the
        dataflow, timed node by node); `alone`: it may run without a frame."""
        line = schedule.straight
        if line is None or times is not None or not self._lines:
            return (_CAPTURED if self._captured else _DATAFLOW), 0.0
        if line is not self._line:  # the worker bar of the line seen last, kept
            self._line, self._worth = line, self.worth_a_worker(line)
        return self.place(line.seconds, self._worth, alone)

    def place(self, seconds: float, worth: bool, alone: bool = False) -> tuple[Mode, float]:
        """Where a straight line of `seconds` runs (`worth`: `worth_a_worker` said so), and
        for FRAMELESS and LINE_NOW the perf_counter time it starts at. Mode.DIRECT's call
        (runtime/direct.py) is placed here too, as a line of one node."""
        state = self.state
        budget = state.budget if state.budget is not None else state.bind()
        start = budget.start(seconds)
        if start is None:  # the slice is spent, or left too short for it
            busy = state.running > 0  # another execution is in flight to overlap it
            if seconds > budget.slice_s:  # a fresh slice would not hold it either
                return (_LINE_WORKER if busy and worth else _LINE_SLICED), 0.0
            # extend's peek: work waits on the loop; where the loop shows no queue (uvloop,
            # trio), a line already waiting for the next iteration, or an execution in
            # flight, stands for it (else every line of 64 callers waited for the loop's next
            # iteration and ran on the loop's one core)
            if worth and (budget.others_wait or (
                    not budget.shows_queues and (busy or state.lines_next > 0))):
                return _LINE_WORKER, 0.0
            return _LINE_NEXT, 0.0
        if worth and budget.others_queued():  # it fits, but callers queue for the loop
            return _LINE_WORKER, 0.0
        return (_FRAMELESS if alone else _LINE_NOW), start

    def worth_a_worker(self, line: StraightLine) -> bool:
        """Whether this line may go to a worker: its nodes are kernel time enough and free to
        leave the loop thread (adaptive placement keeps such a line whole on a loaded loop)."""
        return line.node_seconds >= self._worker_node_s and line.any_thread


# The modes as module constants: read on every execution, faster than Mode's attributes.
_FRAMELESS, _LINE_NOW, _LINE_NEXT = Mode.FRAMELESS, Mode.LINE_NOW, Mode.LINE_NEXT
_LINE_SLICED, _LINE_WORKER = Mode.LINE_SLICED, Mode.LINE_WORKER
_CAPTURED, _DATAFLOW = Mode.CAPTURED, Mode.DATAFLOW

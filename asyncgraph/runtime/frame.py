"""ExecutionFrame: all the state of one execution, and nothing else.

Values, producer counts, read counts, the count of WorkUnits in flight and the first errors
live here, never on the Executor, so one Executor serves many concurrent calls. A frame is
reused by later executions: `load` overwrites everything an execution reads, and `clear`
drops every value of the previous execution before the frame goes back to the pool.

Counters are changed under `lock` because they are decremented from the loop thread and
from worker threads; we do not rely on the GIL, which free-threaded CPython removes.

A frame of a program with CUDA nodes also owns its device state (`gpu`, a Device:
runtime/device.py; cuda/device.py's FrameStreams, events and the leased stream set), created
once with the frame, which gives the frame per-unit call and placement tables for the loaded
schedule: CUDA units enqueue on their streams and CPU units that read GPU values are marked
Placement.HOST_WAIT. The device builds them once per schedule and keeps them, so the
scheduler's run loop is the same for CPU and GPU programs and tests nothing per unit. A frame
of a program whose executions are captured whole as CUDA graphs also has `graphs` (a
Captures: cuda/graphs.py's FrameGraphs, which Mode.CAPTURED asks to replay, leasing one of
the Executor's graph instances, cuda/instances.py);
a program's captured segments are its device state's, reached through the unit tables, which
carry the loaded execution's weights version (`load`). The frame never knows what is behind
either.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from asyncgraph.runtime.backend import FutureLike, TaskLike
from asyncgraph.runtime.device import Calls, Captures, Device
from asyncgraph.runtime.placement import NodeTimes
from asyncgraph.runtime.plan import ExecutionPlan, Placement
from asyncgraph.runtime.schedule import Schedule
from asyncgraph.runtime.units import Observer

HOST_WAIT = Placement.HOST_WAIT
"""The placement of a unit in a frame's `where` table (never in a Schedule) whose node reads
GPU values (plan.py)."""


def load_values(
    values: list[Any], template: list[Any], slots: tuple[int, ...], inputs: list[Any]
) -> None:
    """`values` as the weights `template` with the user `inputs` in their `slots`: the start
    of an execution, in a frame or without one (Executor._run_alone). A program's only input
    is stored without a zip."""
    values[:] = template
    if len(slots) == 1 == len(inputs):
        values[slots[0]] = inputs[0]
    else:
        for slot, value in zip(slots, inputs, strict=True):
            values[slot] = value


class ExecutionFrame:
    """The per-execution storage of one graph's values and counters."""

    __slots__ = (
        "_nothing", "calls", "counts", "drops", "errors", "execution_id", "finished", "gpu",
        "graphs", "id", "last_used", "lock", "observer", "pending", "plan", "reads", "rng",
        "schedule", "seconds", "stopped", "stores", "tasks", "times", "values", "waiter",
        "where",
    )

    def __init__(
        self,
        plan: ExecutionPlan,
        frame_id: int,
        gpu: Device | None = None,
        graphs: Captures | None = None,
    ) -> None:
        self.id = frame_id
        self.plan = plan
        self.gpu = gpu
        self.graphs = graphs  # its CUDA-graph captures (cuda/graphs.py), when captured
        self.values: list[Any] = [None] * plan.num_values
        self._nothing = (None,) * plan.num_values  # what `clear` leaves in `values`
        self.counts: list[int] = []  # per unit of the loaded schedule
        self.reads: list[int] = list(plan.read_counts)
        self.lock = threading.Lock()
        self.pending = 0
        self.stopped = False
        self.finished = True
        self.errors: list[BaseException] = []
        self.tasks: set[TaskLike] = set()  # asyncio Tasks or their trio form (backend.py)
        self.waiter: FutureLike | None = None
        self.execution_id = 0
        self.last_used = 0.0
        self.rng: Any = None
        self.schedule: Schedule | None = None
        self.times: NodeTimes | None = None
        # What the scheduler runs per unit of the loaded schedule: its calls and placements,
        # the schedule's own without a GPU.
        self.calls: Calls = ()
        self.where: tuple[int, ...] = ()
        # What the run loop (units.py) reads besides: the store slot and the measured time of
        # each unit, the values each drops when the execution runs as a straight line (set
        # by `load` when the schedule has one; None: the dataflow's counters free them), and
        # the timing hook of a profiled or traced execution.
        self.stores: tuple[int, ...] = ()
        self.seconds: tuple[float, ...] | None = None
        self.drops: tuple[tuple[int, ...], ...] | None = None
        self.observer: Observer | None = None

    def load(
        self,
        template: list[Any],
        inputs: list[Any],
        schedule: Schedule,
        times: NodeTimes | None = None,
        weights_version: int = 0,
    ) -> None:
        """Start an execution (its id is the frame's `execution_id`, given when the frame
        was taken): weights from `template`, the user inputs and the units it runs (`times`
        collects node times while placement is profiled). The dataflow's counters are loaded
        by `load_counters`: a straight line runs without them."""
        plan = self.plan
        values = self.values
        load_values(values, template, plan.user_input_slots, inputs)
        for slot in plan.token_slots:
            values[slot] = torch.empty(0)  # a fresh effect token per execution
        self.pending = 0
        self.stopped = False
        self.finished = False
        self.errors.clear()
        self.schedule = schedule
        self.times = times
        self.stores, self.seconds = schedule.stores, schedule.seconds
        line = schedule.straight  # run as a line unless the dataflow clears them
        self.drops = line.drops if line is not None else None
        self.observer = None
        if self.gpu is None:
            self.calls, self.where = schedule.calls, schedule.where
        else:
            self.calls, self.where = self.gpu.unit_tables(schedule)
            self.gpu.weights_version = weights_version

    def use(self, schedule: Schedule) -> None:
        """Run `schedule`'s straight line on this frame, without loading it (Mode.FRAMELESS:
        the Executor's own frame, loaded and cleared by the Executor, synchronously): the
        tables the run loop reads."""
        self.schedule = schedule
        self.calls, self.stores = schedule.calls, schedule.stores
        self.seconds = schedule.seconds
        self.drops = schedule.straight.drops if schedule.straight is not None else None

    def load_counters(self) -> None:
        """Fresh producer and read counts for the loaded schedule (the dataflow's)."""
        schedule = self.schedule
        assert schedule is not None, "the frame was not loaded"
        self.counts[:] = schedule.producer_counts
        self.reads[:] = self.plan.read_counts

    def finish(self) -> None:
        """Mark the execution finished and wake its awaiting caller (loop thread only)."""
        self.finished = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        """Drop every value and error so nothing of this execution reaches the next."""
        self.values[:] = self._nothing
        self.errors.clear()
        self.waiter = None
        self.times = None

    def __repr__(self) -> str:
        return f"<ExecutionFrame {self.id} pending={self.pending} finished={self.finished}>"


"""ExecutionFrame: all the state of one execution, and nothing else.

Values, producer counts, read counts, the count of WorkUnits in flight and the first errors
live here, never on the Executor, so one Executor serves many concurrent calls. A frame is
reused by later executions: `load` overwrites everything an execution reads, and `clear`
drops every value of the previous execution before the frame goes back to the pool.

Counters are changed under `lock` because they are decremented from the loop thread and
from worker threads; we do not rely on the GIL, which free-threaded CPython removes.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from asyncgraph.placement import NodeTimes
from asyncgraph.plan import ExecutionPlan
from asyncgraph.schedule import Schedule


class ExecutionFrame:
    """The per-execution storage of one graph's values and counters."""

    __slots__ = (
        "counts", "errors", "execution_id", "finished", "id", "last_used", "lock", "pending",
        "plan", "reads", "rng", "schedule", "stopped", "tasks", "times", "values", "waiter",
    )

    def __init__(self, plan: ExecutionPlan, frame_id: int) -> None:
        self.id = frame_id
        self.plan = plan
        self.values: list[Any] = [None] * plan.num_values
        self.counts: list[int] = []  # per unit of the loaded schedule
        self.reads: list[int] = list(plan.read_counts)
        self.lock = threading.Lock()
        self.pending = 0
        self.stopped = False
        self.finished = True
        self.errors: list[BaseException] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.waiter: asyncio.Future[None] | None = None
        self.execution_id = 0
        self.last_used = 0.0
        self.rng: Any = None
        self.schedule: Schedule | None = None
        self.times: NodeTimes | None = None

    def load(
        self,
        template: list[Any],
        inputs: list[Any],
        execution_id: int,
        schedule: Schedule,
        times: NodeTimes | None = None,
    ) -> None:
        """Start an execution: weights from `template`, the user inputs, the units it runs
        and their fresh counters (`times` collects node times while placement is profiled)."""
        plan = self.plan
        values = self.values
        values[:] = template
        for slot, value in zip(plan.user_input_slots, inputs, strict=True):
            values[slot] = value
        for slot in plan.token_slots:
            values[slot] = torch.empty(0)  # a fresh effect token per execution
        self.counts[:] = schedule.producer_counts
        self.reads[:] = plan.read_counts
        self.pending = 0
        self.stopped = False
        self.finished = False
        self.errors.clear()
        self.execution_id = execution_id
        self.schedule = schedule
        self.times = times

    def finish(self) -> None:
        """Mark the execution finished and wake its awaiting caller (loop thread only)."""
        self.finished = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        """Drop every value and error so nothing of this execution reaches the next."""
        self.values[:] = [None] * len(self.values)
        self.errors.clear()
        self.waiter = None
        self.times = None

    def __repr__(self) -> str:
        return f"<ExecutionFrame {self.id} pending={self.pending} finished={self.finished}>"


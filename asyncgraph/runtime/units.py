"""The run loop: `run_units`, the one loop that calls units, for every way an execution runs.

A *run* is what the loop reads: the values, a call and a store slot per unit, and either the
values each unit drops (a straight line: its units in order, nativert's serial executor) or
none, in which case the caller's `complete` does the dataflow's bookkeeping after each unit
(producer counts, frees, routing the users that became ready: scheduler.py). The loop takes
units from a stack, so the same code runs a line (the stack holds its units in reverse) and a
dataflow work item (the stack holds the ready units). An ExecutionFrame is a run (frame.py);
so is a `Line` over node tables, which the GPU layer records into a CUDA graph and runs
segments with (cuda/graphs.py, cuda/segment_graphs.py).

What the loop leaves to its caller, so that it reads on one screen and costs a fraction of a
microsecond per unit: a kernel's error goes to `on_error` (which records it, or raises), the
run's end and its error boundary belong to the work item around it (scheduler.py), and
timing goes to the run's `observer` (profiling and tracing: instrument.py's UnitObserver),
one test per unit when there is none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

Call = Callable[[list[Any]], Any]


class Observer(Protocol):
    """Times the units of a run (instrument.py's UnitObserver)."""

    def start(self) -> Any: ...

    def done(self, run: Any, unit: int, started: Any, result: Any) -> None: ...


class Run(Protocol):
    """What `run_units` reads of a run (an ExecutionFrame, or a Line)."""

    @property
    def values(self) -> list[Any]: ...
    @property
    def calls(self) -> Sequence[Call]: ...
    @property
    def stores(self) -> Sequence[int]: ...
    @property
    def drops(self) -> Sequence[Sequence[int]] | None: ...
    @property
    def seconds(self) -> Sequence[float] | None: ...
    @property
    def observer(self) -> Observer | None: ...
    @property
    def stopped(self) -> bool: ...


class Line:
    """A run of calls in order over plain node tables, with no frame (the GPU layer's
    recording and uncaptured segments): never stopped, never timed."""

    __slots__ = ("calls", "drops", "stores", "values")

    seconds = None
    observer = None
    stopped = False

    def __init__(
        self, values: list[Any], calls: Sequence[Call], stores: Sequence[int],
        drops: Sequence[Sequence[int]],
    ) -> None:
        self.values, self.calls, self.stores, self.drops = values, calls, stores, drops


def in_order(count: int, first: int = 0) -> list[int]:
    """The stack that runs units `first..count-1` in order."""
    return list(range(count - 1, first - 1, -1))


def run_units(
    run: Run,
    stack: list[int],
    on_error: Callable[[Any, int, BaseException], None],
    complete: Callable[[Any, int, list[int]], None] | None = None,
    deadline: float | None = None,
    run_first: bool = True,
) -> bool:
    """Run units from `stack` until none is left, the run is stopped, or a unit fails (its
    error handed to `on_error(run, unit, exc)`, which records it or raises). After each
    unit: its result stored, then the values it drops freed (a line), or `complete(run,
    unit, stack)` (the dataflow: it pushes the users that became ready).

    With a `deadline` (perf_counter time), return True before a unit whose measured time
    (`run.seconds`) would end after it, the unit left on the stack: it goes on later. The
    first unit runs regardless when `run_first`. Otherwise return False."""
    values = run.values
    calls = run.calls
    stores = run.stores
    drops = run.drops
    observer = run.observer
    sliced = deadline is not None
    check = sliced and not run_first
    while stack:
        if run.stopped:
            break
        unit = stack.pop()
        if check:
            seconds = run.seconds
            expected = seconds[unit] if seconds is not None else 0.0
            if time.perf_counter() + expected > deadline:  # type: ignore[operator]
                stack.append(unit)
                return True
        check = sliced
        if observer is not None:
            started = observer.start()
        try:
            result = calls[unit](values)
        except BaseException as exc:  # the kernel's: its node is named by on_error
            on_error(run, unit, exc)
            break
        if observer is not None:
            observer.done(run, unit, started, result)
        store = stores[unit]
        if store >= 0:
            values[store] = result
        del result
        if drops is not None:
            for value in drops[unit]:
                values[value] = None
        else:
            complete(run, unit, stack)  # type: ignore[misc]
    return False

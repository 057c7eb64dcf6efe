"""StraightLine: an all-inline schedule run as one loop over its units, without the dataflow.

When every unit of a schedule runs inline on the event loop, the dataflow machinery buys
nothing: producer counts, the frame lock, the ready stack and `pending` all exist to let units
run on several threads and in any ready order. Run on one thread, the units can simply go in
their topological order, storing each result and dropping the values whose last reader it was.
That is nativert's serial executor; here it costs a fraction of a microsecond per unit instead
of about one, which on small graphs is most of an execution's fixed cost.

The scheduler takes this path only when the execution cannot be interleaved with anything: no
worker, task or CUDA unit, no profiling or tracing, no seeded ready order, and measured unit
times. When they fit in what is left of the loop's slice, `Scheduler.run_straight` runs the
units at once, without a coroutine; otherwise `run_dataflow` runs them in order over as many
slices as they take, deferring between slices as the dataflow path does (so neither stretches
a loop iteration beyond what the dataflow path would). Otherwise the dataflow path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asyncgraph.runtime.plan import Placement
from asyncgraph.runtime.schedule import Schedule


@dataclass(frozen=True, slots=True)
class StraightLine:
    """The units of one schedule in order, and the values to drop after each."""

    drops: tuple[tuple[int, ...], ...]  # per unit: values whose last reader it is
    seconds: float  # the measured time of all units together
    unit_seconds: tuple[float, ...]  # per unit: its measured time
    node_seconds: float  # the measured time per node: large when kernels (off the GIL) rule
    any_thread: bool  # every node may run on any thread (placement.py: AdaptivePlacement)


def straight_line(
    schedule: Schedule, any_thread: Sequence[bool] | None = None
) -> StraightLine | None:
    """The straight-line form of `schedule`, or None when it has a unit that does not run
    inline, no measured times, or units out of topological order. `any_thread`: per node
    of the graph, whether it may leave the loop thread (None: none may)."""
    if schedule.seconds is None or any(w is not Placement.INLINE for w in schedule.where):
        return None
    for unit, users in enumerate(schedule.users_reversed):
        if any(user <= unit for user in users):
            return None  # unit order is not a topological order: keep the dataflow
    last_reader: dict[int, int] = {}
    for unit, frees in enumerate(schedule.frees):
        for value in frees:
            last_reader[value] = unit
    drops: list[list[int]] = [[] for _ in schedule.calls]
    for value, unit in last_reader.items():
        drops[unit].append(value)
    seconds = sum(schedule.seconds)
    nodes = [node for unit_nodes in schedule.nodes for node in unit_nodes]
    return StraightLine(
        tuple(tuple(d) for d in drops), seconds, schedule.seconds,
        seconds / max(len(nodes), 1),
        any_thread is not None and all(any_thread[node] for node in nodes),
    )

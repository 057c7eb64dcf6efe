"""Device: what the run loop asks of a frame's device state, without knowing what is behind it.

A frame of a program with CUDA nodes holds one (`ExecutionFrame.gpu`); cuda/device.py's
FrameStreams implements it, and the frame never imports cuda/. Per loaded schedule the device
gives the frame its unit tables (`unit_tables`: the call and the placement of every unit, in
which CUDA units enqueue on their streams and units that read GPU values are
Placement.HOST_WAIT); per execution the scheduler calls `begin`, `host_ready`/`wait_host`
before a HOST_WAIT unit, and `await finish()`; the Executor calls `protect_outputs` on what it
hands to the caller. A frame whose executions are captured as CUDA graphs also holds its
captures (`ExecutionFrame.graphs`, `Captures`: cuda/graphs.py's FrameGraphs or FrameSegments).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asyncgraph.runtime.plan import Placement

Calls = tuple[Callable[[list[Any]], Any], ...]

RunKey = tuple[int, int]
"""What consecutive device nodes share to fuse into one run (cuda/: (device, stream))."""

ALIAS_KEY: RunKey = (-1, -1)
"""The run key of an inline alias node (getitem, tuple packing): it continues an open device
run; it runs on the host in nanoseconds and would otherwise split runs after every tuple op."""


class DeviceRuns(Protocol):
    """How a program's device nodes fuse into runs, and the calls a run's compiled code
    makes around each node (cuda/streams.py's StreamPlan). A run's function is
    `unit(v, g, s)`: `v` the frame's values, `g` the frame's Device, `s` the run's stream."""

    def run_key(self, node: int, placement: Placement) -> RunKey | None:
        """The key of the device run node `node` may join when placed `placement`, ALIAS_KEY
        for an alias that continues one, None when it joins none."""
        ...

    def before_node(self, node: int) -> list[str]:
        """Statements of a run's code before node `node`'s kernel."""
        ...

    def after_node(self, node: int, value: Callable[[int], str]) -> list[str]:
        """Statements after it; `value(p)` is the expression of node p's value."""
        ...


class UnitSchedule(Protocol):
    """What a device reads of a Schedule (schedule.py) to build its unit tables."""

    @property
    def calls(self) -> Calls: ...

    @property
    def where(self) -> tuple[Placement, ...]: ...

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]: ...

    @property
    def segments(self) -> tuple[int, ...]: ...


class Device(Protocol):
    """A frame's device state, reused by the frame's executions (one at a time)."""

    def unit_tables(self, schedule: UnitSchedule) -> tuple[Calls, tuple[int, ...]]:
        """The calls and placements of `schedule`'s units on this device (kept per schedule)."""
        ...

    def begin(self) -> None:
        """Start an execution (loop thread)."""
        ...

    def host_ready(self, node: int) -> bool:
        """Whether the device values host node `node` reads are ready (never waits)."""
        ...

    async def wait_host(self, node: int) -> None:
        """Await, without blocking the loop, the device values host node `node` reads."""
        ...

    async def finish(self) -> None:
        """Await the end of the execution's device work."""
        ...

    def protect_outputs(self, outputs: Sequence[Any]) -> None:
        """Make outputs safe to use on the caller's side."""
        ...


class Captures(Protocol):
    """A frame's captured executions (cuda/graphs.py)."""

    async def run(self, frame: Any, flat: list[Any], signature: Any, version: int) -> bool:
        """Run the loaded frame as a capture or replay; False: it takes the dataflow."""
        ...

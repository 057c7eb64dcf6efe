"""The one decision (runtime/modes.py): each execution's Mode, from the schedule, profiling,
the loop's slice and what waits on the loop; and statistics().modes counting them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.runtime.loop_state import LoopState
from asyncgraph.runtime.modes import Mode, ModeChooser
from asyncgraph.runtime.placement import NodeTimes
from asyncgraph.runtime.schedule import StraightLine

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]


@dataclass
class _Budget:
    """LoopBudget's answers, set by the test."""

    start_at: float | None = 1.0
    slice_s: float = 0.001
    others_wait: bool = False
    queued: bool = False
    shows_queues: bool = True  # False: uvloop's or trio's, whose queues the budget cannot see

    def start(self, seconds: float) -> float | None:
        return self.start_at

    def others_queued(self) -> bool:
        return self.queued


@dataclass
class _Schedule:
    straight: StraightLine | None


def _line(
    seconds: float = 0.0005, node_seconds: float = 0.0, any_thread: bool = True
) -> StraightLine:
    return StraightLine(((),), seconds, (seconds,), node_seconds, any_thread, (0,))


def _chooser(budget: _Budget, running: int = 0, lines_next: int = 0,
             **flags: bool) -> ModeChooser:
    state = LoopState(budget.slice_s)
    state.budget = budget  # type: ignore[assignment]
    state.running = running
    state.lines_next = lines_next
    config = ExecutorConfig(worker_execution_node_us=50)
    return ModeChooser(state, config, device=flags.get("device", False),
                       captured=flags.get("captured", False), traced=flags.get("traced", False))


HEAVY = 1e-3  # node seconds over worker_execution_node_us (50 us)


@pytest.mark.parametrize(
    ("budget", "line", "running", "alone", "mode"),
    [
        (_Budget(), _line(), 0, True, Mode.FRAMELESS),
        (_Budget(), _line(), 0, False, Mode.LINE_NOW),
        (_Budget(queued=True), _line(node_seconds=HEAVY), 0, True, Mode.LINE_WORKER),
        (_Budget(queued=True), _line(), 0, True, Mode.FRAMELESS),  # light: stays on the loop
        (_Budget(start_at=None), _line(), 0, True, Mode.LINE_NEXT),
        (_Budget(start_at=None, others_wait=True), _line(node_seconds=HEAVY), 0, True,
         Mode.LINE_WORKER),
        (_Budget(start_at=None), _line(seconds=0.01), 0, True, Mode.LINE_SLICED),
        (_Budget(start_at=None), _line(seconds=0.01, node_seconds=HEAVY), 0, True,
         Mode.LINE_SLICED),  # nothing in flight to overlap it
        (_Budget(start_at=None), _line(seconds=0.01, node_seconds=HEAVY), 1, True,
         Mode.LINE_WORKER),
        (_Budget(start_at=None), _line(seconds=0.01, node_seconds=HEAVY, any_thread=False), 1,
         True, Mode.LINE_SLICED),  # a node held to the loop thread
    ],
)
def test_the_line_modes_follow_the_slice_and_the_loop(
    budget: _Budget, line: StraightLine, running: int, alone: bool, mode: Mode
) -> None:
    chosen, start = _chooser(budget, running).choose(_Schedule(line), None, alone)  # type: ignore[arg-type]
    assert chosen is mode
    assert start == (budget.start_at if mode in (Mode.FRAMELESS, Mode.LINE_NOW) else 0.0)


UNSEEN = {"start_at": None, "shows_queues": False}  # a spent slice of a loop showing no queue


@pytest.mark.parametrize(
    ("budget", "running", "lines_next", "mode"),
    [
        (_Budget(**UNSEEN), 0, 0, Mode.LINE_NEXT),  # nothing else: the next iteration
        (_Budget(**UNSEEN), 0, 1, Mode.LINE_WORKER),  # another line waits for it already
        (_Budget(**UNSEEN), 1, 0, Mode.LINE_WORKER),  # an execution in flight
        (_Budget(start_at=None), 1, 1, Mode.LINE_NEXT),  # asyncio's peek saw nothing waiting
    ],
)
def test_where_the_loop_shows_no_queue_waiting_lines_and_executions_stand_for_it(
    budget: _Budget, running: int, lines_next: int, mode: Mode
) -> None:
    """uvloop and trio show no ready queue: a spent slice, with a line waiting for the next
    iteration or an execution in flight, sends a line worth a worker there (64 callers of a
    0.2 ms ONNX form otherwise all waited for the loop and ran on its one core)."""
    chooser = _chooser(budget, running, lines_next)
    chosen, _ = chooser.choose(_Schedule(_line(node_seconds=HEAVY)), None, True)  # type: ignore[arg-type]
    assert chosen is mode
    light, _ = chooser.choose(_Schedule(_line()), None, True)  # type: ignore[arg-type]
    assert light is Mode.LINE_NEXT  # not worth a worker: it waits, whatever waits


@pytest.mark.parametrize(
    ("schedule", "times", "flags", "mode"),
    [
        (_Schedule(None), None, {}, Mode.DATAFLOW),  # a unit off the loop: no line
        (_Schedule(_line()), NodeTimes(1), {}, Mode.DATAFLOW),  # profiled: timed per node
        (_Schedule(_line()), None, {"traced": True}, Mode.DATAFLOW),
        (_Schedule(_line()), None, {"device": True}, Mode.DATAFLOW),
        (_Schedule(None), None, {"device": True, "captured": True}, Mode.CAPTURED),
    ],
)
def test_everything_else_is_the_dataflow_or_a_capture(
    schedule: _Schedule, times: NodeTimes | None, flags: dict[str, bool], mode: Mode
) -> None:
    chosen, _ = _chooser(_Budget(), **flags).choose(schedule, times, True)  # type: ignore[arg-type]
    assert chosen is mode


class _Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.relu(x) * 2)


def _add_one(x: int) -> int:
    return x + 1


async def test_statistics_count_the_modes_executions_ran_in() -> None:
    ep = torch.export.export(_Chain(), (torch.randn(4, 8),))
    async with Executor(ep, ExecutorConfig(profile_executions=1)) as ex:
        for _ in range(8):
            await asyncio.sleep(0)  # a fresh slice each
            await ex.execute(torch.randn(4, 8))
        modes = ex.statistics().modes
        assert set(modes) == {m.name for m in Mode}
        assert sum(modes.values()) == ex.statistics().started == 8
        assert modes["DATAFLOW"] >= 1  # warm-up and profiling
        assert modes["FRAMELESS"] >= 1  # then the line, at once, without a frame
    b = GraphBuilder()
    b.output(b.call(_add_one, b.call(_add_one, b.input("x"), name="w", placement="worker"),
                    name="i", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        for _ in range(3):
            assert await ex.execute(1) == 3
        assert ex.statistics().modes["DATAFLOW"] == 3  # a worker unit: never a line


"""Side effects keep graph order in every execution mode (ARCHITECTURE.md, "Order of side
effects"; asyncgraph/graph/effects.py).

Issue 39: two `pop`s of one torchbind queue, with no data edge between them, ran in the other
order from the second execution on (adaptive placement changed the schedule). The property
test below builds random graphs whose side-effecting nodes append to their execution's log,
runs each past adaptive placement's decision (profiling, then decided schedules, fused and
straight-line runs, worker hops), then several executions at once, serially and in parallel
with a seeded ready order, and compares each log with graph order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import LeakChecker
from tests.support import torchbind

pytestmark = pytest.mark.usefixtures("leak_check")

CALLS = 7  # past profile_executions (3) and the decided placement's first runs
SERIAL = ExecutorConfig(max_parallel_ops=1)


def parallel(seed: int) -> ExecutorConfig:
    return ExecutorConfig(max_parallel_ops=3, ready_order_seed=seed, heavy_op_flops=0,
                          max_concurrent_executions=4)


# -- torchbind: the reproducer ----------------------------------------------------------

needs_torchbind = pytest.mark.skipif(
    torchbind.SKIP_REASON is not None, reason=str(torchbind.SKIP_REASON)
)


class PopTwice(torch.nn.Module):
    def forward(self, tq: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tq.pop() + torch.mm(x, x), tq.pop() + x


class PopTwiceAttribute(torch.nn.Module):
    """The queue is a module attribute (a CUSTOM_OBJ constant of the program)."""

    def __init__(self) -> None:
        super().__init__()
        self.tq = torchbind.tensor_queue()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.tq.push(x + 1)
        self.tq.push(x + 2)
        return self.tq.pop() + torch.mm(x, x), self.tq.pop() + x


def two_item_queue() -> Any:
    return torchbind.tensor_queue(torch.ones(2, 2), torch.full((2, 2), 2.0))


@needs_torchbind
@pytest.mark.parametrize("config", [SERIAL, parallel(3)], ids=["serial", "parallel"])
async def test_torchbind_pops_keep_graph_order(config: ExecutorConfig) -> None:
    x = torch.zeros(2, 2)
    ep = torch.export.export(PopTwice(), (two_item_queue(), x), strict=False)
    expected = [o[0, 0].item() for o in ep.module()(two_item_queue(), x)]
    assert expected == [1.0, 2.0]
    async with Executor(ep, config) as ex:
        for call in range(CALLS):
            got = [o[0, 0].item() for o in await ex.execute(two_item_queue(), x)]
            assert got == expected, f"execution {call + 1}: {got}"


@needs_torchbind
@pytest.mark.parametrize("config", [SERIAL, parallel(5)], ids=["serial", "parallel"])
async def test_torchbind_attribute_keeps_graph_order(config: ExecutorConfig) -> None:
    x = torch.randn(2, 2)
    ep = torch.export.export(PopTwiceAttribute(), (x,), strict=False)
    expected = ep.module()(x)
    async with Executor(ep, config) as ex:
        for call in range(CALLS):
            got = await ex.execute(x)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, msg=f"execution {call + 1}")


# -- an effectful custom op in an fx graph that is not functionalized --------------------------

LOG: list[int] = []


@torch.library.custom_op("agtest::log_value", mutates_args=())
def log_value(x: torch.Tensor, tag: int) -> torch.Tensor:
    LOG.append(tag)
    return x.clone()


@log_value.register_fake
def _(x: torch.Tensor, tag: int) -> torch.Tensor:
    return torch.empty_like(x)


torch.library._register_effectful_op(
    "agtest::log_value", torch._library.effects.EffectType.ORDERED
)


class Logging(torch.nn.Module):
    """Independent branches that each log: only the effect order relates them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.agtest.log_value.default
        a = op(torch.mm(x, x), 1)
        b = op(x + 1, 2)
        c = op(x * 3, 3)
        return a + b + c


@pytest.mark.parametrize("config", [SERIAL, parallel(11)], ids=["serial", "parallel"])
async def test_effectful_op_in_fx_graph_keeps_order(config: ExecutorConfig) -> None:
    gm = torch.fx.symbolic_trace(Logging())
    async with Executor(gm, config) as ex:
        for _ in range(CALLS):
            LOG.clear()
            await ex.execute(torch.randn(8, 8))
            assert LOG == [1, 2, 3]


# -- the property: random graphs, effects in graph order ----------------------------------------


@dataclass(frozen=True)
class Step:
    sources: tuple[int, ...]  # earlier values (inputs first)
    state: int | None  # the state it changes, or None: a pure node
    kind: str  # "inline", "worker", "task" (async)


@st.composite
def effect_graphs(draw: st.DrawFn) -> tuple[Step, ...]:
    n = draw(st.integers(2, 14))
    steps = []
    for i in range(n):
        available = 1 + i
        k = draw(st.integers(1, min(2, available)))
        sources = tuple(draw(st.lists(st.integers(0, available - 1), min_size=k, max_size=k,
                                      unique=True)))
        state = draw(st.one_of(st.none(), st.integers(0, 2)))
        steps.append(Step(sources, state, draw(st.sampled_from(("inline", "worker", "task")))))
    return tuple(steps)


def build(steps: tuple[Step, ...]) -> Graph:
    """Every side-effecting node appends (state, node) to the list its execution passes in
    (`log`), so concurrent executions keep separate logs. State 0 is a name, state 1 the
    object a graph input holds (a Ref), state 2 another name."""
    b = GraphBuilder()
    x = b.input("x")
    log = b.input("log")
    values = [x]
    for i, step in enumerate(steps):
        effects: Any = None
        if step.state == 1:
            effects = log
        elif step.state is not None:
            effects = f"state{step.state}"
        placement = None if step.kind == "task" else step.kind
        values.append(b.call(_node(i, step), log, *(values[s] for s in step.sources),
                             name=f"n{i}", placement=placement, effects=effects))
    b.output(tuple(values[1:]))
    return b.build()


def _node(i: int, step: Step) -> Any:
    def value(xs: tuple[int, ...]) -> int:
        return (sum(xs) * 3 + i) % 1009

    if step.kind == "task":
        async def run_async(log: list[tuple[int, int]], *xs: int) -> int:
            await asyncio.sleep(0)
            if step.state is not None:
                log.append((step.state, i))
            return value(xs)

        return run_async

    def run(log: list[tuple[int, int]], *xs: int) -> int:
        if step.state is not None:
            log.append((step.state, i))
        return value(xs)

    return run


def expected_order(steps: tuple[Step, ...]) -> dict[int, list[int]]:
    order: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        if step.state is not None:
            order.setdefault(step.state, []).append(i)
    return order


async def run_once(ex: Executor, graph: Graph, want: dict[int, list[int]], call: int) -> None:
    log: list[tuple[int, int]] = []
    await ex.execute(call, log)
    got: dict[int, list[int]] = {}
    for state, node in log:
        got.setdefault(state, []).append(node)
    assert got == want, (
        f"max_parallel_ops={ex.config.max_parallel_ops}, execution {call + 1}: effects ran "
        f"in order {got}, graph order is {want}\n{graph.format()}"
    )


async def check_effect_order(steps: tuple[Step, ...], seed: int) -> None:
    """CALLS executions one after another, then rounds of 4 at once (overlapping executions
    take the loaded placement and worker executions), serially and in parallel."""
    graph = build(steps)
    want = expected_order(steps)
    for config in (SERIAL, parallel(seed)):
        async with LeakChecker(), Executor(graph, config) as ex:
            for call in range(CALLS):
                await run_once(ex, graph, want, call)
            for round_ in range(2):
                await asyncio.gather(
                    *(run_once(ex, graph, want, CALLS + 4 * round_ + k) for k in range(4))
                )


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(steps=effect_graphs(), seed=st.integers(0, 2**16))
async def test_random_graphs_keep_effects_in_graph_order(
    steps: tuple[Step, ...], seed: int
) -> None:
    await check_effect_order(steps, seed)


async def test_independent_effects_in_one_fan() -> None:
    """A fixed example the property covers: a fan of effects on one state, each reading only
    the input, so only the ordering edges relate them."""
    steps = tuple(Step((0,), 0, kind) for kind in ("worker", "inline", "task") * 3)
    await check_effect_order(steps, seed=1)

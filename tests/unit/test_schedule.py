"""Schedules: runs of inline nodes fused into units, their edges, frees and errors."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.runtime.plan import Placement
from asyncgraph.runtime.schedule import ScheduleCache, build_schedule
from tests.support.loop_turns import LoopTurns

pytestmark = pytest.mark.usefixtures("leak_check")


def add_one(x: int) -> int:
    return x + 1


def chain(length: int, placement: str = "inline") -> Graph:
    b = GraphBuilder()
    v = b.input("x")
    for i in range(length):
        v = b.call(add_one, v, name=f"n{i}", placement=placement)
    b.output(v)
    return b.build()


def schedule_of(ex: Executor, fused: bool = True) -> Any:
    """The schedule of the plan's placement, built as the Executor builds it for these CPU
    graphs (no stream plan, no segments, no adaptive decision for the plan's own tuple)."""
    cache = ScheduleCache(ex.graph, ex.plan, ex.kernels, ex.config.max_fused_nodes)
    return cache.get(ex.plan.placement, fused)


async def test_a_chain_fuses_into_runs_of_max_fused_nodes() -> None:
    async with Executor(chain(70), ExecutorConfig(max_fused_nodes=32)) as ex:
        s = schedule_of(ex)
        assert [len(n) for n in s.nodes] == [32, 32, 6]
        assert s.producer_counts == (0, 1, 1) and s.roots == (0,)
        assert s.users_reversed == ((1,), (2,), ())
        assert await ex.execute(0) == 70


async def test_max_fused_nodes_1_runs_one_unit_per_node() -> None:
    async with Executor(chain(5), ExecutorConfig(max_fused_nodes=1)) as ex:
        s = schedule_of(ex)
        assert s.nodes == tuple((i,) for i in range(5)) and not s.fused
        assert await ex.execute(1) == 6


def test_max_fused_nodes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_fused_nodes must be >= 1, got 0"):
        ExecutorConfig(max_fused_nodes=0)


async def test_a_run_ends_at_a_node_feeding_a_worker_node() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(add_one, x, name="a", placement="inline")
    w = b.call(add_one, a, name="w", placement="worker")
    c = b.call(add_one, a, name="c", placement="inline")
    d = b.call(add_one, c, name="d", placement="inline")
    e = b.call(lambda p, q: p * q, w, d, name="e", placement="inline")
    b.output(e)
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        s = schedule_of(ex)
        # a feeds the worker node, so its run ends there and w is dispatched right after a.
        assert s.nodes == ((0,), (1,), (2, 3, 4))
        assert s.where == (Placement.INLINE, Placement.WORKER, Placement.INLINE)
        assert s.producer_counts == (0, 1, 2)
        # a's value is read by two other units; it is stored in the frame and freed by counts.
        assert s.stores[0] == ex.plan.outputs[0]
        assert await ex.execute(1) == (1 + 2) * (1 + 3)


async def test_values_read_only_inside_a_run_stay_local() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(add_one, x, name="a", placement="inline")
    y = b.call(add_one, a, name="y", placement="inline")
    z = b.call(add_one, y, name="z", placement="inline")
    b.output((y, z))  # y is an output: stored; a is read only by y: a local
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        s = schedule_of(ex)
        assert s.nodes == ((0, 1, 2),) and s.stores == (-1,)
        source_frees = s.frees[0]
        a_id, y_id = ex.plan.outputs[0], ex.plan.outputs[1]
        assert a_id not in source_frees and y_id not in source_frees  # y is pinned as output
        assert await ex.execute(1) == (3, 4)


async def test_an_error_inside_a_fused_run_names_the_failing_node() -> None:
    def explode(v: int) -> int:
        raise ValueError(f"bad value {v}")

    b = GraphBuilder()
    v = b.input("x")
    for i in range(5):
        v = b.call(add_one, v, name=f"n{i}", placement="inline")
    v = b.call(explode, v, name="explode", placement="inline")
    v = b.call(add_one, v, name="after", placement="inline")
    b.output(v)
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        assert [len(n) for n in schedule_of(ex).nodes] == [7]
        with pytest.raises(ValueError, match="bad value 5") as info:
            await ex.execute(0)
        notes = getattr(info.value, "__notes__", [])
        assert any(n.startswith("While executing %explode = ") for n in notes), notes
        assert ex.statistics().failed == 1


async def test_a_fused_chain_keeps_at_most_two_intermediates_alive() -> None:
    lock = threading.Lock()
    live = peak = 0

    def drop() -> None:
        nonlocal live
        with lock:
            live -= 1

    def step(t: torch.Tensor) -> torch.Tensor:
        nonlocal live, peak
        out = t + 1
        with lock:
            live += 1
            peak = max(peak, live)
        weakref.finalize(out, drop)
        return out

    b = GraphBuilder()
    v = b.input("x")
    for i in range(100):
        v = b.call(step, v, name=f"s{i}", placement="inline")
    b.output(v)
    async with Executor(b.build(), ExecutorConfig(adaptive_placement=False)) as ex:
        out = await ex.execute(torch.zeros(4))
        assert torch.equal(out, torch.full((4,), 100.0))
        del out
    assert peak <= 2, f"{peak} intermediates alive at once"
    assert live == 0


async def test_fused_and_unfused_agree_on_an_exported_encoder() -> None:
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(1, 8, 32)
    ep = torch.export.export(model, (x,))
    configs = [
        ExecutorConfig(max_fused_nodes=n, heavy_op_flops=flops, adaptive_placement=False)
        for n in (1, 4, 32)
        for flops in (2**62, 0, 20_000)
    ]
    with torch.inference_mode():
        expected = ep.module()(x)
    for config in configs:
        async with Executor(ep, config) as ex:
            torch.testing.assert_close(await ex.execute(x), expected)


async def test_the_loop_gets_a_turn_between_fused_units() -> None:
    config = ExecutorConfig(max_fused_nodes=4, loop_slice_s=1e-9, adaptive_placement=False)
    async with Executor(chain(40), config) as ex, LoopTurns() as turns:
        before = turns.count
        assert await ex.execute(0) == 40
        during = turns.count - before
    assert during >= 5, f"the heartbeat ran {during} times during 10 units"


async def test_units_form_a_dag_in_topological_order() -> None:
    b = GraphBuilder()
    x = b.input("x")
    values = [x]
    for i in range(30):
        placement = "worker" if i % 7 == 3 else "inline"
        args = values[-1], values[len(values) // 2]
        values.append(b.call(lambda p, q: p + q, *args, name=f"n{i}", placement=placement))
    b.output(values[-1])
    graph = b.build()
    async with Executor(graph, ExecutorConfig(adaptive_placement=False)) as ex:
        expected = await ex.execute(1)
    for max_fused in (1, 3, 32):
        s = build_schedule(graph, ex.plan, ex.kernels, ex.plan.placement, max_fused)
        covered = sorted(n for run in s.nodes for n in run)
        assert covered == list(range(len(graph.nodes)))
        for unit, users in enumerate(s.users_reversed):
            assert all(user > unit for user in users)
        for run in s.nodes:
            if len(run) > 1:
                assert all(ex.plan.placement[n] is Placement.INLINE for n in run)
        config = ExecutorConfig(adaptive_placement=False, max_fused_nodes=max_fused)
        async with Executor(graph, config) as other:
            assert await other.execute(1) == expected


async def test_a_units_priority_is_the_longest_path_of_cost_from_it_to_the_end() -> None:
    b = GraphBuilder()
    x = b.input("x")
    a = b.call(add_one, x, name="a", placement="worker")
    long1 = b.call(add_one, a, name="long1", placement="worker")
    long2 = b.call(add_one, long1, name="long2", placement="worker")
    short = b.call(add_one, a, name="short", placement="worker")
    b.output(b.call(lambda p, q: p + q, long2, short, name="join", placement="worker"))
    graph = b.build()
    async with Executor(graph, ExecutorConfig(adaptive_placement=False)) as ex:
        assert await ex.execute(0) == 5
        names = [n.name for n in graph.nodes]
        costs = {"a": 1.0, "long1": 2.0, "long2": 3.0, "short": 10.0, "join": 0.5}
        s = build_schedule(
            graph, ex.plan, ex.kernels, ex.plan.placement, 1, costs=[costs[n] for n in names]
        )
        priority = dict(zip(names, s.priority, strict=True))
        assert priority == {
            "a": 11.5, "long1": 5.5, "long2": 3.5, "short": 10.5, "join": 0.5
        }
        assert s.seconds is None  # estimates rank units but say nothing of time
        timed = build_schedule(
            graph, ex.plan, ex.kernels, ex.plan.placement, 1,
            costs=[costs[n] for n in names], measured=True,
        )
        assert timed.seconds is not None
        assert dict(zip(names, timed.seconds, strict=True)) == {
            n: c / 1e6 for n, c in costs.items()
        }
        # without measured times the kernels' estimates count (a Python callable: 1 each)
        default = dict(zip(names, schedule_of(ex, fused=False).priority, strict=True))
        assert default == {"a": 4.0, "long1": 3.0, "long2": 2.0, "short": 2.0, "join": 1.0}


async def test_statistics_count_schedules_and_fused_units() -> None:
    async with Executor(chain(40), ExecutorConfig(max_fused_nodes=16)) as ex:
        assert await ex.execute(0) == 40
        stats = ex.statistics().schedules
    # the first execution is adaptive placement's warm-up: the plan's placement, fused
    assert stats.schedules >= 1
    assert stats.fused_units >= 3 and stats.fused_nodes >= 40


def test_the_schedule_cache_keeps_the_most_recently_used() -> None:
    """A service seeing ever new shapes decides ever new placements: the cache stays bounded
    and evicts the schedule used least recently."""
    ex = Executor(chain(3))
    cache = ScheduleCache(ex.graph, ex.plan, ex.kernels, max_fused=8, max_schedules=2)
    placements = [tuple(list(ex.plan.placement)) for _ in range(3)]  # equal, distinct objects
    first = cache.get(placements[0], fused=True)
    cache.get(placements[1], fused=True)
    assert cache.get(placements[0], fused=True) is first  # a hit, now the most recent
    cache.get(placements[2], fused=True)  # evicts placements[1]'s
    assert cache.get(placements[0], fused=True) is first
    stats = cache.statistics()
    assert (stats.schedules, stats.built) == (2, 3)
    cache.get(placements[1], fused=True)  # built again
    assert cache.statistics().built == 4


def test_the_most_recent_schedule_is_found_again_only_while_the_cache_holds_it() -> None:
    """`cached` answers the most recently used entry by identity; once that entry is evicted
    it answers None, as the cache does."""
    ex = Executor(chain(3))
    placements = [tuple(list(ex.plan.placement)) for _ in range(2)]  # equal, distinct objects
    cache = ScheduleCache(ex.graph, ex.plan, ex.kernels, max_fused=8, max_schedules=1)
    first = cache.get(placements[0], fused=True)
    assert cache.cached(placements[0], fused=True) is first
    assert cache.cached(placements[1], fused=True) is None  # equal is not identical
    assert cache.cached(placements[0], fused=False) is None  # nor is the unfused one
    cache.get(placements[1], fused=True)  # evicts the first
    assert cache.cached(placements[0], fused=True) is None
    empty = ScheduleCache(ex.graph, ex.plan, ex.kernels, max_fused=8, max_schedules=0)
    empty.get(placements[0], fused=True)  # built, and evicted at once
    assert empty.cached(placements[0], fused=True) is None
    assert empty.statistics().schedules == 0

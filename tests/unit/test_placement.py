"""Adaptive placement: measured node times decide inline versus worker, per input shapes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import asyncgraph
from asyncgraph import ExecutorConfig, Placement
from asyncgraph.runtime.placement import AdaptivePlacement
from asyncgraph.runtime.validation import InputValidator
from asyncgraph.testing import introspect

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.serial]


class Mixed(torch.nn.Module):
    """One big matmul (worth a thread) followed by tiny elementwise ops (not worth a hop)."""

    def forward(self, x: torch.Tensor, small: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ x).sum(), (small + 1).relu()


async def test_profiled_runs_decide_placement() -> None:
    x, small = torch.randn(384, 384), torch.randn(4)
    ep = torch.export.export(Mixed(), (x, small))
    # one worker thread, so the warm-up execution warms the thread the profiled ones run on;
    # the matmul has no heavy peer, so it moves for overrunning the slice: 0.2 ms, which a
    # 384^3 matmul (0.6-2 ms on one core) does on any machine, and the small ops do not
    config = ExecutorConfig(
        max_parallel_ops=1, heavy_op_flops=0, profile_executions=2, heavy_node_us=150,
        loop_slice_s=0.0002,
    )
    async with asyncgraph.Executor(ep, config) as ex:
        assert set(ex.placements().values()) == {Placement.WORKER}  # the estimate: all heavy
        for _ in range(4):
            out = await ex.execute(x, small)
        torch.testing.assert_close(out, Mixed()(x, small))
        placements = ex.placements()
        stats = ex.placement_statistics()
    matmul = next(n for n in placements if n.startswith("matmul") or n.startswith("mm"))
    assert placements[matmul] is Placement.WORKER  # a 384^3 matmul takes milliseconds
    assert placements["add"] is Placement.INLINE and placements["relu"] is Placement.INLINE
    assert stats is not None and stats.decided == 1 and stats.profiling_runs == 2


def test_new_shapes_are_profiled_again() -> None:
    ep = torch.export.export(
        Mixed(), (torch.randn(8, 8), torch.randn(4)),
        dynamic_shapes=({0: torch.export.Dim("n"), 1: torch.export.Dim("n")}, None),
    )
    ex = asyncgraph.Executor(ep)
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, profile_executions=1)
    first = [torch.randn(8, 8), torch.randn(4)]
    assert adaptive.choose(first)[1] is None  # the warm-up execution is not profiled
    _, times = adaptive.choose(first)
    assert times is not None
    adaptive.finished(times)
    assert adaptive.choose(first)[1] is None  # decided for this signature
    second = [torch.randn(16, 16), torch.randn(4)]
    adaptive.choose(second)
    assert adaptive.choose(second)[1] is not None  # a new signature is profiled afresh
    assert adaptive.statistics().signatures == 2


def test_decide_moves_only_cpu_nodes_without_hints() -> None:
    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    b.output(b.call(lambda v: v, x, name="pinned", placement="worker"))
    ex = asyncgraph.Executor(b.build())
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels)
    assert adaptive.decide([0.0]) == (Placement.WORKER,)


def _diamond_of_heavy_nodes(config: ExecutorConfig | None = None) -> asyncgraph.Executor:
    """x -> a -> b -> (c, d) -> e: a and b on the spine, c and d independent of each other."""
    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    a = b.call(torch.relu, x, name="a")
    spine = b.call(torch.relu, a, name="b")
    c = b.call(torch.relu, spine, name="c")
    d = b.call(torch.relu, spine, name="d")
    b.output(b.call(torch.add, c, d, name="e"))
    return asyncgraph.Executor(b.build(), config or ExecutorConfig(heavy_op_flops=0))


def test_heavy_nodes_on_the_serial_spine_run_inline() -> None:
    ex = _diamond_of_heavy_nodes()
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, heavy_node_us=80)
    for node in ex.graph.nodes:  # Python callables start on workers; only measured CPU ops move
        assert ex.plan.placement[node.index] is Placement.WORKER
    adaptive.movable = (True,) * 5
    w, i = Placement.WORKER, Placement.INLINE
    # all heavy: a, b and e are ancestors or descendants of every other node; c and d overlap
    assert adaptive.decide([200.0] * 5) == (i, i, w, w, i)
    # only c heavy: it has no heavy peer, so a hop would buy nothing
    assert adaptive.decide([1.0, 1.0, 200.0, 1.0, 1.0]) == (i, i, i, i, i)
    # a node longer than the loop's slice leaves the loop even alone
    assert adaptive.decide([5000.0, 1.0, 1.0, 1.0, 1.0]) == (w, i, i, i, i)


def test_independent_heavy_branches_go_to_workers() -> None:
    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    b.output([b.call(torch.relu, x, name=f"branch{k}") for k in range(4)])
    ex = asyncgraph.Executor(b.build())
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, heavy_node_us=80)
    adaptive.movable = (True,) * 4
    assert set(adaptive.decide([100.0] * 4)) == {Placement.WORKER}
    assert set(adaptive.decide([100.0, 1.0, 1.0, 1.0])) == {Placement.INLINE}


def test_a_loaded_loop_sends_every_heavy_node_to_a_worker() -> None:
    ex = _diamond_of_heavy_nodes()
    adaptive = AdaptivePlacement(
        ex.graph, ex.plan, ex.kernels, heavy_node_us=80, loaded_heavy_node_us=250
    )
    adaptive.movable = (True,) * 5
    w, i = Placement.WORKER, Placement.INLINE
    best = [300.0, 1.0, 300.0, 1.0, 1.0]
    assert adaptive.decide(best) == (i, i, i, i, i)  # quiet: nothing overlaps a or c
    assert adaptive.decide(best, loaded=True) == (w, i, w, i, i)  # other executions do


def test_a_loaded_loop_keeps_nodes_below_its_own_bar_inline() -> None:
    """Under a busy loop a worker waits for the GIL to start and finish each node: a node
    heavy enough for a worker on a quiet loop stays inline below loaded_heavy_node_us."""
    ex = _diamond_of_heavy_nodes()
    adaptive = AdaptivePlacement(
        ex.graph, ex.plan, ex.kernels, heavy_node_us=80, loaded_heavy_node_us=250
    )
    adaptive.movable = (True,) * 5
    w, i = Placement.WORKER, Placement.INLINE
    assert adaptive.decide([100.0, 1.0, 300.0, 1.0, 1.0], loaded=True) == (i, i, w, i, i)


def test_the_loaded_bar_comes_from_the_config() -> None:
    with pytest.raises(ValueError, match="loaded_heavy_node_us"):
        ExecutorConfig(loaded_heavy_node_us=-1)
    ex = _diamond_of_heavy_nodes(ExecutorConfig(heavy_op_flops=0, loaded_heavy_node_us=123.0))
    stats = ex.placement_statistics()
    assert stats is not None and stats.loaded_heavy_node_us == 123.0


class Spine(torch.nn.Module):
    """Light ops around one matmul on the serial spine: it stays inline once measured."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + 1).relu() @ x).neg().abs()


async def test_a_heavy_inline_node_runs_as_a_unit_of_its_own() -> None:
    """Fused with its light neighbours, a heavy node would hide inside one long unit, past
    the loop budget's checks between units."""
    x = torch.randn(256, 256)
    ep = torch.export.export(Spine(), (x,))
    config = ExecutorConfig(profile_executions=1, heavy_node_us=0.0, loop_slice_s=10.0)
    async with asyncgraph.Executor(ep, config) as ex:
        for _ in range(3):
            out = await ex.execute(x)
        torch.testing.assert_close(out, Spine()(x))
        placements = ex.placements()
        assert set(placements.values()) == {Placement.INLINE}
        stats = ex.placement_statistics()
        # every node measured >= 0 us: all heavy
        assert stats is not None and stats.heavy_nodes == tuple(placements)
        # the decided placement's schedule: the cache asks adaptive.decision
        schedule = introspect.schedule(ex)
        unfused = introspect.schedule(ex)  # same placement: the cached one
    assert all(len(unit) == 1 for unit in schedule.nodes)
    assert unfused is schedule
    # without the heavy marks the same chain is one fused unit
    fused = introspect.schedule(ex, tuple(placements.values()))  # a new tuple object
    assert len(fused.nodes) == 1


def test_a_signature_finds_the_entry_its_shape_key_finds_until_that_entry_is_evicted() -> None:
    """The Executor passes validation's input signature to `choose`, which then finds the
    entry without computing its shape key; an entry evicted meanwhile is not found again
    through a signature remembered before (it starts afresh, with a warm-up)."""
    ep = torch.export.export(
        Mixed(), (torch.randn(8, 8), torch.randn(4)),
        dynamic_shapes=({0: torch.export.Dim("n"), 1: torch.export.Dim("n")}, None),
    )
    ex = asyncgraph.Executor(ep)
    adaptive = AdaptivePlacement(
        ex.graph, ex.plan, ex.kernels, profile_executions=1, max_signatures=1
    )
    first = [torch.randn(8, 8), torch.randn(4)]
    validator = InputValidator(ex.graph, ex.config.max_unbounded_int)  # as the Executor's
    signature = validator.check(first)
    assert signature is not None
    assert adaptive.choose(first, signature=signature)[1] is None  # warm-up
    _, times = adaptive.choose(first)  # without the signature: the same entry, profiled
    assert times is not None
    adaptive.finished(times)
    decided, times = adaptive.choose(first, signature=signature)
    assert times is None and decided is adaptive.choose(first)[0]
    second = [torch.randn(16, 16), torch.randn(4)]
    adaptive.choose(second, signature=validator.check(second))  # evicts the first entry
    assert adaptive.choose(first, signature=signature)[1] is None  # a new entry's warm-up
    assert adaptive.choose(first, signature=signature)[1] is not None  # profiled afresh


def test_a_decided_placement_is_rechecked_as_it_warms_up() -> None:
    """The first round may still be warming up: a node that measured past the loop's slice
    goes to a worker, and the recheck round (with that placement) brings it back inline."""
    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    b.output(b.call(torch.relu, x, name="segment"))
    ex = asyncgraph.Executor(b.build())
    adaptive = AdaptivePlacement(
        ex.graph, ex.plan, ex.kernels, profile_executions=2, recheck_after=3
    )
    adaptive.movable = (True,)
    inputs = [torch.randn(4)]
    assert adaptive.choose(inputs)[1] is None  # warm-up
    for us in (3000.0, 1500.0):  # cold: past the 1 ms slice
        placement, times = adaptive.choose(inputs)
        assert times is not None
        times.add(0, int(us * 1000))
        adaptive.finished(times)
    first, times = adaptive.choose(inputs)
    assert first == (Placement.WORKER,) and times is None
    decided = adaptive.decision(first)
    assert decided is not None and decided.best_us == (1500.0,)
    for _ in range(2):  # the countdown: 3 executions in all, the first above
        assert adaptive.choose(inputs) == (first, None)
    for us in (600.0, 700.0):  # the recheck round runs with the decided placement
        placement, times = adaptive.choose(inputs)
        assert placement is first and times is not None
        times.add(0, int(us * 1000))
        adaptive.finished(times)
    rechecked, times = adaptive.choose(inputs)
    assert rechecked == (Placement.INLINE,) and times is None
    assert adaptive.decision(first) is None  # the old decision is forgotten
    now = adaptive.decision(rechecked)
    assert now is not None and now.best_us == (600.0,)
    for gap in (6, 12):  # two more rounds, each twice as far out; the best times only fall
        for _ in range(gap - 1):  # the countdown, the first execution above
            assert adaptive.choose(inputs) == (rechecked, None)
        for us in (650.0, 900.0):
            placement, times = adaptive.choose(inputs)
            assert placement is rechecked and times is not None
            times.add(0, int(us * 1000))
            adaptive.finished(times)
        rechecked, times = adaptive.choose(inputs)
        assert rechecked == (Placement.INLINE,) and times is None
        assert adaptive.decision(rechecked).best_us == (600.0,)  # type: ignore[union-attr]
    assert all(adaptive.choose(inputs)[1] is None for _ in range(300))  # RECHECKS rounds only
    stats = adaptive.statistics()
    assert (stats.rechecked, stats.revised, stats.profiling_runs) == (3, 1, 8)


def test_a_later_recheck_catches_a_slow_warm_up() -> None:
    """Still cold at the first recheck, the node stays on its worker; warm at the second, it
    comes back inline."""
    b = asyncgraph.GraphBuilder()
    b.output(b.call(torch.relu, b.input("x"), name="segment"))
    ex = asyncgraph.Executor(b.build())
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, profile_executions=1,
                                 recheck_after=2)
    adaptive.movable = (True,)
    inputs = [torch.randn(4)]
    adaptive.choose(inputs)  # warm-up
    seen = []
    for us in (3000.0, 1200.0, 500.0):  # the first decision, then the first two rechecks
        for _ in range(10):  # counting down to the next profiled execution
            _, times = adaptive.choose(inputs)
            if times is not None:
                break
        assert times is not None, f"no profiled round for {us} us"
        times.add(0, int(us * 1000))
        adaptive.finished(times)
        seen.append(adaptive.choose(inputs)[0])
    assert seen == [(Placement.WORKER,), (Placement.WORKER,), (Placement.INLINE,)]
    stats = adaptive.statistics()
    assert (stats.rechecked, stats.revised) == (2, 1)


def test_recheck_after_zero_decides_once() -> None:
    with pytest.raises(ValueError, match="placement_recheck_after"):
        ExecutorConfig(placement_recheck_after=-1)
    b = asyncgraph.GraphBuilder()
    b.output(b.call(torch.relu, b.input("x"), name="only"))
    ex = asyncgraph.Executor(b.build(), ExecutorConfig(placement_recheck_after=0))
    stats = ex.placement_statistics()
    assert stats is not None and stats.recheck_after == 0
    adaptive = AdaptivePlacement(  # as the Executor makes it from its config
        ex.graph, ex.plan, ex.kernels,
        profile_executions=ex.config.profile_executions,
        recheck_after=ex.config.placement_recheck_after,
    )
    assert adaptive.recheck_after == 0
    inputs = [torch.randn(4)]
    adaptive.choose(inputs)
    for _ in range(adaptive.profile_executions):
        _, times = adaptive.choose(inputs)
        assert times is not None
        adaptive.finished(times)
    assert all(adaptive.choose(inputs)[1] is None for _ in range(300))
    assert adaptive.statistics().rechecked == 0


class _ColdThenWarm:
    """A kernel that burns CPU during its first calls, as a compiled segment warming up does."""

    def __init__(self, cold_calls: int) -> None:
        self.calls = 0
        self.cold_calls = cold_calls

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.cold_calls:
            until = time.thread_time() + 0.003
            while time.thread_time() < until:
                pass
        return x + 1


async def test_an_executor_moves_a_node_that_warmed_up_back_inline() -> None:
    kernel = _ColdThenWarm(cold_calls=3)  # the warm-up and both profiled runs
    b = asyncgraph.GraphBuilder()
    b.output(b.call(kernel, b.input("x"), name="warming"))
    config = ExecutorConfig(profile_executions=2, placement_recheck_after=2)
    x = torch.randn(4)
    async with asyncgraph.Executor(b.build(), config) as ex:
        for _ in range(3):
            await ex.execute(x)
        assert ex.placements()["warming"] is Placement.WORKER  # measured ~3 ms: past the slice
        for _ in range(5):  # 2 counted down, 2 rechecked, 1 with the new placement
            torch.testing.assert_close(await ex.execute(x), x + 1)
        assert ex.placements()["warming"] is Placement.INLINE
        stats = ex.placement_statistics()
    assert stats is not None and (stats.rechecked, stats.revised) == (1, 1)


def test_a_line_that_leaves_whole_for_a_worker_stays_inline_on_a_loaded_loop() -> None:
    """A graph with nodes over worker_execution_node_us on average runs whole on a worker
    when it overlaps others (StraightRunner), however short: the loaded loop's placement
    then keeps every node inline, rather than a hop per heavy node."""
    ex = _diamond_of_heavy_nodes()
    adaptive = AdaptivePlacement(
        ex.graph, ex.plan, ex.kernels, heavy_node_us=80, loaded_heavy_node_us=250,
        loop_slice_us=1000, worker_execution_node_us=250,
    )
    adaptive.movable = adaptive.any_thread = (True,) * 5
    whole = adaptive._runs_whole_on_worker
    assert whole([300.0] * 5)  # 1.5 ms, 300 us a node
    assert adaptive.decide([300.0] * 5, whole_line=True) == (Placement.INLINE,) * 5
    assert adaptive.decide([300.0] * 5, loaded=True) == (Placement.WORKER,) * 5
    assert not whole([180.0] * 5)  # 180 us a node: under the bar
    assert not whole([300.0, 1.0, 300.0, 1.0, 1.0])  # 120 us a node: under the bar
    adaptive.loop_slice_us = 2000
    assert whole([300.0] * 5)  # shorter than a slice: it leaves whole when others wait
    adaptive.any_thread = (False,) + (True,) * 4  # a node held to the loop thread
    assert not whole([300.0] * 5)
    adaptive.any_thread = (True,) * 5
    adaptive.worker_execution_node_us = None  # turned off
    assert not whole([300.0] * 5)


def test_the_worker_execution_bar_comes_from_the_config() -> None:
    with pytest.raises(ValueError, match="worker_execution_node_us"):
        ExecutorConfig(worker_execution_node_us=-1)
    ex = _diamond_of_heavy_nodes(ExecutorConfig(heavy_op_flops=0, worker_execution_node_us=7.0))
    stats = ex.placement_statistics()
    assert stats is not None and stats.worker_execution_node_us == 7.0
    ex = _diamond_of_heavy_nodes(ExecutorConfig(heavy_op_flops=0, worker_execution_node_us=None))
    stats = ex.placement_statistics()
    assert stats is not None and stats.worker_execution_node_us is None


@pytest.mark.parametrize(
    "inputs",
    [
        (torch.randn(3, 4),),
        (torch.randn(23, 8), torch.tensor(1.5), 7),
        (torch.zeros(0, 2, dtype=torch.int64), 2.5, True),
        (torch.randn(1, 1, 1).to(torch.float16),),
    ],
    ids=["one", "mixed", "empty-rows", "half"],
)
def test_a_signature_gives_the_key_its_inputs_give(inputs: tuple[Any, ...]) -> None:
    """Adaptive placement finds an entry by the validated Signature without the inputs
    (the Executor hands it none then): its key must be the one the inputs make."""
    from asyncgraph.runtime.placement import (
        batch_bucket_key,
        shape_key,
        signature_bucket_key,
        signature_shape_key,
    )
    from asyncgraph.runtime.validation import signature_of

    signature = signature_of(inputs)
    assert signature is not None
    assert signature_shape_key(signature) == shape_key(inputs)
    assert signature_bucket_key(signature) == batch_bucket_key(inputs)


def test_a_burst_profiles_only_as_many_executions_as_it_needs_at_once() -> None:
    """While a signature is undecided, at most profile_executions executions run profiled at
    once; the others run the base placement unprofiled (its fused schedule). A profiled one
    that fails or is cancelled frees its place; a finished one counts toward the decision."""
    ep = torch.export.export(Mixed(), (torch.randn(8, 8), torch.randn(4)))
    ex = asyncgraph.Executor(ep)
    adaptive = AdaptivePlacement(ex.graph, ex.plan, ex.kernels, profile_executions=3)
    x = [torch.randn(8, 8), torch.randn(4)]
    assert adaptive.choose(x)[1] is None  # the warm-up
    burst = [adaptive.choose(x) for _ in range(64)]  # 64 callers at once
    profiled = [times for _, times in burst if times is not None]
    assert len(profiled) == 3
    assert all(placement == adaptive.base for placement, _ in burst)
    adaptive.abandoned(profiled[0])  # cancelled: another execution may take its place
    _, again = adaptive.choose(x)
    assert again is profiled[1]  # the entry's times
    assert adaptive.choose(x)[1] is None  # three in flight again
    for times in (again, profiled[1], profiled[2]):
        adaptive.finished(times)
    assert adaptive.statistics().decided == 1
    assert adaptive.statistics().profiling_runs == 4

"""Higher-order ops run their subgraphs on asyncgraph's scheduler: the behaviour around it.

The values are covered by the corpus (test_models, test_export_db). Here: the ops the export
frontends rarely emit (invoke_subgraph, run_const_graph, while_loop_stack_output) on hand-built
fx graphs; a subgraph running its own nodes in parallel; errors inside subgraphs naming both
nodes; cancellation in the middle of a loop; load-time reports of unsupported ops inside
subgraphs; and the edge cases where eager fails.
"""

from __future__ import annotations

import asyncio
import operator
import time
from typing import Any

import pytest
import torch
import torch.fx
from torch._higher_order_ops.hints_wrap import hints_wrapper
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch._higher_order_ops.map import map_impl
from torch._higher_order_ops.run_const_graph import run_const_graph
from torch._higher_order_ops.while_loop import while_loop, while_loop_stack_output_op

from asyncgraph import Executor, ExecutorConfig, UnsupportedOpsError
from asyncgraph.kernels import KernelFactory
from asyncgraph.tools.compare import assert_same
from conformance.harness import close_all, make_executor

pytestmark = pytest.mark.usefixtures("leak_check")

PARALLEL = ExecutorConfig(max_parallel_ops=2, heavy_op_flops=0)


@torch.library.custom_op("agconf::fail_on_negative", mutates_args=())
def fail_on_negative(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise ValueError("agconf::fail_on_negative: negative input")
    return x * 2


@fail_on_negative.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("agconf::slow_step", mutates_args=())
def slow_step(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.005)
    return x + 1


@slow_step.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("agconf::cuda_only", mutates_args=(), device_types="cuda")
def cuda_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@cuda_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _fx(build: Any, **attrs: Any) -> torch.fx.GraphModule:
    """A GraphModule from a function that fills a torch.fx.Graph, with `attrs` as submodules
    or buffers of its root (what the export frontends put behind get_attr)."""
    root = torch.nn.Module()
    for name, value in attrs.items():
        if isinstance(value, torch.Tensor):
            root.register_buffer(name, value)
        else:
            setattr(root, name, value)
    graph = torch.fx.Graph()
    graph.output(build(graph))
    return torch.fx.GraphModule(root, graph)


def _traced(fn: Any) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


async def _run(gm: torch.fx.GraphModule, *args: Any, config: ExecutorConfig = PARALLEL) -> Any:
    ex = Executor(gm, config, kernel_factory=KernelFactory(config))
    try:
        return await ex.execute(*args)
    finally:
        await close_all(ex)


async def test_invoke_subgraph_and_run_const_graph() -> None:
    block = _traced(lambda a: (a.sin() * 2,))
    const = _traced(lambda w: (w * 3 + 1,))

    def build(g: torch.fx.Graph) -> Any:
        x = g.placeholder("x")
        blk, cst, w = g.get_attr("blk"), g.get_attr("const"), g.get_attr("w")
        a = g.call_function(operator.getitem, (g.call_function(invoke_subgraph, (blk, "b", x)), 0))
        b = g.call_function(operator.getitem, (g.call_function(invoke_subgraph, (blk, "b", a)), 0))
        c = g.call_function(operator.getitem, (g.call_function(run_const_graph, (cst, (w,))), 0))
        return (g.call_function(torch.add, (b, c)),)

    gm = _fx(build, blk=block, const=const, w=torch.arange(3.0))
    x = torch.randn(3)
    expected = gm(x)
    ex = make_executor(gm, PARALLEL)
    try:
        got = await ex.execute(x)
        kinds = {k.name: k.kind.value for k in ex.kernels}
        assert kinds["higher_order.invoke_subgraph"] == "async"
        assert kinds["higher_order.run_const_graph"] == "async"
    finally:
        await close_all(ex)
    assert_same(got, expected)


async def test_while_loop_stack_output() -> None:
    cond = _traced(lambda i, x: i < 4)
    body = _traced(lambda i, x: (i + 1, x * 2))

    def build(g: torch.fx.Graph) -> Any:
        i, x = g.placeholder("i"), g.placeholder("x")
        c, b = g.get_attr("cond"), g.get_attr("body")
        return g.call_function(while_loop_stack_output_op, (c, b, (i, x), ()))

    gm = _fx(build, cond=cond, body=body)
    args = (torch.tensor(0), torch.randn(2))
    assert_same(await _run(gm, *args), gm(*args))
    args = (torch.tensor(9), torch.randn(2))  # the body never runs: one stacked row
    assert_same(await _run(gm, *args), gm(*args))


async def test_hints_wrapper() -> None:
    body = _traced(lambda a, b: (a * b + 1,))

    def build(g: torch.fx.Graph) -> Any:
        a, b = g.placeholder("a"), g.placeholder("b")
        out = g.call_function(
            hints_wrapper, (g.get_attr("body"), (a, b), {}), {"hints": {"outer": True}}
        )
        return g.call_function(operator.getitem, (out, 0))

    gm = _fx(build, body=body)
    args = (torch.randn(3), torch.randn(3))
    assert_same(await _run(gm, *args), gm(*args))


async def test_map_over_zero_rows_fails_like_eager() -> None:
    body = _traced(lambda r: (r * 2,))

    def build(g: torch.fx.Graph) -> Any:
        xs = g.placeholder("xs")
        return g.call_function(map_impl, (g.get_attr("body"), [xs], []))

    gm = _fx(build, body=body)
    with pytest.raises(AssertionError):
        gm(torch.empty(0, 3))
    with pytest.raises(RuntimeError, match="map over 0 rows") as info:
        await _run(gm, torch.empty(0, 3))
    assert any("%map_impl" in note for note in info.value.__notes__)
    xs = torch.randn(5, 3)
    assert_same(await _run(gm, xs), gm(xs))


class TwoBranches(torch.nn.Module):
    """A cond whose true branch has two independent matmuls: a subgraph with parallelism."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        def true_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (x @ w).relu() + (x.t() @ w).tanh()

        def false_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x - w

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x, w))


async def test_subgraph_runs_its_own_nodes_on_worker_threads() -> None:
    ep = torch.export.export(TwoBranches(), (torch.ones(8, 8), torch.randn(8, 8)))
    ex = make_executor(ep, PARALLEL)
    try:
        x, w = torch.ones(8, 8), torch.randn(8, 8)
        assert_same(await ex.execute(x, w), ep.module()(x, w))
        (cond,) = [k for k in ex.kernels if k.name == "higher_order.cond"]
        true_branch = cond.fn.executors()[0]
        assert true_branch.config.max_parallel_ops == 2  # the factory's configuration
        assert not true_branch.config.validate_inputs
        placements = true_branch.placements()
        matmuls = [p.name for n, p in placements.items() if n.startswith("matmul")]
        assert matmuls == ["WORKER", "WORKER"], placements
        stats = true_branch.statistics()
        assert stats.completed == 1
        assert stats.workers.threads == 2 and stats.workers.items_run >= 2
    finally:
        await close_all(ex)


class CheckedBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            x.sum() < 0,
            lambda x: torch.ops.agconf.fail_on_negative(x) + 1,
            lambda x: x - 1,
            (x,),
        )


async def test_error_inside_a_subgraph_names_both_nodes() -> None:
    ep = torch.export.export(CheckedBranch(), (torch.ones(3),))
    with pytest.raises(ValueError, match="negative input"):
        ep.module()(-torch.ones(3))
    ex = make_executor(ep, PARALLEL)
    try:
        with pytest.raises(ValueError, match="negative input") as info:
            await ex.execute(-torch.ones(3))
        notes = "\n".join(info.value.__notes__)
        assert "%fail_on_negative = agconf.fail_on_negative" in notes
        assert "%cond = torch.ops.higher_order.cond" in notes
        assert ex.statistics().failed == 1
        assert_same(await ex.execute(torch.ones(3)), ep.module()(torch.ones(3)))
    finally:
        await close_all(ex)


class SlowLoop(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def cond_fn(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return i < n

        def body_fn(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return i + 1, torch.ops.agconf.slow_step(x)

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x.clone()))


async def test_cancelling_in_the_middle_of_a_loop_releases_everything() -> None:
    ep = torch.export.export(SlowLoop(), (torch.zeros(2), torch.tensor(3)))
    ex = make_executor(ep, PARALLEL)
    try:
        assert_same(await ex.execute(torch.zeros(2), torch.tensor(3)),
                    ep.module()(torch.zeros(2), torch.tensor(3)))
        (loop,) = [k for k in ex.kernels if k.name == "higher_order.while_loop"]
        body = next(e for e in loop.fn.executors() if "body" in e.program.name)
        before = body.statistics().completed
        task = asyncio.create_task(ex.execute(torch.zeros(2), torch.tensor(10_000)))
        for _ in range(2000):  # until a few iterations are in (bounded: ~10 s at most)
            if body.statistics().completed >= before + 3:
                break
            await asyncio.sleep(0.005)
        assert body.statistics().completed >= before + 3, "the loop never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.statistics().cancelled == 1
        for inner in loop.fn.executors():
            assert inner.statistics().in_flight == 0
        assert_same(await ex.execute(torch.zeros(2), torch.tensor(2)),
                    ep.module()(torch.zeros(2), torch.tensor(2)))
    finally:
        await close_all(ex)


class CudaOnlyBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            x.sum() > 0, lambda x: torch.ops.agconf.cuda_only(x), lambda x: x * 2, (x,)
        )


async def test_unsupported_op_in_a_subgraph_is_reported_at_load() -> None:
    ep = torch.export.export(CudaOnlyBranch(), (torch.ones(3),))
    with pytest.raises(UnsupportedOpsError) as info:
        Executor(ep, PARALLEL)
    assert "agconf.cuda_only" in str(info.value)
    assert "cond (in a subgraph)" in str(info.value)

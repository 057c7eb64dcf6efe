"""Reliability scenario 8: differential testing of random DAGs with Hypothesis.

Random graphs - tall chains, wide fans, diamonds and random DAGs; inline, worker-thread and
async kernels; random latencies; ints or int64 tensors - run three ways:
- the ReferenceRunner (graph order, one node at a time, no scheduler),
- a serial Executor (max_parallel_ops=1, one execution at a time),
- a parallel Executor with a seeded random ready order, several executions at once, values
  freed after use or not.
All three must give equal results, and each example ends leak-free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import LeakChecker, ReferenceRunner
from tests.support.soak import soak

MOD = 1009
KINDS = ("inline", "worker", "task")
DELAYS = (0.0, 0.0, 0.0, 0.0002, 0.001)


@dataclass(frozen=True)
class NodeSpec:
    kind: str
    sources: tuple[int, ...]  # value indices: inputs first, then nodes
    mul: int
    add: int
    delay: float


@dataclass(frozen=True)
class DagSpec:
    shape: str
    inputs: int
    nodes: tuple[NodeSpec, ...]
    outputs: tuple[int, ...]
    tensors: bool


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 12) -> DagSpec:
    shape = draw(st.sampled_from(["tall", "wide", "diamond", "random"]))
    n_inputs = draw(st.integers(1, 3))
    n_nodes = draw(st.integers(1, max_nodes))
    nodes: list[NodeSpec] = []
    for i in range(n_nodes):
        available = n_inputs + i
        if shape == "tall":
            sources: tuple[int, ...] = (available - 1,)
        elif shape == "wide":
            sources = (draw(st.integers(0, n_inputs - 1)),)
        elif shape == "diamond":  # fan out from the previous join, then join the fan
            width = 3
            layer, slot = divmod(i, width + 1)
            base = n_inputs + layer * (width + 1) - 1
            if slot < width:
                sources = (max(base, 0),)
            else:
                sources = tuple(range(available - width, available))
        else:
            k = draw(st.integers(1, min(3, available)))
            sources = tuple(draw(st.lists(st.integers(0, available - 1), min_size=k,
                                          max_size=k, unique=True)))
        nodes.append(NodeSpec(
            kind=draw(st.sampled_from(KINDS)),
            sources=sources,
            mul=draw(st.integers(1, 7)),
            add=draw(st.integers(0, 50)),
            delay=draw(st.sampled_from(DELAYS)),
        ))
    total = n_inputs + n_nodes
    extra = draw(st.lists(st.integers(0, total - 1), max_size=3))
    outputs = tuple(dict.fromkeys([total - 1, *extra]))
    return DagSpec(shape, n_inputs, tuple(nodes), outputs, draw(st.booleans()))


def _combine(xs: tuple[Any, ...], spec: NodeSpec) -> Any:
    acc: Any = 0
    for i, x in enumerate(xs):
        acc = acc + x * (i + 1)
    return (acc * spec.mul + spec.add) % MOD


def _kernel(spec: NodeSpec, calls: list[int], index: int) -> Callable[..., Any]:
    if spec.kind == "task":

        async def run_async(*xs: Any) -> Any:
            calls.append(index)
            await asyncio.sleep(spec.delay)
            return _combine(xs, spec)

        return run_async

    def run(*xs: Any) -> Any:
        calls.append(index)
        if spec.delay and spec.kind == "worker":
            time.sleep(spec.delay)
        return _combine(xs, spec)

    return run


def build(spec: DagSpec, calls: list[int]) -> Graph:
    b = GraphBuilder()
    values = [b.input(f"x{i}") for i in range(spec.inputs)]
    for i, node in enumerate(spec.nodes):
        fn = _kernel(node, calls, i)
        placement = None if node.kind == "task" else node.kind
        values.append(b.call(fn, *(values[s] for s in node.sources), name=f"n{i}",
                             placement=placement))
    b.output(tuple(values[o] for o in spec.outputs))
    return b.build()


def make_inputs(spec: DagSpec, seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    if spec.tensors:
        return [torch.randint(0, MOD, (4,), generator=gen) for _ in range(spec.inputs)]
    return [int(torch.randint(0, MOD, (1,), generator=gen)) for _ in range(spec.inputs)]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and bool(a == b)


async def check_dag(spec: DagSpec, seed: int, free_values: bool) -> None:
    calls: list[int] = []
    graph = build(spec, calls)
    batches = [make_inputs(spec, seed * 100 + i) for i in range(4)]
    async with LeakChecker():
        reference = ReferenceRunner(graph)
        expected = [tuple(await reference.run_flat(x)) for x in batches]
        serial = ExecutorConfig(max_parallel_ops=1, max_concurrent_executions=1)
        async with Executor(graph, serial) as ex:
            got_serial = [await ex.execute(*x) for x in batches]
        parallel = ExecutorConfig(
            max_parallel_ops=4,
            max_concurrent_executions=3,
            ready_order_seed=seed,
            free_values_after_use=free_values,
        )
        async with Executor(graph, parallel) as ex:
            got_parallel = await asyncio.wait_for(
                asyncio.gather(*(ex.execute(*x) for x in batches)), 60
            )
    for i, want in enumerate(expected):
        assert same(got_serial[i], want), f"serial run {i}: {got_serial[i]} != {want}"
        assert same(got_parallel[i], want), f"parallel run {i}: {got_parallel[i]} != {want}"
    assert len(calls) == 3 * len(batches) * len(spec.nodes), "a node ran too often or not at all"


_CHECKS = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


@settings(max_examples=40, deadline=None, suppress_health_check=_CHECKS)
@given(spec=dags(), seed=st.integers(0, 2**16), free_values=st.booleans())
async def test_random_dags_serial_equals_parallel(
    spec: DagSpec, seed: int, free_values: bool
) -> None:
    await check_dag(spec, seed, free_values)


@pytest.mark.slow
@settings(max_examples=soak(400), deadline=None, suppress_health_check=_CHECKS)
@given(spec=dags(max_nodes=40), seed=st.integers(0, 2**31), free_values=st.booleans())
async def test_random_dags_serial_equals_parallel_long(
    spec: DagSpec, seed: int, free_values: bool
) -> None:
    await check_dag(spec, seed, free_values)


async def test_known_shapes() -> None:
    """One fixed example of each shape, so a regression names its shape."""
    for shape in ("tall", "wide", "diamond", "random"):
        nodes = tuple(
            NodeSpec(KINDS[i % 3], (i,) if shape != "wide" else (0,), i % 5 + 1, i, 0.0)
            for i in range(9)
        )
        if shape in ("diamond", "random"):
            nodes = (*nodes[:6], NodeSpec("worker", (3, 4, 5, 6), 2, 1, 0.0))
        spec = DagSpec(shape, 1, nodes, (len(nodes),), tensors=shape == "random")
        await check_dag(spec, seed=3, free_values=True)

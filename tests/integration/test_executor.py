"""The executor against eager PyTorch on the model corpus, serial and parallel."""

from __future__ import annotations

import asyncio
import copy
import gc
import weakref
from typing import Any

import pytest
import torch

import asyncgraph
from asyncgraph import ExecutorConfig
from asyncgraph.graph import importers
from asyncgraph.testing import introspect
from tests.support.models import CASES, Case, Counter

pytestmark = pytest.mark.usefixtures("leak_check")

_EXPORTED: dict[str, tuple[torch.nn.Module, torch.export.ExportedProgram]] = {}


def exported(case: Case) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    if case.name not in _EXPORTED:
        _EXPORTED[case.name] = case.export()
    return _EXPORTED[case.name]


def clone_inputs(inputs: Any) -> Any:
    return copy.deepcopy(inputs)


# heavy_op_flops=0 puts every CPU kernel on the worker threads, so the thread paths of the
# scheduler (chains continuing on a worker, hand-offs, completion from threads) are exercised.
MODES = {
    "serial": ExecutorConfig(max_parallel_ops=1, adaptive_placement=False),
    "serial-workers": ExecutorConfig(
        max_parallel_ops=1, heavy_op_flops=0, adaptive_placement=False
    ),
    "parallel2-workers": ExecutorConfig(
        max_parallel_ops=2, heavy_op_flops=0, adaptive_placement=False
    ),
    "parallel4-shuffled": ExecutorConfig(
        max_parallel_ops=4, heavy_op_flops=0, ready_order_seed=7, adaptive_placement=False
    ),
    "adaptive": ExecutorConfig(max_parallel_ops=2, profile_executions=1, heavy_node_us=20),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_execute_matches_eager(case: Case, mode: str) -> None:
    model, ep = exported(case)
    reference = ep.module() if case.mutates else model
    config = MODES[mode]
    async with asyncgraph.Executor(ep, config) as ex:
        for seed in range(4):
            args, kwargs = case.make_inputs(seed)
            ours_args, ours_kwargs = clone_inputs((args, kwargs))
            ref_args, ref_kwargs = clone_inputs((args, kwargs))
            with torch.no_grad():
                expected = reference(*ref_args, **ref_kwargs)
            out = await ex.execute(*ours_args, **ours_kwargs)
            torch.testing.assert_close(out, expected, equal_nan=True)
            # user-input mutations are written back exactly as ep.module() writes them
            torch.testing.assert_close((ours_args, ours_kwargs), (ref_args, ref_kwargs))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_execute_flat_matches_eager(case: Case) -> None:
    model, ep = exported(case)
    reference = ep.module() if case.mutates else model
    async with asyncgraph.Executor(ep, ExecutorConfig(max_parallel_ops=2)) as ex:
        args, kwargs = case.make_inputs(5)
        flat = torch.utils._pytree.tree_leaves(
            (args, {k: kwargs[k] for k in sorted(kwargs, key=list(kwargs).index)})
        )
        ref_args, ref_kwargs = clone_inputs((args, kwargs))
        with torch.no_grad():
            expected = reference(*ref_args, **ref_kwargs)
        out = await ex.execute_flat(clone_inputs(flat))
        torch.testing.assert_close(out, torch.utils._pytree.tree_leaves(expected))


async def test_outputs_are_fresh_tensors_per_call() -> None:
    """Two calls never share an output buffer: the frame is cleared between executions."""
    model, ep = exported(CASES[0])
    async with asyncgraph.Executor(ep) as ex:
        x = torch.randn(4, 16)
        first = await ex.execute(x)
        second = await ex.execute(x + 1)
        assert first.data_ptr() != second.data_ptr()
        torch.testing.assert_close(first, model(x))
        frame = introspect.idle_frames(ex)[0]
        assert all(v is None or k in dict(ex.plan.weight_slots)
                   for k, v in enumerate(frame.values))


async def test_graph_module_import() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 4)
    async with asyncgraph.Executor(gm) as ex:
        torch.testing.assert_close(await ex.execute(x), model(x))


async def test_pt2_round_trip(tmp_path: Any) -> None:
    model, ep = exported(CASES[0])
    path = tmp_path / "mlp.pt2"
    torch.export.save(ep, path)
    x = torch.randn(4, 16)
    async with asyncgraph.load(path) as ex:
        torch.testing.assert_close(await ex.execute(x), model(x))
        assert ex.program.name == "mlp.pt2"


async def test_runs_under_inference_mode() -> None:
    seen: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_inference_mode_enabled())
        return x * 2

    b = asyncgraph.GraphBuilder()
    x = b.input("x")
    b.output([b.call(probe, x, placement="inline"), b.call(probe, x, placement="worker")])
    async with asyncgraph.Executor(b.build()) as ex:
        await ex.execute(torch.ones(2))
    assert seen == [True, True]


async def test_closed_executor_refuses_calls() -> None:
    _, ep = exported(CASES[0])
    ex = asyncgraph.Executor(ep)
    await ex.execute(torch.randn(4, 16))
    await ex.aclose()
    await ex.aclose()  # idempotent
    with pytest.raises(asyncgraph.ExecutorClosedError, match="the executor is closed"):
        await ex.execute(torch.randn(4, 16))
    assert ex.statistics().closed


async def test_executors_of_one_mutating_program_functionalize_it_once() -> None:
    """run_decompositions takes a large part of a second: the second Executor reuses the
    first one's functionalized program, and it goes when the program goes."""
    ep = torch.export.export(Counter(), (torch.randn(3, 4),))
    async with asyncgraph.Executor(ep) as first, asyncgraph.Executor(ep) as second:
        assert first.program.exported is second.program.exported is not ep
        x = torch.ones(3, 4)
        await first.execute(x)
        out = await second.execute(x)  # each Executor has its own buffers
    torch.testing.assert_close(out, torch.full((4,), 3.0) * 2 + 1)
    program = weakref.ref(ep)
    assert ep in importers._FUNCTIONALIZED
    del first, second, ep
    gc.collect()
    assert program() is None  # the cache does not keep the program alive


async def test_a_call_from_another_event_loop_is_refused_with_the_reason() -> None:
    """An Executor binds to the loop of its first call (its frames' futures and the loop
    slice belong to that loop). A call from another loop, here running on another thread
    while the bound one runs, is refused before it takes a frame; the bound loop's calls
    go on."""
    _, ep = exported(CASES[0])
    async with asyncgraph.Executor(ep) as ex:
        x = torch.randn(4, 16)
        expected = await ex.execute(x)

        def from_another_loop() -> None:
            asyncio.run(ex.execute(x))

        with pytest.raises(RuntimeError, match="bound to another event loop"):
            await asyncio.to_thread(from_another_loop)
        assert ex.statistics().started == 1 and ex.statistics().frames.in_use == 0
        torch.testing.assert_close(await ex.execute(x), expected)

"""Mode.DIRECT (asyncgraph/runtime/direct.py): a program that is one delegate call and the
getitems taking its outputs apart runs, once its placement is settled on the loop, as that
call: outputs, weights versions, errors and counts as on the general path."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
import torch.fx

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.compiled.build import segment_module
from asyncgraph.compiled.segments import Segment, replace_segments, tensor_bounded_segments
from asyncgraph.graph.ir import Graph, TensorSpec
from asyncgraph.kernels.base import KernelKind
from asyncgraph.runtime.delegates import SegmentBackend, register_backend, unregister_backend
from asyncgraph.runtime.weights import weights_ran_on
from tests.support.models import DeepMLP, eager_output, export_model

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]

BACKEND = "direct_fx"
CALLS = 60  # enough for adaptive placement to profile the signature and settle it


class FxDelegate:
    """A delegate running its nodes as the fx module, noting the mode of each call."""

    kernel_kind = KernelKind.DELEGATE

    def __init__(self, name: str, module: torch.fx.GraphModule, guard: bool) -> None:
        self.__name__ = name
        self.module = module
        self.needs_inference_mode = guard
        self.inference: list[bool] = []  # per call: whether inference mode was on
        self.threads: list[str] = []  # per call: the thread it ran on
        self.fail = False
        self.delay_s = 0.0
        self.hold: threading.Event | None = None  # set: calls wait for it

    def __call__(self, *inputs: Any) -> list[Any]:
        self.inference.append(torch.is_inference_mode_enabled())
        self.threads.append(threading.current_thread().name)
        if self.hold is not None and self.threads[-1].startswith("asyncgraph-worker"):
            self.hold.wait(30)  # never on the loop's thread: it would wait for ever
        end = time.perf_counter() + self.delay_s
        while time.perf_counter() < end:  # kernel time: CPU, off the GIL (as torch's)
            hashlib.sha256(BLOCK)
        if self.fail:
            raise ValueError("the delegate was told to fail")
        with torch.no_grad():  # as compiled code records no autograd, in any mode
            return list(self.module(*inputs))

    def prepare_weights(self, tensors: Any) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def statistics(self) -> dict[str, Any]:
        return {"calls": len(self.inference)}


@pytest.fixture(params=[True, False], ids=["guarded", "unguarded"])
def guard(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The backend, its delegates saying `needs_inference_mode` = the param."""

    def plan(graph: Graph, config: ExecutorConfig) -> tuple[Graph, list[str]]:
        segments = tensor_bounded_segments(
            graph, "auto", lambda vid: isinstance(graph.values[vid].spec, TensorSpec),
            min_nodes=2)

        def delegate(segment: Segment) -> tuple[str, FxDelegate]:
            name = f"{BACKEND}_segment_{segment.index}"
            return name, FxDelegate(name, segment_module(graph, segment), request.param)

        return replace_segments(graph, segments, delegate), [
            f"{BACKEND}_segment_{s.index}" for s in segments]

    register_backend(SegmentBackend(BACKEND, lambda: plan))
    yield request.param
    unregister_backend(BACKEND)


def _delegate(ex: Executor) -> FxDelegate:
    (delegate,) = [k.fn for k in ex.kernels if isinstance(k.fn, FxDelegate)]
    return delegate


async def test_a_one_call_program_runs_as_its_call(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        delegate = _delegate(ex)
        for _ in range(CALLS):
            out = await ex.execute(x)
            torch.testing.assert_close(out, eager_output(model, x))
            assert weights_ran_on() == 0
        stats = ex.statistics()
        assert stats.modes["DIRECT"] >= CALLS // 2, stats.modes  # settled, then direct
        assert stats.started == stats.completed == CALLS and stats.failed == 0
        # the general path always guards; Mode.DIRECT (and DIRECT_NEXT, a spent slice's)
        # only where the delegate needs it
        direct = stats.modes["DIRECT"] + stats.modes["DIRECT_NEXT"]
        assert delegate.inference.count(False) == (0 if guard else direct)
        assert not out.requires_grad

        with torch.no_grad():  # a swap: the call's weights laid out again
            for p in model.parameters():
                p.mul_(-0.5)
        version = ex.swap_weights(dict(model.state_dict()))
        before = ex.statistics().modes["DIRECT"]
        for _ in range(8):
            torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
            assert weights_ran_on() == version
        # direct on the new weights (a call may take the general path: a spent slice)
        assert ex.statistics().modes["DIRECT"] > before


@pytest.mark.parametrize("guard", [False], indirect=True, ids=["unguarded"])
async def test_a_direct_calls_error_names_its_node_and_the_next_call_runs(guard: bool) -> None:
    """Unguarded, a call without inference mode is a direct one: failures until one is."""
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        for _ in range(CALLS):
            await ex.execute(x)
        assert ex.statistics().modes["DIRECT"] > 0
        delegate = _delegate(ex)
        delegate.fail = True
        failures = 0
        while failures < 20:
            failures += 1
            with pytest.raises(ValueError, match="told to fail") as caught:
                await ex.execute(x)
            assert any(f"%{BACKEND}_segment_0" in note for note in caught.value.__notes__)
            if delegate.inference[-1] is False:
                break  # Mode.DIRECT's
        assert delegate.inference[-1] is False, "no failure in Mode.DIRECT"
        delegate.fail = False
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
        stats = ex.statistics()
        assert stats.failed == failures and stats.completed == CALLS + 1
        assert stats.started == stats.completed + stats.failed


async def test_traced_or_plain_programs_never_run_direct(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    ep = export_model(model, x)
    for config in (ExecutorConfig(segments=(BACKEND,), trace=True), ExecutorConfig()):
        async with Executor(ep, config) as ex:
            for _ in range(CALLS // 2):
                torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
            assert ex.statistics().modes["DIRECT"] == 0


# A call of kernel time above the worker bar (40 us) and below the loop's slice (1 ms, past
# which placement puts its node on a worker): inline alone, worth a worker under load.
SLOW_S = 0.0003
BLOCK = bytes(1 << 16)  # hashlib releases the GIL while it hashes this much


async def _settle_slow(ex: Executor, x: torch.Tensor, delay_s: float = SLOW_S) -> FxDelegate:
    """The delegate made slow, its signature settled (one caller at a time, then a few
    bursts): executions under load then run as Mode.DIRECT_WORKER (at SLOW_S)."""
    delegate = _delegate(ex)
    delegate.delay_s = delay_s
    for _ in range(CALLS):
        await ex.execute(x)
    for _ in range(4):
        await asyncio.gather(*(ex.execute(x) for _ in range(8)))
    return delegate


async def test_a_one_call_program_under_load_runs_its_call_on_a_worker(guard: bool) -> None:
    """Mode.DIRECT_WORKER: the call worth a worker goes to one as a work item of its own,
    with the general path's outputs, counts and weights versions (no frame's load,
    placement, schedule or units on the loop)."""
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        delegate = await _settle_slow(ex, x)
        before = ex.statistics()
        calls = len(delegate.threads)
        outs = await asyncio.gather(*(ex.execute(x) for _ in range(16)))
        for out in outs:
            torch.testing.assert_close(out, eager_output(model, x))
        after = ex.statistics()
        on_workers = after.modes["DIRECT_WORKER"] - before.modes["DIRECT_WORKER"]
        # the first calls fill the loop's slice (uvloop, whose queue no one sees, runs a
        # slice's worth of them on the loop each iteration), the rest go to the workers
        assert on_workers >= 4, after.modes
        threads = delegate.threads[calls:]
        assert sum(t.startswith("asyncgraph-worker") for t in threads) >= on_workers
        assert after.completed - before.completed == 16 and after.failed == 0
        assert after.started == after.completed
        assert after.workers.items_run - before.workers.items_run >= on_workers

        with torch.no_grad():  # a swap: calls on workers run on the new weights
            for p in model.parameters():
                p.mul_(-0.5)
        version = ex.swap_weights(dict(model.state_dict()))

        async def call() -> tuple[torch.Tensor, int | None]:
            return await ex.execute(x), weights_ran_on()  # the task's own version

        before = ex.statistics()
        for out, ran_on in await asyncio.gather(*(call() for _ in range(8))):
            torch.testing.assert_close(out, eager_output(model, x))
            assert ran_on == version
        assert ex.statistics().modes["DIRECT_WORKER"] > before.modes["DIRECT_WORKER"]


@pytest.mark.parametrize("guard", [True], indirect=True, ids=["guarded"])
async def test_a_call_on_a_worker_that_fails_names_its_node_and_fails_alone(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), ExecutorConfig(segments=(BACKEND,))) as ex:
        delegate = await _settle_slow(ex, x)
        before = ex.statistics()
        delegate.fail = True
        results = await asyncio.gather(*(ex.execute(x) for _ in range(8)),
                                       return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in results), results
        assert all(any(f"%{BACKEND}_segment_0" in note for note in r.__notes__)
                   for r in results if isinstance(r, ValueError))
        after = ex.statistics()
        assert after.modes["DIRECT_WORKER"] > before.modes["DIRECT_WORKER"], after.modes
        assert after.failed - before.failed == 8
        delegate.fail = False
        outs = await asyncio.gather(*(ex.execute(x) for _ in range(8)))
        for out in outs:
            torch.testing.assert_close(out, eager_output(model, x))


@pytest.mark.parametrize("guard", [True], indirect=True, ids=["guarded"])
async def test_a_cancelled_call_on_a_worker_holds_its_frame_until_the_call_ends(
        guard: bool) -> None:
    """Cancelled, an execution on a worker returns once the thread is done with its inputs:
    the pool's frames bound the calls running, cancelled or not."""
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    config = ExecutorConfig(segments=(BACKEND,), max_concurrent_executions=8)
    async with Executor(export_model(model, x), config) as ex:
        delegate = await _settle_slow(ex, x)
        before = ex.statistics()
        calls = len(delegate.threads)
        delegate.hold = threading.Event()
        # 8: on uvloop a slice's worth run on the loop and one waits for the next iteration
        tasks = [asyncio.create_task(ex.execute(x)) for _ in range(8)]
        try:
            for _ in range(2000):  # until a worker holds a call (10 s at most)
                if any(t.startswith("asyncgraph-worker") for t in delegate.threads[calls:]):
                    break
                await asyncio.sleep(0.005)
            running = [t for t in delegate.threads[calls:]
                       if t.startswith("asyncgraph-worker")]
            assert running, delegate.threads[calls:]
            cancelled = [t for t in tasks if not t.done()]  # one may have run on the loop
            for task in cancelled:
                task.cancel()
            await asyncio.sleep(0.05)
            held = [t for t in cancelled if not t.done()]
            assert len(held) >= len(running)  # waiting for their calls, frames held
            assert ex.statistics().frames.in_use >= len(held)
        finally:  # a failed check leaves no thread waiting
            delegate.hold.set()
        for task in cancelled:
            with pytest.raises(asyncio.CancelledError):
                await task
        after = ex.statistics()
        assert after.cancelled - before.cancelled == len(cancelled) >= len(running)
        assert after.frames.in_use == 0
        delegate.hold = None
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))


# Calls that stay on the loop whatever its load (no worker bar), tens of them to a slice.
LOOP_ONLY = ExecutorConfig(segments=(BACKEND,), worker_execution_node_us=None)
LOOP_S = 0.000015
CALLS_NEXT = 200


@contextlib.asynccontextmanager
async def _other_task_on_the_loop() -> AsyncIterator[list[int]]:
    """A task always ready beside the test's, so a spent slice is never extended; yields
    the count of its turns (one element), and stops it on exit."""
    turns, stop = [0], asyncio.Event()

    async def spin() -> None:
        while not stop.is_set():
            turns[0] += 1
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin())
    try:
        yield turns
    finally:
        stop.set()
        await spinner


@pytest.mark.parametrize("guard", [False], indirect=True, ids=["unguarded"])
async def test_a_call_that_finds_the_slice_spent_runs_in_a_later_iterations_slice(
        guard: bool) -> None:
    """Mode.DIRECT_NEXT: a call that fits a slice but finds this iteration's spent waits in
    the loop budget's queue, holding a frame, and runs on the loop in a later iteration;
    other work on the loop gets its turn in between."""
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), LOOP_ONLY) as ex:
        delegate = await _settle_slow(ex, x, LOOP_S)
        async with _other_task_on_the_loop() as turns:
            before, calls = ex.statistics(), len(delegate.threads)
            spun = []
            for _ in range(CALLS_NEXT):  # some tens of calls fill a 1 ms slice
                torch.testing.assert_close(await ex.execute(x), eager_output(model, x))
                spun.append(turns[0])
        after = ex.statistics()
        assert after.modes["DIRECT_NEXT"] - before.modes["DIRECT_NEXT"] >= 4, str(after.modes)
        assert after.modes["DIRECT"] > before.modes["DIRECT"], after.modes
        assert set(delegate.threads[calls:]) == {threading.current_thread().name}
        assert after.completed - before.completed == CALLS_NEXT and after.failed == 0
        assert after.started == after.completed and after.frames.in_use == 0
        assert spun[-1] > spun[0]  # the other task ran between the calls


@pytest.mark.parametrize("guard", [False], indirect=True, ids=["unguarded"])
async def test_a_call_cancelled_before_its_turn_never_runs(guard: bool) -> None:
    from asyncgraph.runtime.loop_budget import loop_budget

    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    config = LOOP_ONLY
    async with Executor(export_model(model, x), config) as ex:
        delegate = await _settle_slow(ex, x, LOOP_S)
        budget = loop_budget(asyncio.get_running_loop(), config.loop_slice_s)

        async def after_a_spent_slice() -> torch.Tensor:
            budget.start(0.0)  # this iteration's slice, spent before the call
            time.sleep(2 * config.loop_slice_s)  # noqa: ASYNC251 (the loop busy, as in a kernel)
            out: torch.Tensor = await ex.execute(x)
            return out

        async with _other_task_on_the_loop():
            before, calls = ex.statistics(), len(delegate.threads)
            task = asyncio.create_task(after_a_spent_slice())
            await asyncio.sleep(0)  # the task runs its call to the budget's queue
            assert ex.statistics().modes["DIRECT_NEXT"] - before.modes["DIRECT_NEXT"] == 1
            assert not task.done() and ex.statistics().frames.in_use == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(4):  # the budget's queue reaches the call's place
                await asyncio.sleep(0)
        after = ex.statistics()
        assert not budget._queue  # its turn came,
        assert len(delegate.threads) == calls  # and the cancelled call did not run
        assert after.cancelled - before.cancelled == 1 and after.frames.in_use == 0
        assert ex._scheduler.state.lines_next == 0
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))


@pytest.mark.parametrize("guard", [False], indirect=True, ids=["unguarded"])
async def test_a_call_in_a_later_slice_that_fails_names_its_node(guard: bool) -> None:
    model, x = DeepMLP(16, 3).eval(), torch.randn(2, 16)
    async with Executor(export_model(model, x), LOOP_ONLY) as ex:
        delegate = await _settle_slow(ex, x, LOOP_S)
        async with _other_task_on_the_loop():
            before = ex.statistics()
            delegate.fail = True
            for _ in range(CALLS_NEXT):
                with pytest.raises(ValueError, match="told to fail") as failed:
                    await ex.execute(x)
                assert any(f"%{BACKEND}_segment_0" in note for note in failed.value.__notes__)
        after = ex.statistics()
        assert after.modes["DIRECT_NEXT"] > before.modes["DIRECT_NEXT"], str(after.modes)
        assert after.failed - before.failed == CALLS_NEXT and after.frames.in_use == 0
        assert ex._scheduler.state.lines_next == 0
        delegate.fail = False
        torch.testing.assert_close(await ex.execute(x), eager_output(model, x))

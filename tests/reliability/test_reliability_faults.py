"""Reliability scenarios 3 and 4, and the fault-injecting kernels themselves.

3. A node that raises in one of K concurrent runs: that caller gets the kernel's own exception
   type with its attributes and a "While executing %node" note; the other K-1 results are
   correct; two failing branches of one run give an ExceptionGroup of both errors.
4. Abort mid-graph: after the error has been handled, the run's other inputs and its
   intermediates are no longer referenced (their weakrefs are dead).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig, GraphBuilder
from asyncgraph.graph.ir import Graph
from asyncgraph.testing import FaultInjectionError, FaultInjector, Gate, InjectedFault

pytestmark = pytest.mark.usefixtures("leak_check")


class KernelError(Exception):
    """A kernel's own exception type, with attributes the caller must receive intact."""

    def __init__(self, node: str, call: int) -> None:
        super().__init__(f"kernel failed in {node} on call {call}")
        self.node = node
        self.call = call
        self.code = 4242


def kernel_error(node: str, call: int) -> KernelError:
    """The fault factory: FaultInjector calls it with the node name and the call index."""
    return KernelError(node, call)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(64, 128)
        self.l2 = torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


@pytest.fixture(scope="module")
def mlp() -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = MLP().eval()
    return model, torch.export.export(model, (torch.randn(32, 64),))


def _note(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("node", ["linear", "relu", "linear_1"])  # worker, inline, inline
async def test_one_failing_run_among_k(
    mlp: tuple[torch.nn.Module, torch.export.ExportedProgram], node: str
) -> None:
    model, ep = mlp
    k, bad = 12, 5
    faults = FaultInjector().raise_on(node, exception=kernel_error, calls={bad})
    inputs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(i)) for i in range(k)]
    with torch.inference_mode():
        expected = [model(x) for x in inputs]
    # relu stays a node of its own (not fused into linear's addmm: passes/epilogue.py)
    config = ExecutorConfig(
        max_concurrent_executions=4, max_parallel_ops=2, fuse_activations=False
    )
    async with Executor(ep, config, kernel_factory=faults.kernel_factory()) as ex:
        results = await asyncio.gather(
            *(ex.execute(x) for x in inputs), return_exceptions=True
        )
        failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert len(failures) == 1, f"expected exactly one failing run, got {failures}"
        index, exc = failures[0]
        assert type(exc) is KernelError
        assert (exc.node, exc.call, exc.code) == (node, bad, 4242)
        assert f"While executing %{node} = " in _note(exc)
        for i, out in enumerate(results):
            if i != index:
                torch.testing.assert_close(out, expected[i])
        stats = ex.statistics()
        assert (stats.completed, stats.failed) == (k - 1, 1)
        torch.testing.assert_close(await ex.execute(inputs[0]), expected[0])


@pytest.mark.parametrize("placement", ["inline", "worker", "task"])
async def test_fault_keeps_type_and_attributes_on_every_placement(placement: str) -> None:
    async def async_ident(x: int) -> int:
        await asyncio.sleep(0)
        return x

    def ident(x: int) -> int:
        return x

    b = GraphBuilder()
    x = b.input("x")
    fn = async_ident if placement == "task" else ident
    y = b.call(fn, x, name="target", placement=placement)
    b.output(b.call(lambda v: v + 1, y, name="after", placement="inline"))
    faults = FaultInjector().raise_on("target", exception=kernel_error, calls={1})
    async with Executor(b.build(), kernel_factory=faults.kernel_factory()) as ex:
        assert await ex.execute(1) == 2
        with pytest.raises(KernelError) as info:
            await ex.execute(2)
        assert info.value.code == 4242 and info.value.call == 1
        assert "While executing %target = " in _note(info.value)
        assert await ex.execute(3) == 4


def two_failing_branches(barrier: threading.Barrier) -> Graph:
    def left(x: int) -> int:
        barrier.wait()  # both branches are running before either fails
        raise KernelError("left", 0)

    def right(x: int) -> int:
        barrier.wait()
        raise ValueError("right branch failed")

    b = GraphBuilder()
    x = b.input("x")
    out_left = b.call(left, x, placement="worker")
    out_right = b.call(right, x, placement="worker")
    b.output(b.call(lambda a, c: a + c, out_left, out_right, name="join", placement="inline"))
    return b.build()


async def test_two_failing_branches_give_an_exception_group() -> None:
    barrier = threading.Barrier(2, timeout=30)
    config = ExecutorConfig(max_parallel_ops=2)
    async with Executor(two_failing_branches(barrier), config) as ex:
        with pytest.raises(ExceptionGroup) as info:
            await ex.execute(1)
        group = info.value
        kinds = sorted(type(e).__name__ for e in group.exceptions)
        assert kinds == ["KernelError", "ValueError"]
        by_type = {type(e): e for e in group.exceptions}
        assert by_type[KernelError].code == 4242
        assert "While executing %left = " in _note(by_type[KernelError])
        assert "While executing %right = " in _note(by_type[ValueError])
        assert ex.statistics().frames.in_use == 0


async def test_concurrent_runs_unaffected_by_a_failing_branch() -> None:
    """Runs sharing the executor with failing runs all complete with their own results."""
    faults = FaultInjector().raise_on("double", calls=range(0, 40, 3))
    b = GraphBuilder()
    x = b.input("x")
    d = b.call(lambda v: v * 2, x, name="double", placement="worker")
    s = b.call(lambda v: v + 1, x, name="succ", placement="worker")
    b.output(b.call(lambda p, q: (p, q), d, s, name="pair", placement="inline"))
    config = ExecutorConfig(max_concurrent_executions=6, max_parallel_ops=3)
    async with Executor(b.build(), config, kernel_factory=faults.kernel_factory()) as ex:
        results = await asyncio.gather(*(ex.execute(i) for i in range(40)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == len(range(0, 40, 3))
    assert all(isinstance(e, InjectedFault) and e.node == "double" for e in failed)
    ok = {r for r in results if not isinstance(r, BaseException)}
    assert ok == {(2 * i, i + 1) for i in range(40)} - {
        (2 * i, i + 1) for i, r in enumerate(results) if isinstance(r, BaseException)
    }


# -- scenario 4 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["inline", "worker", "task"])
async def test_abort_mid_graph_releases_inputs_and_intermediates(placement: str) -> None:
    produced: list[weakref.ref[torch.Tensor]] = []

    def first(x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        produced.append(weakref.ref(out))
        return out

    def other_branch(y: torch.Tensor) -> torch.Tensor:
        out = y + 1
        produced.append(weakref.ref(out))
        return out

    def fail(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise KernelError("fail", 0)

    async def fail_async(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        await asyncio.sleep(0)
        raise KernelError("fail", 0)

    b = GraphBuilder()
    x, y = b.input("x"), b.input("y")
    a = b.call(first, x, placement="worker")
    o = b.call(other_branch, y, placement="inline")
    bad = b.call(fail_async if placement == "task" else fail, a, o, name="fail",
                 placement=placement)
    b.output(b.call(lambda t: t.sum(), bad, name="tail", placement="inline"))
    async with Executor(b.build(), ExecutorConfig(max_concurrent_executions=1)) as ex:
        tx, ty = torch.randn(64), torch.randn(64)
        refs = [weakref.ref(tx), weakref.ref(ty)]
        try:
            await ex.execute(tx, ty)
        except KernelError:
            pass
        else:
            pytest.fail("the failing node did not raise")
        del tx, ty
        await asyncio.sleep(0)
        gc.collect()
        alive = [r() for r in refs + produced if r() is not None]
        assert len(produced) == 2, "both producers should have run before the failure"
        assert not alive, f"{len(alive)} input(s)/intermediate(s) still referenced after the error"
        assert ex.statistics().frames.idle == 1


# -- the fault injector -----------------------------------------------------------------------


def _chain(placement: str = "worker") -> Graph:
    b = GraphBuilder()
    x = b.input("x")
    y = b.call(lambda v: v + 1, x, name="inc", placement=placement)
    b.output(b.call(lambda v: v * 3, y, name="triple", placement=placement))
    return b.build()


async def test_unknown_node_names_are_reported() -> None:
    faults = FaultInjector().raise_on("nope")
    with pytest.raises(KeyError, match=r"nope.*its nodes are: inc, triple"):
        Executor(_chain(), kernel_factory=faults.kernel_factory())


async def test_block_on_inline_node_refuses_instead_of_deadlocking() -> None:
    faults = FaultInjector()
    gate = faults.block("inc")
    async with Executor(_chain("inline"), kernel_factory=faults.kernel_factory()) as ex:
        with pytest.raises(FaultInjectionError, match="event loop thread"):
            await ex.execute(1)
    gate.open()


async def test_block_async_kernel_is_cancellable() -> None:
    async def step(v: int) -> int:
        return v + 1

    b = GraphBuilder()
    x = b.input("x")
    b.output(b.call(step, x, name="step"))
    faults = FaultInjector()
    gate = faults.block("step")
    async with Executor(b.build(), kernel_factory=faults.kernel_factory()) as ex:
        task = asyncio.create_task(ex.execute(1))
        await gate.wait_entered(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.waiting == 0
        gate.open()
        assert await ex.execute(5) == 6


async def test_delay_and_block_on_worker() -> None:
    faults = FaultInjector().delay("inc", seconds=0.01)
    gate = faults.block("triple", calls={0})
    async with Executor(_chain(), kernel_factory=faults.kernel_factory()) as ex:
        task = asyncio.create_task(ex.execute(1))
        await gate.wait_entered(1)
        assert not task.done()
        gate.open()
        assert await task == 6
        assert await ex.execute(2) == 9  # later calls are not blocked (calls={0})
    assert [e.action for e in faults.events] == ["delay", "block", "delay"]
    assert faults.calls("inc") == 2 and faults.calls("triple") == 2


async def test_random_faults_are_seeded() -> None:
    def run_events(seed: int) -> Any:
        return FaultInjector(seed=seed).random(raise_rate=0.3, delay_rate=0.3, max_delay_s=0.0)

    outcomes = []
    for seed in (11, 11, 12):
        faults = run_events(seed)
        async with Executor(_chain(), kernel_factory=faults.kernel_factory()) as ex:
            got = []
            for i in range(30):  # one caller at a time: the run replays exactly
                try:
                    got.append(await ex.execute(i))
                except InjectedFault as exc:
                    got.append((exc.node, exc.call))
        outcomes.append((got, [(e.node, e.call, e.action) for e in faults.events]))
    assert outcomes[0] == outcomes[1], "the same seed must make the same decisions"
    assert outcomes[0] != outcomes[2], "another seed should make other decisions"
    assert any(isinstance(g, tuple) for g in outcomes[0][0]), "no fault was injected"


async def test_gate_helpers() -> None:
    gate = Gate()
    with pytest.raises(TimeoutError, match="0 of 1"):
        await gate.wait_entered(1, within_s=0.01)
    assert not gate.wait_sync(timeout=0.001)
    gate.open()
    assert gate.is_open and gate.wait_sync(timeout=0.001)
    await gate.wait_async()
    gate.close()
    assert not gate.is_open

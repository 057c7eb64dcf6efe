"""aswap_weights: the constant folding of a weights swap on a worker thread, not on the loop.

swap_weights refolds inline and holds the loop for as long as folding takes; aswap_weights
folds on a thread while executions go on with the old weights, then puts the new version in
place on the loop. Swaps complete in call order; a cancelled swap changes nothing; buffer
updates made by executions during the fold are kept; a sync swap during the fold is folded in.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorClosedError, ExecutorConfig
from asyncgraph.passes.folding import ConstantFolder
from tests.support.models import Scaled

pytestmark = [pytest.mark.usefixtures("leak_check"), pytest.mark.timeout(60)]


class Counting(Scaled):
    """Scaled, plus a buffer every execution increments (folding never reads it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x) + self.calls


class Inverse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(3) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.inv(self.w)


def _export(model: torch.nn.Module, x: torch.Tensor) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), (x,))


def _expected(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ (w * 2).t() + b


class FoldProbe:
    """ConstantFolder.__call__ watched: the threads it ran on, and a gate that holds it on
    threads other than the loop's (a sync swap's inline fold never waits)."""

    def __init__(self) -> None:
        self.loop_thread = threading.current_thread()
        self.threads: list[threading.Thread] = []
        self.folding = asyncio.Event()
        self.release = threading.Event()
        self.release.set()

    def hold(self) -> None:
        self.release.clear()

    def entered(self, loop: asyncio.AbstractEventLoop) -> None:
        thread = threading.current_thread()
        self.threads.append(thread)
        if thread is not self.loop_thread:
            loop.call_soon_threadsafe(self.folding.set)
            assert self.release.wait(20), "the test never released the fold"

    async def wait_folding(self) -> None:
        async with asyncio.timeout(20):
            await self.folding.wait()


@pytest.fixture
async def fold_probe(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FoldProbe]:
    probe = FoldProbe()
    loop = asyncio.get_running_loop()
    fold = ConstantFolder.__call__

    def watched(self: ConstantFolder, tensors: Mapping[str, Any]) -> dict[str, Any]:
        probe.entered(loop)
        return fold(self, tensors)

    monkeypatch.setattr(ConstantFolder, "__call__", watched)
    yield probe
    probe.release.set()


async def test_aswap_gives_the_results_and_version_of_swap() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    ep = _export(model, x)
    new = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    async with Executor(ep) as sync_ex, Executor(ep) as async_ex:
        assert async_ex.statistics().folded_nodes > 0
        assert sync_ex.swap_weights(new) == await async_ex.aswap_weights(new) == 1
        after_sync, after_async = await sync_ex.execute(x), await async_ex.execute(x)
        assert async_ex.weights.derived.keys() == sync_ex.weights.derived.keys()
    torch.testing.assert_close(after_async, after_sync)
    torch.testing.assert_close(after_async, _expected(new["w"], new["b"], x))


async def test_aswap_folds_on_a_worker_thread(fold_probe: FoldProbe) -> None:
    model, x = Scaled(), torch.randn(5, 3)
    async with Executor(_export(model, x)) as ex:
        fold_probe.threads.clear()  # the fold at construction ran here, as it always has
        await ex.aswap_weights({"w": torch.randn(4, 3)})
        assert fold_probe.threads and threading.current_thread() not in fold_probe.threads
        fold_probe.threads.clear()
        ex.swap_weights({"w": torch.randn(4, 3)})
        assert fold_probe.threads == [threading.current_thread()]  # the sync one: inline


async def test_executions_during_the_fold_run_on_one_version_each(fold_probe: FoldProbe) -> None:
    model, x = Scaled(), torch.randn(5, 3)
    old_w, old_b = model.w.detach().clone(), model.b.detach().clone()
    new = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    old_out, new_out = _expected(old_w, old_b, x), _expected(new["w"], new["b"], x)
    async with Executor(_export(model, x), ExecutorConfig(max_concurrent_executions=4)) as ex:
        fold_probe.hold()
        swap = asyncio.create_task(ex.aswap_weights(new))
        await fold_probe.wait_folding()
        # the loop serves while the thread folds: these complete, on the old weights
        during = await asyncio.gather(*(ex.execute(x) for _ in range(8)))
        for out in during:
            torch.testing.assert_close(out, old_out)
        assert ex.weights.version == 0 and not swap.done()
        around = [asyncio.create_task(ex.execute(x)) for _ in range(16)]
        fold_probe.release.set()
        assert await swap == 1
        around += [asyncio.create_task(ex.execute(x)) for _ in range(16)]
        for out in await asyncio.gather(*around):  # each on one version: old or new, never a mix
            assert torch.allclose(out, old_out) or torch.allclose(out, new_out), out
        torch.testing.assert_close(await ex.execute(x), new_out)


async def test_concurrent_aswaps_complete_in_call_order() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    states = [{"w": torch.randn(4, 3), "b": torch.randn(4)} for _ in range(4)]
    async with Executor(_export(model, x)) as ex:
        versions = await asyncio.gather(*(ex.aswap_weights(s) for s in states))
        assert versions == [1, 2, 3, 4]
        assert ex.weights.version == 4
        torch.testing.assert_close(
            await ex.execute(x), _expected(states[-1]["w"], states[-1]["b"], x)
        )


async def test_a_cancelled_aswap_changes_nothing(fold_probe: FoldProbe) -> None:
    model, x = Scaled(), torch.randn(5, 3)
    async with Executor(_export(model, x)) as ex:
        before = await ex.execute(x)
        fold_probe.hold()
        swap = asyncio.create_task(ex.aswap_weights({"w": torch.randn(4, 3)}))
        await fold_probe.wait_folding()
        swap.cancel()
        with pytest.raises(asyncio.CancelledError):
            await swap
        fold_probe.release.set()
        assert ex.weights.version == 0
        torch.testing.assert_close(await ex.execute(x), before)
        assert await ex.aswap_weights({"b": torch.zeros(4)}) == 1  # the lock was released


async def test_buffer_updates_during_the_fold_are_kept(fold_probe: FoldProbe) -> None:
    model, x = Counting(), torch.randn(5, 3)
    w = torch.randn(4, 3)
    async with Executor(_export(model, x)) as ex:
        fold_probe.hold()
        swap = asyncio.create_task(ex.aswap_weights({"w": w}))
        await fold_probe.wait_folding()
        for _ in range(3):
            await ex.execute(x)  # each updates the `calls` buffer: a new weights version
        assert ex.weights.version == 3
        fold_probe.release.set()
        assert await swap == 4
        torch.testing.assert_close(ex.weights.tensors["calls"], torch.tensor(3.0))
        expected = _expected(w, model.b.detach(), x) + 4
        torch.testing.assert_close(await ex.execute(x), expected)


async def test_a_sync_swap_during_the_fold_is_folded_in(fold_probe: FoldProbe) -> None:
    model, x = Scaled(), torch.randn(5, 3)
    w, b = torch.randn(4, 3), torch.randn(4)
    async with Executor(_export(model, x)) as ex:
        fold_probe.hold()
        swap = asyncio.create_task(ex.aswap_weights({"b": b}))
        await fold_probe.wait_folding()
        assert ex.swap_weights({"w": w}) == 1  # folds inline, on the loop
        fold_probe.release.set()
        assert await swap == 2
        torch.testing.assert_close(await ex.execute(x), _expected(w, b, x))


async def test_an_aswap_that_cannot_fold_fails_and_keeps_the_old_weights() -> None:
    x = torch.randn(2, 3)
    async with Executor(_export(Inverse(), x)) as ex:
        with pytest.raises(torch.linalg.LinAlgError) as caught:
            await ex.aswap_weights({"w": torch.zeros(3, 3)})  # singular
        assert any("while folding node %linalg_inv" in n for n in caught.value.__notes__)
        assert ex.weights.version == 0
        torch.testing.assert_close(await ex.execute(x), x / 2)


async def test_aswap_without_folding_and_on_a_closed_executor() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    new = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    ex = Executor(_export(model, x), ExecutorConfig(fold_constants=False))
    async with ex:
        assert await ex.aswap_weights(new) == 1
        torch.testing.assert_close(await ex.execute(x), _expected(new["w"], new["b"], x))
    with pytest.raises(ExecutorClosedError, match="closed"):
        await ex.aswap_weights(new)

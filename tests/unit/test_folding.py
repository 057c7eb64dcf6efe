"""Constant folding: nodes that read only weights run once per weights version."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.errors import WeightsError
from asyncgraph.passes.folding import FOLDED_PREFIX
from tests.support.models import Scaled

pytestmark = pytest.mark.usefixtures("leak_check")


class Inverse(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(3) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.inv(self.w)


class NotFoldable(torch.nn.Module):
    """Weight-only nodes that must run on every call: random, an output, a mutated buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.calls.add_(1)
        noisy = x + torch.rand_like(self.w)
        return noisy, self.w * 2, x * (self.calls * 10)


def _export(model: torch.nn.Module, *args: Any, decompose: bool = False) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = torch.export.export(model.eval(), args)
        return ep.run_decompositions() if decompose else ep


def _eager(model: torch.nn.Module, *args: Any) -> Any:
    with torch.no_grad():
        return model(*args)


async def test_weight_only_nodes_leave_the_graph_and_results_match() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    ep = _export(model, x, decompose=True)
    async with Executor(ep) as folded, Executor(ep, ExecutorConfig(fold_constants=False)) as full:
        out, ref = await folded.execute(x), await full.execute(x)
        weights = folded.weights
        assert (folded.statistics().folded_nodes, full.statistics().folded_nodes) == (2, 0)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out, _eager(model, x))
    gone = {n.name for n in full.graph.nodes} - {n.name for n in folded.graph.nodes}
    assert gone == {"mul", "permute"}  # 2 * W and its transpose
    assert set(weights.derived) == {FOLDED_PREFIX + "permute"}  # only what the rest reads
    assert FOLDED_PREFIX + "permute" not in weights.tensors
    torch.testing.assert_close(weights.derived[FOLDED_PREFIX + "permute"], (model.w * 2).t())


async def test_swap_weights_refolds() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    async with Executor(_export(model, x)) as ex:
        before = await ex.execute(x)
        new_w = torch.randn(4, 3)
        version = ex.swap_weights({"w": new_w})
        after = await ex.execute(x)
        model.w.data.copy_(new_w)
        torch.testing.assert_close(after, _eager(model, x))
        assert not torch.allclose(before, after)
        assert ex.weights.version == version == 1


async def test_a_swap_that_cannot_fold_fails_in_swap_weights_and_keeps_the_old_weights() -> None:
    model, x = Inverse(), torch.randn(2, 3)
    async with Executor(_export(model, x)) as ex:
        assert len(ex.graph.nodes) < len(ex.program.graph.nodes)  # the inverse folded
        with pytest.raises(torch.linalg.LinAlgError) as caught:
            ex.swap_weights({"w": torch.zeros(3, 3)})  # singular
        assert any("while folding node %linalg_inv" in n for n in caught.value.__notes__)
        assert ex.weights.version == 0
        torch.testing.assert_close(await ex.execute(x), x / 2)


async def test_folded_names_are_not_weights_a_caller_can_swap() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    async with Executor(_export(model, x)) as ex:
        name = next(iter(ex.weights.derived))
        with pytest.raises(WeightsError, match="unknown weight name"):
            ex.swap_weights({name: torch.zeros(3, 4)})
        ex.swap_weights({"w": model.w.detach(), "b": model.b.detach()}, strict=True)


async def test_random_output_and_mutated_buffer_nodes_do_not_fold() -> None:
    model, x = NotFoldable(), torch.zeros(3)
    ep = _export(model, x)
    async with Executor(ep) as ex:
        assert len(ex.graph.nodes) == len(ex.program.graph.nodes)
        first = await ex.execute(x)
        second = await ex.execute(x)
    assert not torch.equal(first[0], second[0])  # rand_like ran on each call
    assert first[1] is not second[1]  # an output is fresh per call, as in eager
    torch.testing.assert_close(second[2], torch.full((3,), 0.0))
    torch.testing.assert_close((await _run_twice(ep, torch.ones(3)))[2], torch.full((3,), 20.0))


async def _run_twice(ep: Any, x: torch.Tensor) -> Any:
    async with Executor(ep) as ex:
        await ex.execute(x)
        return await ex.execute(x)


async def test_fold_constants_off_keeps_every_node() -> None:
    model, x = Scaled(), torch.randn(5, 3)
    ep = _export(model, x)
    async with Executor(ep, ExecutorConfig(fold_constants=False)) as ex:
        assert len(ex.graph.nodes) == len(ex.program.graph.nodes)
        assert ex.weights.derived == {}
        torch.testing.assert_close(await ex.execute(x), _eager(model, x))

"""Identity removal: dropouts that return their input leave the executed graph."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig

pytestmark = pytest.mark.usefixtures("leak_check")

aten = torch.ops.aten


class Dropouts(torch.nn.Module):
    """Dropouts inside (two in a row) and one as the last op, whose result is an output."""

    def __init__(self, p: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.drop(self.drop(self.linear(x))))
        return y * 2, self.drop(y)


def _export(model: torch.nn.Module, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model, args)


# Bitwise comparisons with eager: the linear keeps at::linear's own transpose (a view).
BITWISE = ExecutorConfig(pretranspose_weights=False)


def _dropouts(graph: Any) -> int:
    return sum(n.target is aten.dropout.default for n in graph.nodes)


async def test_eval_mode_dropouts_leave_the_graph_but_an_output_keeps_its_node() -> None:
    model, x = Dropouts(0.5).eval(), torch.randn(4, 8)
    ep = _export(model, x)
    async with Executor(ep, BITWISE) as ex:
        assert _dropouts(ex.program.graph) == 3
        assert (ex.dropped_identities, _dropouts(ex.graph)) == (2, 1)
        doubled, last = await ex.execute(x)
        ref_doubled, ref_last = ep.module()(x)
        assert torch.equal(doubled, ref_doubled) and torch.equal(last, ref_last)
        with torch.no_grad():
            assert torch.equal(doubled, model(x)[0])


async def test_a_zero_probability_dropout_in_training_mode_leaves_too() -> None:
    model, x = Dropouts(0.0).train(), torch.randn(4, 8)
    async with Executor(_export(model, x), BITWISE) as ex:
        assert ex.dropped_identities == 2
        with torch.no_grad():
            assert torch.equal((await ex.execute(x))[0], model(x)[0])


async def test_a_training_mode_dropout_stays_and_draws() -> None:
    model, x = Dropouts(0.5).train(), torch.ones(64, 8)
    async with Executor(_export(model, x)) as ex:
        assert (ex.dropped_identities, _dropouts(ex.graph)) == (0, 3)
        first, second = (await ex.execute(x))[0], (await ex.execute(x))[0]
        assert not torch.equal(first, second)  # fresh random masks on each call

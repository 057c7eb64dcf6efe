"""Linear lowering: a 2-D CPU linear runs as addmm with its weight's transpose folded."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.passes.folding import FOLDED_PREFIX

pytestmark = pytest.mark.usefixtures("leak_check")

aten = torch.ops.aten


class Mlp(torch.nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16, bias=bias)
        self.b = torch.nn.Linear(16, 4, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class WeightAsInput(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w, b)


def _export(model: torch.nn.Module, *args: Any, dynamic: Any = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), args, dynamic_shapes=dynamic)


def _targets(ex: Executor) -> list[Any]:
    return [n.target for n in ex.graph.nodes]


async def test_two_d_linears_run_as_addmm_with_the_same_bits_and_names() -> None:
    model, x = Mlp(), torch.randn(3, 8)
    ep = _export(model, x)
    async with Executor(ep) as lowered, Executor(ep, ExecutorConfig(lower_linear=False)) as plain:
        assert (lowered.lowered_linears, plain.lowered_linears) == (2, 0)
        assert _targets(lowered) == [aten.addmm.default, aten.relu.default, aten.addmm.default]
        assert aten.linear.default in _targets(plain)
        assert [n.name for n in lowered.graph.nodes] == [n.name for n in plain.graph.nodes]
        assert sorted(lowered.weights.derived) == [
            FOLDED_PREFIX + "linear_1_weight_t", FOLDED_PREFIX + "linear_weight_t",
        ]
        for _ in range(5):  # past adaptive placement's profiling: the decided placement too
            out, ref = await lowered.execute(x), await plain.execute(x)
            assert torch.equal(out, ref)  # the op at::linear itself calls: bitwise the same
        with torch.no_grad():
            assert torch.equal(out, model(x))


async def test_swap_weights_refolds_the_transpose() -> None:
    model, x = Mlp(), torch.randn(2, 8)
    async with Executor(_export(model, x)) as ex:
        before = await ex.execute(x)
        new = {"a.weight": torch.randn(16, 8), "b.bias": torch.randn(4)}
        ex.swap_weights(new)
        after = await ex.execute(x)
        with torch.no_grad():
            model.a.weight.copy_(new["a.weight"])
            model.b.bias.copy_(new["b.bias"])
            assert torch.equal(after, model(x))
        assert not torch.equal(before, after)


async def test_a_dynamic_batch_is_lowered_and_runs_every_size() -> None:
    model = Mlp()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = _export(model, torch.randn(4, 8), dynamic=({0: batch},))
    async with Executor(ep) as ex:
        assert ex.lowered_linears == 2
        for rows in (1, 7, 64):
            x = torch.randn(rows, 8)
            with torch.no_grad():
                assert torch.equal(await ex.execute(x), model(x))


@pytest.mark.parametrize(
    ("model", "args", "why"),
    [
        (Mlp(), (torch.randn(2, 3, 8),), "a 3-D input"),
        (Mlp(bias=False), (torch.randn(2, 8),), "no bias"),
        (WeightAsInput(), (torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)),
         "a weight passed as an input"),
    ],
)
async def test_what_is_not_lowered_keeps_its_linear(
    model: torch.nn.Module, args: tuple[Any, ...], why: str
) -> None:
    async with Executor(_export(model, *args)) as ex:
        assert ex.lowered_linears == 0, why
        assert aten.linear.default in _targets(ex), why
        with torch.no_grad():
            torch.testing.assert_close(await ex.execute(*args), model(*args))


async def test_off_without_folding() -> None:
    """Without folding the transpose would run on every call: no gain, so no lowering."""
    model, x = Mlp(), torch.randn(2, 8)
    async with Executor(_export(model, x), ExecutorConfig(fold_constants=False)) as ex:
        assert ex.lowered_linears == 0
        with torch.no_grad():
            assert torch.equal(await ex.execute(x), model(x))


async def test_an_error_in_a_lowered_linear_names_the_linear() -> None:
    model = Mlp()
    async with Executor(_export(model, torch.randn(2, 8)),
                        ExecutorConfig(validate_inputs=False)) as ex:
        with pytest.raises(RuntimeError) as caught:
            await ex.execute(torch.randn(2, 5))  # 5 columns where the weight has 8
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "While executing %linear = aten.addmm.default" in notes, notes

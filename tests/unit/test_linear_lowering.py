"""Linear lowering: CPU linears run on their weight's transpose, folded into a contiguous copy."""

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


# the lowering alone: without the addmm + relu fusion that follows it (test_epilogue.py)
LOWERED = ExecutorConfig(fuse_activations=False)


def _weights_t(model: Mlp) -> tuple[torch.Tensor, torch.Tensor]:
    return model.a.weight.detach().t().contiguous(), model.b.weight.detach().t().contiguous()


async def test_two_d_linears_run_as_addmm_on_contiguous_transposes() -> None:
    model, x = Mlp(), torch.randn(3, 8)
    ep = _export(model, x)
    async with Executor(ep, LOWERED) as lowered, Executor(
        ep, ExecutorConfig(lower_linear=False)
    ) as plain:
        assert (lowered.lowered_linears, lowered.weight_copies) == (2, 2)
        assert (plain.lowered_linears, plain.weight_copies) == (0, 0)
        assert _targets(lowered) == [aten.addmm.default, aten.relu.default, aten.addmm.default]
        assert aten.linear.default in _targets(plain)
        assert [n.name for n in lowered.graph.nodes] == [n.name for n in plain.graph.nodes]
        derived = lowered.weights.derived
        assert sorted(derived) == [
            FOLDED_PREFIX + "linear_1_weight_t", FOLDED_PREFIX + "linear_weight_t",
        ]
        at, bt = _weights_t(model)
        assert derived[FOLDED_PREFIX + "linear_weight_t"].is_contiguous()
        assert torch.equal(derived[FOLDED_PREFIX + "linear_weight_t"], at)
        with torch.no_grad():  # exactly the products on the copies
            expected = torch.addmm(model.b.bias, torch.relu(torch.addmm(model.a.bias, x, at)), bt)
            eager = model(x)
        for _ in range(5):  # past adaptive placement's profiling: the decided placement too
            out, ref = await lowered.execute(x), await plain.execute(x)
            assert torch.equal(out, expected)
            torch.testing.assert_close(out, ref)  # another BLAS layout: equal to rounding
        assert torch.equal(ref, eager)


async def test_without_pretranspose_the_two_d_lowering_is_bitwise_linear() -> None:
    model, x = Mlp(), torch.randn(3, 8)
    config = ExecutorConfig(pretranspose_weights=False, fuse_activations=False)
    async with Executor(_export(model, x), config) as ex:
        assert (ex.lowered_linears, ex.weight_copies) == (2, 0)
        assert _targets(ex) == [aten.addmm.default, aten.relu.default, aten.addmm.default]
        transposed = ex.weights.derived[FOLDED_PREFIX + "linear_weight_t"]
        assert not transposed.is_contiguous()  # the view at::linear makes: no copy
        for _ in range(5):
            out = await ex.execute(x)
            with torch.no_grad():
                assert torch.equal(out, model(x))


async def test_swap_weights_refolds_the_transpose() -> None:
    model, x = Mlp(), torch.randn(2, 8)
    async with Executor(_export(model, x)) as ex:
        before = await ex.execute(x)
        new = {"a.weight": torch.randn(16, 8), "b.bias": torch.randn(4)}
        ex.swap_weights(new)
        after = await ex.execute(x)
        assert torch.equal(ex.weights.derived[FOLDED_PREFIX + "linear_weight_t"],
                           new["a.weight"].t())
        with torch.no_grad():
            model.a.weight.copy_(new["a.weight"])
            model.b.bias.copy_(new["b.bias"])
            torch.testing.assert_close(after, model(x))
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
                torch.testing.assert_close(await ex.execute(x), model(x))


@pytest.mark.parametrize(
    ("model", "args", "why"),
    [
        (Mlp(), (torch.randn(2, 3, 8),), "a 3-D input"),
        (Mlp(bias=False), (torch.randn(2, 8),), "no bias"),
    ],
)
async def test_other_linears_read_a_view_of_the_copy(
    model: torch.nn.Module, args: tuple[Any, ...], why: str
) -> None:
    """at::linear multiplies by its weight's transpose: given `copy.t()`, that is the copy."""
    ep = _export(model, *args)
    async with Executor(ep) as ex, Executor(ep, ExecutorConfig(pretranspose_weights=False)) as off:
        assert (ex.lowered_linears, ex.weight_copies) == (2, 2), why
        assert _targets(ex).count(aten.linear.default) == 2, why
        for name, view in ex.weights.derived.items():
            if name.endswith("_weight_tt"):
                assert view.t().is_contiguous() and not view.is_contiguous(), name
        assert (off.lowered_linears, off.weight_copies) == (0, 0), why
        with torch.no_grad():
            expected = model(*args)
        torch.testing.assert_close(await ex.execute(*args), expected)
        assert torch.equal(await off.execute(*args), expected)


async def test_a_shared_weight_is_copied_once() -> None:
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(torch.relu(self.a(x)))

    model, x = Twice(), torch.randn(2, 8)
    async with Executor(_export(model, x)) as ex:
        assert (ex.lowered_linears, ex.weight_copies) == (2, 1)
        assert len(ex.weights.derived) == 1
        with torch.no_grad():
            torch.testing.assert_close(await ex.execute(x), model(x))


async def test_a_core_aten_transpose_before_a_product_becomes_a_copy() -> None:
    model, x = Mlp(bias=False), torch.randn(2, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = _export(model, x).run_decompositions()
    async with Executor(ep) as ex:
        assert (ex.lowered_linears, ex.weight_copies) == (0, 2)
        assert aten.mm.default in _targets(ex)
        at, bt = _weights_t(model)
        assert sorted((t.shape for t in ex.weights.derived.values()), key=tuple) == sorted(
            (at.shape, bt.shape), key=tuple)
        assert all(t.is_contiguous() for t in ex.weights.derived.values())
        with torch.no_grad():
            torch.testing.assert_close(await ex.execute(x), model(x))


async def test_a_transpose_read_other_than_by_a_product_stays_a_view() -> None:
    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            wt = self.w.t()
            return torch.mm(x, wt) + wt.sum()

    model, x = Reads(), torch.randn(2, 4)
    async with Executor(_export(model, x)) as ex:
        assert ex.weight_copies == 0
        with torch.no_grad():
            assert torch.equal(await ex.execute(x), model(x))


async def test_a_weight_passed_as_an_input_keeps_its_linear() -> None:
    args = (torch.randn(2, 8), torch.randn(4, 8), torch.randn(4))
    async with Executor(_export(WeightAsInput(), *args)) as ex:
        assert (ex.lowered_linears, ex.weight_copies) == (0, 0)
        assert aten.linear.default in _targets(ex)
        torch.testing.assert_close(await ex.execute(*args), WeightAsInput()(*args))


async def test_off_without_folding() -> None:
    """Without folding the transpose would run on every call: no gain, so no lowering."""
    model, x = Mlp(), torch.randn(2, 8)
    async with Executor(_export(model, x), ExecutorConfig(fold_constants=False)) as ex:
        assert (ex.lowered_linears, ex.weight_copies) == (0, 0)
        with torch.no_grad():
            assert torch.equal(await ex.execute(x), model(x))


async def test_an_error_in_a_lowered_linear_names_the_linear() -> None:
    model = Mlp()
    async with Executor(_export(model, torch.randn(2, 8)),
                        ExecutorConfig(validate_inputs=False)) as ex:
        with pytest.raises(RuntimeError) as caught:
            await ex.execute(torch.randn(2, 5))  # 5 columns where the weight has 8
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        # lowered to addmm, then fused with its relu: the node keeps the linear's name
        assert "While executing %linear = aten._addmm_activation.default" in notes, notes

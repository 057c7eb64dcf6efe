"""Activation epilogues: a CPU addmm whose only reader is relu or exact gelu runs as one node."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from asyncgraph import Executor, ExecutorConfig

pytestmark = pytest.mark.usefixtures("leak_check")

aten = torch.ops.aten
UNFUSED = ExecutorConfig(fuse_activations=False)


class Layers(torch.nn.Module):
    """relu and exact gelu after linears (fused), tanh gelu and a shared product (not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        h = torch.nn.functional.gelu(self.b(h))
        h = torch.nn.functional.gelu(self.c(h), approximate="tanh")
        y = self.d(h)
        return torch.relu(y), y  # y is an output too: its addmm stays


def _export(model: torch.nn.Module, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model.eval(), args)


def _targets(ex: Executor) -> list[Any]:
    return [n.target for n in ex.graph.nodes]


async def test_relu_and_exact_gelu_fuse_bitwise_the_same() -> None:
    model, x = Layers(), torch.randn(3, 16)
    ep = _export(model, x)
    async with Executor(ep) as fused, Executor(ep, UNFUSED) as unfused:
        assert (fused.fused_activations, unfused.fused_activations) == (2, 0)
        assert _targets(fused) == [
            aten._addmm_activation.default, aten._addmm_activation.default,
            aten.addmm.default, aten.gelu.default, aten.addmm.default, aten.relu.default,
        ]
        first, second = fused.graph.nodes[:2]
        assert (first.name, first.kwargs) == ("linear", {})
        assert (second.name, second.kwargs) == ("linear_1", {"use_gelu": True})
        for _ in range(5):  # past adaptive placement's profiling: the decided placement too
            out, ref = await fused.execute(x), await unfused.execute(x)
            assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


async def test_a_core_aten_graph_fuses_too() -> None:
    model, x = Layers(), torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = _export(model, x).run_decompositions()
    async with Executor(ep) as fused, Executor(ep, UNFUSED) as unfused:
        assert fused.fused_activations == 2
        out, ref = await fused.execute(x), await unfused.execute(x)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


async def test_a_product_read_twice_keeps_the_two_nodes() -> None:
    class Reused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return torch.relu(y) + y

    model, x = Reused(), torch.randn(2, 8)
    async with Executor(_export(model, x)) as ex:
        assert ex.fused_activations == 0
        assert aten.relu.default in _targets(ex)
        with torch.no_grad():
            torch.testing.assert_close(await ex.execute(x), model(x))


async def test_an_error_in_the_product_names_the_linear() -> None:
    model = Layers()
    async with Executor(_export(model, torch.randn(2, 16)),
                        ExecutorConfig(validate_inputs=False)) as ex:
        with pytest.raises(RuntimeError) as caught:
            await ex.execute(torch.randn(2, 5))
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        assert "While executing %linear = aten._addmm_activation.default" in notes, notes

"""Dimensions exported as Dim.AUTO / Dim.DYNAMIC: asyncgraph accepts what ep.module() accepts.

torch.export specialises such dimensions away from 0 and 1 and reports the range [2, inf], yet
`ep.module()` runs a batch of 1 (torch lets 0 and 1 through a lower bound of 2 or less). A
held-out model zoo exported this way was refused by asyncgraph at batch 1 before this rule.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import asyncgraph
from asyncgraph import InputValidationError


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


CASES = [
    (MLP, (4, 8), Dim.AUTO),
    (MLP, (4, 8), Dim.DYNAMIC),
    (Conv, (3, 3, 8, 8), Dim.AUTO),
    (Attention, (3, 5, 16), Dim.DYNAMIC),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model_type", "shape", "dim"), CASES,
                         ids=["mlp-auto", "mlp-dynamic", "conv-auto", "attention-dynamic"])
async def test_batch_of_one_runs_as_ep_module_runs_it(
    model_type: type[torch.nn.Module], shape: tuple[int, ...], dim: Dim,
    leak_check: object,
) -> None:
    torch.manual_seed(0)
    model = model_type().eval()
    ep = torch.export.export(model, (torch.randn(*shape),), dynamic_shapes=({0: dim},))
    lower = [int(r.lower) for r in ep.range_constraints.values()]
    assert 2 in lower  # export's 0/1 specialisation: the case this test is about
    async with asyncgraph.Executor(ep) as ex:
        for batch in (1, 2, shape[0]):
            x = torch.randn(batch, *shape[1:])
            torch.testing.assert_close(await ex.execute(x), ep.module()(x))


@pytest.mark.parametrize(("low", "high"), [(3, 16), (2, 16)])
async def test_a_range_the_user_bounded_is_enforced_as_written(
    low: int, high: int, leak_check: object,
) -> None:
    ep = torch.export.export(MLP().eval(), (torch.randn(4, 8),),
                             dynamic_shapes=({0: Dim("b", min=low, max=high)},))
    async with asyncgraph.Executor(ep) as ex:
        with pytest.raises(InputValidationError,
                           match=rf"^x\.shape\[0\]: expected a size in \[{low}, {high}\] "
                                 rf"\(Dim 'b'\), got 1$"):
            await ex.execute(torch.randn(1, 8))
    if low > 2:
        with pytest.raises((RuntimeError, AssertionError), match=">= 3"):
            ep.module()(torch.randn(1, 8))  # eager refuses it too (from 3: torch's own rule)

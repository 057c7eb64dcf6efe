"""Dimensions exported as Dim.AUTO / Dim.DYNAMIC: asyncgraph accepts what ep.module() accepts.

torch.export specialises such dimensions away from 0 and 1 and reports the range [2, inf], yet
`ep.module()` runs a batch of 1 (torch lets 0 and 1 through a lower bound of 2 or less). A
held-out model zoo exported this way was refused by asyncgraph at batch 1 before this rule.
"""

from __future__ import annotations

import re
from pathlib import Path

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


# -- the user's names of dynamic dims after a save and a load ---------------------------------


def _batch_program() -> torch.export.ExportedProgram:
    batch = Dim("batch", min=2, max=8)
    return torch.export.export(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),),
                               dynamic_shapes=({0: batch},))


async def _size_error(ex: asyncgraph.Executor) -> str:
    with pytest.raises(InputValidationError) as info:
        await ex.execute(torch.randn(20, 4))
    return str(info.value)


@pytest.mark.usefixtures("leak_check")
async def test_a_torch_saved_program_names_a_dim_by_the_input_it_sizes(tmp_path: Path) -> None:
    torch.export.save(_batch_program(), tmp_path / "m.pt2")
    async with asyncgraph.load(tmp_path / "m.pt2") as ex:
        message = await _size_error(ex)
    assert "dynamic dim of input.shape[0]" in message, message
    assert not re.search(r"\bs\d+\b", message), f"an internal symbol in: {message}"


@pytest.mark.usefixtures("leak_check")
async def test_asyncgraph_save_keeps_the_dim_names(tmp_path: Path) -> None:
    ep = _batch_program()
    asyncgraph.save(ep, tmp_path / "m.pt2")
    async with asyncgraph.Executor(ep) as in_memory, asyncgraph.load(tmp_path / "m.pt2") as loaded:
        assert await _size_error(loaded) == await _size_error(in_memory)
        assert "(Dim 'batch')" in await _size_error(loaded)
    assert torch.export.load(tmp_path / "m.pt2") is not None  # still torch's own format


@pytest.mark.usefixtures("leak_check")
@pytest.mark.parametrize("member", [b"not json", b'{"dim_names": [[0, 0, "x; import os"]]}',
                                    b'{"dim_names": [[-1, 0, "b"]]}', b'{"dim_names": 3}'])
async def test_damaged_dim_names_are_ignored(tmp_path: Path, member: bytes) -> None:
    torch.export.save(_batch_program(), tmp_path / "m.pt2",
                      extra_files={"asyncgraph_dim_names.json": member.decode()})
    async with asyncgraph.load(tmp_path / "m.pt2") as ex:
        assert "dynamic dim of input.shape[0]" in await _size_error(ex)

"""`asyncgraph check MODEL.pt2`: the per-output table and the exit status.

The command runs its own event loops (asyncio.run), so the tests call it from a worker thread
and the leak check still sees every executor and thread it created.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from asyncgraph.cli.main import app
from asyncgraph.tools.check import run_check

pytestmark = [
    pytest.mark.usefixtures("leak_check"),
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]

_TICKS = itertools.count(1)


@torch.library.custom_op("agconf::tick", mutates_args=())
def tick(x: torch.Tensor) -> torch.Tensor:
    """Nondeterministic on purpose: every call adds a new number, so no two runs agree."""
    return x + next(_TICKS)


@tick.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Stateful(torch.nn.Module):
    """A cond, a buffer mutation, a user-input mutation and a nested output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> dict[str, object]:
        self.steps.add_(1)
        extra["acc"].add_(x.sum(0))
        y = torch.cond(x.sum() > 0, lambda a: self.lin(a).relu(), lambda a: a.cos(), (x,))
        return {"y": y, "steps": self.steps * 1, "pair": [x.shape[0], None]}


class Ticking(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.ops.agconf.tick(x)


def _save(module: torch.nn.Module, args: tuple, path: Path) -> Path:
    ep = torch.export.export(module, args)
    torch.export.save(ep, path)
    return path


@pytest.fixture(scope="module")
def stateful_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("check") / "s.pt2"
    return _save(Stateful(), (torch.randn(3, 4), {"acc": torch.zeros(4)}), path)


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check", *args], catch_exceptions=False)
    return result.exit_code, result.output


async def test_check_passes_and_prints_every_leaf(stateful_pt2: Path) -> None:
    code, output = await asyncio.to_thread(_invoke, str(stateful_pt2))
    assert code == 0, output
    assert "sample inputs" in output
    for row in ("out['y']", "out['steps']", "out['pair'][0]", "out['pair'][1]",
                "input extra['acc']", "buffer steps"):
        assert row in output, row
    assert "MISMATCH" not in output
    assert "output leaves match in every run" in output


async def test_check_with_random_inputs(stateful_pt2: Path) -> None:
    code, output = await asyncio.to_thread(_invoke, str(stateful_pt2), "--random", "--seed", "5")
    assert code == 0, output
    assert "random inputs (seed 5)" in output


async def test_check_report_rows(stateful_pt2: Path) -> None:
    """The report behind the table: one row per output leaf, mutated input and buffer."""
    report = await asyncio.to_thread(run_check, stateful_pt2)
    rows = [what for what, _, _ in report.rows]
    assert rows == [
        "out['y']", "out['steps']", "out['pair'][0]", "out['pair'][1]",
        "input extra['acc']", "buffer steps",
    ]
    assert report.ok
    assert set(report.runs) == {"eager", "serial", "parallel(2)"}


async def test_check_exits_1_on_a_mismatch(tmp_path: Path) -> None:
    model = _save(Ticking(), (torch.zeros(2),), tmp_path / "t.pt2")
    code, output = await asyncio.to_thread(_invoke, str(model))
    assert code == 1, output
    assert "MISMATCH" in output
    report = await asyncio.to_thread(run_check, model)
    (ok_row, bad_row) = report.rows
    assert all(c is not None and c.ok for c in ok_row[2].values())
    assert all(c is not None and not c.ok for c in bad_row[2].values())


async def test_check_exits_1_on_a_file_that_is_not_a_program(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.pt2"
    bogus.write_text("not a zip")
    code, output = await asyncio.to_thread(_invoke, str(bogus))
    assert code == 1
    assert "not a .pt2 archive" in " ".join(output.split())

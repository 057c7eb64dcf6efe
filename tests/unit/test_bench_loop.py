"""A benchmark run as its own script (`python -m benchmarks.ort --loop uvloop`) runs on the
event loop asked for, and its report says which: uvicorn serves on uvloop by default."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncgraph.bench import suite
from asyncgraph.bench.harness import CaseResult, Context


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_standalone_scenario_runs_on_the_loop_asked_for(
    loop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ran_on: list[str] = []

    async def cases(ctx: Context) -> list[CaseResult]:
        ran_on.append(type(asyncio.get_running_loop()).__module__.split(".")[0])
        return []

    args = suite.standalone_parser("a scenario", ("mlp",)).parse_args(["--json", "--loop", loop])
    assert suite.run_standalone(args, cases, width=100) == 0
    assert ran_on == [loop]
    assert json.loads(capsys.readouterr().out)["settings"]["loop"] == loop


def test_an_unknown_loop_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        suite.standalone_parser("a scenario", ("mlp",)).parse_args(["--loop", "trio"])
    assert "invalid choice: 'trio'" in capsys.readouterr().err

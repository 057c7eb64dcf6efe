"""ARCHITECTURE.md's run loop on one screen is the code itself: `Executor._execute`, copied
verbatim, short enough for one screen. A change to the run loop changes the document too
(`python scripts/sync_run_loop.py` writes the copy)."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from asyncgraph.runtime.executor import Executor

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- run loop: runtime/executor.py Executor._execute -->"
ONE_SCREEN = 60  # lines


def documented_run_loop() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    after = text.split(MARK, 1)[1]
    block = after.split("```python\n", 1)[1]
    return block.split("```", 1)[0]


def source_run_loop() -> str:
    return textwrap.dedent(inspect.getsource(Executor._execute))


def test_the_documented_run_loop_is_the_source() -> None:
    assert documented_run_loop() == source_run_loop(), (
        "ARCHITECTURE.md's run loop differs from Executor._execute: "
        "run python scripts/sync_run_loop.py"
    )


def test_the_run_loop_fits_one_screen() -> None:
    lines = source_run_loop().splitlines()
    assert len(lines) <= ONE_SCREEN, f"Executor._execute is {len(lines)} lines"

"""The runtime's error boundaries: where `except BaseException` may stand in runtime/.

A handler that catches everything decides what becomes of an interrupt, a cancellation and
a bug of the runtime's own, so each is a boundary with one job. The run loop has two (a
kernel's error, units.py; a work item's, scheduler.py), and the hand-off that ends the items
it could not start one more; the rest route an error to where it belongs: the thread that
asked for a thread, the trio task's future, the unraisable hook of a callback or a worker.
Cleanup on failure is a `finally`, not a handler. A new handler fails this test: make it a
`finally`, or add it here with why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgraph

RUNTIME = Path(asyncgraph.__file__).parent / "runtime"

BOUNDARIES = {
    ("units.py", "run_units"): "a kernel's error goes to the run's on_error",
    ("scheduler.py", "_item"): "the work item: an error of the runtime fails the execution",
    ("scheduler.py", "_hand_off"): "the items a failed hand-off could not start end there",
    ("workers.py", "_worker_main"): "a bug escaping a work item goes to the unraisable hook",
    ("threads.py", "_serve"): "a thread's start error goes to the thread that asked for it",
    ("backends/trio.py", "_guarded"): "a callback's error must not end the trio run",
    ("backends/trio.py", "_main"): "the task's outcome goes to its future",
    ("backends/loop_wake.py", "_drain"): "a callback's error to the loop's handler, as asyncio",
}


def _handlers() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if (isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.Name)
                        and node.type.id == "BaseException"):
                    key = (path.relative_to(RUNTIME).as_posix(), function.name)
                    found[key] = found.get(key, 0) + 1
    return found


def test_every_catch_all_in_the_runtime_is_a_listed_boundary() -> None:
    found = _handlers()
    assert set(found) == set(BOUNDARIES), (
        f"unlisted: {sorted(set(found) - set(BOUNDARIES))}; "
        f"listed but gone: {sorted(set(BOUNDARIES) - set(found))}"
    )
    assert all(count == 1 for count in found.values()), found
    assert sum(found.values()) <= 8

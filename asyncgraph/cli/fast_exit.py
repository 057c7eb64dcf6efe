"""Leaving the process at once once a server has stopped, instead of tearing torch down.

Why: once `asyncgraph serve` has drained and closed everything it owns ("server stopped"),
what is left is CPython's finalization: every module's globals cleared and collected, torch's
and sympy's among them. That takes a good part of a second
(benchmarks/results/cpu/design_measurements.md#fast-exit), during which the process holds its
memory and an orchestrator waits to start its replacement. A command that has
released all it holds calls `request()`; `asyncgraph`'s entry point (cli/main.py `main`, never
an in-process CliRunner) then runs the atexit handlers, flushes the standard streams and
logging, and ends the process with `os._exit`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys

_requested = False


def request() -> None:
    """Say that the command has closed everything it opened: no finalizer is left to run."""
    global _requested
    _requested = True


def leave_if_requested(code: int) -> None:
    """End the process now with `code` if a command asked to (`request`), else return."""
    if not _requested:
        return
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to write
            stream.flush()
    os._exit(code)

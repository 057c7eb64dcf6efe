"""A pytest plugin for projects that use asyncgraph: leak checks and fault injection.

Enable it in a conftest.py:

    pytest_plugins = ["asyncgraph.testing.pytest_plugin"]

Fixtures (async ones need an async test runner such as pytest-asyncio or anyio):
- `asyncgraph_leak_check`: fails the test if an Executor created during it still has a frame
  in use or a waiter, if a task is left pending, if a worker thread outlives it, or if CUDA
  memory grew; Executors created in the test are closed first.
- `fault_injector`: a fresh FaultInjector (seed 0) whose gates are opened at teardown, so a
  failing test never leaves a kernel blocked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from asyncgraph.testing.faults import FaultInjector
from asyncgraph.testing.leaks import LeakChecker


@pytest.fixture
async def asyncgraph_leak_check() -> AsyncIterator[LeakChecker]:
    """Check, after the test, that nothing of any Executor it created is left over."""
    async with LeakChecker() as checker:
        yield checker


@pytest.fixture
def fault_injector() -> Iterator[FaultInjector]:
    """A FaultInjector for `Executor(..., kernel_factory=fault_injector.kernel_factory())`."""
    injector = FaultInjector(seed=0)
    try:
        yield injector
    finally:
        injector.open_gates()

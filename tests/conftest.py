"""Test matrix and fixtures: every async test runs on asyncio (debug mode) and on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import torch
import uvloop

from asyncgraph.testing import LeakChecker

torch.set_num_threads(1)


def _asyncio_debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 10.0  # debug mode's slow-callback log is noise under load
    return loop


LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": _asyncio_debug_loop,
    "uvloop": uvloop.new_event_loop,
}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    return dict(LOOP_FACTORIES)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true",
        help="run the long soak tests (sized by ASYNCGRAPH_SOAK_SCALE: tests/soak.py)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
async def leak_check() -> AsyncIterator[LeakChecker]:
    """The leak check every executor test ends with: frames, waiters, tasks, threads."""
    async with LeakChecker() as checker:
        yield checker

"""Test matrix and fixtures.

Every async test runs on asyncio (debug mode) and on uvloop (pytest-asyncio's loop factories,
`LOOP_FACTORIES`). A sync test that takes `backend` runs its async body with anyio on each of
tests/support/backends.py's BACKENDS, asyncio (debug mode) and trio: `run(body, backend)`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
import uvloop

from asyncgraph.testing import LeakChecker
from tests.support.backends import BACKENDS

torch.set_num_threads(1)

# Each xdist worker compiles with an inductor cache of its own. Twice (17 and 23 failures) an
# AOTInductor package came out with an empty wrapper_metadata.json while another process
# compiled or loaded AOTI models beside it; the cache, where those files are written and read,
# is the one thing the processes shared. Kept between runs (same worker names), so the cache
# still saves recompiles.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-asyncgraph-tests-{_WORKER}")

# Exported segments and fast-form verdicts are cached on disk (asyncgraph/runtime/disk_cache.py):
# each test process uses a folder of its own, removed at exit, never the user's
# ~/.cache/asyncgraph. xdist workers inherit the environment of the controller, which loads
# this file too: a folder a test process set (marked by _ASYNCGRAPH_TEST_CACHE) is replaced,
# else the workers shared one, and one worker's test adopted the verdict another's had kept.
_EXPORT_CACHE = tempfile.TemporaryDirectory(prefix="asyncgraph-test-cache-")
if os.environ.get("ASYNCGRAPH_CACHE_DIR") in (None, os.environ.get("_ASYNCGRAPH_TEST_CACHE")):
    os.environ["ASYNCGRAPH_CACHE_DIR"] = os.environ["_ASYNCGRAPH_TEST_CACHE"] = _EXPORT_CACHE.name
# Fast forms (asyncgraph/runtime/forms.py) are built on a thread and switched to by timing, so
# a test's Executor would change forms at a moment that depends on the machine's speed. Tests
# get the plain graph unless they ask (`ExecutorConfig(fast_paths=True)`:
# tests/integration/test_fast_forms.py, and the conformance run on the fast form).
os.environ.setdefault("ASYNCGRAPH_FAST_PATHS", "0")
# Nor do the Executors that ask compile an AOTInductor form (a child process compiling for tens
# of seconds per program): tests/integration/test_aoti_form.py turns it on for its own.
os.environ.setdefault("ASYNCGRAPH_AOTI_FORM", "0")


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


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The anyio backend a sync test runs its body on: `run(body, backend)` (the ids
    `[asyncio]`, `[trio]`). A test that holds for one backend only parametrizes `backend`
    itself, which overrides this."""
    param: str = request.param
    return param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true",
        help="run the long soak tests (sized by ASYNCGRAPH_SOAK_SCALE: tests/support/soak.py)",
    )


# Session and module fixtures that take minutes on a loaded machine: AOTInductor compiles
# (tests/integration/test_compiled.py) and a Ray instance (test_ray.py). The first test to use
# one pays for it inside its own timeout, so each test using one gets at least this.
HEAVY_FIXTURES = frozenset({"compiled", "tuned", "frozen", "chosen", "bert_package",
                            "bert_aoti_package", "cluster"})
HEAVY_FIXTURE_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("timeout")
        if HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())) and (
                marker is None or marker.args[0] < HEAVY_FIXTURE_TIMEOUT_S):
            item.add_marker(pytest.mark.timeout(HEAVY_FIXTURE_TIMEOUT_S), append=False)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _earlier_modules_frozen() -> None:
    """Leave the objects of earlier test modules out of the cyclic collector's work.

    The suite's heap grows large (exported programs, cached corpora, imported libraries), and
    a full collection of it took up to 1.5 s on the development machine (gc callbacks over one
    Python 3.12 run: 113 collections over 50 ms, the 31 longest 0.86-1.48 s). One inside a
    test's timing window fails it: in CI, `asyncgraph stress` measured a 1.7 s loop lag in
    test_cli_stress_with_batching, a run that takes 0.05 s. Collected, then frozen when a
    module starts, the live objects of earlier modules stay out of every later collection, so
    a module's collections scan its own objects (garbage cycles among the frozen objects are
    never collected: the suite's caches live for the session anyway).
    """
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Unfreeze before the plugins' summaries: hypothesis, imported there when no test module
    imported it, checks its PRNGs' referrers with gc.get_referrers, which skips frozen
    objects."""
    gc.unfreeze()


@pytest.fixture
def children(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The child processes that fast-form builds start (compiled/child_process.py), recorded."""
    from asyncgraph.compiled import child_process

    started: list[Any] = []
    popen = child_process.subprocess.Popen

    def recorded(*args: Any, **kwargs: Any) -> Any:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(child_process.subprocess, "Popen", recorded)
    return started


@pytest.fixture
async def leak_check() -> AsyncIterator[LeakChecker]:
    """The leak check every executor test ends with: frames, waiters, tasks, threads."""
    async with LeakChecker() as checker:
        yield checker

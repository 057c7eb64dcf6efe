"""The async backends a test body runs on with anyio, and what such bodies share.

`BACKENDS` is the matrix of tests/conftest.py's `backend` fixture: a sync test taking
`backend` runs its async body with `run(body, backend)`, on asyncio (debug mode) and on
trio, inside a leak check. The other helpers work on either backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from asyncgraph.errors import ExecutorClosedError
from asyncgraph.testing import LeakChecker

BACKENDS = ["asyncio", "trio"]


def run(body: Callable[[], Awaitable[None]], backend: str) -> None:
    """Run `body` on `backend` inside a leak check."""

    async def checked() -> None:
        async with LeakChecker():
            await body()

    options = {"debug": True} if backend == "asyncio" else {}
    anyio.run(checked, backend=backend, backend_options=options)


def cancelled_exc() -> type[BaseException]:
    return anyio.get_cancelled_exc_class()


async def settle(turns: int = 10) -> None:
    for _ in range(turns):
        await anyio.lowlevel.checkpoint()


async def until(condition: Callable[[], bool], what: str, *, poll_s: float = 0.001) -> None:
    """Wait (at most 30 s) for `condition`, looking every `poll_s`; `poll_s=0` looks at every
    turn of the loop, for a state that lasts only a few turns."""
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110 (set by a thread: no event to await)
            await anyio.sleep(poll_s)
    assert condition(), what


def closed_by_cancel(backend: str) -> str:
    """What a caller whose execution aclose(cancel=True) cancelled sees: on asyncio its task
    is cancelled (CancelledError); on trio, where a cancellation belongs to a cancel scope,
    ExecutorClosedError naming aclose(cancel=True)."""
    return "cancelled" if backend == "asyncio" else "closed"


async def outcome_of(call: Awaitable[Any], outcomes: dict[str, str], name: str) -> None:
    """Record how `call` ended: "value", "closed" (ExecutorClosedError), "cancelled" (the
    backend's cancellation) or the name of any other exception type."""
    try:
        await call
        outcomes[name] = "value"
    except ExecutorClosedError as exc:
        assert "aclose(cancel=True)" in str(exc), str(exc)
        outcomes[name] = "closed"
    except cancelled_exc():
        outcomes[name] = "cancelled"
    except BaseException as exc:  # concurrent.futures.CancelledError would land here
        outcomes[name] = type(exc).__qualname__

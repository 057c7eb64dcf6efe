"""Every Executor alive in this process, in a weak set that tools outside the runtime read.

The leak checker (asyncgraph.testing) must see the executors a test created without the runtime
importing the testing package: the runtime records each Executor here when it is built, and
testing reads the set. Weak references, so recording never keeps an Executor alive.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncgraph.runtime.executor import Executor

_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()


def register(executor: Executor) -> None:
    """Record `executor` (called once, by Executor.__init__)."""
    _LIVE.add(executor)


def live_executors() -> list[Executor]:
    """Every Executor created in this process that is still alive."""
    return list(_LIVE)

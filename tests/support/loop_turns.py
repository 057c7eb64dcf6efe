"""LoopTurns: how often the event loop ran another task while a test's work was in flight.

Tests use it to show that the loop stays free (between fused units, between slices of many
callers, while the GPU works) without asserting any wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType


class LoopTurns:
    """`async with LoopTurns() as turns:` counts in `turns.count` the turns of a task that
    sleeps `interval_s` (0: every loop iteration) until the block ends."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)  # the task has started
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

"""LoopBudget: how long the event loop may run inline kernels in one iteration.

An execution running inline kernels yields after `loop_slice_s`. That bounds one execution,
but not many: asyncio runs every callback that is ready at the start of an iteration, so 64
callers each running a 0.4 ms graph inline delay a timer by 25 ms. The budget is shared by
all executions of all Executors on one loop: the first inline work of an iteration opens a
slice and schedules its close with `call_soon`, which runs at the start of the next iteration;
until then, work that finds the slice spent waits in the budget's FIFO queue, which one
callback per iteration runs until the next slice is spent. The scheduler also defers a unit
whose measured time would end after the slice (it then runs first thing in a later
iteration). So each iteration spends about one slice in inline kernels (more only for a unit
longer than a slice, or one not measured yet), whatever the number of callers, timers and I/O
get their turn in between, and deferred work costs one loop callback per iteration rather
than one per waiting execution.

A spent slice is extended (`extend`) instead when nothing else waits on the loop: asyncio's
pure-Python loops show it (no ready callback but the budget's own, no timer due, and a
zero-timeout `select` of its selector finds no I/O; epoll and kqueue report level-triggered
events again at the loop's own select, so the peek takes nothing from it). A single caller
then does not pay a loop iteration per slice for nobody's sake: tiny BERT (0.7 ms) ran
1.04-1.07x nativert's time with it against 1.10x without, the MLP 0.81-0.87x against 0.89x
(alternating blocks in shuffled order). uvloop and trio do not show their queues: there the
slice always ends.

On trio the "loop" is the run's TrioLoop (backend.py): `call_soon` there is the run token's
`run_sync_soon`, whose callbacks run in the run's next batch, after the tasks runnable now, so
the slice closes and deferred work resumes once per scheduling round, as on asyncio.

Budgets are kept per loop in a table with weak keys, and a budget holds its loop weakly too:
an entry (and its loop) goes as soon as nothing else uses the loop, so a process that runs
many `asyncio.run` calls does not keep every loop it ever ran on.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class SoonLoop(Protocol):
    """What a budget needs of its loop: an asyncio loop, or a TrioLoop (backend.py)."""

    def call_soon(self, fn: Callable[[], None], /) -> Any: ...
    def is_closed(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class LoopBudgetStatistics:
    slices: int  # slices opened
    deferred: int  # times work found the slice spent and waited for the next iteration
    extended: int = 0  # times a spent slice was extended: nothing else waited on the loop


class LoopBudget:
    """The per-iteration inline-kernel budget of one event loop (loop thread only)."""

    __slots__ = (
        "_deadline", "_deferred", "_extended", "_loop", "_open", "_peek", "_queue", "_scheduled",
        "_slices", "others_wait", "slice_s",
    )

    def __init__(self, loop: SoonLoop, slice_s: float) -> None:
        # Weak: the budget is the value of a weak-keyed table whose key is this loop; a strong
        # reference here would keep the key, and so the entry and the loop, alive for ever.
        self._loop = weakref.ref(loop)
        self.slice_s = slice_s
        self._open = False
        self._deadline = 0.0
        self._slices = 0
        self._deferred = 0
        self._queue: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._scheduled = False
        self._peek = _shows_its_queues(loop)
        self._extended = 0
        # The last `extend` found other work ready on the loop (a pure-Python asyncio loop's
        # peek; never set where the loop does not show its queues): the loop is contended.
        self.others_wait = False

    @property
    def shows_queues(self) -> bool:
        """Whether `others_queued` and `others_wait` see the loop's queues (asyncio's
        pure-Python loops); where they do not (uvloop, trio), both stay False."""
        return self._peek

    @property
    def is_open(self) -> bool:
        """Whether a slice is open in this iteration (the next `deadline` continues it)."""
        return self._open

    @property
    def slices(self) -> int:
        """Slices opened so far: two readings alike fall in one slice."""
        return self._slices

    def deadline(self) -> float | None:
        """The perf_counter time the current slice ends, opening one if none is open; None
        when the slice is spent (the caller hands its work to `defer`)."""
        now = time.perf_counter()
        if not self._open:
            return self._open_slice(now)
        if now >= self._deadline:
            return self.extend(now)
        return self._deadline

    def start(self, seconds: float) -> float | None:
        """The perf_counter time now when `seconds` of inline work fit in what is left of the
        slice (opening one if none is open), else None: the caller then defers or splits its
        work. One clock read, where `deadline()` and a read for the fit take two."""
        now = time.perf_counter()
        if not self._open:
            self._open_slice(now)
        elif now + seconds > self._deadline and (
            seconds > self.slice_s or self.extend(now) is None  # no peek for what cannot fit
        ):
            return None
        return now if now + seconds <= self._deadline else None

    def _open_slice(self, now: float) -> float:
        """Open this iteration's slice at `now`; it closes at the next iteration's start."""
        self._open = True
        self._deadline = now + self.slice_s
        self._slices += 1
        self._call_soon(self._close)
        return self._deadline

    def extend(self, now: float | None = None) -> float | None:
        """A fresh slice from now when nothing else waits on the loop (the module docstring),
        its deadline; else None, and the slice ends as it would."""
        if not self._peek:
            return None
        loop = self._loop()
        self.others_wait = loop is not None and not _idle(loop, 1 + self._scheduled)
        if loop is None or self.others_wait:  # _idle counts the budget's own callbacks
            return None
        if now is None:
            now = time.perf_counter()
        self._deadline = now + self.slice_s
        self._extended += 1
        return self._deadline

    def others_queued(self) -> bool:
        """Whether other callbacks are ready to run on the loop now (besides the budget's
        own): other callers' tasks queued behind the running one. The ready queue only, no
        selector call: a per-execution check (asyncio's pure-Python loops; False where the
        loop does not show its queues)."""
        if not self._peek:
            return False
        loop = self._loop()
        return loop is not None and len(loop._ready) > 1 + self._scheduled  # type: ignore[attr-defined]

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` in a later iteration, after the work deferred before it."""
        self._deferred += 1
        self._queue.append((fn, args))
        if not self._scheduled:
            self._scheduled = True
            self._call_soon(self._run_deferred)

    def _call_soon(self, fn: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None:  # only reachable from a callback of a loop being torn down
            raise RuntimeError("the event loop of this LoopBudget no longer exists")
        loop.call_soon(fn)

    def _run_deferred(self) -> None:
        """Run deferred work in order until the slice is spent; the rest waits a turn.

        Only the entries present at the start run: work that defers itself again goes to the
        back and waits for the next iteration.
        """
        self._scheduled = False
        queue = self._queue
        try:
            for _ in range(len(queue)):
                if self._open and time.perf_counter() >= self._deadline:
                    break
                fn, args = queue.popleft()
                fn(*args)
        finally:  # even if a callback raised, the work behind it must not be stranded
            if queue and not self._scheduled:
                self._scheduled = True
                self._call_soon(self._run_deferred)

    def _close(self) -> None:
        self._open = False

    def statistics(self) -> LoopBudgetStatistics:
        return LoopBudgetStatistics(self._slices, self._deferred, self._extended)


def _shows_its_queues(loop: Any) -> bool:
    """Whether `loop` is one of asyncio's pure-Python loops, whose ready queue, timers and
    selector `_idle` reads (not uvloop, trio, or the Windows proactor loop)."""
    return all(hasattr(loop, name) for name in ("_ready", "_scheduled", "_selector", "time"))


def _idle(loop: Any, own: int) -> bool:
    """Whether nothing but `own` ready callbacks waits on `loop`: no other ready callback,
    no timer due (a cancelled one too: it ends the slice), no I/O ready."""
    if len(loop._ready) > own:
        return False
    timers = loop._scheduled
    if timers and timers[0].when() <= loop.time():
        return False
    return not loop._selector.select(0)


_BUDGETS: weakref.WeakKeyDictionary[SoonLoop, LoopBudget] = weakref.WeakKeyDictionary()


def loop_budget(loop: SoonLoop, slice_s: float) -> LoopBudget:
    """The budget shared by everything on `loop`; the smallest slice asked for wins."""
    budget = _BUDGETS.get(loop)
    if budget is None:
        budget = _BUDGETS[loop] = LoopBudget(loop, slice_s)
    elif slice_s < budget.slice_s:
        budget.slice_s = slice_s
    return budget


def loops_with_budgets() -> list[SoonLoop]:
    """The loops that have a budget and are still alive (the leak checker reads this)."""
    return list(_BUDGETS)

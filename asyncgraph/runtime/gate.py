"""HandOffQueue: the first-come-first-served hand-off that the frame pool and the server's
admission gate share (the pattern of trio's ParkingLot).

Several places bound something and make the callers beyond the bound wait: the frame pool
(runtime/pool.py: a frame), the server's admission gate (serve/admission.py: a slot, the
decode lane). They all wait the same way, for three reasons:

- **Fairness.** Waiters are served in arrival order, and a releaser hands what it releases
  straight to the oldest waiter instead of putting it back for anyone to take, so a caller
  that arrives at the right moment cannot barge ahead of those already waiting. The owner's
  fast path keeps this only if it takes nothing while anyone waits (`if not gate.queue`).
- **No thundering herd.** A release wakes exactly one waiter, the one it was handed to,
  rather than every waiter to race for it and all but one to go back to sleep.
- **No lost hand-off.** A waiter can be cancelled after it was handed the value and before
  it ran (the release-then-cancel race of anyio #398). It then passes the value on (the
  owner's `pass_on`: to the next waiter, or back to the free ones), so a cancellation never
  leaks or skips what was handed over. A waiter cancelled while still queued just leaves.

Each waiter is a one-shot future of the running loop, made through the Loop seam
(backend.py's `current_loop().create_future()`), not an asyncio primitive: asyncio's own bind
to the first loop that waits on them, and on trio the future is a TrioFuture that parks the
trio task. On trio a waiter handed its value is rescheduled and is not cancelled at that
wait any more (trio delivers a cancellation at its next checkpoint), so it always receives
the value, and its owner's code releases it on its own error paths; the pass-on above is what
asyncio (uvloop included) needs.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from asyncgraph.runtime.backend import FutureLike, current_loop

T = TypeVar("T")


class HandOffQueue(Generic[T]):
    """A FIFO of waiters; `hand_over(value)` gives `value` to the oldest one still waiting
    (see the module docstring).

    `queue` is the FIFO itself, for an owner's hot path: `if not gate.queue` tests emptiness
    with no call (a method or `__len__` would cost one per execution). Read it only; it
    changes through `wait` and `hand_over`. It may briefly hold futures already done (a
    waiter cancelled whose task has not run yet, on asyncio): `len()` counts them, as the
    bounds on waiters always have, and `waiting()` does not.
    """

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: deque[FutureLike] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def waiting(self) -> int:
        """Waiters neither handed a value yet nor cancelled."""
        return sum(1 for waiter in self.queue if not waiter.done())

    async def wait(self, pass_on: Callable[[T], object]) -> T:
        """Join the queue and wait until a releaser hands a value over. Cancelled after a
        value was handed to it, the waiter gives it to `pass_on` (which should hand it to the
        next waiter or free it) before the cancellation goes on."""
        waiter: FutureLike = current_loop().create_future()
        self.queue.append(waiter)
        taken = False
        try:
            handed: T = await waiter
            taken = True
            return handed
        finally:
            if not taken:  # cancelled, or the wait itself failed
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    pass_on(waiter.result())  # handed it, then cancelled: pass it on
                else:
                    with contextlib.suppress(ValueError):
                        self.queue.remove(waiter)

    def hand_over(self, value: T) -> bool:
        """Give `value` to the oldest waiter still waiting (it owns it now); False, and
        `value` stays the caller's, when nobody waits."""
        queue = self.queue
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(value)
                return True
        return False

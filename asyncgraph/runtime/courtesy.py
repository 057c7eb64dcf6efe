"""Background Python that gives the GIL back while the event loop serves.

Why: a fast form's build (runtime/forms.py) runs on a thread of the serving process, and what
it does there is Python: constant folding, segment planning, fx modules built and pickled, the
form's own Executor (50-100 ms for tiny BERT). Python on two threads shares one GIL, and
lowering the interpreter's switch interval only makes the turns shorter, not the loop's share
larger: with 64 callers of tiny BERT on the plain graph, the first round after a start saw
the loop's lag p99 at 15-22 ms with the build running against 5-6 ms without it, whatever the
switch interval (5 ms, 0.5 ms or 20 us). What the loop loses is a convoy: an execution run
inline on the loop gives the GIL up at every kernel, the build thread takes it, and the loop
gets it back only when the switch interval forces it, one kernel per interval. The build is in
no hurry; the callers are.

How: `GilCourtesy` installs a profile function on the thread that enters it (`sys.setprofile`
is per thread), which the interpreter calls on every Python call and return. Every
`CHECK_EVERY` calls it reads the clock; once the thread has run `slice_s` since its last
pause and `busy()` says the loop serves, it sleeps `pause_s`, which releases the GIL. So while
the loop serves, the thread holds the GIL for at most about a slice in every slice + pause,
and when the loop is quiet it runs at full speed. A long call into C that holds the GIL (an
ONNX Runtime session made, a compile) is one event and is not cut.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

CHECK_EVERY = 64  # profile events between clock reads (a read is ~0.1 us, an event ~0.2 us)


@dataclass(frozen=True, slots=True)
class CourtesyStatistics:
    pauses: int  # times the thread slept for the loop
    paused_s: float  # seconds it slept


class GilCourtesy:
    """A context manager: the entering thread pauses its Python while `busy()` (see module)."""

    def __init__(self, busy: Callable[[], bool], slice_s: float = 0.0005,
                 pause_s: float = 0.002) -> None:
        self._busy = busy
        self.slice_s = slice_s
        self.pause_s = pause_s
        self._events = 0
        self._since = 0.0
        self._previous: Any = None
        self.pauses = 0
        self.paused_s = 0.0

    def __enter__(self) -> GilCourtesy:
        self._since = time.perf_counter()
        self._previous = sys.getprofile()
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        self._events += 1
        if self._events % CHECK_EVERY:
            return
        now = time.perf_counter()
        if now - self._since < self.slice_s:
            return
        if self._busy():
            time.sleep(self.pause_s)
            self.pauses += 1
            after = time.perf_counter()
            self.paused_s += after - now
            now = after
        self._since = now

    def wait_quiet(self, max_s: float, busy: Callable[[], bool] | None = None) -> None:
        """Wait, up to `max_s`, for a moment when `busy()` (or the one given) says the loop
        is not serving: a gap between bursts (under steady load none comes, and the caller
        goes ahead after `max_s`). The pauses count in the statistics."""
        busy = busy or self._busy
        deadline = time.perf_counter() + max_s
        while busy() and time.perf_counter() < deadline:
            time.sleep(self.pause_s)
            self.pauses += 1
            self.paused_s += self.pause_s

    def statistics(self) -> CourtesyStatistics:
        return CourtesyStatistics(self.pauses, self.paused_s)

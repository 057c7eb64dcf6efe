"""Background Python that gives the GIL back while the event loop serves.

Why: a fast form's build (runtime/forms.py) runs on a thread of the serving process, and what
it does there is Python: constant folding, segment planning, fx modules built and pickled, the
form's own Executor (50-100 ms for tiny BERT). Python on two threads shares one GIL, and
lowering the interpreter's switch interval only makes the turns shorter, not the loop's share
larger: with 64 callers of tiny BERT on the plain graph, the first round after a start saw
the loop's lag p99 at 15-22 ms with the build running against 5-6 ms without it, whatever the
switch interval (5 ms, 0.5 ms or 20 us). The build is in no hurry; the callers are.

How: `GilCourtesy` installs a profile function on the thread that enters it (`sys.setprofile`
is per thread), which the interpreter calls on every Python call and return. Every
`CHECK_EVERY` calls it reads the clock; once the thread has run `slice_s` since its last
pause and `busy()` says the loop serves, it sleeps `pause_s`, which releases the GIL. So while
the loop serves, the thread holds the GIL for at most about a slice in every slice + pause,
and when the loop is quiet it runs at full speed. A long call into C that holds the GIL (an
ONNX Runtime session made, a compile) is one event and is not cut.

Who enters it: the fast-form build thread (busy while its Executor's executions start or
end), the delegates' builder threads (sessions made, first calls checked and timed against the
plain nodes: compiled/delegate_support.py; busy while any fast-path execution starts or ends,
`loop_serving`), and schedule builds for a new placement (runtime/schedule.py), which run only
because an execution waits for them (`background()`, always busy). Without it each of them,
on the loop's first bursts, took the GIL every time a kernel on the loop released it, and the
loop waited a switch interval (5 ms by default) to get it back: a 32-node unit of tiny BERT's
plain graph, inline, stalled 5-17 ms while a 1.5 ms schedule build ran beside it. A thread
that times work while it is courteous subtracts its pauses (`current().paused_s`), and one
about to make a long call into C that no pause can cut waits for a gap between bursts first
(`wait_quiet`).
"""

from __future__ import annotations

import builtins
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

CHECK_EVERY = 64  # profile events between clock reads (a read is ~0.1 us, an event ~0.2 us)
_CURRENT = threading.local()  # the courtesy the thread is in, if any
# Calls into C that hold the GIL for milliseconds on a large program and that no pause can cut:
# torch.fx compiles and runs each GraphModule's generated source (a segment of tiny BERT: 1-9
# ms under load), and a segment is pickled for its export process (4 ms). Before one, a
# courteous thread waits up to LONG_CALL_WAIT_S for a gap between bursts.
LONG_CALLS = frozenset({builtins.compile, builtins.exec, pickle.dumps})
LONG_CALL_WAIT_S = 0.1


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
        self._outer: GilCourtesy | None = None
        self.pauses = 0
        self.paused_s = 0.0

    def __enter__(self) -> GilCourtesy:
        self._since = time.perf_counter()
        self._previous = sys.getprofile()
        self._outer = getattr(_CURRENT, "courtesy", None)
        _CURRENT.courtesy = self
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)
        _CURRENT.courtesy = self._outer

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and arg in LONG_CALLS:
            self.wait_quiet(LONG_CALL_WAIT_S)
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

    def wait_quiet(self, max_s: float = 0.25, busy: Callable[[], bool] | None = None) -> None:
        """Before a long call into C that holds the GIL, which no pause can cut: wait, up to
        `max_s`, for a moment when `busy()` (or the one given) says the loop is not serving
        (a gap between bursts; under steady load none comes, and the call goes ahead after
        `max_s`)."""
        if self._busy is _always:  # background work: the loop is always serving
            return
        busy = busy or self._busy
        deadline = time.perf_counter() + max_s
        while busy() and time.perf_counter() < deadline:
            time.sleep(self.pause_s)
            self.pauses += 1
            self.paused_s += self.pause_s

    def statistics(self) -> CourtesyStatistics:
        return CourtesyStatistics(self.pauses, self.paused_s)


def _always() -> bool:
    return True


QUIET_S = 0.002  # no execution started or ended this long ago: the loop is not serving
_last_served = float("-inf")  # when a fast-path execution last started or ended


def note_serving(now: float | None = None) -> None:
    """The loop serves at `now` (perf_counter; now if None): an execution on a fast path
    starts or ends (runtime/forms.py's FastForms.run), or kernels ran inline on a loop
    (runtime/loop_state.py's `account`). What `loop_serving` reads, process-wide."""
    global _last_served
    _last_served = time.perf_counter() if now is None else now


def loop_serving() -> bool:
    """Whether a loop served within QUIET_S (`note_serving`): the busy signal of the
    delegates' builder threads, and with its own Executor's of the fast-form build."""
    return time.perf_counter() - _last_served < QUIET_S


def background() -> GilCourtesy:
    """A courtesy for background Python that serving itself asked for (module doc): it
    pauses whatever the loop does, since it runs only while the loop serves."""
    return GilCourtesy(_always)


def current() -> GilCourtesy | None:
    """The courtesy the calling thread is in, if any (its `paused_s` grows while it pauses)."""
    return getattr(_CURRENT, "courtesy", None)

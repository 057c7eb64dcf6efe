"""Starting the library's helper threads at the loop's priority, not a worker's.

Why: on Linux a thread starts with the nice value and scheduling policy of the thread that
starts it, and an unprivileged thread cannot lower its nice value again (RLIMIT_NICE is 0 by
default) nor leave SCHED_IDLE. Worker threads step back from the loop (`step_back`: SCHED_IDLE
by `ExecutorConfig.worker_idle`, else their nice value raised by `ExecutorConfig.worker_nice`,
runtime/workers.py), so every thread started from one would run stepped back for its whole
life: the scripted segments' tracer
(compiled/scripted.py), the ONNX segments' builder (compiled/onnx_delegate.py) and the ONNX
Runtime threads its sessions make, a pool started by an Executor run inside a kernel (its
workers would step back twice), the host waiter (cuda/host_wait.py).

How: while a stepped-back WorkerPool is started, the process keeps one "launcher" thread
(`asyncgraph-launcher`), made by the thread that started the first such pool (the event
loop's), so at its priority. `start_thread(thread)` on a thread stepped back further than the
launcher (a worker) hands `thread.start()` to the launcher and waits for it, re-raising what
the start raised; anywhere else it starts the thread itself. The launcher ends with the last
such pool (`release_launcher`), so an idle process holds no thread of it; where none runs (no
stepped-back pool, not Linux, a forked child) every start is direct. A start is rare and costs
a thread start anyway; telling a stepped-back caller is two system calls more.

What is not covered: a thread that user code starts inside a kernel on a worker (a
`threading.Thread`, a pool of its own) inherits the worker's priority, and so do the OpenMP
threads a worker's own intra-op parallelism makes (on purpose: they do the worker's work).
torch's inter-op pool (`torch.jit.fork`, `at::launch`) is made, all its threads at once, by
the first thread that launches work into it, and keeps that thread's priority for the
process's life; asyncgraph launches nothing into it. A kernel on a worker that does would make
the pool stepped back: launch something into it from the loop's thread first (a scripted
`torch.jit.fork` before the first execution). asyncgraph does not make it eagerly, since a
pool made makes a later `torch.set_num_interop_threads` raise.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

LAUNCHER_NAME = "asyncgraph-launcher"
# Linux's policy for threads that run only when no other thread wants the CPU (None elsewhere)
SCHED_IDLE: int | None = getattr(os, "SCHED_IDLE", None) if sys.platform == "linux" else None


def own_nice() -> int:
    """The calling thread's nice value (Linux: PRIO_PROCESS with a thread id names that
    thread alone)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def own_idle() -> bool:
    """Whether the calling thread runs under SCHED_IDLE (Linux: pid 0 names the calling
    thread)."""
    return SCHED_IDLE is not None and os.sched_getscheduler(0) == SCHED_IDLE


@dataclass(eq=False)
class _Start:
    """One thread to start, and what starting it raised, once `done` is set."""

    thread: threading.Thread
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Launcher:
    """The thread, at the loop's priority, that starts threads for stepped-back ones (see
    module doc)."""

    def __init__(self) -> None:
        self.nice = own_nice()
        self.idle = own_idle()
        self.holders = 0  # stepped-back pools started and not yet closed (guarded by _STATE)
        # reentrant, as _STATE: a pool's finalizer (release_launcher) may run from a garbage
        # collection that an allocation under the lock set off, on the same thread
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._starts: deque[_Start] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=LAUNCHER_NAME, daemon=True)
        self._thread.start()

    def start(self, thread: threading.Thread) -> bool:
        """Start `thread` on the launcher and wait for it; False when the launcher has
        stopped (the caller starts it itself)."""
        start = _Start(thread)
        with self._lock:
            if self._stopping:
                return False
            self._starts.append(start)  # before the stop token: it is served
            self._wakeup.notify()
        start.done.wait()
        if start.error is not None:
            raise start.error
        return True

    def stop(self) -> None:
        """End the thread once the starts asked so far are done, and wait for it (unless
        called on it, from a finalizer a collection ran there): a pool's `aclose` leaves no
        thread of asyncgraph's behind it."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._starts and not self._stopping:
                    self._wakeup.wait()
                if not self._starts:
                    return
                start = self._starts.popleft()
            try:
                start.thread.start()
            except BaseException as exc:  # given to the thread that asked
                start.error = exc
            finally:
                start.done.set()
            del start


_STATE = threading.RLock()  # guards _launcher and the holders' counts
_launcher: _Launcher | None = None


def hold_launcher() -> object:
    """Keep the launcher running (starting it from the calling thread when none runs) until
    `release_launcher` is given what this returned. WorkerPool calls it before starting
    stepped-back threads, on the thread that starts them."""
    global _launcher
    if sys.platform != "linux":
        return None
    with _STATE:
        launcher = _launcher
        if launcher is None:
            launcher = _launcher = _Launcher()
        launcher.holders += 1
        return launcher


def release_launcher(hold: object) -> None:
    """Let go of a `hold_launcher`; the launcher ends with its last holder. Safe to call from
    any thread, and in a forked child (the parent's launcher is not the child's)."""
    global _launcher
    if not isinstance(hold, _Launcher):
        return
    with _STATE:
        hold.holders -= 1
        if hold.holders or hold is not _launcher:
            return
        _launcher = None
    hold.stop()


def raise_nice(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux: setpriority on a thread id
    sets that thread's alone; elsewhere the id could name a process, so callers pass 0)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # at the ceiling, or not allowed: run as it is
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def step_back(nice: int, idle: bool = False) -> None:
    """Lower the calling thread's priority below the loop's: with `idle`, move it to
    SCHED_IDLE (Linux), under which any other thread that wakes takes its core at once;
    otherwise raise its nice value by `nice`. Where neither is allowed it runs as it is."""
    if idle and SCHED_IDLE is not None:
        with contextlib.suppress(OSError):  # a seccomp profile may refuse it: fall back
            os.sched_setscheduler(0, SCHED_IDLE, os.sched_param(0))
            return
    raise_nice(nice)


def start_thread(thread: threading.Thread) -> None:
    """`thread.start()`, from a thread that is not stepped back (see module doc); raises
    what `start` raises (RuntimeError when no thread can be had)."""
    launcher = _launcher
    if launcher is not None and (own_nice() > launcher.nice or (own_idle() and not launcher.idle)
                                 ) and launcher.start(thread):
        return
    thread.start()


def _after_fork_in_child() -> None:
    global _STATE, _launcher
    _STATE = threading.RLock()  # another thread may have held it at the fork
    _launcher = None  # its thread was not copied into the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

"""Fast forms: the faster way to run a program, built off the loop and chosen by measurement.

Why: the plain graph a user gets from `Executor(ep)` spends most of a small model's time in
per-node Python dispatch on the event loop's thread (tiny BERT at 64 callers: 0.37x ONNX
Runtime via `asyncio.to_thread`), while the same Executor with ONNX Runtime segments runs the
model from C++ with the GIL released (0.97x). A user should not have to know to ask for it.

What: a *form* is the same program built again with a segment backend registered as a fast
form (runtime/delegates.py: `SegmentBackend.fast_form`; "onnx" when onnxruntime imports), as
an Executor of its own. `FastForms` (one per Executor, when `ExecutorConfig.fast_paths`):

1. **builds it off the loop**: on the Executor's first execution, a thread builds each
   registered fast form in turn, at a nice value 10 above the loop's, so serving goes on
   meanwhile on the plain graph. What would still hold the loop is kept from it: a first
   export runs in a child process (`building_off_loop`, compiled/export_worker.py; exports
   are then cached on disk, compiled/export_cache.py, so a restart builds in a tenth of a
   second), the backend's modules are imported when the Executor is made, and the
   interpreter switches threads every 0.5 ms while a build runs (`_QuickSwitches`). A
   backend that plans no delegate node (no run long enough) or fails is passed over, with
   the reason; a build whose Executor closes is stopped (`build_cancelled`);
2. **chooses per input signature, by measurement**: once a form is built, a signature's next
   executions first warm it (`WARM` runs, and until its delegates' builders are idle: ONNX
   sessions, the first-call checks against the plain nodes), then alternate between the
   plain graph and the form, `SAMPLES` timed runs each; the faster median serves that
   signature from then on. Timed under the load of the moment, so the verdict is what this
   machine does now, batch size included (each batch size is a signature of its own);
3. **never serves other weights**: a form is built from the weights the Executor has when the
   build starts and serves only while the Executor's weights version is that one. A swap
   retires the form (closed with the Executor) and builds it again on the new weights.

`statistics()` says, per backend and signature, which form serves and why (the medians
measured, or what stopped the form). `ExecutorConfig(fast_paths=False)` (or the environment's
`ASYNCGRAPH_FAST_PATHS=0`) keeps only the plain graph.

Not yet: thread counts chosen by measurement (a form's sessions run one intra-op thread, as
`segments=("onnx",)` does by default), AOTInductor packages as a form (a compile takes
18-33 s per program on 2 cores), and measuring a decided signature again later.
"""

from __future__ import annotations

import logging
import statistics as stats
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from asyncgraph.runtime.threads import raise_nice, start_thread
from asyncgraph.runtime.validation import Signature, signature_of

LOG = logging.getLogger("asyncgraph.forms")

WARM = 8  # untimed runs of a signature on a new form: sessions made, first calls checked
SAMPLES = 16  # timed runs of each form per signature before the choice
NICE = 10  # the build thread's nice value above the loop's: serving comes first
PLAIN = "plain"
MIN_FORM_NODES = 8  # a graph shorter than a segment (compiled/onnx_segments.py) has no form


class Form(Protocol):
    """What FastForms asks of a built form (an Executor)."""

    async def _execute(self, flat: list[Any], caller_inputs: list[Any] | None,
                       caller: Any, signature: Signature | None) -> list[Any]: ...

    def _bind_loop(self) -> None: ...

    async def aclose(self, *, cancel: bool = False) -> None: ...

    @property
    def delegates_idle(self) -> bool: ...

    @property
    def has_delegates(self) -> bool: ...


Run = Callable[[list[Any], "list[Any] | None", Any, "Signature | None"], Awaitable[list[Any]]]
# builds the form of one backend (on the Executor's current weights)
Build = Callable[[str], Form]


@dataclass
class _Choice:
    """One signature's verdict: the form serving it, and the runs that decided."""

    form: str | None = None  # None: still warming or measuring
    warm: int = 0
    plain_s: list[float] | None = None
    fast_s: list[float] | None = None
    turn: int = 0
    why: str = ""


_BUILDING = threading.local()


def building_off_loop() -> bool:
    """Whether the calling thread builds a fast form while the loop serves: work that holds
    the GIL long (a first export) goes to a child process instead (compiled/export_worker.py)."""
    return getattr(_BUILDING, "owner", None) is not None


def build_cancelled() -> bool:
    """Whether the fast-form build on the calling thread is no longer wanted (its Executor
    is closing): a child process working for it is stopped."""
    owner = getattr(_BUILDING, "owner", None)
    return owner is not None and owner._closed


class _QuickSwitches:
    """The interpreter's switch interval, lowered while any build thread runs.

    A build is Python-heavy (the graph passes, planning, the form's own construction: ~0.1 s
    for tiny BERT), and with the default interval (5 ms) the loop's thread waits up to that
    for the GIL each time it wants it back from the build thread: the first burst of
    requests saw 5-7 ms waits. At 0.5 ms, a build costs the loop at most that per switch, for
    the build's duration only; the interval the process had is put back after the last build
    (unless something else changed it meanwhile)."""

    INTERVAL_S = 0.0005

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._builds = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._builds == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.INTERVAL_S))
            self._builds += 1

    def exit(self) -> None:
        with self._lock:
            self._builds -= 1
            if self._builds == 0 and sys.getswitchinterval() == min(self._saved,
                                                                      self.INTERVAL_S):
                sys.setswitchinterval(self._saved)


_QUICK_SWITCHES = _QuickSwitches()


class FastForms:
    """One Executor's fast forms: the build thread, the verdicts, and the routing."""

    def __init__(self, backends: Sequence[str], build: Build, plain: Run,
                 version: Callable[[], int],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.backends = tuple(backends)
        self._clock = clock
        self._build = build
        self._plain = plain
        self._version = version  # the Executor's current weights version
        self._form: Form | None = None
        self._form_backend = ""
        self._form_version = -1
        self._bound = False  # the form bound to the Executor's loop
        self._building: threading.Thread | None = None
        self._built_for = -1  # the weights version the last build started on
        self._retired: list[Form] = []
        self._choices: dict[Signature, _Choice] = {}
        self._passed: dict[str, str] = {}  # backend -> why it serves nothing
        self.builds = 0
        self.build_s = 0.0
        self.fast_runs = 0
        self._closed = False

    # -- routing (on the loop) ----------------------------------------------------------------

    async def run(self, flat: list[Any], caller_inputs: list[Any] | None = None,
                  caller: Any = None, signature: Signature | None = None) -> list[Any]:
        """One execution on the form that serves its signature (the plain graph until a
        form is built and measured faster)."""
        form = self._current()
        key = signature if signature is not None else signature_of(flat)
        if form is None or key is None:
            return await self._plain(flat, caller_inputs, caller, signature)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice()
        if choice.form == PLAIN:
            return await self._plain(flat, caller_inputs, caller, signature)
        if choice.form is not None:
            self.fast_runs += 1
            return await form._execute(flat, caller_inputs, caller, signature)
        if choice.warm < WARM or not form.delegates_idle:
            choice.warm += 1
            self.fast_runs += 1
            return await form._execute(flat, caller_inputs, caller, signature)
        choice.turn += 1
        fast = choice.turn % 2 == 1
        start = self._clock()
        if fast:
            self.fast_runs += 1
            outputs = await form._execute(flat, caller_inputs, caller, signature)
        else:
            outputs = await self._plain(flat, caller_inputs, caller, signature)
        self._timed(choice, fast, self._clock() - start)
        return outputs

    def _current(self) -> Form | None:
        """The built form for the current weights, starting a build when none is (or was)."""
        version = self._version()
        form = self._form
        if form is not None and self._form_version == version:
            if not self._bound:
                form._bind_loop()  # on the Executor's loop, as the Executor is
                self._bound = True
            return form
        if self._form is not None:  # built on other weights: never served again
            self._retired.append(self._form)
            self._form, self._bound = None, False
            self._choices.clear()
        if self._building is None and self._built_for != version and not self._closed:
            self._start(version)
        return None

    def _timed(self, choice: _Choice, fast: bool, seconds: float) -> None:
        samples = choice.fast_s if fast else choice.plain_s
        if samples is None:
            samples = []
            if fast:
                choice.fast_s = samples
            else:
                choice.plain_s = samples
        samples.append(seconds)
        if choice.form is not None or choice.plain_s is None or choice.fast_s is None:
            return
        if min(len(choice.plain_s), len(choice.fast_s)) < SAMPLES:
            return
        plain_us = stats.median(choice.plain_s) * 1e6
        fast_us = stats.median(choice.fast_s) * 1e6
        choice.form = self._form_backend if fast_us < plain_us else PLAIN
        choice.why = (f"measured: {self._form_backend} {fast_us:.0f} us, plain {plain_us:.0f} us "
                      f"(medians of {SAMPLES} alternating runs)")

    # -- the build thread ---------------------------------------------------------------------

    def _start(self, version: int) -> None:
        self._built_for = version
        thread = threading.Thread(target=self._build_forms, args=(version,),
                                  name="asyncgraph-fast-form", daemon=True)
        self._building = thread
        start_thread(thread)

    def _build_forms(self, version: int) -> None:
        """The build thread: the first registered backend whose form plans delegates."""
        raise_nice(NICE if sys.platform == "linux" else 0)
        started = time.perf_counter()
        _QUICK_SWITCHES.enter()
        _BUILDING.owner = self
        try:
            for backend in self.backends:
                if self._closed:
                    return
                try:
                    built = self._build(backend)
                except Exception as exc:  # a form that cannot be built: the plain graph serves
                    self._passed[backend] = f"not built: {type(exc).__name__}: {exc}"
                    LOG.warning("fast form %r %s", backend, self._passed[backend])
                    continue
                if not built.has_delegates:
                    self._retired.append(built)  # closed with the Executor
                    self._passed[backend] = "no run of the graph became a segment"
                    continue
                self._form_backend, self._form_version = backend, version
                self._form = built  # one assignment: the loop sees the form whole
                return
        finally:
            _BUILDING.owner = None
            _QUICK_SWITCHES.exit()
            self.builds += 1
            self.build_s += time.perf_counter() - started
            self._building = None

    # -- the Executor's side ------------------------------------------------------------------

    async def aclose(self, *, cancel: bool = False) -> None:
        """Wait for a build in progress (off the loop), then close every form built."""
        self._closed = True
        thread = self._building
        if thread is not None:
            import anyio.to_thread

            await anyio.to_thread.run_sync(thread.join)
        forms = [*self._retired, *([self._form] if self._form is not None else [])]
        self._retired, self._form = [], None
        for form in forms:
            await form.aclose(cancel=cancel)

    def statistics(self) -> dict[str, Any]:
        """Which form serves each signature and why; what each backend did."""
        signatures = {str(key): {"form": c.form or "measuring",
                                 "why": c.why or f"warming and measuring ({c.warm} warm runs)"}
                      for key, c in self._choices.items()}
        state = ("building" if self._building is not None
                 else "ready" if self._form is not None else "none")
        return {"state": state, "form": self._form_backend if self._form else None,
                "passed": dict(self._passed), "builds": self.builds,
                "build_s": round(self.build_s, 3), "fast_runs": self.fast_runs,
                "signatures": signatures}

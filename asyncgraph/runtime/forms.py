"""Fast forms: the faster way to run a program, built off the loop and chosen by measurement.

Why: the plain graph a user gets from `Executor(ep)` spends most of a small model's time in
per-node Python dispatch on the event loop's thread (tiny BERT at 64 callers: 0.37x ONNX
Runtime via `asyncio.to_thread`), while the same Executor with ONNX Runtime segments runs the
model from C++ with the GIL released (0.97x). A user should not have to know to ask for it.

What: a *form* is the same program built again with a segment backend registered as a fast
form (runtime/delegates.py: `SegmentBackend.fast_form`; "onnx" when onnxruntime imports), as
an Executor of its own. `FastForms` (one per Executor, when `ExecutorConfig.fast_paths`):

1. **builds it off the loop**: on the Executor's first execution (at construction when a
   verdict kept on disk chose a form), a thread builds each registered fast form in turn, at
   a nice value 10 above the loop's, so serving goes on meanwhile on the plain graph. A
   build nothing waits for starts in a gap between bursts (no execution in flight, none
   started or ended for QUIET_S), or after QUIET_START_S: the burst that started it runs on
   the plain graph undisturbed. What would still hold the loop is kept from it: a first
   export runs in a child process (`building_off_loop`, compiled/export_worker.py; exports
   are then cached on disk, compiled/export_cache.py, so a restart builds in a tenth of a
   second), the backend's modules are imported and its runtime started when the Executor is
   made, the form starts from the Executor's graph passes rather than running them again,
   the build's Python pauses while executions are in flight (runtime/courtesy.py), and the
   interpreter switches threads every 0.5 ms while a build runs (`_QuickSwitches`). A
   backend that plans no delegate node (no run long enough) or fails is passed over, with
   the reason; a build whose Executor closes is stopped (`build_cancelled`). A backend's
   form is built once per intra-op thread count in `THREAD_COUNTS` that the process has the
   CPUs for ("onnx", "onnx, 2 threads"): which count is faster alone depends on the model
   and the machine, so it is a form of its own, chosen by measurement (under load only
   one-thread forms are candidates: the executions in flight already fill the cores). A
   built form starts its sessions at once. Then each *additional* backend (one whose form
   is a program of its own, `SegmentBackend.form_program`: the AOTInductor package of
   compiled/aoti_form.py, whose first compile takes 16-60 s in a child process) builds its
   form, published as one more candidate when ready: the forms built first serve meanwhile;
2. **chooses per input signature and load, by measurement**. Which form is faster depends on
   the load: alone, an execution's latency is what counts (a thread hop costs a tiny model
   more than the form saves); under many callers, throughput is (the plain graph holds the
   GIL on the loop's thread; a form running in C++ releases it and uses every core). So an
   execution is *loaded* when another is in flight, or another task's execution ended
   within `BURST_GAP_S` (a burst of callers whose executions run inline one after another),
   else *alone* (an alone run that another execution started beside, the first of a burst,
   is no sample of either); a batch of more than one row (an Executor with batching) is
   loaded: its rows are requests in flight together, and throughput is what serves them. Each
   (signature, regime) gets its own verdict. A signature's first
   executions on a new form warm it (`WARM` runs, and until its delegates' builders are
   idle: ONNX sessions, the first-call checks against the plain nodes). Then, alone, the
   forms and the plain graph take turns (`RUN_OF` runs in a row each, the first of them
   untimed: a form's first run after another's finds the caches holding the other's
   weights), `SAMPLES` timed runs each, and the lowest median
   wins. Loaded, latency would mislead (an inline plain run never waits in a queue, a form's
   run waits behind the others'), so the candidates take turns in windows: a window opens
   once nothing of another form runs (a burst's first execution, alone, not counted), times
   `WINDOW` executions and closes when they have ended (later executions meanwhile run on
   the same form, untimed), and its cost per execution is `max(loop thread CPU, process CPU
   / usable CPUs)`: the loop's thread is one serial resource, the cores are the other, and
   the busier of the two bounds throughput. After `WINDOWS` windows each, the lowest median
   wins (in either regime a form must beat the plain graph by `MARGIN`). Batches (an
   Executor with batching) share a verdict per batch size rounded up to a power of two, as
   adaptive placement does. A verdict reached before a form arrives is measured again with it
   (`_catch_up`); once every backend had its turn, the verdicts are kept on disk
   (runtime/form_verdicts.py), so a restart adopts them at once. A verdict, measured or kept,
   is measured again once it has served `RECHECK_RUNS` executions and `RECHECK_S` have
   passed (twice as long after each recheck, up to `RECHECK_MAX_S`), and the disk then
   keeps the new one: a verdict reached on a busy moment, or on a neighbour's, is not
   served for the life of the cache;
3. **never serves other weights**: a form is built from the weights the Executor has when the
   build starts and serves only while the Executor's weights version is that one. A swap
   retires the form (closed with the Executor) and builds it again on the new weights.

A restart with a kept verdict that chose a form starts the build at construction, of the
backends the kept verdicts chose only (an AOTInductor form that lost is not loaded), and the
executions of that signature wait (off the loop) until the form chosen is built rather than
run the plain graph: the form serves from the first request. A signature new to the restarted
process is measured among those forms and the plain graph.

`statistics()` says, per backend, signature and regime, which form serves and why (the
medians measured, kept from an earlier run, or what stopped the form).
`ExecutorConfig(fast_paths=False)` (or the environment's `ASYNCGRAPH_FAST_PATHS=0`) keeps only
the plain graph.

Within a form, each segment (ONNX or scripted) chooses per input signature between its session
or trace and its plain nodes, timed once they are made (compiled/delegate_support.py,
`SLOWER_BY`): a short segment whose call into ONNX Runtime or TorchScript costs more than its
nodes stays plain. `statistics()["segments"]` says,
per form, segment and signature, which serves and why.

Not yet: a
form no verdict chose keeps its sessions until a swap or close. On trio an execution's caller
is not known, so a burst of inline executions counts as alone unless they overlap.
"""

from __future__ import annotations

import logging
import statistics as stats
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from asyncgraph.runtime.backend import current_loop
from asyncgraph.runtime.courtesy import GilCourtesy
from asyncgraph.runtime.form_verdicts import FormVerdicts, usable_cpus
from asyncgraph.runtime.placement import batch_bucket_key
from asyncgraph.runtime.threads import start_thread, step_back
from asyncgraph.runtime.validation import Signature, signature_of
from asyncgraph.runtime.weights import ran_on

LOG = logging.getLogger("asyncgraph.forms")

WARM = 8  # untimed runs of a signature on a new form: sessions made, first calls checked
SAMPLES = 16  # timed runs of each form per signature alone, before the choice
# Alone, each candidate runs this many executions in a row and the first is not timed: it
# finds the caches holding the previous candidate's weights. Timed one execution each in turn,
# tiny BERT's AOTInductor form read 411 us against its ONNX form's 452 and was chosen, then
# served 418 us where the ONNX form served 319 (benchmarks/results/cpu/
# design_measurements.md#warm-turns).
RUN_OF = 4
# Loaded executions per window of one form, and windows of each form before the choice: shorter
# and fewer windows chose a form that costs more CPU per execution than another
# (benchmarks/results/cpu/design_measurements.md#loaded-windows).
WINDOW = 32
WINDOWS = 6
BURST_GAP_S = 0.0002  # another task's execution that ended this recently: a burst
# runs timed alone that overlapped others, after which the loaded verdict serves alone too
OVERLAPS = 2 * SAMPLES
# A form replaces the plain graph only when its median is this much lower: closer is within
# the spread of windows on a shared machine (the MLP under 64 callers: the form 56 us of CPU
# against the plain graph's 57, while the plain graph's throughput read 9% higher), and the
# plain graph holds no second copy of the weights.
MARGIN = 0.05
# A verdict is measured again (`_recheck`) once it has served this many executions and this
# long has passed since it was reached; each recheck waits twice as long as the one before, up
# to RECHECK_MAX_S. A recheck under load times WINDOWS x WINDOW executions per candidate (about
# 600 with two forms), alone SAMPLES runs each: at most a few percent of RECHECK_RUNS, served
# on the slower candidates.
RECHECK_RUNS = 20_000
RECHECK_S = 60.0
RECHECK_MAX_S = 3600.0
NICE = 10  # the build thread's nice value above the loop's: serving comes first
QUIET_S = 0.002  # no execution started or ended this long ago: the loop is not serving
STUCK_S = 0.05  # executions in flight, none started or ended this long: the loop waits on us
QUIET_START_S = 1.0  # at most this long a first build (nothing waits for it) waits for a gap
PLAIN = "plain"
ALONE, LOADED = "alone", "loaded"
THREAD_COUNTS = (1, 2)  # intra-op threads a form's sessions are built with, each a form
MIN_FORM_NODES = 8  # a graph shorter than a segment (compiled/onnx_segments.py) has no form


class Form(Protocol):
    """What FastForms asks of a built form (an Executor)."""

    async def _execute(self, flat: list[Any], caller_inputs: list[Any] | None,
                       caller: Any, signature: Signature | None, *,
                       direct: bool = True) -> list[Any]: ...

    def _run_direct(self, flat: list[Any], signature: Signature | None, caller: Any = None,
                    ) -> list[Any] | Awaitable[list[Any]] | None: ...

    def _bind_loop(self) -> None: ...

    async def aclose(self, *, cancel: bool = False) -> None: ...

    def prepare_sessions(self) -> None: ...

    @property
    def delegates_idle(self) -> bool: ...

    @property
    def has_delegates(self) -> bool: ...

    def delegate_statistics(self) -> dict[str, dict[str, Any]]: ...


Run = Callable[[list[Any], "list[Any] | None", Any, "Signature | None"], Awaitable[list[Any]]]
# builds the form of one backend at an intra-op thread count (on the current weights)
Build = Callable[[str, int], Form]
# (the loop thread's CPU seconds, the process's CPU seconds), read on the loop's thread
CpuClock = Callable[[], tuple[float, float]]
# told when a measured execution ends: the form it ran on, and its seconds (None: another
# execution started while it ran, so it did not run alone)
Timed = Callable[[str, float | None], None]


def _cpu_now() -> tuple[float, float]:
    return time.thread_time(), time.process_time()


@dataclass
class _Verdict:
    """One (signature, regime)'s verdict: the form serving it, and the samples that decided,
    per form (alone: seconds per run; loaded: seconds of the busier resource per execution)."""

    form: str | None = None  # None: still measuring
    samples: dict[str, list[float]] = field(default_factory=dict)
    turn: int = 0  # alone: runs so far, the forms in turn
    why: str = ""
    # loaded: the window's turn (which form), the CPU clocks at its opening (None: not open),
    # its executions started and ended
    window_turn: int = 0
    window_at: tuple[float, float] | None = None
    window_starts: int = 0
    window_ends: int = 0
    # kept from an earlier run, or reached once every backend had its turn (then kept on
    # disk); a verdict that is not is measured again when more forms arrive (`_catch_up`)
    final: bool = False
    published: int = 0  # FastForms._published when it was reached: the forms it measured
    overlapped: int = 0  # alone: timed runs another execution started during (not counted)
    borrowed: bool = False  # alone: the loaded verdict's form, not measured alone, not kept
    # a final verdict's executions served, and the clock reading from which it may be
    # measured again (`_recheck`); its rechecks so far, and the form the last one replaced
    served: int = 0
    due: float = float("inf")
    rechecks: int = 0
    previous: str | None = None


@dataclass
class _Choice:
    """One signature's verdicts, one per regime, and its warm runs on the form."""

    alone: _Verdict
    loaded: _Verdict
    warm: int = 0
    runs: int = 0  # executions of the signature (statistics: which ones the load makes)


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
                 clock: Callable[[], float] = time.perf_counter,
                 verdicts: FormVerdicts | None = None,
                 cpu: CpuClock = _cpu_now, cpus: int | None = None,
                 batched: bool = False, quiet_start_s: float = QUIET_START_S,
                 additional: Sequence[str] = (),
                 thread_counts: Mapping[str, Sequence[int]] | None = None) -> None:
        self.backends = tuple(backends)
        # the backends built after the first of the others that builds, each one more
        # candidate (the AOTInductor form: SegmentBackend.form_program), and their counts
        self._additional = tuple(b for b in self.backends if b in additional)
        self._thread_counts = dict(thread_counts or {})
        # batches: a verdict per batch size rounded up to a power of two, not per size (the
        # sizes vary with load, and each would need its own hundreds of measured runs)
        self._batched = batched
        self._quiet_start_s = quiet_start_s  # QUIET_START_S (tests with a frozen clock: 0)
        self._clock = clock
        self._cpu = cpu
        self._cpus = cpus or usable_cpus()
        self._threads = tuple(t for t in THREAD_COUNTS if t <= self._cpus)
        # bumped by the build thread as it publishes forms, and once every backend had its
        # turn; the loop measures again the verdicts reached before (`_current`)
        self._generation = 0
        self._seen_generation = 0
        self._published = 0  # bumped as forms are published: the verdicts' candidates
        self._complete = False  # every backend built or passed: verdicts are kept on disk
        self._build = build
        self._plain = plain
        self._version = version  # the Executor's current weights version
        self._forms: dict[str, Form] = {}  # name -> form, built on `_form_version`'s weights
        self._form_threads: dict[str, int] = {}  # name -> its sessions' intra-op threads
        self._form_backend = ""
        self._form_version = -1
        self._bound = False  # the forms bound to the Executor's loop
        self._building: threading.Thread | None = None
        self._built_for = -1  # the weights version the last build started on
        self._retired: list[Form] = []
        self._choices: dict[Hashable, _Choice] = {}
        # the last execution's key and choice: a repeat caller's signature is the same object
        # (InputValidator.check), found without hashing it
        self._hot: tuple[Hashable, _Choice | None] = (None, None)
        self._passed: dict[str, str] = {}  # backend -> why it serves nothing
        self._verdicts = verdicts
        self._kept = verdicts.load() if verdicts is not None else {}
        self._build_lock = threading.Lock()  # the build's end against a waiter's arrival
        # (loop, future) woken when forms are published and when the build ends
        self._build_waiters: list[tuple[Any, Any]] = []
        self._in_flight = 0
        self._begun = 0  # executions started so far: an alone run that saw it move overlapped
        self._awaiting_build = 0  # of those, executions waiting for the build (`_built`)
        # loaded executions in flight, per form (a burst's first execution counts as
        # alone and is left out: under bursts it would hold every window of another form)
        self._running: dict[str, int] = {PLAIN: 0}
        self._last_caller = 0  # the id of the task whose execution ended last (not the
        # task itself: a finished task holds its loop)
        self._last_end = float("-inf")
        self._last_start = float("-inf")
        self.builds = 0
        self.build_s = 0.0
        self.fast_runs = 0
        self.build_waits = 0  # executions that waited for a build a kept verdict promised
        self._closed = False
        self._courtesy = GilCourtesy(self._serving)  # the build thread's, for the loop's sake
        if any(self._known(form) and form != PLAIN for form, _ in self._kept.values()):
            self._start(version(), promised=True)  # a restart: the form chosen before, now

    # -- routing (on the loop) ----------------------------------------------------------------

    async def run(self, flat: list[Any], caller_inputs: list[Any] | None = None,
                  caller: Any = None, signature: Signature | None = None) -> list[Any]:
        """One execution on the form that serves its signature and load (the plain graph
        until a form is built and measured faster)."""
        key: Hashable | None = (batch_bucket_key(flat) if self._batched
                                else signature if signature is not None else signature_of(flat))
        regime = LOADED if self._batched and _rows(flat) > 1 else self._regime(caller)
        self._in_flight += 1
        self._begun += 1
        begun = self._begun
        self._last_start = self._clock()  # before a build starts: it sees the loop serving
        counted: str | None = None  # the route counted in `_running`
        timed: Timed | None = None
        route, start = PLAIN, 0.0
        try:
            forms = self._current()
            if key is None:
                return await self._plain(flat, caller_inputs, caller, signature)
            hot_key, choice = self._hot
            if key is not hot_key or choice is None:
                choice = self._choices.get(key) or self._new_choice(key)
                self._hot = (key, choice)
            choice.runs += 1
            if self._building is not None:  # kept verdicts chose forms not built yet: wait
                wanted = _promised(choice)
                if wanted and not wanted <= (forms or {}).keys():
                    forms = await self._built(wanted)
            route, timed = self._route(forms, choice, regime, key)
            form = forms.get(route) if forms is not None else None
            if regime is LOADED:  # in `_running`, which the windows read
                counted = route
                self._running[route] = self._running.get(route, 0) + 1
            if timed is not None:
                start = self._clock()
            if form is not None:
                self.fast_runs += 1
                version = self._form_version  # the Executor's version, not the form's own
                outputs = form._run_direct(flat, signature, caller)  # the form's one call
                if outputs is None:
                    outputs = await form._execute(flat, caller_inputs, caller, signature,
                                                  direct=False)  # declined just now
                elif not isinstance(outputs, list):  # the call on a worker thread
                    outputs = await outputs
                ran_on(version)
                return outputs
            return await self._plain(flat, caller_inputs, caller, signature)
        finally:
            self._in_flight -= 1
            if counted is not None:
                self._running[counted] -= 1
            end = self._clock()
            self._last_caller, self._last_end = id(caller), end
            if timed is not None:  # an alone run that others started beside is no sample
                timed(route, end - start if regime is LOADED or self._begun == begun else None)

    def _route(self, forms: dict[str, Form] | None, choice: _Choice, regime: str,
               key: Hashable) -> tuple[str, Timed | None]:
        """The form this execution runs on (a name, or PLAIN), and what to tell when it ends
        (its measurement, while its verdict is being reached)."""
        verdict = choice.loaded if regime is LOADED else choice.alone
        if verdict.final:
            verdict.served += 1
            if (verdict.served >= RECHECK_RUNS and forms and self._building is None
                    and self._clock() >= verdict.due):
                verdict = self._recheck(choice, regime)
        if forms is None or verdict.form == PLAIN:
            return PLAIN, None
        if verdict.form is not None:
            return (verdict.form if verdict.form in forms else PLAIN), None
        names = list(forms)
        if choice.warm < WARM * len(names) or not all(f.delegates_idle for f in forms.values()):
            choice.warm += 1  # sessions made, first calls checked, before any timing
            return names[choice.warm % len(names)], None
        if regime is ALONE:  # in turn, RUN_OF in a row each, the first of a run untimed
            candidates = [*names, PLAIN]
            verdict.turn += 1
            route = candidates[verdict.turn // RUN_OF % len(candidates)]
            if verdict.turn % RUN_OF == 0:
                return route, None
            return route, (
                lambda route, seconds: self._alone(verdict, choice.loaded, key, candidates,
                                                   route, seconds))
        # under load each execution gets one core: the executions in flight already fill
        # them, and a session's second thread only takes a core from another's
        candidates = [*(n for n in names if self._form_threads[n] == 1), PLAIN]
        return self._windowed(verdict, key, candidates)

    def _recheck(self, choice: _Choice, regime: str) -> _Verdict:
        """A final verdict due to be measured again: a fresh one in its place, measured as a
        first one is (the forms warmed first: a kept verdict's forms may not have served this
        signature in this process), then kept on disk in place of the old."""
        old: _Verdict = getattr(choice, regime)
        fresh = _Verdict(rechecks=old.rechecks + 1, previous=old.form)
        setattr(choice, regime, fresh)
        return fresh

    def _regime(self, caller: Any) -> str:
        """LOADED while another execution is in flight or another task's just ended."""
        if self._in_flight or (id(caller) != self._last_caller
                               and self._clock() - self._last_end < BURST_GAP_S):
            return LOADED
        return ALONE

    def _known(self, form: str) -> bool:
        """Whether `form` names the plain graph or a form this Executor may build."""
        return form == PLAIN or self._backend(form) in self.backends

    @staticmethod
    def _backend(form: str) -> str:
        """The backend of a form's name ("onnx, 2 threads": "onnx")."""
        return form.split(",")[0]

    def _new_choice(self, key: Hashable) -> _Choice:
        """A signature seen for the first time: its verdicts kept on disk, if any."""
        choice = self._choices[key] = _Choice(_Verdict(), _Verdict())
        for regime in (ALONE, LOADED):
            kept = self._kept.get(f"{regime} {key}")
            if kept is not None and self._known(kept[0]):
                verdict = getattr(choice, regime)
                verdict.form, verdict.why = kept[0], f"kept from an earlier run here: {kept[1]}"
                verdict.final, verdict.due = True, self._clock() + RECHECK_S
        return choice

    def _current(self) -> dict[str, Form] | None:
        """The forms built for the current weights, starting a build when none are (or were)."""
        version = self._version()
        if self._generation != self._seen_generation:
            self._catch_up()
        forms = self._forms
        if forms and self._form_version == version:
            if not self._bound:
                for form in forms.values():
                    form._bind_loop()  # on the Executor's loop, as the Executor is
                self._bound = True
            return forms
        if forms:  # built on other weights: never served again
            self._retired.extend(forms.values())
            self._forms, self._bound = {}, False
            self._choices.clear()
            self._hot = (None, None)
        if self._building is None and self._built_for != version and not self._closed:
            self._start(version)
        return None

    def _catch_up(self) -> None:
        """Forms were published, or the build had every backend's turn, since the loop last
        looked (loop thread): the new forms are bound when next served; the verdicts reached
        without one of them are measured again, and, the build over, those reached with
        every form are kept."""
        self._seen_generation = self._generation
        self._bound = False
        for key, choice in self._choices.items():
            for regime in (ALONE, LOADED):
                verdict = getattr(choice, regime)
                if verdict.final:
                    continue
                if verdict.published != self._published or verdict.form is None:
                    setattr(choice, regime, _Verdict())
                    choice.warm = 0  # the new forms' first runs are not timed either
                elif self._complete:
                    self._keep(verdict, regime, key)

    async def _built(self, wanted: set[str]) -> dict[str, Form] | None:
        """Wait, off the loop, until the build underway has published the forms `wanted`
        (kept verdicts chose them) or ended; the forms then (None: none)."""
        loop = current_loop()
        self.build_waits += 1
        self._awaiting_build += 1
        try:
            while True:
                future = loop.create_future()
                with self._build_lock:
                    if self._building is None or wanted <= self._forms.keys():
                        return self._current()
                    self._build_waiters.append((loop, future))
                await future
        finally:
            self._awaiting_build -= 1

    def _alone(self, verdict: _Verdict, loaded: _Verdict, key: Hashable,
               candidates: list[str], route: str, seconds: float | None) -> None:
        """Alone: the forms and the plain graph in turn, each run's latency kept, unless
        another execution started while it ran (`seconds` None).

        Such a run was the first of a burst, counted alone when it started, and its latency
        says nothing of a lone caller's: a form's run on a worker shares the cores with the
        burst, while the plain graph's inline run finishes before the burst starts. Kept,
        those samples chose the plain graph for the encoder, 1.7x slower than its ONNX form
        for a lone caller, and a kept verdict outlives the process
        (benchmarks/results/cpu/design_measurements.md#alone-runs-that-start-bursts). Where
        runs timed alone keep overlapping (`OVERLAPS`: every lone-looking
        execution starts a burst), the loaded verdict, once reached, serves them: they run
        among the burst's executions."""
        if seconds is None:
            verdict.overlapped += 1
            if verdict.form is None and loaded.form is not None and (
                    verdict.overlapped >= OVERLAPS):
                verdict.form, verdict.published = loaded.form, self._published
                verdict.borrowed = True
                verdict.why = (f"served as under load: {verdict.overlapped} runs timed alone "
                               "had other executions start beside them (the first of bursts)")
            return
        verdict.samples.setdefault(route, []).append(seconds)
        if verdict.form is None and all(len(verdict.samples.get(c, ())) >= SAMPLES
                                        for c in candidates):
            self._decide(verdict, ALONE, key, candidates, "us",
                         f"medians of {SAMPLES} runs each, in turn, alone")

    def _windowed(self, verdict: _Verdict, key: Hashable,
                  candidates: list[str]) -> tuple[str, Timed | None]:
        """Loaded: which form this execution runs on, and whether it is one of a window's.

        A window opens once nothing of the other forms runs (its CPU is this form's alone),
        routes WINDOW executions, and closes when they have all ended; meanwhile later
        executions run on the same form untimed. Then the next form takes the new
        executions, and its window opens once this one's have drained."""
        route = candidates[verdict.window_turn % len(candidates)]
        if verdict.window_at is None and not any(
                self._running.get(c, 0) for c in candidates if c != route):
            verdict.window_at, verdict.window_starts, verdict.window_ends = self._cpu(), 0, 0
        if verdict.window_at is None or verdict.window_starts == WINDOW:
            return route, None
        verdict.window_starts += 1
        return route, lambda route, seconds: self._window_end(verdict, key, candidates, route)

    def _window_end(self, verdict: _Verdict, key: Hashable, candidates: list[str],
                    route: str) -> None:
        verdict.window_ends += 1
        if verdict.window_ends < WINDOW or verdict.window_at is None:
            return
        loop_s, process_s = (now - then for now, then in zip(self._cpu(), verdict.window_at,
                                                             strict=True))
        cost = max(loop_s, process_s / self._cpus) / WINDOW
        verdict.samples.setdefault(route, []).append(cost)
        verdict.window_turn, verdict.window_at = verdict.window_turn + 1, None
        if verdict.form is None and all(len(verdict.samples.get(c, ())) >= WINDOWS
                                        for c in candidates):
            self._decide(verdict, LOADED, key, candidates, "us CPU",
                         f"medians of {WINDOWS} windows of {WINDOW} executions each under "
                         f"load, the busier of the loop's thread and {self._cpus} CPUs")

    def _decide(self, verdict: _Verdict, regime: str, key: Hashable, candidates: list[str],
                unit: str, how: str) -> None:
        medians = {name: stats.median(verdict.samples[name]) * 1e6 for name in candidates}
        best = min(medians, key=medians.__getitem__)
        said = ""
        # the planned forms before an additional one, and the plain graph before any form,
        # unless MARGIN faster: closer is within the spread (tiny BERT alone: the AOTInductor
        # form 292 us in turn with the others, against the ONNX form's 295; on its own, 253
        # against 200)
        planned = [n for n in medians if n != PLAIN and self._backend(n) not in self._additional]
        if self._backend(best) in self._additional and planned:
            first = min(planned, key=medians.__getitem__)
            if medians[best] > medians[first] * (1 - MARGIN):
                said = f"; {best} within {MARGIN:.0%} of {first}: {first}"
                best = first
        plain = medians.get(PLAIN)
        if plain is not None and best != PLAIN and medians[best] > plain * (1 - MARGIN):
            said = f"; {best} within {MARGIN:.0%} of the plain graph: the plain graph"
            best = PLAIN
        if verdict.rechecks:
            said += f"; measured again ({verdict.rechecks}), {verdict.previous} before"
            if best != verdict.previous:
                LOG.info("fast form for %s %s: %s measured again: %s", regime, key,
                         verdict.previous, best)
        verdict.form = best
        verdict.why = "measured: " + ", ".join(
            f"{name} {us:.0f} {unit}" for name, us in medians.items()) + f" ({how})" + said
        verdict.published = self._published
        verdict.due = self._clock() + min(RECHECK_S * 2 ** verdict.rechecks, RECHECK_MAX_S)
        if self._complete:
            self._keep(verdict, regime, key)

    def _keep(self, verdict: _Verdict, regime: str, key: Hashable) -> None:
        """A verdict reached with every form this process builds: final, and kept on disk."""
        verdict.final = True
        if self._verdicts is not None and verdict.form is not None and not verdict.borrowed:
            self._verdicts.store(f"{regime} {key}", verdict.form, verdict.why)

    # -- the build thread ---------------------------------------------------------------------

    def _start(self, version: int, promised: bool = False) -> None:
        self._built_for = version
        self._complete = False
        thread = threading.Thread(target=self._build_forms, args=(version, promised),
                                  name="asyncgraph-fast-form", daemon=True)
        self._building = thread
        start_thread(thread)

    def _build_forms(self, version: int, promised: bool) -> None:
        """The build thread: the first registered backend whose form plans delegates, at
        each intra-op thread count in THREAD_COUNTS that this process has the CPUs for; then
        each additional backend's form, published as one more candidate when built.
        Unless executions wait for it (`promised`: a kept verdict chose a form), it starts in
        a gap between bursts, or after QUIET_START_S: the burst that started it, a server's
        first, runs on the plain graph undisturbed."""
        step_back(NICE)
        started = time.perf_counter()
        _QUICK_SWITCHES.enter()
        _BUILDING.owner = self
        try:
            with self._courtesy:  # its Python pauses while the loop serves
                if not promised:
                    self._courtesy.wait_quiet(self._quiet_start_s, self._in_a_burst)
                chosen = self._chosen_backends() if promised else None
                self._build_first_backend(version, chosen)
                for backend in self._additional:
                    if chosen is None or backend in chosen:
                        built = self._build_backend(backend)
                        if built:
                            self._publish(backend, built, version)
        finally:
            _BUILDING.owner = None
            _QUICK_SWITCHES.exit()
            self.builds += 1
            self.build_s += time.perf_counter() - started
            self._complete = True
            self._generation += 1
            with self._build_lock:
                self._building = None
            self._wake_waiters()

    def _chosen_backends(self) -> set[str]:
        """The backends of the forms that verdicts kept on disk chose: a restart builds only
        those (the others lost, and an AOTInductor form's load holds the GIL in long
        stretches while the loop serves)."""
        return {self._backend(form) for form, _ in self._kept.values() if form != PLAIN}

    def _build_first_backend(self, version: int, chosen: set[str] | None = None) -> None:
        """The forms of the first backend (of those not additional, and in `chosen` when
        given) that builds any."""
        for backend in self.backends:
            if backend not in self._additional and (chosen is None or backend in chosen):
                built = self._build_backend(backend)
                if built:
                    self._publish(backend, built, version)
                    return

    def _publish(self, backend: str, built: dict[str, Form], version: int) -> None:
        """`built` served from now on, beside the forms published for the same weights (one
        assignment: the loop sees the forms whole); the executions waiting for them woken."""
        if self._forms and self._form_version == version:
            forms = {**self._forms, **built}
        else:
            forms, self._form_backend = dict(built), backend
        self._form_version = version
        self._forms = forms
        self._published += 1
        self._generation += 1
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        with self._build_lock:
            waiters, self._build_waiters = self._build_waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake, future)

    def _serving(self) -> bool:
        """Whether the loop serves (the build thread reads it: a stale answer costs one
        pause or one slice): an execution started or ended within QUIET_S, or executions are
        in flight and one started or ended within STUCK_S.

        In flight counts: an execution running inline on the loop gives up the GIL at every
        kernel, and a build thread that then takes it keeps it for the switch interval each
        time, so the execution runs one kernel per 0.5 ms and starts and ends nothing for
        10-15 ms (design_measurements.md#the-build-and-the-gil). Executions waiting for the
        build do not count (it should hurry), and after STUCK_S without progress the loop
        may be blocked on a lock the build thread holds, which must then go on, not pause."""
        since = self._clock() - max(self._last_start, self._last_end)
        return since < QUIET_S or (self._in_flight > self._awaiting_build and since < STUCK_S)

    def _in_a_burst(self) -> bool:
        """Whether executions are in flight, or one started or ended within QUIET_S: stricter
        than `_serving` (a burst's executions that wait on schedules built on a thread start
        and end nothing for milliseconds), for a build that has not started (holding no lock
        the loop could wait on)."""
        return not self._closed and (self._in_flight > 0 or self._serving())

    def _build_backend(self, backend: str) -> dict[str, Form]:
        """`backend`'s forms, one per thread count; none when it plans no delegate or fails."""
        built: dict[str, Form] = {}
        counts = self._thread_counts.get(backend, self._threads)
        for threads in (t for t in counts if t <= self._cpus):
            name = backend if threads == 1 else f"{backend}, {threads} threads"
            if self._closed:
                break
            form = None
            try:
                form = self._build(backend, threads)
                if form.has_delegates:
                    form.prepare_sessions()  # its sessions start now, not on first calls
            except Exception as exc:  # a form that cannot be built: the others serve
                if form is not None:
                    self._retired.append(form)  # closed with the Executor
                self._passed[name] = f"not built: {type(exc).__name__}: {exc}"
                if not self._closed:  # a build its Executor's close stopped is no news
                    LOG.warning("fast form %r %s", name, self._passed[name])
                if not built:
                    break
                continue
            if not form.has_delegates:
                self._retired.append(form)
                self._passed[name] = "no run of the graph became a segment"
                break
            built[name] = form
            self._form_threads[name] = threads
        return built

    # -- the Executor's side ------------------------------------------------------------------

    async def aclose(self, *, cancel: bool = False) -> None:
        """Wait for a build in progress (off the loop), then close every form built; the
        verdicts reached with every form are kept first, if no execution came to keep them
        since the build ended."""
        self._closed = True
        thread = self._building
        if thread is not None:
            import anyio.to_thread

            await anyio.to_thread.run_sync(thread.join)
        if self._generation != self._seen_generation:
            self._catch_up()
        forms = [*self._retired, *self._forms.values()]
        self._retired, self._forms = [], {}
        for form in forms:
            await form.aclose(cancel=cancel)

    def statistics(self) -> dict[str, Any]:
        """Which form serves each signature under each load and why; what each backend did."""
        signatures = {str(key): {ALONE: _said(c.alone, c.warm, self._published),
                                 LOADED: _said(c.loaded, c.warm, self._published),
                                 "runs": c.runs}
                      for key, c in self._choices.items()}
        state = ("building" if self._building is not None
                 else "ready" if self._forms else "none")
        return {"state": state, "form": self._form_backend if self._forms else None,
                "forms": list(self._forms), "passed": dict(self._passed),
                "builds": self.builds, "build_s": round(self.build_s, 3),
                "fast_runs": self.fast_runs, "build_waits": self.build_waits,
                "kept": len(self._kept), "signatures": signatures,
                "segments": {name: {node: said["serves"]
                                    for node, said in form.delegate_statistics().items()
                                    if "serves" in said}
                             for name, form in self._forms.items()}}


def _rows(flat: list[Any]) -> int:
    """A batch's rows: its first tensor input's dim 0 (1 for none)."""
    for x in flat:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


def _promised(choice: _Choice) -> set[str]:
    """The forms that verdicts kept from an earlier run chose for this signature."""
    return {v.form for v in (choice.alone, choice.loaded)
            if v.form is not None and v.form != PLAIN and v.final}


def _said(verdict: _Verdict, warm: int, published: int) -> dict[str, str]:
    """A verdict as statistics() says it: one reached before a form published since will be
    measured again (`_catch_up`, at the next execution), and says so already."""
    if verdict.form is None and verdict.previous is not None:
        return {"form": "measuring", "why": f"measuring again ({verdict.rechecks}), "
                                            f"{verdict.previous} until now"}
    if verdict.form is None or (not verdict.final and verdict.published != published):
        return {"form": "measuring", "why": f"warming and measuring ({warm} warm runs)"}
    return {"form": verdict.form, "why": verdict.why}


def _wake(future: Any) -> None:
    if not future.done():  # its waiter may have been cancelled meanwhile
        future.set_result(None)

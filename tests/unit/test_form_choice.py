"""FastForms' routing and choice (asyncgraph/runtime/forms.py) over fake forms and a fake
clock: which form serves a signature, when, and never on other weights."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncgraph.runtime import forms
from asyncgraph.runtime.form_verdicts import FormVerdicts
from asyncgraph.runtime.forms import FastForms

pytestmark = pytest.mark.timeout(30)

SIG = (("tensor", (1, 4)),)


class Clock:
    """The time the fake forms' runs take: each run advances it by its form's cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeForm:
    def __init__(self, clock: Clock, cost: float, name: str = "fast",
                 cpu: list[float] | None = None, cpu_cost: tuple[float, float] = (0.0, 0.0),
                 yields: bool = False) -> None:
        self.clock, self.cost, self.name = clock, cost, name
        self.cpu, self.cpu_cost, self.yields = cpu, cpu_cost, yields
        self.runs = 0
        self.bound = 0
        self.prepared = 0
        self.closed = False
        self.idle = True
        self.has_delegates = True

    async def _execute(self, flat: list[Any], caller_inputs: Any, caller: Any,
                       signature: Any, *, direct: bool = True) -> list[Any]:
        self.runs += 1
        self.clock.now += self.cost
        if self.cpu is not None:  # (the loop thread's CPU, the process's CPU) it takes
            self.cpu[0] += self.cpu_cost[0]
            self.cpu[1] += self.cpu_cost[1]
        if self.yields:  # a form whose run waits for a worker: others start meanwhile
            await asyncio.sleep(0)
        return [self.name]

    def _run_direct(self, flat: list[Any], signature: Any, caller: Any = None) -> list[Any] | None:
        return None  # never a program of one call: every run is `_execute`'s

    def _bind_loop(self) -> None:
        self.bound += 1

    def delegate_statistics(self) -> dict[str, dict[str, Any]]:
        return {f"{self.name}_segment": {"serves": {"*": self.name}}}

    def prepare_sessions(self) -> None:
        self.prepared += 1

    async def aclose(self, *, cancel: bool = False) -> None:
        self.closed = True

    @property
    def delegates_idle(self) -> bool:
        return self.idle


class Setup:
    def __init__(self, fast_cost: float = 1.0, plain_cost: float = 2.0,
                 build: Any = None, verdicts: FormVerdicts | None = None,
                 fast_cpu: tuple[float, float] = (0.0, 0.0),
                 plain_cpu: tuple[float, float] = (0.0, 0.0),
                 gate: threading.Event | None = None, cpus: int = 1,
                 two_threads: tuple[float, tuple[float, float]] | None = None,
                 quiet_start_s: float = 0.0, batched: bool = False) -> None:
        # cpus=1: one form (one intra-op thread); 2: a second form on 2 threads, whose
        # (latency, CPU) are `two_threads` (the first form's when None)
        self.two_threads = two_threads
        self.gate = gate  # builds wait for it (a slow build)
        self.clock = Clock()
        self.cpu = [0.0, 0.0]
        self.fast_cpu, self.plain_cpu = fast_cpu, plain_cpu
        self.version = 0
        self.plain_runs = 0
        self.plain_cost = plain_cost
        self.built: list[FakeForm] = []
        self.fast_cost = fast_cost
        self.forms = FastForms(("fast",), build or self.build, self.plain, lambda: self.version,
                               self.clock, verdicts, cpu=lambda: (self.cpu[0], self.cpu[1]),
                               cpus=cpus, quiet_start_s=quiet_start_s, batched=batched)

    def build(self, backend: str, threads: int = 1) -> FakeForm:
        if self.gate is not None:
            assert self.gate.wait(10)
        cost, cpu = ((self.fast_cost, self.fast_cpu) if threads == 1 or not self.two_threads
                     else self.two_threads)
        form = FakeForm(self.clock, cost, "fast" if threads == 1 else "fast2", cpu=self.cpu,
                        cpu_cost=cpu, yields=True)
        self.built.append(form)
        return form

    async def plain(self, flat: list[Any], caller_inputs: Any, caller: Any,
                    signature: Any) -> list[Any]:
        self.plain_runs += 1
        self.clock.now += self.plain_cost
        self.cpu[0] += self.plain_cpu[0]
        self.cpu[1] += self.plain_cpu[1]
        return ["plain"]

    async def run(self) -> str:
        out: list[str] = await self.forms.run([], None, None, SIG)
        return out[0]

    def wait_built(self) -> None:
        deadline = time.monotonic() + 10
        while self.forms.statistics()["state"] == "building" or (
                self.forms.builds == 0 and time.monotonic() < deadline):
            time.sleep(0.001)


async def _decide(setup: Setup) -> list[str]:
    """Runs until the signature's verdict alone: the warm runs, then the timed ones in turn."""
    served = []  # up to 3 candidates: their warm runs, then runs of RUN_OF, one untimed
    for _ in range(3 * forms.WARM + 3 * (forms.SAMPLES + 2 * forms.RUN_OF) * 2):
        served.append(await setup.run())
        if setup.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] != "measuring":
            return served
    raise AssertionError(f"no verdict: {setup.forms.statistics()}")


async def test_the_plain_graph_serves_until_the_form_is_built_then_the_faster_wins() -> None:
    setup = Setup(fast_cost=1.0, plain_cost=2.0)
    assert await setup.run() == "plain"  # starts the build
    setup.wait_built()
    served = await _decide(setup)
    assert served[:forms.WARM] == ["fast"] * forms.WARM
    # then in turn, RUN_OF runs in a row each (the first run of the first turn counted in
    # the warm runs' turn), until each has SAMPLES timed runs
    runs = [(form, len(list(run))) for form, run in itertools.groupby(served[forms.WARM:])]
    assert [form for form, _ in runs] == ["fast", "plain"] * (len(runs) // 2) + (
        ["fast"] if len(runs) % 2 else [])
    assert all(n == forms.RUN_OF for _, n in runs[1:-1]), runs
    assert [await setup.run() for _ in range(5)] == ["fast"] * 5
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "fast" and "fast 1000000 us, plain 2000000 us" in verdict["why"]
    # and what serves each segment of each form built, as its delegates say
    assert setup.forms.statistics()["segments"] == {"fast": {"fast_segment": {"*": "fast"}}}
    assert setup.built[0].bound == 1
    await setup.forms.aclose()
    assert setup.built[0].closed


async def test_a_form_measured_slower_leaves_the_signature_on_the_plain_graph() -> None:
    setup = Setup(fast_cost=3.0, plain_cost=2.0)
    await setup.run()
    setup.wait_built()
    await _decide(setup)
    before = setup.built[0].runs
    assert [await setup.run() for _ in range(5)] == ["plain"] * 5
    assert setup.built[0].runs == before
    assert setup.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] == "plain"
    await setup.forms.aclose()


async def test_no_timing_while_the_forms_delegates_still_build() -> None:
    setup = Setup()
    await setup.run()
    setup.wait_built()
    setup.built[0].idle = False
    assert [await setup.run() for _ in range(3 * forms.WARM)] == ["fast"] * (3 * forms.WARM)
    assert setup.plain_runs == 1  # only the run before the build
    assert setup.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] == "measuring"
    await setup.forms.aclose()


async def test_a_form_built_on_other_weights_is_never_served() -> None:
    setup = Setup()
    await setup.run()
    setup.wait_built()
    await _decide(setup)
    setup.version = 1  # a weights swap
    assert await setup.run() == "plain"  # the old form is retired, a new build starts
    old = setup.built[0]
    runs = old.runs
    setup.wait_built()
    assert len(setup.built) == 2 and setup.forms.builds == 2
    served = await _decide(setup)
    assert old.runs == runs and set(served) == {"fast", "plain"}
    await setup.forms.aclose()
    assert old.closed and setup.built[1].closed


async def test_a_build_that_fails_is_reported_and_not_tried_again() -> None:
    def fails(backend: str, threads: int) -> Any:
        raise RuntimeError("the exporter refused")

    setup = Setup(build=fails)
    await setup.run()
    setup.wait_built()
    assert [await setup.run() for _ in range(5)] == ["plain"] * 5
    stats = setup.forms.statistics()
    assert stats["builds"] == 1 and stats["state"] == "none"
    assert stats["passed"] == {"fast": "not built: RuntimeError: the exporter refused"}
    await setup.forms.aclose()


async def test_a_form_without_segments_is_passed_over_and_closed() -> None:
    setup = Setup()

    def empty(backend: str, threads: int) -> FakeForm:
        form = setup.build(backend, threads)
        form.has_delegates = False
        return form

    setup.forms._build = empty
    await setup.run()
    setup.wait_built()
    assert await setup.run() == "plain"
    assert setup.forms.statistics()["passed"] == {"fast": "no run of the graph became a segment"}
    await setup.forms.aclose()
    assert setup.built[0].closed


async def test_aclose_waits_for_a_build_in_progress() -> None:
    release = threading.Event()
    setup = Setup()

    def slow(backend: str, threads: int) -> FakeForm:
        release.wait(10)
        return setup.build(backend, threads)

    setup.forms._build = slow
    await setup.run()
    assert setup.forms.statistics()["state"] == "building"
    threading.Timer(0.05, release.set).start()
    await setup.forms.aclose()
    assert not any(t.name == "asyncgraph-fast-form" for t in threading.enumerate())
    assert setup.built and setup.built[0].closed


async def test_a_first_build_starts_once_the_burst_that_asked_for_it_is_over() -> None:
    """A build nothing waits for starts in a gap between bursts (none in flight, none started
    or ended for QUIET_S), so the burst that started it runs on the plain graph undisturbed."""
    setup = Setup(quiet_start_s=10.0)
    release = asyncio.Event()
    plain = setup.plain

    async def held(*args: Any) -> list[Any]:
        await release.wait()
        return await plain(*args)

    setup.forms._plain = held
    running = asyncio.create_task(setup.run())  # in flight: the build starts, then waits
    await asyncio.sleep(0)
    await anyio.to_thread.run_sync(time.sleep, 0.05)
    assert setup.forms.statistics()["state"] == "building" and setup.built == []
    release.set()
    assert await running == "plain"
    setup.clock.now += 2 * forms.QUIET_S  # the gap
    await anyio.to_thread.run_sync(setup.wait_built)
    assert len(setup.built) == 1
    await setup.forms.aclose()


async def test_with_batching_a_batch_of_many_rows_is_decided_under_load() -> None:
    """A batch's rows are requests in flight together: one caller's batches of 32 rows
    reach the loaded verdict (the plain graph's latency is lower, the form costs the loop
    less), batches of one row the verdict alone."""
    import torch

    setup = Setup(fast_cost=3.0, plain_cost=2.0, fast_cpu=(0.2, 1.0), plain_cpu=(1.5, 1.5),
                  batched=True)
    rows32, rows1 = [torch.zeros(32, 4)], [torch.zeros(1, 4)]
    await setup.forms.run(rows32, None, None, None)
    setup.wait_built()
    stats = setup.forms.statistics
    for _ in range(40 * forms.WINDOW):
        await setup.forms.run(rows32, None, None, None)
        setup.clock.now += 1.0  # one caller: nothing else in flight, no burst
        if stats()["signatures"]["(((32, 4), torch.float32),)"]["loaded"]["form"] != "measuring":
            break
    decided = stats()["signatures"]["(((32, 4), torch.float32),)"]
    assert decided["loaded"]["form"] == "fast", decided  # CPU: 1.0 against 1.5
    assert decided["alone"]["form"] == "measuring" and decided["runs"] > forms.WINDOW
    for _ in range(forms.WARM * 2 + 3 * forms.SAMPLES):
        await setup.forms.run(rows1, None, None, None)
        setup.clock.now += 1.0
    one = stats()["signatures"]["(((1, 4), torch.float32),)"]
    assert one["alone"]["form"] == "plain" and one["loaded"]["form"] == "measuring", one
    await setup.forms.aclose()


async def _burst(setup: Setup, callers: int) -> list[str]:
    """`callers` executions at once, each from a task of its own."""
    tasks = [object() for _ in range(callers)]  # alive together: ids of their own
    outs = await asyncio.gather(*(setup.forms.run([], None, task, SIG) for task in tasks))
    return [o[0] for o in outs]


async def test_under_load_the_form_using_less_of_the_busier_resource_wins() -> None:
    # alone the plain graph is faster (latency 2 against 3), but it holds the loop's thread
    # for all of its CPU, while the form's runs take 0.2 of the loop and 1.0 of the process
    setup = Setup(fast_cost=3.0, plain_cost=2.0, fast_cpu=(0.2, 1.0), plain_cpu=(1.5, 1.5),
                  cpus=2, two_threads=(2.5, (0.2, 1.6)))
    await setup.run()
    setup.wait_built()
    await _decide(setup)
    assert setup.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] == "plain"
    rounds = 0
    while setup.forms.statistics()["signatures"][str(SIG)]["loaded"]["form"] == "measuring":
        await _burst(setup, 32)
        rounds += 1
        assert rounds < 50, setup.forms.statistics()
    loaded = setup.forms.statistics()["signatures"][str(SIG)]["loaded"]
    # the busier resource per execution: the form max(0.2, 1.0 / 2) = 0.5 s, the plain graph
    # 1.5 s; the form on 2 threads is no candidate under load (one core per execution)
    assert loaded["form"] == "fast", loaded
    assert "fast 500000 us CPU" in loaded["why"] and "plain 1500000 us CPU" in loaded["why"]
    assert "2 threads" not in loaded["why"]
    setup.clock.now += 1.0  # a pause before the next burst
    served = await _burst(setup, 8)
    assert served[0] == "plain" and served[1:] == ["fast"] * 7  # the first starts alone
    setup.clock.now += 1.0
    assert [await setup.run() for _ in range(3)] == ["plain"] * 3  # one caller: alone
    await setup.forms.aclose()


async def test_inline_runs_of_other_tasks_close_together_count_as_load() -> None:
    setup = Setup()
    forms = setup.forms
    assert forms._regime(None) == "alone"
    last, other = object(), object()
    forms._last_caller, forms._last_end = id(last), setup.clock.now  # another task, just now
    assert forms._regime(other) == "loaded"
    assert forms._regime(last) == "alone"  # the same task, one execution after another
    setup.clock.now += 1.0  # long after: a new request, not a burst
    assert forms._regime(object()) == "alone"
    await forms.aclose()


async def test_runs_timed_alone_that_others_started_beside_are_no_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bursts after pauses: each burst's first execution starts alone. On the form its run
    # waits for a worker (the fake yields) and the burst starts beside it, so its latency is
    # the burst's; the plain graph's inline run ends before the burst starts. Counted, those
    # samples chose the plain graph for a lone caller and kept it on disk.
    setup = Setup(fast_cost=1.0, plain_cost=2.0, fast_cpu=(0.1, 0.5), plain_cpu=(2.0, 2.0),
                  verdicts=_kept_verdicts(tmp_path, monkeypatch))
    await setup.run()
    setup.wait_built()

    def alone() -> dict[str, str]:
        return setup.forms.statistics()["signatures"][str(SIG)]["alone"]

    for _ in range(400):
        setup.clock.now += 1.0  # a pause: the next burst's first execution starts alone
        await _burst(setup, 33)
        if alone()["form"] != "measuring":
            break
    verdict = setup.forms._choices[SIG].alone
    assert "fast" not in verdict.samples and len(verdict.samples["plain"]) >= 1, verdict
    assert verdict.overlapped >= forms.OVERLAPS
    assert alone()["form"] == "fast" and "served as under load" in alone()["why"], alone()
    setup.clock.now += 1.0
    assert (await _burst(setup, 4))[0] == "fast"  # a burst's first: as under load
    await setup.forms.aclose()
    # borrowed, not measured: a restart measures a lone caller again
    kept = json.loads(next((tmp_path / "forms").glob("*.json")).read_text())
    assert kept[f"loaded {SIG}"]["form"] == "fast" and f"alone {SIG}" not in kept, kept


def _kept_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FormVerdicts:
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", str(tmp_path))
    return FormVerdicts("the graph's text", ("fast",), (1, 2))


async def test_a_restart_serves_the_kept_form_from_its_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch))
    await first.run()
    first.wait_built()
    await _decide(first)
    await first.forms.aclose()
    assert first.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] == "fast"
    kept = json.loads(next((tmp_path / "forms").glob("*.json")).read_text())
    assert kept[f"alone {SIG}"]["form"] == "fast"

    release = threading.Event()
    restarted = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch), gate=release)
    assert restarted.forms.statistics()["state"] == "building"  # before any request
    waiting = asyncio.ensure_future(restarted.run())
    await asyncio.sleep(0.01)
    # it waits for the build, off the loop, and the build's courtesy does not pause for it
    assert not waiting.done() and restarted.forms._awaiting_build == 1
    restarted.clock.now += 2 * forms.QUIET_S  # past its start
    assert not restarted.forms._serving()
    release.set()
    assert await waiting == "fast"
    assert restarted.forms._awaiting_build == 0
    stats = restarted.forms.statistics()
    assert stats["build_waits"] == 1 and restarted.plain_runs == 0
    assert stats["signatures"][str(SIG)]["alone"]["why"].startswith("kept from an earlier run")
    assert restarted.built[0].prepared == 1  # its sessions started when it was built
    await restarted.forms.aclose()


async def test_kept_verdicts_start_the_build_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts = _kept_verdicts(tmp_path, monkeypatch)
    verdicts.store(f"loaded {SIG}", "fast", "measured")
    setup = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch))
    assert setup.forms.statistics()["state"] in ("building", "ready")  # no request yet
    assert await setup.run() == "fast"
    await setup.forms.aclose()


async def test_unreadable_kept_verdicts_are_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    verdicts = _kept_verdicts(tmp_path, monkeypatch)
    assert verdicts.path is not None
    verdicts.path.parent.mkdir(parents=True)
    verdicts.path.write_text("{not json")
    assert verdicts.load() == {}
    assert "ignoring the kept verdicts" in caplog.text
    setup = Setup(verdicts=verdicts)
    assert setup.forms.statistics()["state"] == "none" and await setup.run() == "plain"
    setup.wait_built()
    await setup.forms.aclose()
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", "")  # the cache off: nothing kept, no error
    off = FormVerdicts("the graph's text", ("fast",), (1, 2))
    off.store("alone x", "fast", "why")
    assert off.path is None and off.load() == {}


async def test_a_request_cancelled_while_it_waits_for_the_build_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdicts = _kept_verdicts(tmp_path, monkeypatch)
    verdicts.store(f"alone {SIG}", "fast", "measured")
    release = threading.Event()
    setup = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch), gate=release)
    task = asyncio.ensure_future(setup.run())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    setup.wait_built()
    assert await setup.run() == "fast"
    await setup.forms.aclose()


async def test_the_thread_count_is_a_form_of_its_own_chosen_by_measurement() -> None:
    # alone, the sessions on 2 intra-op threads are the fastest (0.5 against 1.0 and 2.0)
    setup = Setup(fast_cost=1.0, plain_cost=2.0, cpus=2, two_threads=(0.5, (0.0, 0.0)))
    await setup.run()
    setup.wait_built()
    assert setup.forms.statistics()["forms"] == ["fast", "fast, 2 threads"]
    served = await _decide(setup)
    assert {"fast", "fast2", "plain"} <= set(served)  # each measured in turn
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "fast, 2 threads", verdict
    assert [await setup.run() for _ in range(3)] == ["fast2"] * 3
    await setup.forms.aclose()
    assert all(form.closed for form in setup.built)


async def test_a_thread_count_that_fails_to_build_leaves_the_others() -> None:
    setup = Setup(cpus=2)

    def two_fails(backend: str, threads: int) -> FakeForm:
        if threads == 2:
            raise RuntimeError("no second session")
        return setup.build(backend, threads)

    setup.forms._build = two_fails
    await setup.run()
    setup.wait_built()
    stats = setup.forms.statistics()
    assert stats["forms"] == ["fast"]
    assert stats["passed"] == {"fast, 2 threads": "not built: RuntimeError: no second session"}
    await _decide(setup)
    assert setup.forms.statistics()["signatures"][str(SIG)]["alone"]["form"] == "fast"
    await setup.forms.aclose()


async def test_batches_share_a_verdict_per_power_of_two_of_rows() -> None:
    import torch

    setup = Setup()
    setup.forms._batched = True  # as an Executor with batching makes it
    for rows in (17, 20, 32, 3):
        await setup.forms.run([torch.zeros(rows, 4)], None, None, None)
    keys = list(setup.forms.statistics()["signatures"])
    assert len(keys) == 2 and "32" in keys[0] and "4" in keys[1], keys  # 17-32 -> 32; 3 -> 4
    setup.wait_built()
    await setup.forms.aclose()


async def test_the_build_pauses_while_executions_start_end_or_run_on_the_loop() -> None:
    """The build thread's courtesy (runtime/courtesy.py) asks whether the loop serves: yes
    right after an execution starts or ends; yes with one in flight that has run for less
    than STUCK_S (run inline, it gets the GIL back once per switch interval while the build
    holds it, and ends nothing for milliseconds); no once nothing has started or ended for
    STUCK_S (a loop blocked on a lock the build holds must not wait for its pauses), nor
    when the executions in flight only wait for the build."""
    setup = Setup(gate=threading.Event())
    assert not setup.forms._serving()
    task = asyncio.ensure_future(setup.run())
    await asyncio.sleep(0)
    assert setup.forms._serving()
    await task
    setup.clock.now += forms.QUIET_S / 2
    assert setup.forms._serving()
    setup.clock.now += forms.QUIET_S
    assert not setup.forms._serving()  # nothing in flight
    setup.forms._in_flight += 1  # one in flight, nothing started or ended since
    assert setup.forms._serving()
    setup.forms._awaiting_build += 1  # ... that waits for the build
    assert not setup.forms._serving()
    setup.forms._awaiting_build -= 1
    setup.clock.now += forms.STUCK_S
    assert not setup.forms._serving()  # stuck: maybe on the build, which must go on
    setup.forms._in_flight -= 1
    assert setup.gate is not None
    setup.gate.set()
    await setup.forms.aclose()


async def test_a_form_within_the_margin_of_the_plain_graph_leaves_it_plain() -> None:
    """Alone, a form 3% faster than the plain graph is within MARGIN (5%): the plain graph
    keeps the signature, and the verdict says why."""
    assert forms.MARGIN == 0.05
    setup = Setup(fast_cost=1.94, plain_cost=2.0)
    assert await setup.run() == "plain"
    setup.wait_built()
    await _decide(setup)
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "plain"
    assert "fast within 5% of the plain graph: the plain graph" in verdict["why"]
    assert [await setup.run() for _ in range(3)] == ["plain"] * 3
    await setup.forms.aclose()


class LateSetup(Setup):
    """Setup with a second backend, "late", built after "fast" as one more candidate (as the
    AOTInductor form is, runtime/delegates.py's `form_program`), once `late_gate` is set."""

    def __init__(self, late_cost: float, late_gate: threading.Event, **kwargs: Any) -> None:
        self.late_cost, self.late_gate = late_cost, late_gate
        # the base's FastForms without the verdicts: kept ones would start its own build
        super().__init__(**{k: v for k, v in kwargs.items() if k != "verdicts"})
        self.forms = FastForms(("fast", "late"), self.build, self.plain, lambda: self.version,
                               self.clock, kwargs.get("verdicts"),
                               cpu=lambda: (self.cpu[0], self.cpu[1]), cpus=1,
                               quiet_start_s=0.0, additional=("late",),
                               thread_counts={"late": (1,)})

    def build(self, backend: str, threads: int = 1) -> FakeForm:
        if backend == "fast":
            return super().build(backend, threads)
        assert self.late_gate.wait(10)
        form = FakeForm(self.clock, self.late_cost, "late", cpu=self.cpu, yields=True)
        self.built.append(form)
        return form


class FailingLate(LateSetup):
    """LateSetup whose "late" backend fails to build, once `late_gate` is set."""

    def build(self, backend: str, threads: int = 1) -> FakeForm:
        if backend == "late":
            assert self.late_gate.wait(10)
            raise RuntimeError("no compiler")
        return super().build(backend, threads)


async def _decided_before_the_late_build_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[FailingLate, FormVerdicts, threading.Event]:
    """A FailingLate whose signature has its verdict alone on "fast", the "late" build held
    until the gate returned is set (it then fails); its verdicts, kept in `tmp_path`."""
    late_gate = threading.Event()
    verdicts = _late_verdicts(tmp_path, monkeypatch)
    setup = FailingLate(late_cost=0.5, late_gate=late_gate, verdicts=verdicts)
    await setup.run()
    while "fast" not in setup.forms.statistics()["forms"]:  # noqa: ASYNC110 - no event to wait on
        await asyncio.sleep(0.001)
    await _decide(setup)
    return setup, verdicts, late_gate


def _late_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FormVerdicts:
    monkeypatch.setenv("ASYNCGRAPH_CACHE_DIR", str(tmp_path))
    return FormVerdicts("the graph's text", ("fast", "late"), (1, 2))


async def test_a_form_built_later_is_measured_against_the_verdict_reached_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first forms serve as soon as they are built; a form built later (a compile of a
    minute) reopens the verdicts reached meanwhile, which are kept on disk only once every
    backend had its turn; a restart then waits for the form they chose, not for the first."""
    late_gate = threading.Event()
    verdicts = _late_verdicts(tmp_path, monkeypatch)
    setup = LateSetup(late_cost=0.5, late_gate=late_gate, fast_cost=1.0, plain_cost=2.0,
                      verdicts=verdicts)
    await setup.run()
    while "fast" not in setup.forms.statistics()["forms"]:  # noqa: ASYNC110 - no event to wait on
        await asyncio.sleep(0.001)
    await _decide(setup)
    stats = setup.forms.statistics()
    assert stats["state"] == "building" and stats["forms"] == ["fast"]
    assert stats["signatures"][str(SIG)]["alone"]["form"] == "fast"
    assert verdicts.stored == 0  # not every backend had its turn yet

    late_gate.set()
    setup.wait_built()
    assert setup.forms.statistics()["forms"] == ["fast", "late"]
    assert await setup.run() in ("fast", "late")  # the late form's warm runs begin
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "measuring", verdict  # reopened by the late form's arrival
    await _decide(setup)
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "late" and "late 500000 us" in verdict["why"], verdict
    assert all(form.prepared == 1 for form in setup.built)
    await setup.forms.aclose()
    kept = json.loads(next((tmp_path / "forms").glob("*.json")).read_text())
    assert kept[f"alone {SIG}"]["form"] == "late"

    slow_late = threading.Event()
    restarted = LateSetup(late_cost=0.5, late_gate=slow_late, fast_cost=1.0, plain_cost=2.0,
                          verdicts=_late_verdicts(tmp_path, monkeypatch))
    threading.Timer(0.1, slow_late.set).start()  # "fast" is published first, long before
    assert await restarted.run() == "late"  # the kept verdict's form, waited for
    stats = restarted.forms.statistics()
    assert stats["build_waits"] == 1 and restarted.plain_runs == 0
    await restarted.forms.aclose()


async def test_a_form_built_later_must_be_faster_by_the_margin() -> None:
    """An additional form 2% faster than the planned one is within MARGIN: the planned form
    keeps the signature (in turn with the others, a compiled form's lead that small was
    noise), and the verdict says why; 50% faster, it takes it (the test above)."""
    late_gate = threading.Event()
    late_gate.set()
    setup = LateSetup(late_cost=0.98, late_gate=late_gate, fast_cost=1.0, plain_cost=2.0)
    await setup.run()
    setup.wait_built()
    await _decide(setup)
    verdict = setup.forms.statistics()["signatures"][str(SIG)]["alone"]
    assert verdict["form"] == "fast", verdict
    assert verdict["why"].endswith("; late within 5% of fast: fast"), verdict
    await setup.forms.aclose()


async def test_a_build_that_adds_no_form_keeps_the_verdicts_reached_during_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The additional backend fails: the candidates did not change, so the verdict reached
    before the build ended is kept as it is (on disk too), not measured again; a restart
    that finds it builds only the backend it chose."""
    setup, verdicts, late_gate = await _decided_before_the_late_build_fails(tmp_path, monkeypatch)
    assert verdicts.stored == 0
    late_gate.set()
    setup.wait_built()
    assert await setup.run() == "fast"  # the verdict stands: no warm runs, no turns
    stats = setup.forms.statistics()
    assert stats["signatures"][str(SIG)]["alone"]["form"] == "fast"
    assert "no compiler" in stats["passed"]["late"]
    assert verdicts.stored == 1
    await setup.forms.aclose()

    never = threading.Event()  # a "late" build would wait for it and fail the test
    restarted = LateSetup(late_cost=0.5, late_gate=never,
                          verdicts=_late_verdicts(tmp_path, monkeypatch))
    assert await restarted.run() == "fast"
    restarted.wait_built()
    assert restarted.forms.statistics()["forms"] == ["fast"]
    assert [form.name for form in restarted.built] == ["fast"]
    await restarted.forms.aclose()


async def test_verdicts_reached_as_the_build_ends_are_kept_when_the_executor_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that closes right after its build ended, with no execution since, still
    leaves the verdicts it reached for a restart."""
    setup, verdicts, late_gate = await _decided_before_the_late_build_fails(tmp_path, monkeypatch)
    late_gate.set()
    setup.wait_built()
    assert verdicts.stored == 0
    await setup.forms.aclose()
    assert verdicts.stored == 1


async def test_a_kept_verdict_is_measured_again_once_it_has_served_long_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verdict kept on disk may have been reached on a busy moment; a restart serves it at
    once, then, after RECHECK_RUNS executions and RECHECK_S, measures the forms again and keeps
    the new verdict in its place."""
    monkeypatch.setattr(forms, "RECHECK_RUNS", 40)
    monkeypatch.setattr(forms, "RECHECK_S", 1000.0)
    first = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch))
    await first.run()
    first.wait_built()
    await _decide(first)
    await first.forms.aclose()
    restarted = Setup(verdicts=_kept_verdicts(tmp_path, monkeypatch))

    def alone() -> dict[str, str]:
        return restarted.forms.statistics()["signatures"][str(SIG)]["alone"]

    assert await restarted.run() == "fast"
    restarted.built[0].cost = 3.0  # the form now slower than the plain graph (2.0)
    # RECHECK_RUNS served (120 s of the fake clock), not RECHECK_S yet: the kept form serves
    assert [await restarted.run() for _ in range(60)] == ["fast"] * 60
    assert alone()["why"].startswith("kept from an earlier run")
    restarted.clock.now += 1000.0
    await restarted.run()
    assert alone() == {"form": "measuring", "why": "measuring again (1), fast until now"}
    for _ in range(400):
        if alone()["form"] != "measuring":
            break
        await restarted.run()
    assert alone()["form"] == "plain", alone()
    assert "fast 3000000 us" in alone()["why"] and "measured again (1), fast before" in (
        alone()["why"]), alone()
    verdict = restarted.forms._choices[SIG].alone
    assert verdict.final and verdict.due == restarted.clock.now + 2000.0  # twice as long
    kept = json.loads(next((tmp_path / "forms").glob("*.json")).read_text())
    assert kept[f"alone {SIG}"]["form"] == "plain", kept
    await restarted.forms.aclose()

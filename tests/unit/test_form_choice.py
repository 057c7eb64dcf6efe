"""FastForms' routing and choice (asyncgraph/runtime/forms.py) over fake forms and a fake
clock: which form serves a signature, when, and never on other weights."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from asyncgraph.runtime import forms
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
    def __init__(self, clock: Clock, cost: float, name: str = "fast") -> None:
        self.clock, self.cost, self.name = clock, cost, name
        self.runs = 0
        self.bound = 0
        self.closed = False
        self.idle = True
        self.has_delegates = True

    async def _execute(self, flat: list[Any], caller_inputs: Any, caller: Any,
                       signature: Any) -> list[Any]:
        self.runs += 1
        self.clock.now += self.cost
        return [self.name]

    def _bind_loop(self) -> None:
        self.bound += 1

    async def aclose(self, *, cancel: bool = False) -> None:
        self.closed = True

    @property
    def delegates_idle(self) -> bool:
        return self.idle


class Setup:
    def __init__(self, fast_cost: float = 1.0, plain_cost: float = 2.0,
                 build: Any = None) -> None:
        self.clock = Clock()
        self.version = 0
        self.plain_runs = 0
        self.plain_cost = plain_cost
        self.built: list[FakeForm] = []
        self.fast_cost = fast_cost
        self.forms = FastForms(("fast",), build or self.build, self.plain, lambda: self.version,
                               self.clock)

    def build(self, backend: str) -> FakeForm:
        form = FakeForm(self.clock, self.fast_cost)
        self.built.append(form)
        return form

    async def plain(self, flat: list[Any], caller_inputs: Any, caller: Any,
                    signature: Any) -> list[Any]:
        self.plain_runs += 1
        self.clock.now += self.plain_cost
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
    """Runs until the signature's verdict: the warm runs, then the alternating timed ones."""
    return [await setup.run() for _ in range(forms.WARM + 2 * forms.SAMPLES)]


async def test_the_plain_graph_serves_until_the_form_is_built_then_the_faster_wins() -> None:
    setup = Setup(fast_cost=1.0, plain_cost=2.0)
    assert await setup.run() == "plain"  # starts the build
    setup.wait_built()
    served = await _decide(setup)
    assert served[:forms.WARM] == ["fast"] * forms.WARM
    assert served[forms.WARM:].count("fast") == served[forms.WARM:].count("plain")
    assert [await setup.run() for _ in range(5)] == ["fast"] * 5
    verdict = setup.forms.statistics()["signatures"][str(SIG)]
    assert verdict["form"] == "fast" and "fast 1000000 us, plain 2000000 us" in verdict["why"]
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
    assert setup.forms.statistics()["signatures"][str(SIG)]["form"] == "plain"
    await setup.forms.aclose()


async def test_no_timing_while_the_forms_delegates_still_build() -> None:
    setup = Setup()
    await setup.run()
    setup.wait_built()
    setup.built[0].idle = False
    assert [await setup.run() for _ in range(3 * forms.WARM)] == ["fast"] * (3 * forms.WARM)
    assert setup.plain_runs == 1  # only the run before the build
    assert setup.forms.statistics()["signatures"][str(SIG)]["form"] == "measuring"
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
    def fails(backend: str) -> Any:
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

    def empty(backend: str) -> FakeForm:
        form = setup.build(backend)
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

    def slow(backend: str) -> FakeForm:
        release.wait(10)
        return setup.build(backend)

    setup.forms._build = slow
    await setup.run()
    assert setup.forms.statistics()["state"] == "building"
    threading.Timer(0.05, release.set).start()
    await setup.forms.aclose()
    assert not any(t.name == "asyncgraph-fast-form" for t in threading.enumerate())
    assert setup.built and setup.built[0].closed

"""The common harness: alternating runs, warm-up, medians, ratios, targets, progress, reports.

Why it is built this way: the machine is small and shared, so absolute times drift by tens of
percent from one minute to the next. A ratio of two medians taken in the same process, with the
peers interleaved round by round (in a new seeded random order each round, so no peer always
runs first, or always right after the same peer), cancels most of that drift. Warm-up rounds
are dropped: the first executions of anything pay for lazy initialisation (worker threads,
frames, dispatcher caches). A sample is a batch of calls sized to last a few milliseconds, so
timer resolution and the harness's own cost disappear in it.

Every peer is first run once and its output compared with asyncgraph's; a peer that disagrees
is reported as a mismatch, and its time still shown, so a "fast" wrong answer is visible.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

Size = Literal["full", "quick", "tiny"]
Loop = Literal["asyncio", "uvloop"]
LOOPS: tuple[Loop, ...] = ("asyncio", "uvloop")

REFERENCE = "asyncgraph"


@dataclass(frozen=True)
class Settings:
    """How big and how long a run is.

    `full` is the measurement the targets are defined for; `quick` keeps the sizes of the
    targets but runs few rounds (a look, not a figure to quote); `tiny` shrinks the graphs too
    and runs one round: the smoke test CI runs, which checks structure and outputs only.
    """

    size: Size = "full"
    rounds: int | None = None
    warmup: int | None = None
    sample_s: float | None = None
    loop: Loop = "asyncio"
    threads: int = 1
    seed: int = 0

    def pick(self, full: Any, quick: Any, tiny: Any) -> Any:
        """The value for this run's size."""
        return {"full": full, "quick": quick, "tiny": tiny}[self.size]

    @property
    def n_rounds(self) -> int:
        return self.rounds if self.rounds is not None else self.pick(15, 5, 1)

    @property
    def n_warmup(self) -> int:
        return self.warmup if self.warmup is not None else self.pick(3, 1, 0)

    @property
    def target_sample_s(self) -> float:
        """How long one timed sample (a batch of calls) should last."""
        return self.sample_s if self.sample_s is not None else self.pick(0.02, 0.01, 0.0)


def event_loop(name: str) -> Loop:
    """`name` as a Settings.loop: raises ValueError naming the choices for any other."""
    for loop in LOOPS:
        if loop == name:
            return loop
    raise ValueError(f"expected one of {', '.join(LOOPS)}, got {name!r}")


# -- results --------------------------------------------------------------------------------


@dataclass
class PeerResult:
    """One peer of one case: its timing summary and whether its output matched asyncgraph's."""

    name: str
    note: str = ""
    median_s: float | None = None
    p10_s: float | None = None
    p90_s: float | None = None
    samples: int = 0
    calls_per_sample: int = 0
    matched: bool | None = None
    failed: bool = False  # it raised: not timed
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # one value per measured round, in round order (seconds per call, or requests per second
    # in concurrency cases): the peers' values of one round were measured minutes apart at most
    rounds: list[float] = field(default_factory=list)


@dataclass
class Target:
    """One of the issue's targets: `value op limit`, e.g. 1.7 <= 2.0 (a ratio, "x")."""

    number: int
    name: str
    value: float | None
    op: Literal["<=", ">="]
    limit: float
    unit: str = "x"
    note: str = ""
    # p10 and p90 of the same ratio taken round by round (CaseResult.round_spread): whether
    # the target holds in most rounds, or only in the medians
    rounds: tuple[float, float] | None = None

    @property
    def met(self) -> bool:
        if self.value is None or math.isnan(self.value):
            return False
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


@dataclass
class CaseResult:
    """One measured case of a scenario (a graph, a configuration), with its peers and targets."""

    scenario: str
    case: str
    description: str
    params: dict[str, Any] = field(default_factory=dict)
    peers: list[PeerResult] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    columns: str = "time"  # how the report shows the peers: "time" or "metrics"
    # one line each, shown under the case's table: peers left out, and why (peers.left_out)
    notes: list[str] = field(default_factory=list)

    def peer(self, name: str) -> PeerResult:
        for p in self.peers:
            if p.name == name:
                return p
        raise KeyError(f"{self.case}: no peer named {name!r}")

    def ratio(self, name: str, baseline: str) -> float | None:
        """median(name) / median(baseline): below 1 means `name` is faster (None when either
        peer is missing or was not timed)."""
        if not self._has(name, baseline):
            return None
        a, b = self.peer(name).median_s, self.peer(baseline).median_s
        if a is None or b is None or b <= 0:
            return None
        return a / b

    def round_spread(self, name: str, baseline: str) -> tuple[float, float] | None:
        """p10 and p90 of value(name) / value(baseline) over the rounds, each ratio taken
        within one round: drift between rounds, which moves both peers, cancels in it."""
        if not self._has(name, baseline):
            return None
        a, b = self.peer(name).rounds, self.peer(baseline).rounds
        ratios = [x / y for x, y in zip(a, b, strict=False) if y > 0]
        if len(ratios) < 2 or len(a) != len(b):
            return None
        return quantile(ratios, 0.10), quantile(ratios, 0.90)

    def _has(self, *names: str) -> bool:
        present = {p.name for p in self.peers}
        return all(n in present for n in names)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = [t.as_dict() for t in self.targets]
        reference = self.peers[0].median_s if self.peers else None
        for p in d["peers"]:
            m = p["median_s"]
            p["asyncgraph_over_peer"] = (
                reference / m if reference and m and self.columns == "time" else None
            )
        return d


def skipped_case(scenario: str, why: str) -> CaseResult:
    """The one case a scenario that cannot run here reports: its name and why, no peers."""
    case = CaseResult(scenario, f"{scenario} (skipped)", f"{scenario} skipped: {why}",
                      {"skipped": why})
    case.metrics["skipped"] = why
    return case


def environment() -> dict[str, Any]:
    """What the numbers were measured on; they mean little without it."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# -- measuring ------------------------------------------------------------------------------


@dataclass
class Peer:
    """Something to time: `call()` runs the workload once and returns its output.

    Sync peers are wrapped in a coroutine that never suspends (costs well under a microsecond),
    so all peers are timed the same way, from the same event loop.

    `settle_s`: how long the machine is left idle after each of this peer's samples, before the
    next peer's. An ONNX Runtime session with 2 or more intra-op threads keeps its pool's
    threads spinning a while after its last call; on 2 vCPUs that tail took much of the CPU
    from the next peer's sample and slowed it
    (benchmarks/results/cpu/design_measurements.md#onnx-pool-spin-between-peers).
    """

    name: str
    call: Callable[[], Awaitable[Any]]
    note: str = ""
    settle_s: float = 0.0

    async def settle(self) -> None:
        """Leave the machine idle for `settle_s` (after one of this peer's samples)."""
        if self.settle_s:
            await asyncio.sleep(self.settle_s)


def sync_peer(name: str, fn: Callable[[], Any], note: str = "", settle_s: float = 0.0) -> Peer:
    async def call() -> Any:
        return fn()

    return Peer(name, call, note, settle_s)


def compare_outputs(expected: Any, actual: Any, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """Raise AssertionError when the flat leaves of two outputs differ."""
    a = [x for x in pytree.tree_leaves(expected)]
    b = [x for x in pytree.tree_leaves(actual)]
    if len(a) != len(b):
        raise AssertionError(f"expected {len(a)} outputs, got {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, msg=_leaf_message(i))
        elif x != y:
            raise AssertionError(f"[{i}] expected {x!r}, got {y!r}")


def _leaf_message(index: int) -> Callable[[str], str]:
    """assert_close's message for the output leaf `index`: its own, prefixed by the index."""
    return lambda message: f"[{index}] {message}"


async def verify(peers: Sequence[Peer], results: dict[str, PeerResult], **tol: float) -> None:
    """Run every peer once and compare its output with the first peer's (asyncgraph)."""
    expected: Any = None
    for i, peer in enumerate(peers):
        result = results[peer.name]
        try:
            out = await peer.call()
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            result.matched = False
            result.failed = True
            continue
        if i == 0:
            expected = out
            result.matched = True
            continue
        try:
            compare_outputs(expected, out, **tol)
            result.matched = True
        except AssertionError as exc:
            result.matched = False
            result.error = f"output mismatch: {str(exc).splitlines()[0][:200]}"


def round_order(peers: Sequence[Peer], rng: random.Random) -> list[Peer]:
    """The peers in a new random order: a fixed rotation gave every peer the same predecessor
    in every round, and a peer whose threads keep spinning after it returns (dask's threads
    run torch ops with OpenMP teams, which spin a while before they sleep) slowed whichever
    peer came next, every time: the default executor, always after dask threaded, read 3-5%
    slower than the identically placed "all inline" one alone and 11-18% in full runs."""
    return rng.sample(list(peers), len(peers))


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once and move every object to the collector's permanent generation
    (gc.freeze) while the rounds run, so the collection before each round sees only what the
    round made. A full collection walks the whole heap (about 200,000 objects with torch
    loaded: ~100 ms here), which evicts the caches and left the first execution after it
    slower: 12 ms instead of 7 for the skewed graph on two workers, a cost of no peer's own.
    What the caller had frozen (the test suite freezes earlier modules' objects) stays frozen.
    """
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


async def alternate(
    peers: Sequence[Peer],
    settings: Settings,
    advance: Callable[[], None],
    results: dict[str, PeerResult],
) -> None:
    """Time the peers round by round, interleaved, and store median/p10/p90 in `results`.

    Peers whose verification raised are skipped. Each round runs them in a new order
    (`round_order`). Each peer's calls per sample are counted again from its fastest warm-up
    round, so every peer's samples last about as long, warm.
    """
    live = [p for p in peers if not results[p.name].failed]
    calls = {p.name: await _calls_per_sample(p, settings.target_sample_s) for p in live}
    samples: dict[str, list[float]] = {p.name: [] for p in live}
    total = settings.n_warmup + settings.n_rounds
    rng = random.Random(settings.seed)
    warm = {p.name: float("inf") for p in live}  # per peer: its fastest warm-up round
    with frozen_heap():
        for r in range(total):
            gc.collect()
            for peer in round_order(live, rng):
                n = calls[peer.name]
                call = peer.call
                start = time.perf_counter()
                for _ in range(n):
                    await call()
                elapsed = (time.perf_counter() - start) / n
                if r >= settings.n_warmup:
                    samples[peer.name].append(elapsed)
                else:
                    warm[peer.name] = min(warm[peer.name], elapsed)
                await peer.settle()
            if r == settings.n_warmup - 1 and settings.target_sample_s > 0:
                calls = {name: _calls_for(warm[name], settings.target_sample_s) for name in calls}
            advance()
    for name, xs in samples.items():
        res = results[name]
        res.samples = len(xs)
        res.calls_per_sample = calls[name]
        res.rounds = xs
        if xs:
            res.median_s = statistics.median(xs)
            res.p10_s = quantile(xs, 0.10)
            res.p90_s = quantile(xs, 0.90)


async def _calls_per_sample(peer: Peer, target_s: float) -> int:
    """How many calls make one sample last about `target_s` (at least one).

    From the fastest of a few calls: a peer's first calls may be warm-ups (adaptive placement
    profiles its first executions), and a sample of few calls weighs the cold first call after
    each round's gc.collect() more than a sample of many.
    """
    if target_s <= 0:
        return 1
    one = float("inf")
    spent = 0.0
    for _ in range(8):
        start = time.perf_counter()
        await peer.call()
        took = time.perf_counter() - start
        one, spent = min(one, took), spent + took
        if spent > target_s:
            break
    return _calls_for(one, target_s)


def _calls_for(per_call_s: float, target_s: float) -> int:
    """Calls per sample of a peer taking `per_call_s` a call.

    `alternate` counts again from the fastest warm-up round: the first calls `_calls_per_sample`
    sees may still be warming up (adaptive placement profiles several executions: tiny BERT's
    first ten ran 1.5-10 ms against 0.9 warm), which gave that peer fewer calls per sample
    than the others (5 against nativert's 14) and so weighed its cold first call after each
    round's collection more.
    """
    return max(1, min(10_000, round(target_s / max(per_call_s, 1e-7))))


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation (statistics.quantiles needs two points)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def new_results(peers: Sequence[Peer]) -> dict[str, PeerResult]:
    return {p.name: PeerResult(p.name, p.note) for p in peers}


async def measure(
    peers: Sequence[Peer],
    settings: Settings,
    advance: Callable[[], None],
    **tol: float,
) -> list[PeerResult]:
    """Verify every peer against the first, then time them all alternately."""
    results = new_results(peers)
    await verify(peers, results, **tol)
    await alternate(peers, settings, advance, results)
    return [results[p.name] for p in peers]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with `n` intra-op threads, then restore the previous number."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the suite's context ----------------------------------------------------------------------


class Context:
    """What a scenario gets: the settings and a way to report progress."""

    def __init__(
        self,
        settings: Settings,
        start_task: Callable[[str, int], Callable[[], None]] | None = None,
    ) -> None:
        self.settings = settings
        self._start_task = start_task

    def task(self, description: str, total: int) -> Callable[[], None]:
        """Start a progress bar of `total` steps; returns the function that advances it."""
        if self._start_task is None:
            return lambda: None
        return self._start_task(description, total)

    @property
    def rounds_total(self) -> int:
        return self.settings.n_warmup + self.settings.n_rounds

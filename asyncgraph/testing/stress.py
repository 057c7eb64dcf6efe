"""The stress harness: many concurrent callers, cancellations, timeouts, faults, weight swaps.

    report = await run_stress("model.pt2", StressConfig(executions=500, concurrency=32,
                                                        cancel_rate=0.1, fault_rate=0.05))
    print(report.summary())
    assert report.ok, report.violations

Every decision is drawn from `seed` before the run starts: each execution's inputs, whether it
is cancelled or timed out and after how long, and the weights of every swap. Kernel faults and
delays come from a seeded FaultInjector (one random stream per node). The interleaving of
threads is not replayable; with `concurrency=1` fault decisions are made per execution, so a
run without cancellations and timeouts (whose outcome depends on timing) replays exactly.

Executions draw their inputs from `distinct_inputs` input sets made up front, so the check is
cheap: every completed result is checked against a ReferenceRunner (serial, graph order, no
faults) on the weights version(s) the execution may have used, and the reference runs once per
input set and weights version, not once per execution (`StressReport.reference_runs`). A
violation is anything a correct executor never does: a wrong result, an exception other than
the injected ones, a fault without its node context, an unrequested cancellation, a frame or
thread left behind, or statistics that disagree with what the callers saw.
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils import _pytree as pytree

from asyncgraph.graph.importers import Program, ProgramLike, to_program
from asyncgraph.graph.ir import OutputKind
from asyncgraph.testing.faults import FaultInjector, InjectedFault
from asyncgraph.testing.reference import ReferenceRunner, perturbed_weights, random_inputs

if TYPE_CHECKING:
    from asyncgraph.runtime.config import ExecutorConfig
    from asyncgraph.runtime.executor import Executor, ExecutorStatistics

InputsFactory = Callable[[random.Random], list[Any]]
ProgressCallback = Callable[[str, int, int], None]
"""`progress(phase, done, total)`: phase "run" as executions finish, "verify" as results are
checked."""
_WARM_UP = 3  # fault-free executions that measure the latency scale first


@dataclass(frozen=True)
class StressConfig:
    """What a stress run does. Rates are probabilities in [0, 1].

    Attributes:
        executions: executions to run in all.
        concurrency: callers running executions at the same time.
        cancel_rate: fraction of executions whose caller is cancelled after a random delay.
        timeout_rate: fraction of executions run under asyncio.timeout with a random deadline.
        fault_rate: fraction of executions that hit an injected kernel fault (InjectedFault),
            spread evenly over the nodes each execution runs (not the folded ones). With
            batching an execution is a batch, and a faulted batch of several requests is
            retried request by request (BatchingConfig.retry_alone), each retry drawing its
            own faults: the report counts injected faults, retried batches and the faults
            that reached callers apart.
        delay_rate: fraction of kernel calls delayed by up to `max_delay_s` (worker and async
            kernels only, so the event loop itself is never put to sleep).
        max_delay_s: the longest injected delay.
        swap_weights_every: swap in perturbed weights after every this many executions have
            started; 0 never swaps.
        seed: the seed every decision is drawn from.
        max_loop_lag_s: when set, a heartbeat lag p99 above it is a violation. None (the
            library's default) only reports the lag; `asyncgraph stress` checks 100 ms unless
            told otherwise. The heartbeat runs from the first execution to the last, after a
            full garbage collection: a collection owed by earlier work (over a second on a big
            heap) would otherwise be counted as the run's lag.
        distinct_inputs: input sets the executions draw from (at most `executions`). Fewer
            make the reference check cheaper (one reference run per set and weights version);
            more make it likelier that two concurrent executions have different inputs, which
            is what catches results crossing between executions.
    """

    executions: int = 200
    concurrency: int = 16
    cancel_rate: float = 0.05
    timeout_rate: float = 0.05
    fault_rate: float = 0.05
    delay_rate: float = 0.1
    max_delay_s: float = 0.002
    swap_weights_every: int = 0
    seed: int = 0
    max_loop_lag_s: float | None = None
    distinct_inputs: int = 32

    def __post_init__(self) -> None:
        if self.executions < 1:
            raise ValueError(f"executions must be >= 1, got {self.executions}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("cancel_rate", "timeout_rate", "fault_rate", "delay_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.cancel_rate + self.timeout_rate > 1.0:
            raise ValueError(
                "cancel_rate + timeout_rate must be <= 1, "
                f"got {self.cancel_rate} + {self.timeout_rate}"
            )
        if self.max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {self.max_delay_s}")
        if self.swap_weights_every < 0:
            raise ValueError(f"swap_weights_every must be >= 0, got {self.swap_weights_every}")
        if self.distinct_inputs < 1:
            raise ValueError(f"distinct_inputs must be >= 1, got {self.distinct_inputs}")


@dataclass(frozen=True)
class StressReport:
    """The outcome of a stress run; `ok` when there was no violation.

    `faulted` counts the callers whose call failed with an injected fault: the faults that
    reached callers. `injected_faults` counts the kernel calls that raised one, and
    `retried_batches` the batches of several requests that failed and were retried request by
    request (0 without batching). A fault reaches at most one caller and a retried batch
    absorbs at least one fault, so `injected_faults >= faulted + retried_batches` when failed
    batches are retried (a violation otherwise); the rest hit executions whose callers had
    gone (cancelled, timed out) or hit the same execution twice (nodes on several threads).
    """

    config: StressConfig
    completed: int
    cancelled: int
    timed_out: int
    faulted: int
    mismatches: int
    errors: int
    weight_swaps: int
    frames_high_water: int
    max_frames: int
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    elapsed_s: float  # warm-up and executions, up to the executor's close
    violations: tuple[str, ...] = ()
    verify_s: float = 0.0  # checking the results against the reference
    total_s: float = 0.0  # everything: making the inputs, the run and the check
    reference_runs: int = 0
    injected_faults: int = 0
    retried_batches: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        """A short plain-text summary, one fact per line."""
        c = self.config
        lines = [
            f"stress: {c.executions} executions, concurrency {c.concurrency}, seed {c.seed}",
            f"  completed    {self.completed}",
            f"  cancelled    {self.cancelled}",
            f"  timed out    {self.timed_out}",
            f"  faulted      {self.faulted} (injected faults that reached callers)",
            f"  injected     {self.injected_faults} fault(s), {self.retried_batches} failed "
            "batch(es) retried request by request",
            f"  mismatches   {self.mismatches}",
            f"  errors       {self.errors}",
            f"  weight swaps {self.weight_swaps}",
            f"  frames high-water {self.frames_high_water}/{self.max_frames}",
            f"  loop lag p99 {self.loop_lag_p99_ms:.2f} ms (max {self.loop_lag_max_ms:.2f} ms)",
            f"  elapsed      {self.elapsed_s:.2f} s run, {self.verify_s:.2f} s verification "
            f"({self.reference_runs} reference runs), {self.total_s:.2f} s in all",
            "  result       " + ("ok" if self.ok else f"{len(self.violations)} violation(s)"),
        ]
        lines += [f"  ! {v}" for v in self.violations[:20]]
        if len(self.violations) > 20:
            lines.append(f"  ! ... and {len(self.violations) - 20} more")
        return "\n".join(lines)


class LoopLagMonitor:
    """A heartbeat task that sleeps `interval_s` again and again and records how late it wakes.

    The lag of one beat is the time it took beyond `interval_s`: what any callback scheduled on
    the loop waits because something else holds the loop.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def _beat(self) -> None:
        interval = self.interval_s
        clock = time.perf_counter
        while True:
            start = clock()
            await asyncio.sleep(interval)
            self.lags.append(max(0.0, clock() - start - interval))

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100) of the recorded lags in seconds; 0 when none."""
        if not self.lags:
            return 0.0
        ordered = sorted(self.lags)
        k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
        return ordered[k]

    @property
    def p99(self) -> float:
        return self.percentile(99)

    @property
    def max(self) -> float:
        return max(self.lags, default=0.0)


# -- the run ------------------------------------------------------------------------------------

Action = Literal["run", "cancel", "timeout"]


@dataclass
class _Job:
    index: int
    input_set: int  # the index of its inputs among the distinct input sets
    inputs: list[Any]
    action: Action
    after_fraction: float
    outputs: list[Any] | None = None
    versions: tuple[int, int] = (0, 0)


@dataclass
class _Tally:
    completed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    faulted: int = 0
    errors: int = 0
    violations: list[str] = field(default_factory=list)


async def run_stress(
    program: ProgramLike,
    config: StressConfig | None = None,
    *,
    executor_config: ExecutorConfig | None = None,
    inputs: InputsFactory | None = None,
    progress: ProgressCallback | None = None,
) -> StressReport:
    """Drive an Executor of `program` as `config` says and check everything (module docstring).

    `inputs(rng)` makes one set of flat inputs (`config.distinct_inputs` are made); by default
    they are random tensors shaped like the example the program was exported with. The program
    must not mutate its buffers (results would depend on the order of executions).
    `progress(phase, done, total)` is told how the run ("run") and the check ("verify") go.
    """
    from asyncgraph.runtime.executor import Executor

    config = config or StressConfig()
    began = time.perf_counter()
    prog = to_program(program)
    if any(o.kind is OutputKind.BUFFER_MUTATION for o in prog.graph.signature.outputs):
        raise ValueError(
            f"{prog.name}: the program mutates buffers, so its results depend on the order of "
            "executions; stress needs a program without buffer mutations"
        )
    rng = random.Random(config.seed)
    make_inputs: InputsFactory = inputs or (lambda r: random_inputs(prog, r))
    input_sets = [make_inputs(rng) for _ in range(min(config.distinct_inputs, config.executions))]
    jobs = _plan_jobs(config, rng, input_sets)
    swaps = _plan_swaps(config, prog, rng)
    faults = FaultInjector(seed=config.seed)
    references = _References(ReferenceRunner(prog), input_sets)
    tally = _Tally()
    executor = Executor(prog, executor_config, kernel_factory=faults.kernel_factory())
    # Faults on the nodes every execution runs: not on those folded into constants, which
    # run when the Executor is built and on each weights swap, not per request.
    executed = [node.name for node in executor.graph.nodes]
    per_call = (
        1.0 - (1.0 - config.fault_rate) ** (1.0 / max(1, len(executed)))
        if config.fault_rate else 0.0
    )
    faults.random(
        raise_rate=per_call, delay_rate=config.delay_rate, max_delay_s=config.max_delay_s,
        nodes=executed,
    )
    versions: dict[int, dict[str, Any]] = {executor.weights.version: dict(prog.weights)}
    started = time.perf_counter()
    monitor = LoopLagMonitor()
    try:
        scale = await _warm_up(executor, faults, references, tally)
        gc.collect()  # the debt of earlier work: a full collection of a big heap holds the loop
        async with monitor:
            await _drive(executor, faults, config, jobs, swaps, versions, scale, tally, progress)
    finally:
        await monitor.stop()
        stats = executor.statistics()
        await executor.aclose(cancel=True)
    elapsed = time.perf_counter() - started
    injected = sum(1 for event in faults.events if event.action == "raise")
    batching = executor.batching_statistics()
    retried = batching.retried_alone if batching is not None else 0
    _check_after(executor, stats, tally, jobs)
    _check_faults(executor, injected, retried, tally)
    mismatches = await _verify(references, jobs, versions, tally, progress)
    verified = time.perf_counter()
    lag_p99 = monitor.p99
    if config.max_loop_lag_s is not None and lag_p99 > config.max_loop_lag_s:
        tally.violations.append(
            f"loop lag p99 {lag_p99 * 1e3:.2f} ms exceeds {config.max_loop_lag_s * 1e3:.2f} ms"
        )
    return StressReport(
        config=config,
        completed=tally.completed,
        cancelled=tally.cancelled,
        timed_out=tally.timed_out,
        faulted=tally.faulted,
        mismatches=mismatches,
        errors=tally.errors,
        weight_swaps=len(versions) - 1,
        frames_high_water=stats.frames.high_water,
        max_frames=stats.frames.max_frames,
        loop_lag_p99_ms=lag_p99 * 1e3,
        loop_lag_max_ms=monitor.max * 1e3,
        elapsed_s=elapsed,
        violations=tuple(tally.violations),
        verify_s=verified - started - elapsed,
        total_s=verified - began,
        reference_runs=references.runs,
        injected_faults=injected,
        retried_batches=retried,
    )


def _plan_jobs(
    config: StressConfig, rng: random.Random, input_sets: Sequence[list[Any]]
) -> list[_Job]:
    jobs = []
    for i in range(config.executions):
        draw = rng.random()
        action: Action = "run"
        if draw < config.cancel_rate:
            action = "cancel"
        elif draw < config.cancel_rate + config.timeout_rate:
            action = "timeout"
        chosen = rng.randrange(len(input_sets))
        jobs.append(_Job(i, chosen, input_sets[chosen], action, rng.random()))
    return jobs


def _plan_swaps(config: StressConfig, prog: Program, rng: random.Random) -> list[dict[str, Any]]:
    if not config.swap_weights_every or not prog.weights:
        return []
    count = (config.executions - 1) // config.swap_weights_every
    return [perturbed_weights(prog.weights, rng) for _ in range(count)]


async def _warm_up(
    executor: Executor, faults: FaultInjector, references: _References, tally: _Tally
) -> float:
    """Run a few executions without faults; return their median latency (the delay scale)."""
    faults.enabled = False
    latencies = []
    version = executor.weights.version
    try:
        for i in range(_WARM_UP):
            input_set = i % len(references.input_sets)
            start = time.perf_counter()
            out = await executor.execute_flat(_clone(references.input_sets[input_set]))
            latencies.append(time.perf_counter() - start)
            problem = _compare(out, await references.expected(input_set, version))
            if problem:
                tally.violations.append(f"warm-up execution: wrong result: {problem}")
    finally:
        faults.enabled = True
    return max(statistics.median(latencies), 1e-4)


async def _drive(
    executor: Executor,
    faults: FaultInjector,
    config: StressConfig,
    jobs: list[_Job],
    swaps: list[dict[str, Any]],
    versions: dict[int, dict[str, Any]],
    scale: float,
    tally: _Tally,
    progress: ProgressCallback | None = None,
) -> None:
    queue = list(reversed(jobs))
    finished = 0
    pending_swaps = list(reversed(swaps))
    launched = 0
    # a deadline anywhere from "at once" to "while waiting behind the other callers"
    horizon = scale * (2.0 + config.concurrency / max(1, executor.config.max_concurrent_executions))

    async def caller() -> None:
        nonlocal launched, finished
        while queue:
            job = queue.pop()
            launched += 1
            every = config.swap_weights_every
            if every and launched % every == 0 and pending_swaps:
                state = pending_swaps.pop()
                previous = versions[executor.weights.version]
                version = executor.swap_weights(state)
                versions[version] = {**previous, **state}
            if config.concurrency == 1:
                faults.epoch = job.index + 1  # decisions per execution: an exact replay
            await _run_job(executor, job, job.after_fraction * horizon, tally)
            finished += 1
            if progress is not None:
                progress("run", finished, len(jobs))

    callers = [asyncio.create_task(caller()) for _ in range(config.concurrency)]
    try:
        await asyncio.gather(*callers)
    finally:
        for task in callers:
            task.cancel()
        await asyncio.gather(*callers, return_exceptions=True)


async def _run_job(executor: Executor, job: _Job, after_s: float, tally: _Tally) -> None:
    first = executor.weights.version
    call_inputs = _clone(job.inputs)
    try:
        if job.action == "timeout":
            async with asyncio.timeout(after_s):
                outputs = await executor.execute_flat(call_inputs)
        elif job.action == "cancel":
            task = asyncio.create_task(executor.execute_flat(call_inputs))
            handle = asyncio.get_running_loop().call_later(after_s, task.cancel)
            try:
                outputs = await task
            finally:
                handle.cancel()
        else:
            outputs = await executor.execute_flat(call_inputs)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if job.action != "cancel" or (current is not None and current.cancelling()):
            if current is not None and current.cancelling():
                raise
            tally.errors += 1
            tally.violations.append(f"execution {job.index}: cancelled though nobody cancelled it")
            return
        tally.cancelled += 1
        return
    except TimeoutError:
        if job.action == "timeout":
            tally.timed_out += 1
            return
        tally.errors += 1
        tally.violations.append(f"execution {job.index}: unexpected TimeoutError")
        return
    except BaseException as exc:  # every other outcome is classified
        _classify_failure(job, exc, tally)
        return
    job.outputs = outputs
    job.versions = (first, executor.weights.version)
    tally.completed += 1


def _classify_failure(job: _Job, exc: BaseException, tally: _Tally) -> None:
    leaves = list(_leaves(exc))
    if leaves and all(isinstance(e, InjectedFault) for e in leaves):
        tally.faulted += 1
        for leaf in leaves:
            notes = getattr(leaf, "__notes__", [])
            if not any(n.startswith("While executing %") for n in notes):
                tally.violations.append(
                    f"execution {job.index}: injected fault without node context: {leaf!r}"
                )
        return
    tally.errors += 1
    tally.violations.append(
        f"execution {job.index}: unexpected {type(exc).__name__}: {str(exc)[:200]}"
    )


def _leaves(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _check_after(
    executor: Executor, stats: ExecutorStatistics, tally: _Tally, jobs: list[_Job]
) -> None:
    """Nothing left behind, and the executor's counters agree with what callers saw."""
    after = executor.statistics()
    if after.frames.in_use:
        tally.violations.append(f"{after.frames.in_use} frame(s) still in use after the run")
    if after.frames.waiters:
        tally.violations.append(f"{after.frames.waiters} frame waiter(s) left after the run")
    if after.workers.threads:
        tally.violations.append(f"{after.workers.threads} worker thread(s) alive after aclose")
    if stats.frames.total > stats.frames.max_frames:
        tally.violations.append(
            f"{stats.frames.total} frames exist, more than the maximum {stats.frames.max_frames}"
        )
    completed = tally.completed + _WARM_UP
    failed = tally.faulted + tally.errors
    batching = executor.batching_statistics()
    if batching is not None:  # executions are batches: count requests instead
        if batching.requests < completed + failed:
            tally.violations.append(
                f"the batcher took {batching.requests} requests, callers got "
                f"{completed + failed} results"
            )
        if batching.queued or batching.running:
            tally.violations.append(
                f"{batching.queued} request(s) queued and {batching.running} batch(es) "
                "running after the run"
            )
    else:
        if stats.completed != completed:
            tally.violations.append(
                f"executor counted {stats.completed} completed executions, callers got "
                f"{completed}"
            )
        if not tally.faulted <= stats.failed <= failed:
            tally.violations.append(
                f"executor counted {stats.failed} failed executions, callers saw {failed} "
                "failures"
            )
    if sum(1 for j in jobs if j.outputs is not None) != tally.completed:
        tally.violations.append("a completed execution has no outputs")


def _check_faults(executor: Executor, injected: int, retried: int, tally: _Tally) -> None:
    """Each fault a caller saw and each retried batch came from an injected fault of its own
    execution (a batch's members are retried one by one, each an execution of its own)."""
    batching = executor.batching
    if batching is not None and not batching.retry_alone:
        return  # one fault in a batch reaches every member
    if injected < tally.faulted + retried:
        tally.violations.append(
            f"{tally.faulted} fault(s) reached callers and {retried} failed batch(es) were "
            f"retried, but only {injected} fault(s) were injected"
        )


class _References:
    """The reference's outputs per (input set, weights version), each computed once, and the
    count of reference runs."""

    def __init__(self, reference: ReferenceRunner, input_sets: Sequence[list[Any]]) -> None:
        self.input_sets = input_sets
        self.runs = 0
        self._reference = reference
        self._runners: dict[int, ReferenceRunner] = {}
        self._weights: dict[int, dict[str, Any]] = {}
        self._outputs: dict[tuple[int, int], list[Any]] = {}

    def add_weights(self, versions: dict[int, dict[str, Any]]) -> None:
        self._weights.update(versions)

    async def expected(self, input_set: int, version: int) -> list[Any]:
        key = (input_set, version)
        if key not in self._outputs:
            self._outputs[key] = await self._runner(version).run_flat(
                _clone(self.input_sets[input_set])
            )
            self.runs += 1
        return self._outputs[key]

    def forget_before(self, version: int) -> None:
        """Drop the outputs and runners of weights versions older than `version`."""
        for key in [k for k in self._outputs if k[1] < version]:
            del self._outputs[key]
        for old in [v for v in self._runners if v < version]:
            del self._runners[old]

    def _runner(self, version: int) -> ReferenceRunner:
        if version not in self._runners:
            weights = self._weights.get(version)
            self._runners[version] = (
                self._reference if weights is None else self._reference.with_weights(weights)
            )
        return self._runners[version]


async def _verify(
    references: _References,
    jobs: list[_Job],
    versions: dict[int, dict[str, Any]],
    tally: _Tally,
    progress: ProgressCallback | None = None,
) -> int:
    """Compare each completed result with the reference on the weights it may have used.

    Jobs are checked in the order of the first weights version they may have used, so the
    reference outputs of older versions can be dropped on the way.
    """
    references.add_weights(versions)
    done = [job for job in jobs if job.outputs is not None]
    done.sort(key=lambda job: (job.versions[0], job.index))
    mismatches = 0
    for checked, job in enumerate(done, 1):
        assert job.outputs is not None
        first, last = job.versions
        references.forget_before(first)
        problems = []
        for version in range(first, last + 1):
            problem = _compare(job.outputs, await references.expected(job.input_set, version))
            if not problem:
                break
            problems.append(f"weights v{version}: {problem}")
        else:
            mismatches += 1
            tally.violations.append(
                f"execution {job.index}: result differs from the reference: "
                + "; ".join(problems)[:300]
            )
        job.outputs = None  # drop results as soon as they are checked
        if progress is not None:
            progress("verify", checked, len(done))
    return mismatches


def _compare(actual: Any, expected: Any) -> str:
    """'' when equal (tensors within float tolerance, NaN equal to NaN), else what differs."""
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    if got_spec != want_spec:
        return f"structure {got_spec} != {want_spec}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"output {i}: expected a Tensor, got {type(a).__name__}"
            try:
                torch.testing.assert_close(a, b, equal_nan=True)
            except AssertionError as exc:
                return f"output {i}: {str(exc).splitlines()[0]}"
        elif a != b and not (_is_nan(a) and _is_nan(b)):
            return f"output {i}: {a!r} != {b!r}"
    return ""


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _clone(values: Sequence[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]

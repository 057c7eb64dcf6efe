"""The host's cost of a CUDA-graph replay, on a GPU that does nothing (issue 50).

    python -m benchmarks.gpu_host [--quick] [--rounds N] [--warmup N] [--json] [-o FILE]

Issue 50 asks, before any GPU run: "a host-path microbenchmark on a no-op backend: <= 40 us per
replay and <= 10 us per batched request". On a GPU a replayed execution is one graph launch,
so what it costs the host (asyncgraph's Python and the event loop) bounds how many requests
one process serves whatever the GPU's speed. This measures that cost without a GPU.

The backend (`NoOpBackend`): asyncgraph's CUDA layer (asyncgraph/cuda/device.py's `Backend`)
over streams, events and graphs that do nothing: an event is always complete, a graph's
`replay()` only counts itself, a capture only makes its stream current. The program's tensors
are declared on "cuda" (so whole executions are captured, as on a GPU) and are small CPU tensors:
the copies into a graph's static inputs and the clones out of its static outputs, which a GPU
would launch as kernels, are real CPU copies of 64 bytes here. Why not tests/support's simulated
GPU (cuda_graph_fake.py): its replays run the captured kernels again on the host and its event
queries step a simulation of every stream, made to check ordering, not to cost nothing: a
probe of its diamond program (2026-11-29, this machine) took 57-89 us a replay for one caller
and 67-82 us under 64, against 21 and 28 us here, mostly the fake's own work.
benchmarks/gpu_wait.py likewise keeps its own simulated events.

The model: an MLP (Linear(16, 64), ReLU, Linear(64, 16)) exported with a dynamic batch
dimension, every compute node a CUDA kernel of the no-op device; the Executor as the simulated
GPU tests make it (tests/integration/test_gpu_batching.py): `CudaConfig(graphs=True)`, input
validation off (the inputs are CPU tensors for "cuda" specs: the per-signature check is left
out of the figure), adaptive placement and fast forms off. Requests of one row.

Three cases, each asyncgraph against the same no-op work done directly (the baseline: a
hand-written replay of a graph captured on the same backend: the input copied into the
static buffer, `replay()`, the output cloned, an end event recorded and queried), so the
difference is asyncgraph's own:

1. replay, 1 caller: `await ex.execute(x)` in sequence;
2. replay, 64 callers: `asyncio.gather` of 64 `ex.execute(x)` (a frame per caller,
   `max_concurrent_executions=64`; graph instances as instances.py allows); the baseline
   gathers 64 direct replays;
3. batched, 64 callers: the same 64 callers with `BatchingConfig(max_batch_size=64,
   buckets=1, 2, 4, ..., 64)` (benchmarks/gpu.py's `batch_buckets`), each batch replaying its
   bucket's graph; two baselines: one bucket of 64 rows by hand (rows copied in, one replay,
   the output cloned and split), and the same behind 64 gathered tasks that each await a
   future (the least a batching front end costs on asyncio).

Each case warms until a whole round leaves the capture counts unchanged (benchmarks/gpu.py's
`warm_until_settled`), then the harness's `alternate` times the peers round by round in a new
random order each round (asyncgraph/bench/harness.py: warm-up rounds dropped, samples of about
20 ms); the figure is the median over the rounds, per execution (per request when batched),
with the rounds' p10-p90. Every asyncgraph case reports its graph statistics (captures,
replays, fallbacks, instances, instance waits) and counts, from the first verification call to
the last timed one: executions (batches when batched), replays by asyncgraph's statistics and
by the backend's own count of `replay()` calls, captures, warm-ups and fallbacks. A figure
that includes an execution that did not replay is flagged ("NOT all replayed") and its target
counts as not met whatever its value. The 64-caller cases also report the longest event-loop
iteration of each of 50 more rounds (median over the rounds: `loop_iterations`), what a timer
or a request arriving meanwhile waits at most; issue 50's loop-lag target (<= 2 ms under 64
callers) is for a GPU, this is the host's share of it.

What it does not measure: the GPU (nothing runs there), torch's CUDA calls (a stream switch,
a launch: microseconds each on a real GPU, nothing here), input validation, and the host wait
for a GPU that is still busy (the events are complete when first asked: benchmarks/gpu_wait.py
measures that wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import torch

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Peer,
    PeerResult,
    Target,
    alternate,
    new_results,
    quantile,
    verify,
)
from asyncgraph.graph.importers import Program, from_exported_program
from asyncgraph.graph.ir import Graph, Node, TensorSpec
from asyncgraph.kernels import KernelFactory, KernelKind, OpKernel
from asyncgraph.runtime.config import CudaConfig
from benchmarks.gpu import batch_buckets, stats_delta, stats_line, stats_of, warm_until_settled

NAME = "gpu_host"
GRAPHS = ("mlp",)
ISSUE = 50
REPLAY_LIMIT_US = 40.0  # issue 50: host cost per replay on a no-op backend
BATCHED_LIMIT_US = 10.0  # issue 50: host cost per batched request on a no-op backend
CALLERS = 64
DIM, HIDDEN = 16, 64
SEQUENTIAL_ROUND = 16  # executions per warm-up round of the 1-caller case
MAX_WARM_ROUNDS = 20
CAPTURE_STREAMS_PER_DEVICE = 32  # torch's high-priority pool per device, handed out round-robin

#: CudaGraphStatistics counters that must not move while a figure is taken: an execution that
#: warmed up, captured, recaptured, failed or fell back did not replay
NOT_REPLAYS = ("captures", "recaptures", "warmups", "fallbacks", "failures", "before_ready",
               "segment_captures", "segment_warmups", "segment_fallbacks")


# -- the no-op GPU ---------------------------------------------------------------------------------


class NoOpStream:
    """A stream on which nothing runs: waits order nothing, because nothing is ever pending."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<NoOpStream {self.name}>"


class NoOpEvent:
    """An event that is complete as soon as it is recorded (the GPU does nothing)."""

    __slots__ = ()

    def record(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class NoOpGraph:
    """A captured graph whose replay launches nothing: it counts itself on its backend."""

    __slots__ = ("backend", "freed")

    def __init__(self, backend: NoOpBackend) -> None:
        self.backend = backend
        self.freed = False

    def replay(self) -> None:
        if self.freed:
            raise RuntimeError("NoOpGraph.replay: the graph was reset (freed) before this replay")
        self.backend.replays += 1

    def reset(self) -> None:
        self.freed = True


_SAME = object()  # enter_stream's token when the stream was current already


class NoOpBackend:
    """asyncgraph's CUDA `Backend` (asyncgraph/cuda/device.py) over a GPU that does nothing.

    A current stream per thread, as torch.cuda keeps it; capture streams from a pool of 32 per
    device handed out round-robin, as torch's high-priority pool does (the graph instances'
    capture-stream leases see what they would on a GPU); `replays` and `captures` count what
    was asked of it, independently of asyncgraph's own statistics."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.default = NoOpStream("default")
        self._streams = itertools.count()
        self._capture_pool: dict[int, list[NoOpStream]] = {}
        self._capture_turn: dict[int, int] = {}
        self.replays = 0
        self.captures = 0

    def new_stream(self, device: int) -> NoOpStream:
        return NoOpStream(f"d{device}#{next(self._streams)}")

    def new_capture_stream(self, device: int) -> NoOpStream:
        pool = self._capture_pool.setdefault(device, [])
        if len(pool) < CAPTURE_STREAMS_PER_DEVICE:
            pool.append(NoOpStream(f"cap{device}#{len(pool)}"))
            return pool[-1]
        turn = self._capture_turn.get(device, 0)
        self._capture_turn[device] = turn + 1
        return pool[turn % len(pool)]

    def new_event(self) -> NoOpEvent:
        return NoOpEvent()

    def stream_handle(self, stream: Any) -> Any:
        return stream

    def enter_stream(self, handle: Any) -> Any:
        local = self._local
        previous = getattr(local, "stream", None)
        if previous is handle:
            return _SAME
        local.stream = handle
        return previous

    def leave_stream(self, token: Any) -> None:
        if token is not _SAME:
            self._local.stream = token

    def host_streams(self, device: int) -> list[Any]:
        return [self.default]

    def record_stream(self, value: Any, stream: Any) -> None:
        pass

    def new_graph(self) -> NoOpGraph:
        return NoOpGraph(self)

    def graph_pool(self) -> Any:
        return object()

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any, handle: Any) -> Iterator[None]:
        """The kernels run while it is open (small CPU ops): their outputs are the graph's
        static outputs, which replays never write again (the GPU does nothing)."""
        token = self.enter_stream(handle)
        try:
            yield
            self.captures += 1
        finally:
            self.leave_stream(token)


class NoOpDevice(KernelFactory):
    """Every aten compute node a CUDA kernel of the no-op device (what an export on a GPU
    gets); size arithmetic on the batch stays on the host, as on a GPU."""

    def kernel_for(self, node: Node, graph: Graph) -> OpKernel | None:
        kernel = super().kernel_for(node, graph)
        if kernel is not None and kernel.kind in (KernelKind.CPU, KernelKind.DEVICE):
            return OpKernel(kernel.fn, KernelKind.DEVICE, kernel.name, cost=1000,
                            device_type="cuda")
        return kernel


# -- the model -------------------------------------------------------------------------------------


class Mlp(torch.nn.Module):
    """Linear(16, 64), ReLU, Linear(64, 16): a small model, whose replay is one launch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def on_cuda(graph: Graph) -> Graph:
    """`graph` with every tensor spec on "cuda": whole executions are then capturable (the
    values are CPU tensors; validation, which would refuse them, is off)."""
    values = [
        dataclasses.replace(v, spec=dataclasses.replace(v.spec, device=torch.device("cuda")))
        if isinstance(v.spec, TensorSpec) else v
        for v in graph.values
    ]
    return Graph(values, list(graph.nodes), graph.signature)


def device_program(model: torch.nn.Module, callers: int) -> Program:
    """`model` exported with dim 0 dynamic (up to `callers` rows), its tensors on "cuda"."""
    batch = torch.export.Dim("batch", min=1, max=callers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = torch.export.export(model.eval(), (torch.randn(4, DIM),),
                                 dynamic_shapes=({0: batch},))
    program = from_exported_program(ep)
    return dataclasses.replace(program, graph=on_cuda(program.graph), exported=None)


def executor(program: Program, backend: NoOpBackend, **config: Any) -> Executor:
    """An Executor of `program` on the no-op device, whole executions captured."""
    settings = ExecutorConfig(cuda=CudaConfig(graphs=True), validate_inputs=False,
                              adaptive_placement=False, fast_paths=False, **config)
    return Executor(program, settings, kernel_factory=NoOpDevice(), _cuda_backend=backend)


# -- the baseline: the same no-op work, directly -----------------------------------------------


class DirectGraph:
    """A hand-written replay on the same backend: a graph of `model` captured with `rows` rows
    (every row `x`, as every request sends), its static input and output, one stream, one
    end event. What a replay needs at least: copy in, replay, clone out, record and query
    the end event."""

    def __init__(self, backend: NoOpBackend, model: torch.nn.Module, x: torch.Tensor,
                 rows: int) -> None:
        self.backend = backend
        self.stream = backend.new_stream(0)
        self.handle = backend.stream_handle(self.stream)
        self.static_in = x.expand(rows, DIM).clone()
        self.blocks = list(torch.split(self.static_in, 1))
        self.graph = backend.new_graph()
        self.end = backend.new_event()
        with torch.no_grad(), backend.capture(self.graph, backend.graph_pool(), self.handle):
            self.static_out: torch.Tensor = model(self.static_in)

    def one(self, x: torch.Tensor) -> torch.Tensor:
        return self._replay(lambda: self.static_in.copy_(x))

    def bucket(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """One batch of len(xs) one-row requests (as many as the graph's rows): rows copied
        into the static input (one `_foreach_copy_`, as the batcher does), one replay, the
        output cloned and split into per-request views."""
        return torch.split(self._replay(lambda: torch._foreach_copy_(self.blocks, list(xs))), 1)

    def _replay(self, copy_in: Callable[[], Any]) -> torch.Tensor:
        """On the graph's stream: `copy_in`, one replay, the output cloned, the end event
        recorded; then the event awaited (complete at once on this backend)."""
        backend = self.backend
        token = backend.enter_stream(self.handle)
        try:
            copy_in()
            self.graph.replay()
            out = self.static_out.clone()
            self.end.record(self.stream)
        finally:
            backend.leave_stream(token)
        if not self.end.query():
            self.end.synchronize()
        return out


def gathered(call: Callable[[], Awaitable[Any]], callers: int) -> Callable[[], Awaitable[Any]]:
    """One round of `callers` concurrent calls, as `asyncio.gather` runs them."""

    async def round_() -> list[Any]:
        return list(await asyncio.gather(*(call() for _ in range(callers))))

    return round_


def hand_batched(direct: DirectGraph, x: torch.Tensor, callers: int
                 ) -> Callable[[], Awaitable[Any]]:
    """`callers` gathered tasks, each handing its row over and awaiting a future; the last to
    arrive runs the bucket and answers them all: the least a batching front end costs."""

    async def round_() -> list[Any]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[torch.Tensor]] = []

        async def caller() -> torch.Tensor:
            future: asyncio.Future[torch.Tensor] = loop.create_future()
            futures.append(future)
            if len(futures) == callers:
                for f, out in zip(futures, direct.bucket([x] * callers), strict=True):
                    f.set_result(out)
            return await future

        return list(await asyncio.gather(*(caller() for _ in range(callers))))

    return round_


# -- measuring ------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReplayTarget(Target):
    """An issue-50 target on a figure of replays: met only when its value is within the limit
    AND every execution the figure was taken over replayed (`all_replayed`); a figure that
    includes stream-path executions or captures is not one of replays."""

    all_replayed: bool = True

    @property
    def met(self) -> bool:
        return self.all_replayed and super().met


@dataclasses.dataclass
class HostCase(CaseResult):
    """A case with its graph statistics kept whole for the JSON (`details`)."""

    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Window:
    """What the Executor and the backend counted between two readings (`batches` and
    `requests`: the batcher's, None without batching)."""

    executions: int
    backend_replays: int
    graphs: dict[str, int]
    batches: int | None = None
    requests: int | None = None

    @property
    def not_replays(self) -> dict[str, int]:
        return {k: v for k in NOT_REPLAYS if (v := self.graphs.get(k, 0))}

    @property
    def all_replayed(self) -> bool:
        replays = self.graphs.get("replays")
        return (self.executions > 0 and replays == self.executions == self.backend_replays
                and not self.not_replays)

    def verdict(self) -> str:
        counted = (f"{self.executions} executions, {self.graphs.get('replays')} replays "
                   f"(the backend counted {self.backend_replays})")
        if self.batches is not None:
            counted = f"{self.batches} batches: " + counted
        if self.all_replayed:
            return f"{counted}: all replayed"
        return f"{counted}, not replays {self.not_replays}: NOT all replayed"


@dataclasses.dataclass
class Reading:
    completed: int
    backend_replays: int
    graphs: dict[str, Any] | None
    batches: int | None
    requests: int | None


class Counter:
    """Readings of one Executor and its backend (`Window`s between them)."""

    def __init__(self, ex: Executor, backend: NoOpBackend) -> None:
        self.ex = ex
        self.backend = backend

    def read(self) -> Reading:
        batching = self.ex.batching_statistics()
        return Reading(self.ex.statistics().completed, self.backend.replays, stats_of(self.ex),
                       batching.batches if batching is not None else None,
                       batching.requests if batching is not None else None)

    def window(self, before: Reading) -> Window:
        after = self.read()

        def moved(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a - b

        return Window(after.completed - before.completed,
                      after.backend_replays - before.backend_replays,
                      stats_delta(before.graphs, after.graphs),
                      moved(after.batches, before.batches), moved(after.requests, before.requests))


def per_request(result: PeerResult, requests: int) -> None:
    """A peer timed per call of `requests` requests, made per request."""
    if requests == 1:
        return
    result.rounds = [t / requests for t in result.rounds]
    for name in ("median_s", "p10_s", "p90_s"):
        value = getattr(result, name)
        if value is not None:
            setattr(result, name, value / requests)


def us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


LAG_ROUNDS = 50


async def loop_iterations(call: Callable[[], Awaitable[Any]], rounds: int) -> list[float]:
    """The longest event-loop iteration, in seconds, of each of `rounds` calls."""
    return [await longest_iteration(call) for _ in range(rounds)]


async def longest_iteration(call: Callable[[], Awaitable[Any]]) -> float:
    """The longest event-loop iteration during `await call()`: a callback that re-arms
    itself with `call_soon` runs once per iteration and times the gap since its last run
    (what a timer or a request arriving meanwhile would wait at most)."""
    loop = asyncio.get_running_loop()
    last, worst, running = time.perf_counter(), 0.0, True

    def probe() -> None:
        nonlocal last, worst
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        if running:
            loop.call_soon(probe)

    loop.call_soon(probe)
    await call()
    running = False
    await asyncio.sleep(0)  # the probe's last run
    return worst


async def measure(
    ctx: Context, case: str, description: str, counter: Counter, peers: list[Peer],
    warm_round: Callable[[], Awaitable[Any]], requests: int, limit: float, figure: str,
) -> HostCase:
    """Warm the Executor until a round captures nothing, then verify every peer against the
    first (asyncgraph) and time them alternately; the first peer's median is the target's
    figure, checked against the window's counts."""
    warm_rounds, settled = await warm_until_settled(
        warm_round, lambda: stats_of(counter.ex), MAX_WARM_ROUNDS)
    before = counter.read()
    results = new_results(peers)
    await verify(peers, results)
    await alternate(peers, ctx.settings, ctx.task(f"{NAME}: {case}", ctx.rounds_total), results)
    window = counter.window(before)
    lag = await loop_iterations(warm_round, LAG_ROUNDS) if requests > 1 else None
    for timed in results.values():
        per_request(timed, requests)
        timed.extra = {
            "median us": us(timed.median_s), "p10 us": us(timed.p10_s),
            "p90 us": us(timed.p90_s), "calls x samples":
                f"{timed.calls_per_sample}x{timed.samples}" if timed.samples else None,
        }
    ours, direct = results[peers[0].name], results[peers[1].name]
    value, baseline = us(ours.median_s), us(direct.median_s)
    spread = ((quantile(ours.rounds, 0.10) * 1e6, quantile(ours.rounds, 0.90) * 1e6)
              if ours.rounds else None)
    overhead = None
    note = window.verdict()
    if value is not None and baseline is not None:
        overhead = value - baseline
        note = f"direct {baseline:.1f} us, asyncgraph's own {overhead:.1f} us; {note}"
    target = ReplayTarget(ISSUE, f"{case}: host us per {figure}", value, "<=", limit, "us",
                          note, spread, all_replayed=window.all_replayed)
    stats = stats_of(counter.ex)
    result = HostCase(
        NAME, case, description, columns="metrics",
        params={"callers": CALLERS if requests > 1 else 1, "rows per request": 1,
                "model": f"Linear({DIM}, {HIDDEN}), ReLU, Linear({HIDDEN}, {DIM})"},
        peers=[results[p.name] for p in peers], targets=[target],
        metrics={"all replayed": window.all_replayed, "executions": window.executions,
                 "replays": window.graphs.get("replays"),
                 "backend replays": window.backend_replays,
                 "direct us": baseline, "asyncgraph's own us": overhead,
                 "warm rounds": warm_rounds, "settled": settled,
                 "longest loop iteration ms": (None if lag is None
                                               else statistics.median(lag) * 1e3)},
        notes=[f"graphs: {stats_line(stats)}",
               f"from the first verification call to the last timed one: {window.verdict()}"],
        details={"graphs": stats, "graphs_window": window.graphs,
                 "executions_window": window.executions,
                 "backend_replays_window": window.backend_replays,
                 "batches_window": window.batches, "requests_window": window.requests,
                 "not_replays_window": window.not_replays},
    )
    if not settled:
        result.notes.append(f"STILL CAPTURING after {warm_rounds} warm-up rounds")
    return result


# -- the cases ------------------------------------------------------------------------------------


async def replay_one_caller(ctx: Context, program: Program, model: torch.nn.Module,
                            x: torch.Tensor) -> HostCase:
    backend = NoOpBackend()
    direct = DirectGraph(NoOpBackend(), model, x, 1)  # its replays not counted as the Executor's
    async with executor(program, backend, batching=None) as ex:

        async def asyncgraph() -> Any:
            return await ex.execute(x)

        async def by_hand() -> Any:
            return direct.one(x)

        async def warm() -> None:
            for _ in range(SEQUENTIAL_ROUND):
                await ex.execute(x)

        return await measure(
            ctx, "replay, 1 caller", "await ex.execute(x) in sequence, each a replay",
            Counter(ex, backend),
            [Peer("asyncgraph", asyncgraph, "Mode.CAPTURED: a graph instance replayed"),
             Peer("direct replay", by_hand, "copy in, replay(), clone out, end event")],
            warm, 1, REPLAY_LIMIT_US, "replay")


async def replay_many_callers(ctx: Context, program: Program, model: torch.nn.Module,
                              x: torch.Tensor) -> HostCase:
    backend = NoOpBackend()
    direct = DirectGraph(NoOpBackend(), model, x, 1)
    async with executor(program, backend, batching=None,
                        max_concurrent_executions=CALLERS) as ex:

        async def by_hand() -> Any:
            return direct.one(x)

        ours = gathered(lambda: ex.execute(x), CALLERS)
        case = await measure(
            ctx, f"replay, {CALLERS} callers",
            f"asyncio.gather of {CALLERS} ex.execute(x), a frame each, each a replay",
            Counter(ex, backend),
            [Peer("asyncgraph", ours, f"{CALLERS} frames share the graph instances"),
             Peer("direct replay", gathered(by_hand, CALLERS),
                  f"asyncio.gather of {CALLERS} direct replays")],
            ours, CALLERS, REPLAY_LIMIT_US, "replay")
        case.params["max_concurrent_executions"] = CALLERS
        return case


async def batched_many_callers(ctx: Context, program: Program, model: torch.nn.Module,
                               x: torch.Tensor) -> HostCase:
    backend = NoOpBackend()
    direct = DirectGraph(NoOpBackend(), model, x, CALLERS)
    buckets = batch_buckets(1, CALLERS)
    policy = BatchingConfig(max_batch_size=CALLERS, buckets=buckets)
    async with executor(program, backend, batching=policy) as ex:
        if ex.batching is None:
            raise RuntimeError(f"{NAME}: the Executor does not batch (BatchingConfig "
                               f"{policy} refused): no batched figure")

        async def by_hand() -> Any:
            return direct.bucket([x] * CALLERS)

        ours = gathered(lambda: ex.execute(x), CALLERS)
        case = await measure(
            ctx, f"batched, {CALLERS} callers",
            f"asyncio.gather of {CALLERS} one-row ex.execute(x), batched into bucket graphs",
            Counter(ex, backend),
            [Peer("asyncgraph (batched)", ours, f"buckets {', '.join(map(str, buckets))}"),
             Peer("direct bucket", by_hand,
                  f"one bucket of {CALLERS} rows by hand, no tasks"),
             Peer("direct bucket, gathered", hand_batched(direct, x, CALLERS),
                  f"{CALLERS} gathered tasks awaiting futures, one bucket by hand")],
            ours, CALLERS, BATCHED_LIMIT_US, "batched request")
        stats = ex.batching_statistics()
        assert stats is not None
        case.params.update({"buckets": list(buckets),
                            "max_concurrent_batches": policy.max_concurrent_batches})
        case.metrics.update({"batches": case.details["batches_window"],
                             "mean rows": round(stats.mean_rows, 1)})
        case.details["batching"] = {
            "requests": stats.requests, "batches": stats.batches,
            "mean_rows": stats.mean_rows, "padded_rows": stats.padded_rows,
            "largest_batch": stats.largest_batch,
            "by_size": {str(k): v[0] for k, v in sorted(stats.by_size.items())}}
        return case


async def run(ctx: Context) -> list[CaseResult]:
    """The three cases, each on an Executor and a backend of its own."""
    model = Mlp().eval()
    program = device_program(model, CALLERS)
    x = torch.linspace(-1.0, 1.0, DIM).reshape(1, DIM)
    cases: list[CaseResult] = []
    for case in (replay_one_caller, replay_many_callers, batched_many_callers):
        cases.append(await case(ctx, program, model, x))
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    from asyncgraph.bench import suite

    parser = suite.standalone_parser((__doc__ or "").splitlines()[0], GRAPHS)
    args = parser.parse_args(argv)
    return suite.run_standalone(args, run, width=150)


if __name__ == "__main__":
    sys.exit(main())

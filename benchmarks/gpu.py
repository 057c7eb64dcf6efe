"""GPU benchmark: asyncgraph against eager, CUDA graphs and torch.compile, in one process.

    python -m benchmarks.gpu [--iterations 50] [--callers 64] [--rounds 50]
                             [--max-warm-rounds 20] [--quick] [--json PATH] [--models ...]

Issue 50, item 6: the benchmark tells the truth. Three models (a small transformer encoder, a
CNN, a wide MLP; random weights, fp32) in three sections; every asyncgraph case prints its
graph statistics (captures, replays, fallbacks, instances, instance_waits, lease_failures,
warm-ups, failures) and its stream plan's choice, and `--json PATH` writes every figure with
those statistics, rewritten after each case, so a run cut short keeps what it measured.

1. One caller, per model (the median of `--iterations` timed calls after 5 untimed ones;
   ratio = peer / asyncgraph captured, above 1 means asyncgraph is faster): asyncgraph with
   its executions captured as CUDA graphs (`CudaConfig(graphs=True)`) and without
   (`graphs=False`: the stream path), eager (`model(x)` then a stream synchronize), a CUDA
   graph of eager (`torch.cuda.CUDAGraph`, the input copied into the static buffer) and
   `torch.compile(mode="reduce-overhead")` (not with `--quick`; its compile time printed).
2. `--callers` concurrent callers (each round one `asyncio.gather` of one call per caller;
   calls per second, the event loop's lag p99 meanwhile: a 1 ms ticker's lateness; x = calls/s
   over `to_thread(eager)`'s):
   - asyncgraph, unbatched, captured (`max_concurrent_executions=callers`);
   - asyncgraph, batched: the model exported with a dynamic dim 0 (`Dim("batch")`), batching
     on (`BatchingConfig(max_batch_size=callers x the request's rows)`, buckets of the
     request's rows times 1, 2, 4, ... callers), captured;
   - `asyncio.to_thread(eager)` (each call synchronizing its stream);
   - a per-thread CUDA graph of eager: each worker thread (as many as asyncio's default
     executor has) owns a `torch.cuda.CUDAGraph` of the model on its own stream, captured
     before the clock starts; a call copies its input into the thread's static input,
     replays, clones the output and synchronizes that stream. The strongest baseline a
     service builds without asyncgraph.
   Each peer warms round after round until a whole round leaves its capture counts unchanged
   (captures, warm-ups, segment captures and warm-ups, recaptures, failures; at least 2, at
   most `--max-warm-rounds` rounds: "settled after N rounds" or "STILL CAPTURING"), then is
   timed over `--rounds` rounds (at least 50 by default); the graph statistics of the timed
   rounds alone say whether every execution replayed. One more round's outputs are compared
   with eager (a wrong output is one off by more than 1e-2: a wrong value, not rounding).
3. The wide MLP, one caller: 1 and 4 CUDA streams and the plan's own choice
   (`CudaConfig.streams=None`), captured and not.

At the end, the issue-50 targets (scripts/gpu_report.py's `ISSUE50_TARGETS`, the table
`make gpu-report` puts in its summary): each one's figure against its bound, "no figure" where
a case could not run. A peer that raises is reported as an error and the run goes on.

Without CUDA it says it cannot run and exits 0: nothing was measured. docs/gpu.md says what
has and has not been run on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.runtime.config import CudaConfig

ROOT = Path(__file__).resolve().parents[1]


class Encoder(torch.nn.Module):
    """A small transformer encoder (4 layers, d_model 256, 4 heads)."""

    def __init__(self, dim: int = 256, layers: int = 4) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(
            dim, 4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(x)
        return out


class Cnn(torch.nn.Module):
    """Four conv-bn-relu blocks and a linear head."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        blocks: list[torch.nn.Module] = []
        channels = 3
        for k in range(4):
            out = width * 2**k
            blocks += [
                torch.nn.Conv2d(channels, out, 3, stride=2, padding=1),
                torch.nn.BatchNorm2d(out), torch.nn.ReLU(),
            ]
            channels = out
        self.features = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x).mean((2, 3)))
        return out


class WideMlp(torch.nn.Module):
    """`width` independent MLP branches, summed: work several streams can overlap."""

    def __init__(self, width: int = 8, depth: int = 4, dim: int = 512) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(
            torch.nn.Sequential(*[
                m for _ in range(depth) for m in (torch.nn.Linear(dim, dim), torch.nn.ReLU())
            ])
            for _ in range(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([b(x) for b in self.branches]).sum(0)


def models() -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "encoder": (Encoder(), torch.randn(8, 128, 256)),
        "cnn": (Cnn(), torch.randn(16, 3, 64, 64)),
        "wide-mlp": (WideMlp(), torch.randn(64, 512)),
    }


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


async def timed(call: Callable[[], Awaitable[Any]], iterations: int, warmup: int = 5) -> float:
    """Median milliseconds of `iterations` awaited calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        await call()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return median_ms(samples)


def eager_call(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        with torch.inference_mode():
            out = model(x)
        torch.cuda.current_stream().synchronize()
        return out

    return call


def graph_call(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
    """A CUDA graph of eager: captured once after warm-up on a side stream (as torch's docs
    do); each call copies its input into the static input and replays."""
    static_x = x.clone()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        static_out = model(static_x)

    async def call() -> Any:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        return static_out

    return call


def compiled_call(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[Callable[[], Awaitable[Any]], float]:
    """torch.compile(mode="reduce-overhead") and its compile time (the first calls)."""
    compiled = torch.compile(model, mode="reduce-overhead")
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(3):  # cudagraph trees record on the later warm-up calls
            compiled(x)
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start

    async def call() -> Any:
        with torch.inference_mode():
            out = compiled(x)
        torch.cuda.current_stream().synchronize()
        return out

    return call, compile_s


class LoopLag:
    """Lateness of a 1 ms ticker on the loop, while a block runs (p99 in ms)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - start - 0.001)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def p99_ms(self) -> float:
        if not self.lags:
            return float("nan")
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3


# == what is measured: sections, peers, the warm-up rule ==========================================

ONE_CALLER, MANY_CALLERS, STREAMS = "one-caller", "many-callers", "streams"
SECTIONS = (ONE_CALLER, MANY_CALLERS, STREAMS)
MODEL_NAMES = ("encoder", "cnn", "wide-mlp")
STREAMS_MODEL = "wide-mlp"


@dataclasses.dataclass(frozen=True)
class Peer:
    """One thing timed in a section: `key` names it in the JSON (and in gpu_report.py's
    targets), `label` in the output; `asyncgraph` peers print graph statistics."""

    key: str
    section: str
    label: str
    asyncgraph: bool


PEERS = (
    Peer("asyncgraph-captured", ONE_CALLER, "asyncgraph, cuda.graphs=True", True),
    Peer("asyncgraph-uncaptured", ONE_CALLER, "asyncgraph, cuda.graphs=False", True),
    Peer("eager", ONE_CALLER, "eager", False),
    Peer("graph-of-eager", ONE_CALLER, "cuda graph of eager", False),
    Peer("torch-compile", ONE_CALLER, "torch.compile reduce-overhead", False),
    Peer("asyncgraph", MANY_CALLERS, "asyncgraph, unbatched, cuda.graphs=True", True),
    Peer("asyncgraph-batched", MANY_CALLERS,
         "asyncgraph, dynamic-batch export, batching into bucket graphs", True),
    Peer("to-thread-eager", MANY_CALLERS, "asyncio.to_thread(eager)", False),
    Peer("thread-graphs", MANY_CALLERS, "per-thread CUDA graph of eager", False),
    *(Peer(f"{'captured' if graphs else 'uncaptured'}-{count}", STREAMS,
           f"{'captured' if graphs else 'cuda.graphs=False'}, streams={count}", True)
      for graphs in (True, False) for count in ("1", "4", "auto")),
)
BASELINE = "to-thread-eager"  # the many-callers section's x column divides by its calls/s


def peer(key: str) -> Peer:
    for p in PEERS:
        if p.key == key:
            return p
    raise KeyError(f"no peer {key!r}; peers: {[p.key for p in PEERS]}")


#: What a round may change while a peer still warms up: the capture counts of
#: CudaGraphStatistics (fallbacks and replays go on in the steady state).
SETTLING_FIELDS = ("captures", "warmups", "segment_captures", "segment_warmups", "recaptures",
                   "failures")
MIN_WARM_ROUNDS = 2
WRONG_TOLERANCE = 1e-2  # a wrong output is off by more: a wrong value, not TF32 rounding


def settling_key(stats: dict[str, Any] | None) -> tuple[Any, ...]:
    if stats is None:
        return ()
    return tuple(stats.get(name) for name in SETTLING_FIELDS)


async def warm_until_settled(
    one_round: Callable[[], Awaitable[Any]],
    stats: Callable[[], dict[str, Any] | None],
    max_rounds: int,
    min_rounds: int = MIN_WARM_ROUNDS,
) -> tuple[int, bool]:
    """Run rounds until one leaves the capture counts unchanged (and at least `min_rounds`
    ran), at most `max_rounds`: (rounds run, settled). A peer without statistics settles after
    `min_rounds` (lazy initialisation, cuBLAS workspaces)."""
    before = settling_key(stats())
    for done in range(1, max_rounds + 1):
        await one_round()
        after = settling_key(stats())
        if done >= min_rounds and after == before:
            return done, True
        before = after
    return max_rounds, False


def stats_of(ex: Executor) -> dict[str, Any] | None:
    """The Executor's CudaGraphStatistics as a dict (None without CUDA nodes)."""
    stats = ex.cuda_graph_statistics()
    if stats is None:
        return None
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(stats).items()}


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, int]:
    """What the counters did between two readings (the timed rounds alone)."""
    if before is None or after is None:
        return {}
    return {k: v - before[k] for k, v in after.items()
            if isinstance(v, int) and not isinstance(v, bool) and k in before}


GRAPH_FIELDS = ("captures", "replays", "fallbacks", "instances", "instance_waits",
                "lease_failures", "warmups", "failures", "live_graphs", "segment_replays")


def stats_line(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "no CUDA nodes"
    line = ", ".join(f"{k} {stats.get(k)}" for k in GRAPH_FIELDS)
    if not stats.get("capturable"):
        line += f"; not captured whole: {stats.get('reason')}"
    if stats.get("failed"):
        line += f"; failed {stats['failed']}"
    return line


def stream_choice(ex: Executor) -> str:
    plan = ex.stream_plan
    return "no CUDA nodes" if plan is None else (
        f"{plan.streams_per_device} per device, {len(plan.streams_used)} used "
        f"({plan.stream_choice or 'as given'})")


def count_wrong(outputs: Sequence[Any], reference: torch.Tensor) -> tuple[int, float]:
    """Outputs off `reference` by more than WRONG_TOLERANCE, and the largest difference."""
    wrong, worst = 0, 0.0
    for out in outputs:
        diff = float((out.float() - reference.float()).abs().max())
        worst = max(worst, diff)
        if not diff <= WRONG_TOLERANCE * (1.0 + float(reference.abs().max())):
            wrong += 1
    return wrong, worst


# == results: printed, and kept as JSON ==========================================================


class Results:
    """Every case's figures, as the JSON `--json` writes (rewritten after each case)."""

    def __init__(self, path: Path | None, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "args": vars(args), "cases": [], "errors": [],
            "complete": False,
        }

    def add(self, section: str, model: str, key: str, **figures: Any) -> dict[str, Any]:
        case = {"section": section, "model": model, "peer": key, "label": peer(key).label,
                **figures}
        self.data["cases"].append(case)
        self.save()
        return case

    def error(self, section: str, model: str, key: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        self.data["errors"].append({
            "section": section, "model": model, "peer": key, "error": text[:2000],
            "traceback": traceback.format_exc()[-4000:],
        })
        self.save()
        print(f"    {peer(key).label:<56} ERROR {text[:300]}")

    def find(self, section: str, model: str, key: str) -> dict[str, Any] | None:
        for case in self.data["cases"]:
            if (case["section"], case["model"], case["peer"]) == (section, model, key):
                return dict(case)
        return None

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(self.path)


async def guarded(results: Results, section: str, model: str, key: str,
                  body: Callable[[], Awaitable[None]]) -> None:
    """Run one peer's case; an error is reported and the run goes on."""
    try:
        await body()
    except Exception as exc:
        results.error(section, model, key, exc)


# == 1. one caller ================================================================================


async def one_caller(args: argparse.Namespace, results: Results) -> None:
    print("\n1. one caller: median ms (x = peer / asyncgraph captured)")
    for name, (model, x_cpu) in selected_models(args).items():
        await one_caller_model(args, results, name, model.cuda().eval(), x_cpu.cuda())


async def one_caller_model(args: argparse.Namespace, results: Results, name: str,
                           model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        reference = model(x).clone()
    ep = torch.export.export(model, (x,))
    print(f"  {name}")
    ours: float | None = None

    async def asyncgraph_case(key: str, graphs: bool) -> None:
        nonlocal ours
        config = ExecutorConfig(cuda=CudaConfig(graphs=graphs))
        async with Executor(ep, config) as ex:
            ms = await timed(lambda: ex.execute(x), args.iterations)
            wrong, worst = count_wrong([await ex.execute(x)], reference)
            stats = stats_of(ex)
            case = results.add(ONE_CALLER, name, key, ms=ms, wrong_outputs=wrong,
                               max_diff=worst, graphs=stats, streams=stream_choice(ex))
        ours = ms if graphs else ours
        print_one(case, ours)
        print(f"      graphs: {stats_line(stats)}; streams: {case['streams']}")

    async def peer_case(key: str, call: Callable[[], Awaitable[Any]], **extra: Any) -> None:
        case = results.add(ONE_CALLER, name, key, ms=await timed(call, args.iterations),
                           **extra)
        print_one(case, ours)

    await guarded(results, ONE_CALLER, name, "asyncgraph-captured",
                  lambda: asyncgraph_case("asyncgraph-captured", True))
    await guarded(results, ONE_CALLER, name, "asyncgraph-uncaptured",
                  lambda: asyncgraph_case("asyncgraph-uncaptured", False))
    await guarded(results, ONE_CALLER, name, "eager",
                  lambda: peer_case("eager", eager_call(model, x)))
    await guarded(results, ONE_CALLER, name, "graph-of-eager",
                  lambda: peer_case("graph-of-eager", graph_call(model, x)))
    if not args.quick:
        async def compiled() -> None:
            call, compile_s = compiled_call(model, x)
            await peer_case("torch-compile", call, compile_s=compile_s)

        await guarded(results, ONE_CALLER, name, "torch-compile", compiled)


def print_one(case: dict[str, Any], ours: float | None) -> None:
    ratio = f"x{case['ms'] / ours:5.2f}" if ours else "x  -  "
    extra = f" (compile {case['compile_s']:.1f} s)" if "compile_s" in case else ""
    print(f"    {case['label'] + extra:<56} {case['ms']:8.3f} ms   {ratio}")


# == 2. many callers ==============================================================================


class ThreadGraphs:
    """The per-thread CUDA graph of eager: each worker thread of its pool owns a CUDA graph
    of the model captured on a stream of its own, with its static input and output and its
    memory pool, so the threads replay at once without sharing anything (a cuBLAS workspace
    is per stream). Every thread captures before the first timed call: `start` hands each
    worker one capture (a barrier keeps a worker from taking two), one at a time."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, workers: int) -> None:
        self.model, self.x, self.workers = model, x, workers
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, "graph-of-eager")
        self.local = threading.local()
        self.lock = threading.Lock()
        self.captured = 0

    def start(self) -> None:
        """Every worker captures its graph; a capture's error is raised (not the broken
        barrier it leaves the other workers)."""
        barrier = threading.Barrier(self.workers)
        jobs = [self.pool.submit(self._capture_here, barrier) for _ in range(self.workers)]
        errors = [e for e in (job.exception(timeout=300) for job in jobs) if e is not None]
        errors.sort(key=lambda e: isinstance(e, threading.BrokenBarrierError))
        if errors:
            raise errors[0]

    def _capture_here(self, barrier: threading.Barrier) -> None:
        try:
            with self.lock:
                self.local.state = self._capture()
                self.captured += 1
        except BaseException:
            barrier.abort()  # the other workers stop waiting for this one
            raise
        barrier.wait(timeout=300)

    def _capture(self) -> tuple[Any, torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """This thread's graph, on its own stream, after warm-up there (as torch's docs)."""
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        static_x = self.x.clone()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(3):
                self.model(static_x)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"), \
                torch.inference_mode():
            static_out = self.model(static_x)
        return stream, graph, static_x, static_out

    def replay(self) -> torch.Tensor:
        stream, graph, static_x, static_out = self.local.state
        with torch.cuda.stream(stream):
            static_x.copy_(self.x)
            graph.replay()
            out: torch.Tensor = static_out.clone()
        stream.synchronize()
        return out

    async def call(self) -> torch.Tensor:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.replay)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def default_executor_workers() -> int:
    """As many threads as asyncio's default executor (which to_thread uses) has."""
    return min(32, (os.cpu_count() or 1) + 4)


def batch_buckets(rows: int, callers: int) -> tuple[int, ...]:
    """The request's rows times 1, 2, 4, ... up to `callers` requests: every batch of whole
    requests pads to one of these, and they fit in MAX_CAPTURES (8 for 64 callers)."""
    sizes, k = [], 1
    while k < callers:
        sizes.append(rows * k)
        k *= 2
    return (*sizes, rows * callers)


def unbatched_config(callers: int) -> ExecutorConfig:
    """The unbatched asyncgraph peer: captured, a frame per caller."""
    return ExecutorConfig(cuda=CudaConfig(graphs=True), max_concurrent_executions=callers)


def dynamic_batch_export(model: torch.nn.Module, x: torch.Tensor,
                         callers: int) -> torch.export.ExportedProgram:
    """`model` exported with dim 0 dynamic, up to `callers` requests of x's rows."""
    batch = torch.export.Dim("batch", min=1, max=x.shape[0] * callers)
    return torch.export.export(model, (x,), dynamic_shapes=({0: batch},))


def batched_config(rows: int, callers: int) -> ExecutorConfig:
    """The batched asyncgraph peer: every request's rows in one batch at most, padded to
    `batch_buckets`, captured."""
    policy = BatchingConfig(max_batch_size=rows * callers, buckets=batch_buckets(rows, callers))
    return ExecutorConfig(cuda=CudaConfig(graphs=True), batching=policy)


async def many_callers(args: argparse.Namespace, results: Results) -> None:
    print(f"\n2. {args.callers} concurrent callers: calls/s, loop lag p99, x = calls/s / "
          f"{peer(BASELINE).label}'s; warmed until a round captures nothing, then "
          f"{args.rounds} rounds")
    for name, (model, x_cpu) in selected_models(args).items():
        await many_callers_model(args, results, name, model.cuda().eval(), x_cpu.cuda())


async def many_callers_model(args: argparse.Namespace, results: Results, name: str,
                             model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.inference_mode():
        reference = model(x).clone()
    rows = x.shape[0]
    print(f"  {name} (requests of {rows} rows)")
    cases: list[dict[str, Any]] = []

    async def measure(key: str, call: Callable[[], Awaitable[Any]],
                      stats: Callable[[], dict[str, Any] | None] = lambda: None,
                      executions: Callable[[], int] | None = None,
                      **extra: Any) -> None:
        figures = await measure_many(call, args, reference, stats, executions)
        cases.append(results.add(MANY_CALLERS, name, key, **figures, **extra))
        print_many(cases[-1], results.find(MANY_CALLERS, name, BASELINE))

    async def unbatched() -> None:
        ep = torch.export.export(model, (x,))
        async with Executor(ep, unbatched_config(args.callers)) as ex:
            await measure("asyncgraph", lambda: ex.execute(x), lambda: stats_of(ex),
                          streams=stream_choice(ex))

    async def batched() -> None:
        ep = dynamic_batch_export(model, x, args.callers)
        config = batched_config(rows, args.callers)
        policy = config.batching
        assert policy is not None and policy.buckets is not None
        buckets = policy.buckets
        async with Executor(ep, config) as ex:
            def batches() -> int:
                stats = ex.batching_statistics()
                return stats.batches if stats is not None else 0

            await measure("asyncgraph-batched", lambda: ex.execute(x), lambda: stats_of(ex),
                          batches, streams=stream_choice(ex), buckets=list(buckets),
                          batching_config=dataclasses.asdict(policy))
            stats = ex.batching_statistics()
            if stats is not None:
                cases[-1]["batching"] = {
                    "requests": stats.requests, "batches": stats.batches,
                    "mean_rows": round(stats.mean_rows, 1), "padded_rows": stats.padded_rows,
                    "by_size": {str(k): v[0] for k, v in sorted(stats.by_size.items())}}
                results.save()
                print(f"      batching: {cases[-1]['batching']}")

    def eager_sync() -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = model(x)
        torch.cuda.current_stream().synchronize()
        return out

    async def to_thread() -> None:
        await measure(BASELINE, lambda: asyncio.to_thread(eager_sync),
                      workers=default_executor_workers())

    async def thread_graphs() -> None:
        peer_graphs = ThreadGraphs(model, x, default_executor_workers())
        try:
            peer_graphs.start()
            await measure("thread-graphs", peer_graphs.call, workers=peer_graphs.workers,
                          graphs_captured=peer_graphs.captured)
        finally:
            peer_graphs.close()

    # the baseline first: the other rows print their ratio to it
    for key, body in ((BASELINE, to_thread), ("asyncgraph", unbatched),
                      ("asyncgraph-batched", batched), ("thread-graphs", thread_graphs)):
        await guarded(results, MANY_CALLERS, name, key, body)


async def measure_many(
    call: Callable[[], Awaitable[Any]], args: argparse.Namespace, reference: torch.Tensor,
    stats: Callable[[], dict[str, Any] | None], executions: Callable[[], int] | None,
) -> dict[str, Any]:
    """Warm until settled, time `args.rounds` rounds of `args.callers` calls at once, then
    check one more round's outputs. `executions` counts executions (batches) when they are
    not one per call."""

    async def one_round() -> list[Any]:
        return list(await asyncio.gather(*(call() for _ in range(args.callers))))

    warm_rounds, settled = await warm_until_settled(one_round, stats, args.max_warm_rounds)
    before, runs_before = stats(), executions() if executions else 0
    async with LoopLag() as lag:
        start = time.perf_counter()
        for _ in range(args.rounds):
            await one_round()
        elapsed = time.perf_counter() - start
    after, runs_after = stats(), executions() if executions else 0
    calls = args.rounds * args.callers
    delta = stats_delta(before, after)
    runs = runs_after - runs_before if executions else calls
    wrong, worst = count_wrong(await one_round(), reference)
    figures: dict[str, Any] = {
        "calls_per_s": calls / elapsed, "lag_p99_ms": lag.p99_ms(), "rounds": args.rounds,
        "callers": args.callers, "calls": calls, "executions": runs, "seconds": elapsed,
        "warm_rounds": warm_rounds, "settled": settled, "wrong_outputs": wrong,
        "checked_outputs": args.callers, "max_diff": worst,
    }
    if after is not None:
        figures["graphs"] = after
        figures["graphs_timed"] = delta
        figures["all_replaying"] = (bool(after.get("capturable")) and runs > 0
                                    and delta.get("replays") == runs
                                    and not delta.get("fallbacks") and not delta.get("warmups"))
    return figures


def print_many(case: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    ratio = (f"x{case['calls_per_s'] / baseline['calls_per_s']:5.2f}"
             if baseline and baseline.get("calls_per_s") else "x  -  ")
    warm = (f"settled after {case['warm_rounds']} rounds" if case["settled"]
            else f"STILL CAPTURING after {case['warm_rounds']} rounds")
    print(f"    {case['label']:<60} {case['calls_per_s']:9.1f}/s  lag p99 "
          f"{case['lag_p99_ms']:6.2f} ms  {ratio}  {warm}; wrong {case['wrong_outputs']}/"
          f"{case['checked_outputs']}")
    if "graphs_captured" in case:
        print(f"      graphs: {case['graphs_captured']} captured before timing, one per worker "
              f"thread ({case['workers']} threads), each on its own stream")
    elif "workers" in case:
        print(f"      no graphs: eager on {case['workers']} threads (asyncio's default executor)")
    if "graphs" in case:
        timed_stats = case["graphs_timed"]
        print(f"      graphs: {stats_line(case['graphs'])}")
        print(f"      timed rounds: {case['executions']} executions, replays "
              f"{timed_stats.get('replays')}, fallbacks {timed_stats.get('fallbacks')}, "
              f"instance_waits {timed_stats.get('instance_waits')}, lease_failures "
              f"{timed_stats.get('lease_failures')}: "
              f"{'all replaying' if case['all_replaying'] else 'NOT all replaying'}; "
              f"streams: {case.get('streams')}")


# == 3. streams ===================================================================================


async def streams(args: argparse.Namespace, results: Results) -> None:
    print(f"\n3. {STREAMS_MODEL}, one caller: 1 and 4 streams and the plan's choice, captured "
          "and not")
    model, x_cpu = models()[STREAMS_MODEL]
    model = model.cuda().eval()
    x = x_cpu.cuda()
    ep = torch.export.export(model, (x,))
    for graphs in (True, False):
        for count in ("1", "4", "auto"):
            key = f"{'captured' if graphs else 'uncaptured'}-{count}"

            async def case(graphs: bool = graphs, count: str = count, key: str = key) -> None:
                cuda = CudaConfig(streams=None if count == "auto" else int(count), graphs=graphs)
                async with Executor(ep, ExecutorConfig(cuda=cuda)) as ex:
                    ms = await timed(lambda: ex.execute(x), args.iterations)
                    found = results.add(STREAMS, STREAMS_MODEL, key, ms=ms, graphs=stats_of(ex),
                                        streams=stream_choice(ex))
                print(f"  {found['label']:<36} {ms:8.3f} ms  streams: {found['streams']}")
                print(f"      graphs: {stats_line(found['graphs'])}")

            await guarded(results, STREAMS, STREAMS_MODEL, key, case)
    for kind in ("captured", "uncaptured"):
        one = results.find(STREAMS, STREAMS_MODEL, f"{kind}-1")
        four = results.find(STREAMS, STREAMS_MODEL, f"{kind}-4")
        auto = results.find(STREAMS, STREAMS_MODEL, f"{kind}-auto")
        if one and four:
            line = f"  {kind}: 1 stream / 4 streams: x{one['ms'] / four['ms']:5.2f}"
            if auto:
                line += f"; 1 stream / auto: x{one['ms'] / auto['ms']:5.2f}"
            print(line)


# == the targets, and the run =====================================================================


def report_module() -> ModuleType:
    """scripts/gpu_report.py (standard library only), whose ISSUE50_TARGETS this run is
    checked against: one definition for the benchmark's output and the report's summary."""
    name = "gpu_report"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def print_targets(results: Results) -> None:
    report = report_module()
    rows = report.target_rows(results.data, None)
    print("\nIssue-50 targets (64 frames replaying at once: the gpu_report probe `concurrency`, "
          "and the wrong outputs counted above)")
    print(report.targets_table(rows))


def selected_models(args: argparse.Namespace) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    return {k: v for k, v in models().items() if k in args.models}


async def run(args: argparse.Namespace, results: Results) -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    await one_caller(args, results)
    await many_callers(args, results)
    if STREAMS_MODEL in args.models:
        await streams(args, results)
    results.data["complete"] = True
    results.save()
    print_targets(results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50,
                        help="one caller: timed calls per case (default 50)")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=50,
                        help="many callers: timed rounds after warm-up (default 50)")
    parser.add_argument("--max-warm-rounds", type=int, default=20,
                        help="many callers: warm-up rounds at most, before timing anyway")
    parser.add_argument("--quick", action="store_true", help="skip torch.compile")
    parser.add_argument("--json", type=Path, default=None,
                        help="write every figure and graph statistic there, after each case")
    parser.add_argument("--models", default=",".join(MODEL_NAMES),
                        help=f"a comma-separated subset of {', '.join(MODEL_NAMES)}")
    args = parser.parse_args(argv)
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODEL_NAMES]
    if unknown or not chosen:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODEL_NAMES)}")
    args.models = chosen
    for name in ("iterations", "callers", "rounds", "max_warm_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu cannot run: no CUDA GPU (torch.cuda.is_available() is False). "
              "Nothing was measured.")
        return 0
    results = Results(args.json, args)
    asyncio.run(run(args, results))
    return 1 if results.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

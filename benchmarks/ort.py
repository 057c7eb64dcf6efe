"""asyncgraph against ONNX Runtime on CPU: the peer a CPU user shopping for speed would pick.

    asyncgraph bench -s onnxruntime [--quick] [--json] [-o FILE]
    python -m benchmarks.ort [--quick] [--graph mlp] [--[no-]compiled] [--json] [-o FILE]

The workloads of issue 40, each exported twice (batch 1 static, and batch dynamic up to 32 for
the batchers): the MLP (8 x Linear(64, 64)+ReLU), tiny BERT (benchmarks/nativert_compare.py's
TinyBert: token and position embeddings, LayerNorm, a 2-layer post-norm GELU encoder, hidden
128, 4 heads, intermediate 512, seq 16: BERT's shape without transformers, which is not a
dependency) and the suite's encoder (asyncgraph/bench/models.py: nn.TransformerEncoder, the
export graph), batch 1. ONNX Runtime gets each model as a user would give it:
`torch.onnx.export(model, (x,), dynamo=True)`, `ORT_ENABLE_ALL`, sequential execution, one
inter-op thread, 1 and 2 intra-op threads (both timed; the ratios are against the faster), a
torch tensor in and out (`x.numpy()`, `torch.from_numpy`). Exports are cached under
build/onnxruntime/ keyed by graph and weights. onnxruntime, onnx and onnxscript are benchmark
dependencies (the `onnxruntime` extra); without them the scenario reports one case, skipped,
with the reason, and the rest of the suite runs as before.

Latency (one caller): asyncgraph `execute` on the plain graph, with `segments=("script",)`
(a torch.jit trace per segment: builds in seconds), with AOTInductor compiled segments
(`compile_program(ep, path, "auto")`, loaded with trust_compiled=True: 18-33 s per program on
2 cores, cached next to the exports; in full runs, not with --quick, `--no-compiled` leaves
them out), with compiled segments autotuned (`autotune=True`: max-autotune, each segment
keeping the faster of its autotuned and default kernels; timed only where some segment kept
autotuned kernels, and the manifest's verdicts are in the case's params), with ONNX Runtime
segments (`segments=("onnx",)`, sessions built and signatures checked before timing; with 1
and with 2 intra-op threads, `ExecutorConfig.intra_op_threads`, as ONNX Runtime itself is
timed with both), ONNX Runtime's `session.run` and eager `model(x)` for context. Every peer
with a pool of 2 threads, ONNX Runtime's or asyncgraph's, leaves the machine idle for
SETTLE_S after each sample: its pool spins on after the last call, which would slow the next
peer down (harness.Peer.settle_s).

64 callers x N requests (throughput): asyncgraph each request its own execution (plain,
scripted, compiled, autotuned, ONNX Runtime segments), with dynamic batching
(`BatchingConfig(max_batch_size=32)`: plain, scripted, compiled from the dynamic-batch program,
autotuned too where it kept autotuned kernels, and ONNX Runtime segments with batches padded
to powers of two, one checked signature each, both with 32 rows and 2 batches in flight and
with 16 rows and 4 in flight: SMALL_BATCH), against
`asyncio.to_thread(session.run, ...)` and against `OrtBatcher`, the simple batcher a user would
write around a session (up to 32 rows, 2 batches in flight, each on a thread).

The harness of the main suite measures (asyncgraph/bench/harness.py, concurrency.py):
outputs compared with asyncgraph's first, rounds alternating in a new seeded order, medians
after warm-up, ratios of medians of the same run; the targets are issue 40's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch
from torch.export import ExportedProgram

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Peer,
    Settings,
    Target,
    measure,
    sync_peer,
)
from asyncgraph.bench.models import call_nodes, exported_encoder
from asyncgraph.bench.peers import asyncgraph_peer, in_inference
from asyncgraph.compiled.onnx_export import quiet_exporter
from asyncgraph.runtime.disk_cache import cache_root
from asyncgraph.runtime.form_verdicts import KIND
from benchmarks.nativert_compare import (
    Built,
    TinyBert,
    Workload,
    _compile_segments,
    _export,
    _load_compiled,
    callers_case,
    compile_autotuned,
    digest,
    mlp,
)

NAME = "onnxruntime"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "onnxruntime"
TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}  # ORT's fused kernels and eager's round apart
GRAPHS = ("mlp", "bert", "encoder")
MAX_BATCH = 32  # rows per batch, asyncgraph's and OrtBatcher's alike
IN_FLIGHT = 2  # batches running at once, asyncgraph's default and OrtBatcher's alike
# asyncgraph's ONNX segments batched a second way too: smaller batches, more in flight than the
# 2 workers, so that a worker that finishes takes a queued batch while the loop refills the
# callers it answered (64 callers fill 2 x 32 rows exactly, and a worker then waited for the
# refill: tiny BERT 1.90-1.96x ONNX Runtime via to_thread against 1.71-1.86x with 32 x 2, the
# MLP, whose batches take microseconds, 6.9-10.5x against 8.0-12.1x; 2026-11-28)
SMALL_BATCH, SMALL_IN_FLIGHT = 16, 4
ORT_THREADS = (1, 2)  # intra-op threads tried; the faster is the reference
# idle time after each sample of a peer whose ONNX Runtime pool has more than one thread: the
# pool spins up to ~30 ms after its last call, which would take the next peer's CPU (Peer)
SETTLE_S = 0.05
# no square brackets: the report's tables are rich markup, where "[bench]" would vanish
INSTALL = "install them with pip install onnxruntime onnx onnxscript (the onnxruntime extra)"
ISSUE = 40  # the targets' number in the report: issue 40's
DEFAULT_ISSUE = 54  # the default path's targets: issue 54's

PLAIN = "asyncgraph"
SCRIPTED = "asyncgraph (scripted)"
COMPILED = "asyncgraph (compiled)"
AUTOTUNED = "asyncgraph (compiled, autotuned)"
ONNX_SEGMENTS = "asyncgraph (onnx segments)"
BATCHED = "asyncgraph (batched)"
SCRIPTED_BATCHED = "asyncgraph (scripted, batched)"
COMPILED_BATCHED = "asyncgraph (compiled, batched)"
AUTOTUNED_BATCHED = "asyncgraph (compiled, autotuned, batched)"
ONNX_BATCHED = "asyncgraph (onnx segments, batched)"
ONNX_BATCHED_SMALL = (f"asyncgraph (onnx segments, batched, {SMALL_BATCH} rows, "
                      f"{SMALL_IN_FLIGHT} in flight)")
# What `Executor(ep)` gives with no flag: fast forms on (runtime/forms.py), timed once every
# signature it is called with has its verdict (the form measured faster, or the plain graph)
DEFAULT = "asyncgraph (default path)"
DEFAULT_BATCHED = "asyncgraph (default path, batched)"
# executions to wait for a verdict before timing anyway (and saying so): tiny BERT batched, 64
# callers, reached its verdict on 32-row batches after ~28,000 (6 s)
DECIDE_LIMIT = 100_000
BUSY_SHARE = 10  # a signature with at least 1/10 of the executions: its verdict is waited for
BUILD_WAIT_S = 900.0  # how long a build may take (a first AOTInductor compile: 16-60 s a graph)


def settle(threads: int) -> float:
    """Peer.settle_s for an ONNX Runtime pool of `threads` intra-op threads."""
    return SETTLE_S if threads > 1 else 0.0


def onnx_segments_name(threads: int) -> str:
    """asyncgraph with ONNX Runtime segments of `threads` intra-op threads (the latency case
    times each count ONNX Runtime itself gets)."""
    return ONNX_SEGMENTS if threads == 1 else f"asyncgraph (onnx segments, {threads} threads)"


def ort_name(threads: int) -> str:
    return f"onnxruntime ({threads} thread{'s' if threads > 1 else ''})"


def ort_thread_name(threads: int) -> str:
    return f"onnxruntime via to_thread ({threads} thread{'s' if threads > 1 else ''})"


def ort_batcher_name(threads: int) -> str:
    return f"onnxruntime batcher ({threads} thread{'s' if threads > 1 else ''})"


def check_onnxruntime() -> str | None:
    """None when onnxruntime, onnx and onnxscript import; else why this scenario cannot run."""
    missing = []
    for module in ("onnxruntime", "onnx", "onnxscript"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({type(exc).__name__}: {exc})"[:160])
    if missing:
        return f"not importable: {'; '.join(missing)}; {INSTALL}"
    return None


@dataclass(frozen=True)
class Options:
    """What a run builds. `compiled`: AOTInductor compiled segments too, of the batch-1 and
    the dynamic-batch program (`compile_program(ep, path, "auto")`: 18-33 s each on 2 cores,
    about 2.5 minutes for the three graphs the first time, then cached); None: in full runs
    only, so that --quick stays under a minute. `cache`: the exports' and packages' folder
    (None: CACHE)."""

    graphs: tuple[str, ...] = GRAPHS
    compiled: bool | None = None
    cache: Path | None = None


# -- the graphs ----------------------------------------------------------------------------------


def workloads(settings: Settings, names: Sequence[str] = GRAPHS) -> list[Workload]:
    """The compared graphs at the run's size (tiny: small widths, for tests)."""
    out = []
    for name in names:
        if name == "mlp":
            width, layers = settings.pick((64, 8), (64, 8), (16, 2))
            model = mlp(width, layers)
            x = torch.randn(1, width)
            out.append(Workload("mlp", f"MLP, {layers} x Linear({width}, {width})+ReLU, batch 1",
                                model, _export(model, x), x,
                                lambda model=model, x=x: _export(model, x, dynamic=True)))
        elif name == "bert":
            hidden, layers, seq = settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
            model = TinyBert(hidden, layers, seq).eval()
            x = torch.randint(0, 1000, (1, seq))
            out.append(Workload("bert", f"tiny BERT, hidden {hidden}, {layers} layers, 4 heads, "
                                f"seq {seq}, batch 1", model, _export(model, x), x,
                                lambda model=model, x=x: _export(model, x, dynamic=True)))
        elif name == "encoder":
            hidden, layers, seq = settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
            model, ep = exported_encoder(hidden, layers, seq, False)
            out.append(Workload(
                "encoder", f"encoder (nn.TransformerEncoder, export graph), hidden {hidden}, "
                f"{layers} layers, seq {seq}, batch 1", model, ep, torch.randn(1, seq, hidden),
                lambda h=hidden, n=layers, s=seq: exported_encoder(h, n, s, False, MAX_BATCH)[1]))
        else:
            raise ValueError(f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}")
    return out


# -- ONNX Runtime -----------------------------------------------------------------------------


def powers_of_two(max_rows: int) -> tuple[int, ...]:
    """The buckets the ONNX Runtime segments' batches are padded to: powers of two below
    `max_rows`, then `max_rows` (a few checked signatures serve every batch size)."""
    sizes = [1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows]
    return (*sizes, max_rows)


def onnx_model(work: Workload, dynamic: bool, cache: Path, notes: dict[str, Any]) -> bytes:
    """The ONNX model of `work.model` (batch 1, or batch dynamic up to MAX_BATCH), exported with
    `torch.onnx.export(dynamo=True)` or read from the cache; export time kept in `notes`."""
    import onnxscript

    folder = cache / f"torch-{torch.__version__}-onnxscript-{onnxscript.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    kind = "dynamic" if dynamic else "static"
    path = folder / f"{work.key}-{digest(work.ep)}-{kind}.onnx"
    if path.exists():
        notes[f"onnx_{kind}_export_s"] = "cached"
        return path.read_bytes()
    x = torch.cat([work.x, work.x]) if dynamic else work.x
    shapes = ({0: torch.export.Dim("batch", min=1, max=MAX_BATCH)},) if dynamic else None
    start = time.perf_counter()
    with quiet_exporter():
        program = torch.onnx.export(work.model, (x,), dynamo=True, dynamic_shapes=shapes,
                                    verbose=False)
    assert program is not None
    data: bytes = program.model_proto.SerializeToString()
    notes[f"onnx_{kind}_export_s"] = round(time.perf_counter() - start, 1)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


def ort_session(model: bytes, threads: int) -> Any:
    """An InferenceSession as the issue's user made it: every graph optimisation, sequential."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ort_call(session: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """`session.run` on a torch tensor, giving back a torch tensor (the model's one output)."""
    name = session.get_inputs()[0].name
    run = session.run

    def call(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(run(None, {name: x.numpy()})[0])

    return call


class OrtBatcher:
    """The simple batcher a user would write around an ONNX Runtime session: requests queue;
    while fewer than `in_flight` batches run, a batch takes up to `max_rows` rows of what has
    queued by the next loop iteration and runs `session.run` on a thread (the GIL released);
    each caller gets its rows back. Its policy is asyncgraph's BatchingConfig defaults'."""

    def __init__(self, session: Any, max_rows: int = MAX_BATCH, in_flight: int = IN_FLIGHT):
        self._name = session.get_inputs()[0].name
        self._run = session.run
        self._max_rows, self._in_flight = max_rows, in_flight
        self._queue: deque[tuple[Any, asyncio.Future[torch.Tensor]]] = deque()
        self._running = 0  # drain tasks alive, counted down as each returns
        self._tasks: set[asyncio.Task[None]] = set()  # references, so none is collected
        self.batches = self.rows = 0

    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[torch.Tensor] = loop.create_future()
        self._queue.append((x.numpy(), future))
        if self._running < self._in_flight:
            self._running += 1
            task = loop.create_task(self._drain())  # first runs next iteration: others queue
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _drain(self) -> None:
        import numpy as np

        try:
            while self._queue:
                take = [self._queue.popleft()]
                rows = len(take[0][0])
                while self._queue and rows + len(self._queue[0][0]) <= self._max_rows:
                    take.append(self._queue.popleft())
                    rows += len(take[-1][0])
                try:
                    batch = np.concatenate([a for a, _ in take])
                    out = (await asyncio.to_thread(self._run, None, {self._name: batch}))[0]
                except Exception as exc:
                    for _, future in take:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                self.batches, self.rows = self.batches + 1, self.rows + rows
                start = 0
                for a, future in take:
                    if not future.done():  # the caller may have been cancelled
                        future.set_result(torch.from_numpy(out[start:start + len(a)]))
                    start += len(a)
        finally:
            self._running -= 1


# -- the scenario -------------------------------------------------------------------------------


async def run(ctx: Context, options: Options | None = None) -> list[CaseResult]:
    """One latency case and one 64-caller case per graph; one skipped case without ORT."""
    options = options or Options()
    why = check_onnxruntime()
    if why is not None:
        case = CaseResult(NAME, "onnxruntime (skipped)", f"ONNX Runtime peer skipped: {why}",
                          {"skipped": why})
        case.metrics["skipped"] = why
        return [case]
    cache = options.cache or CACHE
    compiled = options.compiled if options.compiled is not None else ctx.settings.size == "full"
    cases = []
    for work in workloads(ctx.settings, options.graphs):
        notes: dict[str, Any] = {}
        static = onnx_model(work, False, cache, notes)
        assert work.dynamic is not None
        dynamic_ep = work.dynamic()
        dynamic = onnx_model(work, True, cache, notes)
        built = Built(notes)
        if compiled:
            folder = cache / f"torch-{torch.__version__}"
            folder.mkdir(parents=True, exist_ok=True)
            built.segments = _compile_segments(
                notes, "segments", work.ep,
                folder / f"{work.key}-{digest(work.ep)}.segments-auto.pt2")
            built.batched = _compile_segments(
                notes, "batched_segments", dynamic_ep,
                folder / f"{work.key}-{digest(dynamic_ep)}.segments-auto-dynamic.pt2")
            built.autotuned = _autotuned(notes, "autotuned", work.ep, folder / (
                f"{work.key}-{digest(work.ep)}.segments-auto-autotuned-kept.pt2"))
            built.autotuned_batched = _autotuned(notes, "autotuned_batched", dynamic_ep, folder / (
                f"{work.key}-{digest(dynamic_ep)}.segments-auto-dynamic-autotuned-kept.pt2"))
        cases.append(await _latency_case(ctx, work, static, built))
        cases.append(await _concurrent_case(ctx, work, dynamic_ep, static, dynamic, built))
    return cases


def _autotuned(notes: dict[str, Any], what: str, ep: ExportedProgram, path: Path) -> Path | None:
    """`compile_program(..., autotune=True)` (each segment keeps the faster of its autotuned
    and default kernels): the package when some segment kept autotuned kernels, else None,
    as it would time the same kernels as the compiled peer. What each kept is in `notes`."""
    from asyncgraph.compiled.package import read_manifest

    compiled = compile_autotuned(notes, what, ep, path)
    if compiled is None:
        return None
    kept = any(s.get("autotuned") for s in read_manifest(compiled)["segments"])
    return compiled if kept else None


def _best(case: CaseResult, names: Sequence[str], higher: bool = False) -> str | None:
    """The fastest of the timed peers `names` (lowest median time, or highest throughput)."""
    timed = [p for p in case.peers if p.name in names and p.median_s is not None]
    if higher:
        timed = [p for p in timed if p.extra.get("throughput")]
        return max(timed, key=lambda p: p.extra["throughput"]).name if timed else None
    return min(timed, key=lambda p: p.median_s or 0.0).name if timed else None


async def _latency_case(ctx: Context, work: Workload, static: bytes, built: Built) -> CaseResult:
    x = work.x
    default = await _default_path(work.ep, [x], built.notes, "default path")
    executors = [Executor(work.ep, ExecutorConfig(fast_paths=False)),
                 Executor(work.ep, ExecutorConfig(segments=("script",))), default]
    peers = [asyncgraph_peer(PLAIN, executors[0], [x], "plain graph (fast_paths=False)"),
             asyncgraph_peer(SCRIPTED, executors[1], [x], "ExecutorConfig(segments=('script',))"),
             asyncgraph_peer(DEFAULT, default, [x], "Executor(ep): no flags, verdict reached")]
    compiled = _load_compiled(built, built.segments)
    if compiled is not None:
        executors.append(compiled)
        peers.append(asyncgraph_peer(COMPILED, compiled, [x], "compile_program(ep, path, 'auto')"))
    autotuned = _load_compiled(built, built.autotuned)
    if autotuned is not None:
        executors.append(autotuned)
        peers.append(asyncgraph_peer(AUTOTUNED, autotuned, [x], "compile_program(..., "
                                     "autotune=True): autotuned kernels kept where faster"))
    for threads in ORT_THREADS:  # the thread counts ONNX Runtime itself gets
        delegated = await _with_onnx_segments(work.ep, [x],
                                              ExecutorConfig(intra_op_threads=threads))
        if delegated is not None:
            executors.append(delegated)
            peers.append(asyncgraph_peer(
                onnx_segments_name(threads), delegated, [x],
                f"ExecutorConfig(segments=('onnx',), intra_op_threads={threads}), sessions "
                "ready", settle(threads)))
    for threads in ORT_THREADS:
        call = ort_call(ort_session(static, threads))
        peers.append(sync_peer(ort_name(threads), lambda call=call: call(x),
                               f"session.run, ORT_ENABLE_ALL, sequential, {threads} intra-op",
                               settle(threads)))
    eager = in_inference(work.model)
    peers.append(sync_peer("eager model(x)", lambda: eager(x), "the nn.Module itself"))
    try:
        advance = ctx.task(f"{NAME}: {work.key} latency ({call_nodes(work.ep)} nodes)",
                           ctx.rounds_total)
        results = await measure(peers, ctx.settings, advance, **TOLERANCE)
    finally:
        for ex in executors:
            await ex.aclose()
    case = CaseResult(NAME, f"{work.key} latency", f"{work.title}; one caller",
                      {"nodes": call_nodes(work.ep), **built.notes}, results)
    best = _best(case, [ort_name(t) for t in ORT_THREADS])
    if best is None:
        return case
    case.params["onnxruntime_reference"] = best
    case.targets.append(Target(
        DEFAULT_ISSUE, f"{work.key}: batch-1 latency, default path / {best}",
        case.ratio(DEFAULT, best), "<=", 1.0, rounds=case.round_spread(DEFAULT, best)))
    for peer, what in ((PLAIN, "plain graph"), (SCRIPTED, "scripted segments"),
                       (COMPILED, "compiled segments"), (AUTOTUNED, "autotuned segments"),
                       *((onnx_segments_name(t), "onnx segments"
                          + (f", {t} intra-op threads" if t > 1 else "")) for t in ORT_THREADS)):
        if peer not in {p.name for p in case.peers}:
            continue
        case.targets.append(Target(
            ISSUE, f"{work.key}: batch-1 latency, {what} / {best}", case.ratio(peer, best),
            "<=", 1.0, rounds=case.round_spread(peer, best)))
    return case


async def _default_path(
    ep: ExportedProgram, xs: Sequence[Any], notes: dict[str, Any], what: str,
    config: ExecutorConfig | None = None, callers: int = 1,
) -> Executor:
    """`Executor(ep)` as a user gets it (fast_paths on, whatever the environment says), called
    as it will be measured, until its verdicts for that load are reached: one call at a time
    (each input in `xs` in turn: the verdict for a caller alone), or `callers` calls at once
    (the verdict under load, runtime/forms.py; with batching, every batch size seen). The
    verdicts, and how long they took from the first call (export and build, or the disk
    cache, then the measurement), go in `notes`."""
    ex = Executor(ep, dataclasses.replace(config or ExecutorConfig(), fast_paths=True))
    regime = "alone" if callers == 1 else "loaded"
    start = time.perf_counter()
    await ex.execute(xs[0])  # starts the build
    while (ex.statistics().forms or {}).get("state") == "building" and (
            time.perf_counter() - start < BUILD_WAIT_S):  # the AOTInductor form's compile
        await ex.execute(xs[0])
        await asyncio.sleep(0.05)
    for n in range(0, DECIDE_LIMIT, max(callers, len(xs))):
        if callers == 1:
            for x in xs:
                await ex.execute(x)
        else:
            await asyncio.gather(*(ex.execute(xs[i % len(xs)]) for i in range(callers)))
        forms = ex.statistics().forms
        if forms is None:  # no fast form applies to this program
            break
        seen = forms["signatures"].values()
        total = sum(v["runs"] for v in seen)
        busy = [v for v in seen if v["runs"] * BUSY_SHARE >= total]  # a batch size met once
        pending = (callers == 1 and len(seen) < len(xs)) or not seen or any(  # is not the load
            v[regime]["form"] == "measuring" for v in busy)
        if not pending:
            break
        if n % 32 == 31 or callers > 1:
            await asyncio.sleep(0.01 if callers == 1 else 0.002)  # the build thread's turn
    forms = ex.statistics().forms
    if forms is None:
        notes[f"{what} verdicts ({regime})"] = "no fast form applies"
    else:
        decided = [v[regime] for v in forms["signatures"].values()]
        served = [v["form"] for v in decided]
        notes[f"{what} verdicts ({regime})"] = {
            "form": forms["form"], "passed": forms["passed"],
            "signatures": [f"{v['form']}: {v['why']}" for v in decided] if len(decided) <= 2
            else {form: served.count(form) for form in sorted(set(served))}}
    notes[f"{what} to verdicts (s)"] = round(time.perf_counter() - start, 3)
    return ex


async def _with_onnx_segments(
    ep: ExportedProgram, xs: Sequence[Any], config: ExecutorConfig | None = None
) -> Executor | None:
    """An Executor with ONNX Runtime segments (`config` with the "onnx" backend) whose sessions
    are built and whose signatures, one per input in `xs`, are checked (the first calls run
    the plain nodes while the builder thread works), or None when no segment was made."""
    from asyncgraph.compiled.onnx_delegate import OnnxDelegate

    config = dataclasses.replace(config or ExecutorConfig(), segments=("onnx",))
    ex = Executor(ep, config)
    delegates = [k.fn for k in ex.kernels if isinstance(k.fn, OnnxDelegate)]
    if not delegates:
        await ex.aclose()
        return None
    for _ in range(3):  # sessions, then the checks of these signatures, then ONNX Runtime
        for x in xs:
            await ex.execute(x)
        for delegate in delegates:
            await anyio.to_thread.run_sync(delegate.wait_idle, 120)
    return ex


async def _concurrent_case(
    ctx: Context, work: Workload, dynamic_ep: ExportedProgram, static: bytes, dynamic: bytes,
    built: Built,
) -> CaseResult:
    s = ctx.settings
    callers, per_caller = s.pick(64, 64, 4), s.pick(8, 2, 1)
    x = work.x
    batching = BatchingConfig(max_batch_size=MAX_BATCH, max_concurrent_batches=IN_FLIGHT)
    executors = [
        Executor(work.ep, ExecutorConfig(fast_paths=False)),
        Executor(work.ep, ExecutorConfig(segments=("script",))),
        Executor(dynamic_ep, ExecutorConfig(batching=batching, fast_paths=False)),
        Executor(dynamic_ep, ExecutorConfig(segments=("script",), batching=batching)),
    ]
    # verdicts reached under the load measured: callers at once (with batching, a batch's
    # rows are a signature each: every batch size the load makes is decided)
    default = await _default_path(work.ep, [x], built.notes, "default path, unbatched",
                                  callers=callers)
    default_batched = await _default_path(
        dynamic_ep, [x], built.notes, "default path, batched", ExecutorConfig(batching=batching),
        callers=callers)
    executors += [default, default_batched]
    peers = [
        asyncgraph_peer(PLAIN, executors[0], [x], "each request its own execution"),
        asyncgraph_peer(DEFAULT, default, [x], "Executor(ep): no flags, verdict reached"),
        asyncgraph_peer(DEFAULT_BATCHED, default_batched, [x],
                        f"Executor(ep, batching up to {MAX_BATCH} rows): no other flag"),
        asyncgraph_peer(SCRIPTED, executors[1], [x], "segments=('script',), unbatched"),
        asyncgraph_peer(BATCHED, executors[2], [x], f"dynamic batching, up to {MAX_BATCH} rows"),
        asyncgraph_peer(SCRIPTED_BATCHED, executors[3], [x],
                        f"segments=('script',), dynamic batching, up to {MAX_BATCH} rows"),
    ]
    batched_config = ExecutorConfig(batching=batching)
    for name, path, config, note in (
        (COMPILED, built.segments, None, "compiled segments"),
        (AUTOTUNED, built.autotuned, None, "compiled segments, autotune=True"),
        (COMPILED_BATCHED, built.batched, batched_config, "compiled segments, batched"),
        (AUTOTUNED_BATCHED, built.autotuned_batched, batched_config,
         "compiled segments, autotune=True, batched"),
    ):
        loaded = _load_compiled(built, path, config)
        if loaded is not None:
            executors.append(loaded)
            peers.append(asyncgraph_peer(name, loaded, [x], note))
    delegated = await _with_onnx_segments(work.ep, [x])
    small = BatchingConfig(max_batch_size=SMALL_BATCH, max_concurrent_batches=SMALL_IN_FLIGHT)
    onnx_peers = [(ONNX_SEGMENTS, delegated, "segments=('onnx',), unbatched")]
    for name, policy in ((ONNX_BATCHED, batching), (ONNX_BATCHED_SMALL, small)):
        buckets = powers_of_two(policy.max_batch_size)  # a signature each, checked first
        executor = await _with_onnx_segments(
            dynamic_ep, [x.expand(rows, *x.shape[1:]).contiguous() for rows in buckets],
            ExecutorConfig(batching=dataclasses.replace(policy, buckets=buckets)))
        onnx_peers.append((name, executor, (
            f"segments=('onnx',), dynamic batching up to {policy.max_batch_size} rows, "
            f"{policy.max_concurrent_batches} in flight, padded to {buckets}")))
    for name, ex, note in onnx_peers:
        if ex is not None:
            executors.append(ex)
            peers.append(asyncgraph_peer(name, ex, [x], note))
    batchers: dict[str, OrtBatcher] = {}
    for threads in ORT_THREADS:
        call = ort_call(ort_session(static, threads))

        async def in_thread(call: Callable[[torch.Tensor], torch.Tensor] = call) -> Any:
            return await asyncio.to_thread(call, x)

        peers.append(Peer(ort_thread_name(threads), in_thread,
                          f"asyncio.to_thread(session.run), {threads} intra-op", settle(threads)))
        batcher = batchers[ort_batcher_name(threads)] = OrtBatcher(ort_session(dynamic, threads))

        async def batched(batcher: OrtBatcher = batcher) -> Any:
            return await batcher(x)

        peers.append(Peer(ort_batcher_name(threads), batched,
                          f"OrtBatcher: up to {MAX_BATCH} rows, {IN_FLIGHT} in flight, "
                          f"{threads} intra-op", settle(threads)))
    case = await callers_case(ctx, NAME, work, peers, executors, (callers, per_caller),
                              executors[2])
    case.params.update({k: v for k, v in built.notes.items() if k.startswith("default path")})
    results = {r.name: r for r in case.peers}
    for name, batcher in batchers.items():
        if batcher.batches:
            case.params[f"{name} mean rows"] = round(batcher.rows / batcher.batches, 1)
    to_thread = _best(case, [ort_thread_name(t) for t in ORT_THREADS], higher=True)
    batcher_best = _best(case, list(batchers), higher=True)
    case.params["onnxruntime_references"] = [to_thread, batcher_best]
    names = {p.name for p in case.peers}

    def throughput_target(issue: int, peer: str, base: str | None, limit: float) -> None:
        if base is None or peer not in names:
            return
        mine, theirs = results[peer].extra.get("throughput"), results[base].extra.get("throughput")
        case.targets.append(Target(
            issue, f"{work.key}, {callers} callers: throughput, {peer} / {base}",
            mine / theirs if mine and theirs else None, ">=", limit,
            rounds=case.round_spread(peer, base)))

    # issue 54's targets for the path a user gets without flags
    unbatched_limit = 1.5 if work.key == "mlp" else 1.0
    batched_limit, batcher_limit = (4.0, 1.0) if work.key == "mlp" else (2.0, 1.3)
    for peer, base, limit in ((DEFAULT, to_thread, unbatched_limit),
                              (DEFAULT_BATCHED, to_thread, batched_limit),
                              (DEFAULT_BATCHED, batcher_best, batcher_limit)):
        throughput_target(DEFAULT_ISSUE, peer, base, limit)
    for peer, base, limit in ((PLAIN, to_thread, 1.0), (SCRIPTED, to_thread, 1.0),
                              (COMPILED, to_thread, 1.0), (AUTOTUNED, to_thread, 1.0),
                              (BATCHED, to_thread, 2.0),
                              (SCRIPTED_BATCHED, to_thread, 2.0),
                              (COMPILED_BATCHED, to_thread, 2.0),
                              (AUTOTUNED_BATCHED, to_thread, 2.0), (ONNX_SEGMENTS, to_thread, 1.0),
                              (ONNX_BATCHED, to_thread, 2.0),
                              (ONNX_BATCHED_SMALL, to_thread, 2.0), (BATCHED, batcher_best, 1.0),
                              (SCRIPTED_BATCHED, batcher_best, 1.0),
                              (COMPILED_BATCHED, batcher_best, 1.0),
                              (AUTOTUNED_BATCHED, batcher_best, 1.0),
                              (ONNX_BATCHED, batcher_best, 1.0),
                              (ONNX_BATCHED_SMALL, batcher_best, 1.0)):
        throughput_target(ISSUE, peer, base, limit)
    return case


# -- the command --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    from asyncgraph.bench import suite

    parser = suite.standalone_parser((__doc__ or "").splitlines()[0], GRAPHS)
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="AOTInductor compiled segments too (compiled on the first run, "
                        "then cached); default: in full runs, not with --quick")
    parser.add_argument("--cache", type=Path, default=CACHE, help="exports' and packages' folder")
    args = parser.parse_args(argv)
    options = Options(graphs=tuple(args.graph or GRAPHS), compiled=args.compiled,
                      cache=args.cache)
    forget_verdicts()
    return suite.run_standalone(args, lambda ctx: run(ctx, options), width=150)


def forget_verdicts() -> None:
    """Drop the fast forms' verdicts kept on disk (runtime/form_verdicts.py), so that each run
    reaches the default path's verdicts itself, under the load it measures, with the code it
    runs; the exports stay cached (they only save time)."""
    root = cache_root()
    if root is not None:
        shutil.rmtree(root / KIND, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

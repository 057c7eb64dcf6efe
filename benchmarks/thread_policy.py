"""The event loop thread's intra-op count: torch's default against 1 (issue 40).

    python -m benchmarks.thread_policy [--quick] [--rounds N] [--json] [-o FILE]

asyncgraph sets torch's intra-op thread count on its own worker threads only
(ExecutorConfig.intra_op_threads_or_default: the usable CPUs / max_parallel_ops, 1 on 2 cores),
never on the thread that runs the event loop, where inline nodes run. A library user who does
not call torch.set_num_threads leaves that thread at torch's default (the CPU count). This
measures what that costs, in one process, the two arms alternating round by round (in a new
seeded order each round, asyncgraph/bench/harness.py and concurrency.py):

- the MLP (8 x Linear(64, 64)+ReLU) and tiny BERT (benchmarks/nativert_compare.py's TinyBert,
  hidden 128, 2 layers, seq 16), batch 1, one caller: asyncgraph plain graph, asyncgraph with
  `segments=("script",)`, and eager `model(x)` (which runs on the loop thread too);
- the same programs under 64 callers: each request its own execution, and dynamic batching
  (BatchingConfig(max_batch_size=32), the dynamic-batch export).

Each arm has executors of its own, built while the loop thread is at torch's default (as a
library user's are, so their workers get the same count in both arms), and profiled, placed and
timed with the loop thread at its arm's count: a peer sets the count on its first call of a
sample or round (torch.set_num_threads, only when it differs from the current one).

With OpenMP (torch's CPU builds on Linux), torch.set_num_threads(n) sets the calling thread's
team size (and MKL's thread-local count), and seeds the count of every thread that has not
run a parallel region yet; a thread that has keeps its own. So the loop thread's count is the
loop thread's alone once set, and asyncgraph's workers, which set theirs when they start, are
not touched by it (`per_thread_semantics()` below checks that on this machine and prints it).
The workers' own torch.set_num_threads already seeds every thread started after them (1 on 2
cores): only the loop thread, initialised before, keeps torch's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.bench.concurrency import measure_concurrent
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Peer,
    Settings,
    environment,
    measure,
    new_results,
    sync_peer,
)
from asyncgraph.bench.peers import in_inference
from benchmarks.nativert_compare import TinyBert, _export, mlp

DEFAULT_THREADS = torch.get_num_threads()  # torch's default in this process (nothing set it)

MAX_BATCH = 32
TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}


class LoopThreads:
    """The loop thread's intra-op count, switched only when a peer needs another one."""

    def __init__(self) -> None:
        self.current = torch.get_num_threads()
        self.switches = 0

    def wrap(self, n: int, call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        async def wrapped() -> Any:
            if self.current != n:
                torch.set_num_threads(n)
                self.current = n
                self.switches += 1
            return await call()

        return wrapped


def arm(name: str, n: int) -> str:
    return f"{name} [loop {n}]"


def per_thread_semantics() -> dict[str, int]:
    """torch.get_num_threads() seen from several threads around a set_num_threads in one of
    them; the loop thread's count is restored at the end."""
    seen: dict[str, int] = {}
    before = torch.get_num_threads()
    ready, go = threading.Event(), threading.Event()

    def early() -> None:
        torch.get_num_threads()  # initialises this thread's count
        seen["thread started before, at start"] = torch.get_num_threads()
        ready.set()
        go.wait()
        seen["thread started before, after main set 1"] = torch.get_num_threads()

    def late() -> None:
        seen["thread started after main set 1"] = torch.get_num_threads()

    thread = threading.Thread(target=early)
    thread.start()
    ready.wait()
    torch.set_num_threads(1)
    seen["main after set 1"] = torch.get_num_threads()
    go.set()
    thread.join()
    thread = threading.Thread(target=late)
    thread.start()
    thread.join()
    torch.set_num_threads(before)
    return seen


def switch_cost_us(pairs: int = 2000) -> float:
    """Microseconds for torch.set_num_threads(1) then back to the current count: the price of
    setting 1 on the loop thread around each inline slice and restoring the caller's count."""
    before = torch.get_num_threads()
    start = time.perf_counter()
    for _ in range(pairs):
        torch.set_num_threads(1)
        torch.set_num_threads(before)
    return (time.perf_counter() - start) / pairs * 1e6


def models(settings: Settings) -> list[tuple[str, torch.nn.Module, torch.Tensor]]:
    width, layers = settings.pick((64, 8), (64, 8), (16, 2))
    hidden, blocks, seq = settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
    return [
        ("mlp", mlp(width, layers), torch.randn(1, width)),
        ("bert", TinyBert(hidden, blocks, seq).eval(), torch.randint(0, 1000, (1, seq))),
    ]


async def run(ctx: Context, loop_counts: Sequence[int]) -> list[CaseResult]:
    threads = LoopThreads()
    cases = []
    for key, model, x in models(ctx.settings):
        ep = _export(model, x)
        dynamic = _export(model, x, dynamic=True)
        cases.append(await _latency(ctx, threads, key, model, ep, x, loop_counts))
        cases.append(await _concurrent(ctx, threads, key, ep, dynamic, x, loop_counts))
    return cases


async def _latency(ctx: Context, threads: LoopThreads, key: str, model: torch.nn.Module,
                   ep: Any, x: torch.Tensor, loop_counts: Sequence[int]) -> CaseResult:
    executors: list[Executor] = []
    peers: list[Peer] = []
    eager = in_inference(model)
    for n in loop_counts:
        plain = Executor(ep, ExecutorConfig())
        scripted = Executor(ep, ExecutorConfig(segments=("script",)))
        executors += [plain, scripted]
        for name, ex in (("asyncgraph", plain), ("asyncgraph (scripted)", scripted)):
            peers.append(Peer(arm(name, n), threads.wrap(n, _execute(ex, x))))
        eager_peer = sync_peer("eager", lambda: eager(x))
        peers.append(Peer(arm("eager model(x)", n), threads.wrap(n, eager_peer.call)))
    try:
        results = await measure(peers, ctx.settings,
                                ctx.task(f"{key}: batch 1", ctx.rounds_total), **TOLERANCE)
    finally:
        for ex in executors:
            await ex.aclose()
    return CaseResult("thread_policy", f"{key} latency", f"{key}, batch 1, one caller",
                      {"loop_counts": list(loop_counts)}, results)


async def _concurrent(ctx: Context, threads: LoopThreads, key: str, ep: Any, dynamic: Any,
                      x: torch.Tensor, loop_counts: Sequence[int]) -> CaseResult:
    s = ctx.settings
    callers, per_caller = s.pick(64, 64, 4), s.pick(8, 2, 1)
    executors: list[Executor] = []
    peers: list[Peer] = []
    for n in loop_counts:
        plain = Executor(ep, ExecutorConfig())
        batched = Executor(dynamic, ExecutorConfig(
            batching=BatchingConfig(max_batch_size=MAX_BATCH)))
        executors += [plain, batched]
        peers.append(Peer(arm("asyncgraph", n), threads.wrap(n, _execute(plain, x))))
        peers.append(Peer(arm("asyncgraph (batched)", n), threads.wrap(n, _execute(batched, x))))
    results = new_results(peers)
    try:
        await measure_concurrent(ctx, peers, results, callers, per_caller,
                                 f"{key}: {callers} callers")
    finally:
        for ex in executors:
            await ex.aclose()
    return CaseResult("thread_policy", f"{key} x {callers} callers",
                      f"{key}, {callers} callers x {per_caller} requests",
                      {"loop_counts": list(loop_counts), "callers": callers,
                       "requests_per_caller": per_caller},
                      [results[p.name] for p in peers], columns="metrics")


def _execute(ex: Executor, x: torch.Tensor) -> Callable[[], Awaitable[Any]]:
    execute = ex.execute

    async def call() -> Any:
        return await execute(x)

    return call


def summary(cases: Sequence[CaseResult], loop_counts: Sequence[int]) -> list[dict[str, Any]]:
    """One row per peer: each arm's median (ms, or requests/s) and the ratio of the first arm
    over the last, with its p10-p90 taken within rounds."""
    first, last = loop_counts[0], loop_counts[-1]
    rows = []
    for case in cases:
        names = [p.name[: -len(f" [loop {first}]")] for p in case.peers
                 if p.name.endswith(f" [loop {first}]")]
        for name in names:
            a, b = case.peer(arm(name, first)), case.peer(arm(name, last))
            row: dict[str, Any] = {"case": case.case, "peer": name}
            if case.columns == "time":
                row[f"loop {first} ms"] = _ms(a.median_s)
                row[f"loop {last} ms"] = _ms(b.median_s)
                row[f"time, loop {first} / loop {last}"] = case.ratio(a.name, b.name)
            else:
                ta, tb = a.extra.get("throughput"), b.extra.get("throughput")
                row[f"loop {first} req/s"] = ta
                row[f"loop {last} req/s"] = tb
                row[f"p99 ms, loop {first} / {last}"] = [a.extra.get("p99_ms"),
                                                         b.extra.get("p99_ms")]
                row[f"throughput, loop {first} / loop {last}"] = ta / tb if ta and tb else None
            row["rounds p10-p90"] = case.round_spread(a.name, b.name)
            rows.append(row)
    return rows


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a look, not a figure")
    parser.add_argument("--rounds", type=int, help="measured rounds (15; 5 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds dropped (3; 1 with --quick)")
    parser.add_argument("--loop-threads", type=int, nargs="+",
                        default=sorted({DEFAULT_THREADS, 1}, reverse=True),
                        help=f"the loop thread's counts compared (default: torch's "
                        f"{DEFAULT_THREADS} and 1)")
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    parser.add_argument("-o", "--output", help="also write the JSON report here")
    args = parser.parse_args(argv)

    settings = Settings(size="quick" if args.quick else "full", rounds=args.rounds,
                        warmup=args.warmup)
    env = environment()
    semantics = per_thread_semantics()
    cost = switch_cost_us()
    start = time.perf_counter()

    def start_task(description: str, total: int) -> Callable[[], None]:
        print(f"{description}: {total} rounds", file=sys.stderr, flush=True)
        return lambda: None

    with asyncio.Runner() as runner:
        cases = runner.run(run(Context(settings, start_task), args.loop_threads))
    torch.set_num_threads(DEFAULT_THREADS)
    rows = summary(cases, args.loop_threads)
    report = {
        "environment": {**env, "load_average_end": environment()["load_average"],
                        "torch_default_threads": DEFAULT_THREADS},
        "settings": asdict(settings),
        "elapsed_s": round(time.perf_counter() - start, 1),
        "per_thread_semantics": semantics,
        "set_num_threads_pair_us": cost,
        "summary": rows,
        "cases": [c.as_dict() for c in cases],
    }
    text = json.dumps(report, indent=2, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    if args.json:
        print(text)
        return 0
    print(f"torch {env['torch']}, {env['cpu_count']} CPUs, torch's default intra-op count "
          f"{DEFAULT_THREADS}; load average {env['load_average']} at the start, "
          f"{report['environment']['load_average_end']} at the end; {report['elapsed_s']} s")
    print("per-thread counts:", ", ".join(f"{k}: {v}" for k, v in semantics.items()))
    print(f"torch.set_num_threads(1) and back: {cost:.1f} us a pair")
    for row in rows:
        cells = []
        for k, v in row.items():
            if k in ("case", "peer"):
                continue
            cells.append(f"{k} = {_fmt(v)}")
        print(f"{row['case']:>18} | {row['peer']:<22} | " + "; ".join(cells))
    return 0


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return "-".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())


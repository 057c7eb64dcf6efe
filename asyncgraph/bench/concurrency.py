"""Target 4, concurrent callers: 64 tasks calling the transformer encoder at once.

(Not named concurrent.py: run as a script from this folder, that would shadow the stdlib.)

The baseline is what a service author writes without asyncgraph: `await asyncio.to_thread(
model, x)` (asyncio's default thread pool, inference_mode inside the thread). asyncgraph runs
twice: every request as its own execution (the batch-1 program), and with dynamic batching
(the same encoder exported with a dynamic batch dimension; concurrent requests stack into
executions of up to 32 rows, asyncgraph/runtime/batching.py). The targets are judged on the batched
configuration, the way a service would deploy it; the unbatched figures stay in the table.

A round starts all callers together, each making a few requests in a row, and measures
throughput (requests per second over the round), each request's latency, and the event loop's
lag: a heartbeat task sleeps 1 ms at a time and records how late it wakes up. Rounds
alternate between the peers.

Throughput is the median over rounds; latency percentiles and lag are pooled over all measured
rounds of a peer.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from asyncgraph import BatchingConfig, Executor, ExecutorConfig
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Peer,
    PeerResult,
    Target,
    frozen_heap,
    new_results,
    quantile,
    round_order,
    verify,
)
from asyncgraph.bench.models import call_nodes, exported_encoder
from asyncgraph.bench.peers import asyncgraph_peer, in_inference
from asyncgraph.bench.transformer import TOLERANCE, sizes

NAME = "concurrent"
BATCHED = "asyncgraph (batched)"
MAX_BATCH = 32
HEARTBEAT_S = 0.001


async def run(ctx: Context) -> list[CaseResult]:
    s = ctx.settings
    hidden, layers, seq = sizes(ctx)
    callers = s.pick(64, 64, 4)
    per_caller = s.pick(8, 4, 1)
    model, ep = exported_encoder(hidden, layers, seq, False)
    _, dynamic_ep = exported_encoder(hidden, layers, seq, False, max_batch=MAX_BATCH)
    x = torch.randn(1, seq, hidden)
    eager = in_inference(model)
    ex = Executor(ep, ExecutorConfig())
    inline = Executor(ep, ExecutorConfig(heavy_op_flops=2**62))
    batched = Executor(dynamic_ep, ExecutorConfig(
        batching=BatchingConfig(max_batch_size=MAX_BATCH)))

    async def to_thread() -> Any:
        return await asyncio.to_thread(eager, x)

    peers = [
        asyncgraph_peer("asyncgraph", ex, [x], "default config (8 frames, 2 workers)"),
        asyncgraph_peer("asyncgraph (all inline)", inline, [x], "heavy_op_flops=2**62"),
        asyncgraph_peer(BATCHED, batched, [x], f"dynamic batching, up to {MAX_BATCH} rows"),
        Peer("to_thread(model, x)", to_thread, "asyncio.to_thread, default executor"),
    ]
    results = new_results(peers)
    try:
        await measure_concurrent(ctx, peers, results, callers, per_caller,
                                 f"{NAME}: {callers} callers")
    finally:
        await ex.aclose()
        await inline.aclose()
        await batched.aclose()
    case = CaseResult(
        NAME, "concurrent",
        f"{callers} concurrent callers x {per_caller} requests, transformer encoder",
        {"nodes": call_nodes(ep), "callers": callers, "requests_per_caller": per_caller,
         "hidden": hidden, "layers": layers, "seq": seq},
        [results[p.name] for p in peers], columns="metrics",
    )
    stats = batched.batching_statistics()
    if stats is not None:
        case.params["mean_batch_rows"] = round(stats.mean_rows, 1)
    ag, base = results[BATCHED].extra, results["to_thread(model, x)"].extra
    case.targets.append(Target(
        4, "throughput, asyncgraph (batched) / to_thread",
        _div(ag.get("throughput"), base.get("throughput")), ">=", 1.2,
        rounds=case.round_spread(BATCHED, "to_thread(model, x)")))
    case.targets.append(Target(
        4, "p99 latency, asyncgraph (batched) / to_thread",
        _div(ag.get("p99_ms"), base.get("p99_ms")), "<=", 1.0))
    case.targets.append(Target(
        4, "event-loop lag p99 (asyncgraph, batched)", ag.get("lag_p99_ms"), "<=", 5.0,
        unit="ms"))
    return [case]


async def measure_concurrent(
    ctx: Context, peers: list[Peer], results: dict[str, PeerResult], callers: int,
    per_caller: int, label: str,
) -> None:
    """Verify the peers, then time `callers` concurrent callers of each, `per_caller` calls
    apiece, round by round in a new seeded order; throughput, latency and loop lag go into
    `results` (the nativert comparison measures its 64-caller case the same way)."""
    s = ctx.settings
    await verify(peers, results, **TOLERANCE)
    live = [p for p in peers if not results[p.name].failed]
    rounds: dict[str, list[Round]] = {p.name: [] for p in live}
    advance = ctx.task(label, ctx.rounds_total)
    rng = random.Random(s.seed)
    with frozen_heap():
        for r in range(ctx.rounds_total):
            for peer in round_order(live, rng):
                gc.collect()
                measured = await one_round(peer.call, callers, per_caller)
                if r >= s.n_warmup:
                    rounds[peer.name].append(measured)
                await peer.settle()  # its threads quiet before the next peer (Peer's doc)
            advance()
    for name, rs in rounds.items():
        _summarise(results[name], rs)


class Round:
    """One round of callers: its wall time, each request's latency, the loop's lags."""

    __slots__ = ("elapsed", "lags", "latencies", "requests")

    def __init__(self, elapsed: float, latencies: list[float], lags: list[float]) -> None:
        self.elapsed = elapsed
        self.latencies = latencies
        self.lags = lags
        self.requests = len(latencies)


async def one_round(call: Callable[[], Awaitable[Any]], callers: int, per_caller: int) -> Round:
    """`callers` tasks making `per_caller` calls each at once, a heartbeat on the same loop."""
    latencies: list[float] = []
    lags: list[float] = []
    running = True

    async def heartbeat() -> None:
        while running:
            start = time.perf_counter()
            await asyncio.sleep(HEARTBEAT_S)
            lags.append(max(0.0, time.perf_counter() - start - HEARTBEAT_S))

    async def caller() -> None:
        for _ in range(per_caller):
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    elapsed = time.perf_counter() - start
    running = False
    await beat
    return Round(elapsed, latencies, lags)


def _summarise(result: PeerResult, rounds: list[Round]) -> None:
    if not rounds:
        return
    latencies = [x for r in rounds for x in r.latencies]
    lags = [x for r in rounds for x in r.lags] or [0.0]
    throughput = [r.requests / r.elapsed for r in rounds]
    result.samples = len(rounds)
    result.rounds = throughput
    result.median_s = statistics.median(latencies)
    result.p10_s = quantile(latencies, 0.10)
    result.p90_s = quantile(latencies, 0.90)
    result.extra = {
        "throughput": statistics.median(throughput),
        "p50_ms": result.median_s * 1e3,
        "p99_ms": quantile(latencies, 0.99) * 1e3,
        "lag_p99_ms": quantile(lags, 0.99) * 1e3,
        "lag_max_ms": max(lags) * 1e3,
        "heartbeats": len(lags),
    }


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b

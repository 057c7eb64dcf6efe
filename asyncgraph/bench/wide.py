"""Target 3, a wide graph: 16 independent branches, each a chain of 256x256 matmuls.

Every matmul takes about 0.4 ms and releases the GIL, so two worker threads should run two
branches at once: the target is a 1.8x speed-up of asyncgraph with max_parallel_ops=2 over
max_parallel_ops=1 (both with one intra-op thread). It is judged on the pair with pinned
workers (`pin_workers=True`, how a service that has the machine to itself deploys it); the
default pair is measured beside it. Peers show the alternatives: eager on one thread, eager
with two intra-op threads (parallelism inside each matmul instead of across branches), and
dask's threaded scheduler with two workers.

A second case, without a target, skews the branches: one chain of 12 matmuls and 8 chains of
2. The long chain alone is 12 of the 28 matmuls, so two threads can at best take 14 (2.0x), and
only if the long chain starts first; the workers' queue ranks units by the work ahead of them.
"""

from __future__ import annotations

import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.harness import CaseResult, Context, Target, measure, sync_peer, torch_threads
from asyncgraph.bench.models import call_nodes, exported_chains
from asyncgraph.bench.peers import (
    asyncgraph_peer,
    dask_peers,
    from_exported,
    in_inference,
    left_out,
)

NAME = "wide"


async def run(ctx: Context) -> list[CaseResult]:
    branches, depth, dim = ctx.settings.pick((16, 8, 256), (16, 4, 256), (4, 2, 32))
    long, short, skew_dim = ctx.settings.pick((12, 2, 256), (12, 2, 256), (3, 1, 32))
    wide = await _case(ctx, "wide", (depth,) * branches, dim)
    speedup = wide.ratio("asyncgraph (serial, pinned)", "asyncgraph (pinned)")
    wide.targets.append(
        Target(3, "speed-up, 2 workers vs serial (pinned)", speedup, ">=", 1.8)
    )
    skewed = await _case(ctx, "wide (skewed)", (long,) + (short,) * 8, skew_dim)
    return [wide, skewed]


async def _case(ctx: Context, case: str, lengths: tuple[int, ...], dim: int) -> CaseResult:
    model, ep = exported_chains(lengths, dim)
    x = torch.randn(dim, dim)
    parallel = Executor(ep, ExecutorConfig(max_parallel_ops=2))
    serial = Executor(ep, ExecutorConfig(max_parallel_ops=1))
    pinned = Executor(ep, ExecutorConfig(max_parallel_ops=2, pin_workers=True))
    serial_pinned = Executor(ep, ExecutorConfig(max_parallel_ops=1, pin_workers=True))
    eager = in_inference(model)

    def eager_two_threads() -> torch.Tensor:
        with torch_threads(2):
            return eager(x)  # type: ignore[no-any-return]

    prog = from_exported(ep)
    try:
        peers = [
            asyncgraph_peer("asyncgraph", parallel, [x], "max_parallel_ops=2"),
            asyncgraph_peer("asyncgraph (serial)", serial, [x], "max_parallel_ops=1"),
            asyncgraph_peer("asyncgraph (pinned)", pinned, [x], "2 workers, pin_workers"),
            asyncgraph_peer(
                "asyncgraph (serial, pinned)", serial_pinned, [x], "1 worker, pin_workers"
            ),
            sync_peer("eager model(x)", lambda: eager(x), "1 intra-op thread"),
            sync_peer("eager (2 threads)", eager_two_threads, "2 intra-op threads"),
            *dask_peers(prog, [x], workers=2),
        ]
        advance = ctx.task(f"{case}: chains of {lengths} matmuls {dim}", ctx.rounds_total)
        results = await measure(peers, ctx.settings, advance, rtol=1e-3, atol=1e-3)
        workers = sum(1 for p in parallel.placements().values() if p.name == "WORKER")
    finally:
        for ex in (parallel, serial, pinned, serial_pinned):
            await ex.aclose()
    lengths_text = (
        f"{len(lengths)} branches x {lengths[0]}" if len(set(lengths)) == 1
        else f"branches of {'+'.join(map(str, lengths))}"
    )
    result = CaseResult(
        NAME, case, f"{lengths_text} chained {dim}x{dim} matmuls",
        {"nodes": call_nodes(ep), "lengths": list(lengths), "dim": dim,
         "worker_nodes": workers},
        results, notes=left_out(),
    )
    result.metrics["speedup_2_workers_vs_serial"] = result.ratio(
        "asyncgraph (serial)", "asyncgraph"
    )
    result.metrics["speedup_pinned"] = result.ratio(
        "asyncgraph (serial, pinned)", "asyncgraph (pinned)"
    )
    result.metrics["speedup_vs_eager_1_thread"] = result.ratio("eager model(x)", "asyncgraph")
    result.metrics["speedup_dask_threaded_vs_sync"] = result.ratio(
        "dask get_sync", "dask threaded"
    )
    return result

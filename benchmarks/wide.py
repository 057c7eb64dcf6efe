"""Target 3, a wide graph: 16 independent branches, each a chain of 256x256 matmuls.

Every matmul takes about a millisecond and releases the GIL, so two worker threads should run
two branches at once: the target is a 1.8x speed-up of asyncgraph with max_parallel_ops=2 over
max_parallel_ops=1 (both with one intra-op thread). Peers show the alternatives: eager on one
thread, eager with two intra-op threads (parallelism inside each matmul instead of across
branches), and dask's threaded scheduler with two workers.
"""

from __future__ import annotations

import torch

from asyncgraph import Executor, ExecutorConfig
from benchmarks.harness import CaseResult, Context, Target, measure, sync_peer, torch_threads
from benchmarks.models import call_nodes, exported_wide
from benchmarks.peers import asyncgraph_peer, dask_runner, from_exported, in_inference

NAME = "wide"


async def run(ctx: Context) -> list[CaseResult]:
    branches, depth, dim = ctx.settings.pick((16, 8, 256), (16, 4, 256), (4, 2, 32))
    model, ep = exported_wide(branches, depth, dim)
    x = torch.randn(dim, dim)
    parallel = Executor(ep, ExecutorConfig(max_parallel_ops=2))
    serial = Executor(ep, ExecutorConfig(max_parallel_ops=1))
    eager = in_inference(model)

    def eager_two_threads() -> torch.Tensor:
        with torch_threads(2):
            return eager(x)  # type: ignore[no-any-return]

    prog = from_exported(ep)
    threaded = dask_runner(prog, threaded=True, workers=2)
    sync = dask_runner(prog, threaded=False)
    try:
        peers = [
            asyncgraph_peer("asyncgraph", parallel, [x], "max_parallel_ops=2"),
            asyncgraph_peer("asyncgraph (serial)", serial, [x], "max_parallel_ops=1"),
            sync_peer("eager model(x)", lambda: eager(x), "1 intra-op thread"),
            sync_peer("eager (2 threads)", eager_two_threads, "2 intra-op threads"),
            sync_peer("dask threaded", lambda: threaded([x]), "dask.threaded.get, 2 workers"),
            sync_peer("dask get_sync", lambda: sync([x]), "dask.local.get_sync"),
        ]
        advance = ctx.task(f"{NAME}: {branches}x{depth} matmuls {dim}", ctx.rounds_total)
        results = await measure(peers, ctx.settings, advance, rtol=1e-3, atol=1e-3)
        workers = sum(1 for p in parallel.placements().values() if p.name == "WORKER")
    finally:
        await parallel.aclose()
        await serial.aclose()
    case = CaseResult(
        NAME, "wide", f"{branches} branches x {depth} chained {dim}x{dim} matmuls",
        {"nodes": call_nodes(ep), "branches": branches, "depth": depth, "dim": dim,
         "worker_nodes": workers},
        results,
    )
    speedup = case.ratio("asyncgraph (serial)", "asyncgraph")
    case.targets.append(Target(3, "speed-up, 2 workers vs serial", speedup, ">=", 1.8))
    vs_eager = case.ratio("eager model(x)", "asyncgraph")
    case.metrics["speedup_vs_eager_1_thread"] = vs_eager
    case.metrics["speedup_dask_threaded_vs_sync"] = case.ratio("dask get_sync", "dask threaded")
    return [case]

"""Target 6, steady state: after warm-up an execution builds no frame and no plan structure.

Counted on the transformer encoder, one caller, after warm-up:

- frames and plans: ExecutionFrame.__init__, ExecutionPlan.__init__ and compile_calls are
  wrapped with counters for the measured executions (and restored after); the plan object
  must stay the same one.
- Python allocations: with tracemalloc, the transient peak of one execution (bytes allocated
  and still alive at the worst moment, over what was alive before); without tracemalloc,
  sys.getallocatedblocks() before and after a second window of many executions (blocks
  retained per execution; about 0 when nothing accumulates).

Tensor storage is not Python memory and is not counted here; the memory scenario counts it.
The same numbers for eager `model(x)` and `ep.module()` put asyncgraph's in proportion.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import asyncgraph.runtime.frame
import asyncgraph.runtime.plan
from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.harness import CaseResult, Context, Peer, PeerResult, Target, verify
from asyncgraph.bench.models import call_nodes, exported_encoder
from asyncgraph.bench.peers import asyncgraph_peer, module_peers
from asyncgraph.bench.transformer import TOLERANCE, sizes

NAME = "steady_state"


@contextmanager
def counting(counts: dict[str, int]) -> Iterator[None]:
    """Count frames and plans made inside the block (by wrapping their constructors)."""
    frame_cls = asyncgraph.runtime.frame.ExecutionFrame
    plan_cls = asyncgraph.runtime.plan.ExecutionPlan
    frame_init, plan_init = frame_cls.__init__, plan_cls.__init__
    compile_calls = asyncgraph.runtime.plan.compile_calls

    def wrap(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[key] = counts.get(key, 0) + 1
            return fn(*args, **kwargs)
        return counted

    frame_cls.__init__ = wrap("frames", frame_init)  # type: ignore[method-assign]
    plan_cls.__init__ = wrap("plans", plan_init)  # type: ignore[method-assign]
    asyncgraph.runtime.plan.compile_calls = wrap("compiled", compile_calls)
    try:
        yield
    finally:
        frame_cls.__init__ = frame_init  # type: ignore[method-assign]
        plan_cls.__init__ = plan_init  # type: ignore[method-assign]
        asyncgraph.runtime.plan.compile_calls = compile_calls


async def run(ctx: Context) -> list[CaseResult]:
    s = ctx.settings
    hidden, layers, seq = sizes(ctx)
    model, ep = exported_encoder(hidden, layers, seq, False)
    x = torch.randn(1, seq, hidden)
    warmup, n = s.pick(50, 20, 2), s.pick(500, 100, 3)
    ex = Executor(ep, ExecutorConfig())
    peers = [
        asyncgraph_peer("asyncgraph", ex, [x], "default config"), *module_peers(model, ep, [x])
    ]
    results = {p.name: PeerResult(p.name, p.note) for p in peers}
    advance = ctx.task(f"{NAME}: {n} executions", len(peers))
    counts: dict[str, int] = {}
    try:
        await verify(peers, results, **TOLERANCE)
        plan = ex.plan
        for i, peer in enumerate(peers):
            for _ in range(warmup):
                await peer.call()
            if i == 0:
                with counting(counts):
                    extra = await _allocations(peer, n)
            else:
                extra = await _allocations(peer, n)
            results[peer.name].extra = extra
            results[peer.name].samples = n
            advance()
        same_plan = ex.plan is plan
    finally:
        await ex.aclose()
    ag = results["asyncgraph"].extra
    ag["frames_created"] = counts.get("frames", 0)
    ag["plans_built"] = counts.get("plans", 0) + counts.get("compiled", 0)
    ag["same_plan_object"] = same_plan
    case = CaseResult(
        NAME, "steady_state", f"allocations per execution after {warmup} warm-up executions",
        {"nodes": call_nodes(ep), "executions": n, "warmup": warmup},
        [results[p.name] for p in peers], columns="metrics",
    )
    case.targets.append(Target(
        6, "frames created per execution", ag["frames_created"] / n, "<=", 0.0, unit=""))
    case.targets.append(Target(
        6, "plan structures built per execution",
        ag["plans_built"] / n + (0.0 if same_plan else 1.0), "<=", 0.0, unit=""))
    case.metrics["python_kb_transient_per_node"] = ag["transient_kb"] / max(1, call_nodes(ep))
    return [case]


async def _allocations(peer: Peer, n: int) -> dict[str, Any]:
    """Transient Python memory of one call, and blocks retained per call."""
    call: Callable[[], Awaitable[Any]] = peer.call
    for _ in range(n):  # the first window fills caches (dicts grow, free lists fill)
        await call()
    gc.collect()
    blocks = sys.getallocatedblocks()
    for _ in range(n):  # the second window shows growth: about 0 when nothing accumulates
        await call()
    gc.collect()
    retained_blocks = (sys.getallocatedblocks() - blocks) / n

    transient: list[int] = []
    tracemalloc.start()
    try:
        for _ in range(min(n, 200)):
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            await call()
            _, peak = tracemalloc.get_traced_memory()
            transient.append(peak - before)
    finally:
        tracemalloc.stop()
    return {
        "transient_kb": statistics.median(transient) / 1024,
        "retained_blocks_per_call": retained_blocks,
    }

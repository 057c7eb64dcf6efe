"""Target 1, per-node overhead: a chain of 1,000 relu ops on an 8x64 tensor.

Each relu costs about a microsecond, so the time is nearly all per-node overhead: binding
arguments, dispatch, the scheduler's bookkeeping. The baseline is the tightest Python there is,
`for fn in fns: x = fn(x)` over the very callables asyncgraph's kernels use (the OpOverload's
C++ `_op`). Two other loops show what the choice of callable alone costs: the OpOverload itself
(one more Python frame) and the eager model (`torch.relu`, the python-arg-parser binding).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.harness import CaseResult, Context, Target, measure, sync_peer
from asyncgraph.bench.models import call_nodes, exported_chain
from asyncgraph.bench.peers import (
    asyncgraph_peer,
    from_exported,
    graph_peers,
    left_out,
    module_peers,
)

NAME = "chain"


async def run(ctx: Context) -> list[CaseResult]:
    s = ctx.settings
    n = s.pick(1000, 1000, 20)
    model, ep = exported_chain(n, (8, 64))
    x = torch.randn(8, 64)
    ex = Executor(ep, ExecutorConfig())
    try:
        fns = [k.fn for k in ex.kernels]
        overloads = [torch.ops.aten.relu.default] * n

        def loop(callables: list[Any]) -> Any:
            y = x
            with torch.inference_mode():
                for fn in callables:
                    y = fn(y)
            return y

        prog = from_exported(ep)
        peers = [
            asyncgraph_peer("asyncgraph", ex, [x], "default config"),
            sync_peer("python loop", lambda: loop(fns),
                      "for fn in fns: x = fn(x), fn = aten.relu.default._op"),
            sync_peer("python loop (OpOverload)", lambda: loop(overloads),
                      "fn = torch.ops.aten.relu.default"),
            *module_peers(model, ep, [x]),
            *graph_peers(prog, [x], loop=False),
        ]
        advance = ctx.task(f"{NAME}: {n} relu", ctx.rounds_total)
        results = await measure(peers, s, advance)
    finally:
        await ex.aclose()
    case = CaseResult(
        NAME, "chain", f"{n} relu ops in a chain on 8x64 (per-node overhead)",
        {"nodes": call_nodes(ep), "shape": [8, 64]}, results, notes=left_out(),
    )
    ratio = case.ratio("asyncgraph", "python loop")
    case.targets.append(Target(1, "asyncgraph / python loop (1,000-node chain)", ratio, "<=", 2.0))
    per_node = results[0].median_s
    if per_node is not None:
        case.metrics["asyncgraph_us_per_node"] = per_node / n * 1e6
    loop_time = case.peer("python loop").median_s
    if loop_time is not None:
        case.metrics["python_loop_us_per_node"] = loop_time / n * 1e6
    return [case]

"""Target 2, single-request latency: a small transformer encoder, batch 1.

nn.TransformerEncoder (hidden 128, 2 layers, 4 heads, sequence 16). Two graphs of it:
`export` is what torch.export.export gives (about 70 nodes: linear, sdpa, layer_norm, views);
`core-aten` is the same program after run_decompositions(), as nativert loads it (about 140
nodes: addmm, bmm, softmax, many views and permutes); asyncgraph recomposes its attention into
SDPA and folds the weight transposes, and runs about 90 (`executed_nodes`). Eager `model(x)`
runs under inference_mode, where PyTorch takes its fused encoder fast path: the strongest
baseline there is.

Besides the default configuration, "asyncgraph (all inline)" raises heavy_op_flops so that no
node goes to a worker thread: the gap between the two is what placement costs on a graph whose
heavy nodes take tens of microseconds.
"""

from __future__ import annotations

import torch

from asyncgraph import Executor, ExecutorConfig
from asyncgraph.bench.harness import CaseResult, Context, Target, measure
from asyncgraph.bench.models import call_nodes, exported_encoder
from asyncgraph.bench.peers import (
    asyncgraph_peer,
    from_exported,
    graph_peers,
    left_out,
    module_peers,
)

NAME = "transformer"
TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}  # the fused fast path rounds differently


def sizes(ctx: Context) -> tuple[int, int, int]:
    """hidden, layers, sequence."""
    size: tuple[int, int, int] = ctx.settings.pick((128, 2, 16), (128, 2, 16), (32, 1, 4))
    return size


async def run(ctx: Context) -> list[CaseResult]:
    hidden, layers, seq = sizes(ctx)
    cases = []
    for core_aten in (False, True):
        cases.append(await _case(ctx, hidden, layers, seq, core_aten))
    return cases


async def _case(ctx: Context, hidden: int, layers: int, seq: int, core_aten: bool) -> CaseResult:
    model, ep = exported_encoder(hidden, layers, seq, core_aten)
    x = torch.randn(1, seq, hidden)
    name = "core-aten" if core_aten else "export"
    ex = Executor(ep, ExecutorConfig())
    inline = Executor(ep, ExecutorConfig(heavy_op_flops=2**62))
    try:
        peers = [
            asyncgraph_peer("asyncgraph", ex, [x], "default config"),
            asyncgraph_peer("asyncgraph (all inline)", inline, [x], "heavy_op_flops=2**62"),
            *module_peers(model, ep, [x]),
            *graph_peers(from_exported(ep), [x]),
        ]
        advance = ctx.task(f"{NAME} ({name}): {call_nodes(ep)} nodes", ctx.rounds_total)
        results = await measure(peers, ctx.settings, advance, **TOLERANCE)
        placements = [p.name for p in ex.placements().values()]  # as decided
    finally:
        await ex.aclose()
        await inline.aclose()
    case = CaseResult(
        NAME, f"transformer ({name})",
        f"TransformerEncoder hidden {hidden}, {layers} layers, seq {seq}, batch 1; {name} graph",
        {"nodes": call_nodes(ep), "hidden": hidden, "layers": layers, "seq": seq,
         "executed_nodes": len(ex.graph.nodes), "worker_nodes": placements.count("WORKER")},
        results, notes=left_out(),
    )
    case.targets.append(Target(
        2, f"asyncgraph / eager model(x) ({name})",
        case.ratio("asyncgraph", "eager model(x)"), "<=", 1.0,
    ))
    case.targets.append(Target(
        2, f"asyncgraph / ep.module() ({name})",
        case.ratio("asyncgraph", "ep.module()"), "<=", 0.8,
    ))
    return case

"""`asyncgraph profile MODEL.pt2`: the slowest nodes, time per op type and the placement.

The measurement is asyncgraph/tools/profile.py's (trace spans, nativert's ProfileMetrics
fields); this runs it on a .pt2 and prints it as tables or JSON.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from asyncgraph.cli.options import (
    ImportsOpt,
    InputsOpt,
    MaxParallelOpsOpt,
    ModelArg,
    RandomOpt,
    ScriptSegmentsOpt,
    SeedOpt,
    SegmentsOpt,
    ThreadsOpt,
    TrustCompiledOpt,
    chosen_segments,
    executor_config,
    load_executor,
)

if TYPE_CHECKING:  # torch is imported when the command runs, so `--help` stays quick
    from asyncgraph.tools.profile import ProfileMetrics


def render(metrics: ProfileMetrics, console: Console, top: int) -> None:
    nodes = sorted(metrics.time_per_node, key=lambda n: -n.mean_us)
    shown = nodes if top <= 0 else nodes[:top]
    table = Table(title=f"slowest nodes ({len(shown)} of {metrics.total_nodes_count}), "
                        f"mean of {metrics.runs} runs", title_justify="left")
    for col in ("#", "node", "op", "placement", "us", "%"):
        table.add_column(col, justify="right" if col in ("#", "us", "%") else "left")
    for n in shown:
        table.add_row(str(n.index), n.name, n.op, n.placement, f"{n.mean_us:.1f}",
                      f"{n.percent:.1f}")
    console.print(table)
    types = Table(title="by op type", title_justify="left")
    for col in ("op", "nodes", "us", "%", "us per node"):
        types.add_column(col, justify="left" if col == "op" else "right")
    for op, us in metrics.time_per_node_type.items():
        count = metrics.instances_per_node_type[op]
        types.add_row(op, str(count), f"{us:.1f}", f"{metrics.percent_per_node_type[op]:.1f}",
                      f"{us / count:.1f}")
    console.print(types)
    folded = (f"; {metrics.folded_nodes_count} nodes read only weights and were folded into "
              "constants" if metrics.folded_nodes_count else "")
    placements = ", ".join(f"{k} {v}" for k, v in sorted(metrics.placement_counts.items()))
    console.print(
        f"nodes {metrics.total_nodes_count} (prim {metrics.prim_nodes_count}, aten "
        f"{metrics.static_dispatch_nodes_count}); placement: {placements}{folded}",
        soft_wrap=True,
    )
    for line in time_lines(metrics):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if metrics.cuda_graphs is not None:
        console.print(f"CUDA graphs: {metrics.cuda_graphs} (profiled executions run node by node)")
    for line in metrics.cuda_graph_segments:
        console.print(f"  {line}", markup=False)


def time_lines(metrics: ProfileMetrics) -> list[str]:
    """Where an execution's wall time goes, every figure the mean over the same executions
    (asyncgraph/tools/profile.py: wall >= nodes running >= critical path by construction)."""
    nodes = max(1, metrics.total_nodes_count)
    at_once = "one at a time"
    if metrics.busy_time_us and metrics.total_time_us > metrics.busy_time_us * 1.005:
        at_once = (f"{metrics.total_time_us / metrics.busy_time_us:.2f} at once on average "
                   "while any ran")
    return [
        f"wall {metrics.wall_time_us:.1f} us per execution (mean of {metrics.runs}; median "
        f"{metrics.wall_median_us:.1f} us) = nodes running {metrics.busy_time_us:.1f} us + no "
        f"node running {metrics.outside_nodes_us:.1f} us (scheduling and tracing, "
        f"{metrics.outside_nodes_us / nodes:.2f} us per node)",
        f"node time {metrics.total_time_us:.1f} us summed over {metrics.total_nodes_count} "
        f"nodes, {at_once}; critical path {metrics.critical_path_us:.1f} us",
    ]


def profile(
    model: ModelArg,
    runs: int = typer.Option(20, min=1, help="Profiled executions."),
    warmup: int = typer.Option(3, min=0, help="Executions before profiling."),
    top: int = typer.Option(25, help="Nodes to list, slowest first (0: all)."),
    max_parallel_ops: MaxParallelOpsOpt = None,
    inputs: InputsOpt = None,
    random: RandomOpt = False,
    seed: SeedOpt = 0,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
    script_segments: ScriptSegmentsOpt = False,
    segments: SegmentsOpt = None,
    json_out: bool = typer.Option(False, "--json", help="Print ProfileMetrics as JSON."),
) -> None:
    """Per-node time, percent, totals per op type and the placement chosen, for a .pt2."""
    from asyncgraph.cli.inputs import chosen_inputs
    from asyncgraph.tools.profile import collect, fast_form_verdict

    options: dict[str, Any] = {
        "trace": True, "segments": chosen_segments(segments, script_segments)}
    if max_parallel_ops is not None:
        options["max_parallel_ops"] = max_parallel_ops
    ex = load_executor(model, executor_config(threads, **options), trust_compiled)
    untraced = {**options, "trace": False}
    plain = not executor_config(threads, **untraced).fast_paths or untraced["segments"]

    async def main() -> tuple[ProfileMetrics, dict[str, Any] | None]:
        try:
            chosen = chosen_inputs(ex, inputs, random, seed)
            metrics = await collect(ex, chosen, runs, warmup)
        finally:
            await ex.aclose()
        if plain:  # no fast form to ask about
            return metrics, None
        default = load_executor(model, executor_config(threads, **untraced), trust_compiled)
        try:
            return metrics, await fast_form_verdict(default, chosen)
        finally:
            await default.aclose()

    console = Console(stderr=json_out)
    with console.status(f"profiling {model.name}..."):
        metrics, forms = asyncio.run(main())
    if json_out:
        print(json.dumps({**metrics.as_dict(), "forms": forms}, indent=2, default=str))
    else:
        render(metrics, console, top)
        for line in form_lines(forms):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def form_lines(forms: dict[str, Any] | None) -> list[str]:
    """What serves these inputs on the default path (`statistics().forms`), and why."""
    if forms is None:
        return []
    lines = [f"default path: {forms['form'] or 'the plain graph'} "
             f"(fast form {forms['state']}, built in {forms['build_s']} s)"]
    lines += [f"  {name} stays plain: {why}" for name, why in forms["passed"].items()]
    lines += [f"  serves these inputs {how}: {v[regime]['form']}: {v[regime]['why']}"
              for v in forms["signatures"].values()
              for regime, how in (("alone", "alone"), ("loaded", "under load"))]
    lines += [f"  form {form}, segment {node}, inputs {signature}: {said}"
              for form, segments in forms.get("segments", {}).items()
              for node, serves in segments.items() for signature, said in serves.items()]
    return lines

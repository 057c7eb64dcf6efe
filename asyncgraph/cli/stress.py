"""`asyncgraph stress MODEL.pt2`: hammer a model with concurrent callers, cancellations,
timeouts, injected kernel faults and delays, and weight swaps; check every result.

A thin front of asyncgraph.testing.run_stress: the summary is printed as a table and the
command exits 1 on any violation (a wrong result, an unexpected error, a leak, a loop-lag p99
above --max-loop-lag-ms). Runs are seeded: the same --seed makes the same decisions. Progress
of the run and of the reference check goes to stderr; the table gives the time of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from asyncgraph.cli.options import (
    ImportsOpt,
    MaxConcurrentExecutionsOpt,
    MaxParallelOpsOpt,
    ThreadsOpt,
    TrustCompiledOpt,
    executor_config,
)

console = Console()
DEFAULT_MAX_LOOP_LAG_MS = 100.0
"""A loop-lag p99 above this fails the run: every timer, request and heartbeat on that loop
waited so long, 100 times the 1 ms slice the executor gives inline kernels per turn."""

def stress(
    model: Annotated[
        Path, typer.Argument(metavar="MODEL", help="A .pt2 file written by torch.export.save.")
    ],
    executions: Annotated[int, typer.Option(min=1, help="Executions to run in all.")] = 200,
    concurrency: Annotated[int, typer.Option(min=1, help="Concurrent callers.")] = 16,
    cancel_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Fraction of callers cancelled.")
    ] = 0.05,
    timeout_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Fraction of calls under a short timeout.")
    ] = 0.05,
    fault_rate: Annotated[
        float,
        typer.Option(min=0.0, max=1.0, help="Fraction of executions hit by a kernel fault."),
    ] = 0.05,
    delay_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Fraction of kernel calls delayed.")
    ] = 0.1,
    max_delay_ms: Annotated[
        float, typer.Option(min=0.0, help="Longest injected kernel delay.")
    ] = 2.0,
    swap_weights_every: Annotated[
        int, typer.Option(min=0, help="Swap in new weights every S executions (0: never).")
    ] = 0,
    seed: Annotated[int, typer.Option(help="Seed of every random decision.")] = 0,
    max_concurrent_executions: MaxConcurrentExecutionsOpt = 8,
    max_parallel_ops: MaxParallelOpsOpt = None,
    max_loop_lag_ms: Annotated[
        float,
        typer.Option(min=0.0, help="Fail when the event loop's lag p99 exceeds this (0: only "
                     "report it)."),
    ] = DEFAULT_MAX_LOOP_LAG_MS,
    distinct_inputs: Annotated[
        int, typer.Option(min=1, help="Input sets the executions draw from; the reference "
                          "runs once per set and weights version.")
    ] = 32,
    max_batch_size: Annotated[
        int, typer.Option(min=0, help="Dynamic batching of up to this many rows (0: off).")
    ] = 0,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
) -> None:
    """Stress a model: concurrent callers, cancellations, timeouts, faults, weight swaps."""
    from asyncgraph.runtime.config import BatchingConfig
    from asyncgraph.testing import StressConfig, run_stress

    config = StressConfig(
        executions=executions,
        concurrency=concurrency,
        cancel_rate=cancel_rate,
        timeout_rate=timeout_rate,
        fault_rate=fault_rate,
        delay_rate=delay_rate,
        max_delay_s=max_delay_ms / 1e3,
        swap_weights_every=swap_weights_every,
        seed=seed,
        max_loop_lag_s=max_loop_lag_ms / 1e3 if max_loop_lag_ms else None,
        distinct_inputs=distinct_inputs,
    )
    options: dict[str, Any] = {"max_concurrent_executions": max_concurrent_executions}
    if max_parallel_ops is not None:
        options["max_parallel_ops"] = max_parallel_ops
    if max_batch_size:
        options["batching"] = BatchingConfig(max_batch_size=max_batch_size)
    from asyncgraph.loading import load_program

    started = time.perf_counter()
    with console.status(f"loading {model} ..."):
        # before the bars: a bad file is one line, nothing else
        program = load_program(model, trust_compiled=trust_compiled)
    load_s = time.perf_counter() - started
    with _progress_bars() as progress:
        report = asyncio.run(run_stress(
            program, config, executor_config=executor_config(threads, **options),
            progress=progress,
        ))

    table = Table(title=f"stress {model.name}, seed {seed}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("executions", str(executions)),
        ("completed", str(report.completed)),
        ("cancelled", str(report.cancelled)),
        ("timed out", str(report.timed_out)),
        ("faults injected", str(report.injected_faults)),
        *([("batches retried alone", str(report.retried_batches))] if max_batch_size else []),
        ("faults reached callers", str(report.faulted)),
        ("mismatches", str(report.mismatches)),
        ("unexpected errors", str(report.errors)),
        ("weight swaps", str(report.weight_swaps)),
        ("frames high-water", f"{report.frames_high_water}/{report.max_frames}"),
        ("loop lag p99", f"{report.loop_lag_p99_ms:.2f} ms"),
        ("loop lag max", f"{report.loop_lag_max_ms:.2f} ms"),
        ("loading", f"{load_s:.2f} s"),
        ("run", f"{report.elapsed_s:.2f} s"),
        ("verification", f"{report.verify_s:.2f} s ({report.reference_runs} reference runs)"),
        ("total", f"{load_s + report.total_s:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if not max_loop_lag_ms:
        console.print("loop lag not checked (--max-loop-lag-ms 0)")
    if report.ok:
        console.print("[green]ok[/green]: no violation")
        return
    console.print(f"[red]{len(report.violations)} violation(s)[/red]:")
    for violation in report.violations[:20]:
        console.print(f"  {violation}", markup=False)
    if len(report.violations) > 20:
        console.print(f"  ... and {len(report.violations) - 20} more")
    raise typer.Exit(1)


@contextlib.contextmanager
def _progress_bars() -> Iterator[Callable[[str, int, int], None]]:
    """Bars on stderr for the run and the reference check; `progress(phase, done, total)`."""
    labels = {"run": "executions", "verify": "verifying results"}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=Console(stderr=True), transient=True,
    ) as bars:
        tasks: dict[str, TaskID] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(labels.get(phase, phase), total=total)
            bars.update(tasks[phase], completed=done, total=total)

        yield progress

"""`asyncgraph check MODEL.pt2`: asyncgraph against ep.module(), a table per output leaf.

The comparison is asyncgraph/tools/check.py's; this prints it. The exit status is 1 when
anything differs or a run fails, so the command can gate a deployment.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from asyncgraph.cli.options import (
    ImportsOpt,
    InputsOpt,
    ModelArg,
    RandomOpt,
    SeedOpt,
    ThreadsOpt,
    TrustCompiledOpt,
    executor_config,
)
from asyncgraph.tools.check import CheckReport, run_check

console = Console()


def check(
    model: ModelArg,
    inputs: InputsOpt = None,
    random: RandomOpt = False,
    seed: SeedOpt = 0,
    max_parallel_ops: Annotated[
        int, typer.Option("--max-parallel-ops", min=2,
                          help="Worker threads of the parallel run.")
    ] = 2,
    rtol: Annotated[
        float | None, typer.Option(help="Relative tolerance (default: by dtype).")
    ] = None,
    atol: Annotated[
        float | None, typer.Option(help="Absolute tolerance (default: by dtype).")
    ] = None,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
) -> None:
    """Run MODEL through asyncgraph and through ep.module(); compare every output leaf.

    The inputs are the files given with --input (as `asyncgraph run` reads them), else the
    sample inputs stored in the file, else random ones with the exported shapes.
    """
    if (rtol is None) != (atol is None):
        raise typer.BadParameter("give both --rtol and --atol, or neither")
    if inputs and random:
        raise typer.BadParameter("give input files or --random, not both")
    given = None
    if inputs:
        from asyncgraph.cli.inputs import load_inputs

        given = functools.partial(load_inputs, sources=list(inputs))
    with warnings.catch_warnings():  # torch's own pytree deprecation noise
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning
        )
        executor_config(threads, max_parallel_ops=max_parallel_ops)  # this thread's torch threads
        report = run_check(
            model, seed=seed, use_random=random, parallel=max_parallel_ops, rtol=rtol, atol=atol,
            threads=threads, trust_compiled=trust_compiled, user_inputs=given,
            user_inputs_source=f"inputs from {_files(inputs or [])}",
        )
    print_report(report)
    if not report.ok:
        raise typer.Exit(1)


def _files(sources: list[str]) -> str:
    """The --input sources by file name (NAME=file.npy, file.pt), for the report's title."""
    names = []
    for source in sources:
        name, eq, path = source.rpartition("=") if "=" in source else ("", "", source)
        names.append(f"{name}{eq}{Path(path).name}")
    return ", ".join(names)


def print_report(report: CheckReport) -> None:
    """The per-output comparison table, then what differs, the failed runs and a verdict."""
    names = [n for n in report.runs if n != "eager"]
    table = Table(
        title=f"asyncgraph check: {report.program} on {report.inputs_source}",
        caption="mutated inputs and buffers are compared after the call",
    )
    table.add_column("output", no_wrap=True)
    table.add_column("eager")
    for name in names:
        table.add_column(name, no_wrap=True)
    table.add_column("max |diff|", justify="right", no_wrap=True)
    table.add_column("result", no_wrap=True, min_width=8)
    details: list[str] = []
    for what, expected, comparisons in report.rows:
        cells, diffs, bad = [], [], False
        for name in names:
            c = comparisons[name]
            if c is None:
                cells.append("[red]run failed[/red]")
                bad = True
                continue
            cells.append(escape(c.actual) if c.actual != expected else "same")
            if c.max_abs_diff is not None:
                diffs.append(c.max_abs_diff)
            if not c.ok:
                bad = True
                details.append(f"{what} ({name}): {c.problem}")
        diff = f"{max(diffs):.3g}" if diffs else "-"
        result = "[red]MISMATCH[/red]" if bad else "[green]ok[/green]"
        table.add_row(escape(what), escape(expected), *cells, diff, result)
    console.print(table)
    for line in details:
        console.print(f"[red]mismatch[/red] {escape(line)}", highlight=False)
    for name, run in report.runs.items():
        if run.error is not None:
            console.print(f"[red]{name} run failed:[/red]\n{escape(run.error)}", highlight=False)
    if report.ok:
        console.print(f"[green]ok[/green]: {_leaves(len(report.rows))} in every run")
    else:
        console.print("[red]MISMATCH[/red]: asyncgraph does not reproduce ep.module()")


def _leaves(count: int) -> str:
    return "the one output leaf matches" if count == 1 else f"all {count} output leaves match"

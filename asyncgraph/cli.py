"""The `asyncgraph` console script (typer + rich)."""

from __future__ import annotations

import asyncio

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Run dataflow graphs - above all torch.export programs - from async Python.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """asyncgraph: an asyncio-native dataflow executor for torch.export programs."""


@app.command()
def demo(
    executions: int = typer.Option(400, help="Executions to run."),
    concurrency: int = typer.Option(32, help="Concurrent callers."),
) -> None:
    """Export a small transformer block, run it from concurrent callers, check against eager."""
    from asyncgraph.demo import run_demo

    with console.status("exporting and running the demo model..."):
        result = asyncio.run(run_demo(executions, concurrency))
    table = Table(title="asyncgraph demo: DemoBlock (transformer encoder block)")
    for column in ("nodes", "executions", "callers", "p50 ms", "p99 ms", "exec/s", "match"):
        table.add_column(column, justify="right")
    ok = result.matched == result.executions
    table.add_row(
        str(result.nodes), str(result.executions), str(result.concurrency),
        f"{result.p50_ms:.2f}", f"{result.p99_ms:.2f}", f"{result.throughput:.0f}",
        f"{result.matched}/{result.executions}" + (" ok" if ok else " MISMATCH"),
    )
    console.print(table)
    if not ok:
        raise typer.Exit(1)


# -- commands defined in their own modules (one registration line each) ------------------------
# (keep this block sorted; each module defines a plain function taking typer options)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

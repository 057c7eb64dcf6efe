"""`asyncgraph bench`: the benchmark suite (peers side by side, targets), from the command line.

The suite is asyncgraph.bench, installed with the package and imported when the command
runs (nothing else imports it), so an installed `asyncgraph[cli]` runs the default scenarios
without a source checkout; dask, a peer, is left out with one line where it does not import.
The two optional scenarios (`-s onnxruntime`, `-s perf-analyzer`) are scripts of a checkout's
benchmarks/ folder: without one in reach each reports one case, skipped, saying so.

Timing never decides anything by itself: `--check` is for a person or a scheduled job on a
quiet machine, and CI runs only the smoke test (tests/integration/test_bench_smoke.py).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console


def bench(
    scenario: list[str] = typer.Option(  # noqa: B008 - typer's declaration style
        [], "--scenario", "-s",
        help="Scenario to run (repeatable): chain, transformer, wide, concurrent, memory, "
             "steady_state; onnxruntime and perf-analyzer only when named (scripts of a "
             "source checkout's benchmarks/; they need the onnxruntime extra and a "
             "perf_analyzer binary). Default: all but those two.",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="Target sizes but few rounds: a look, not a figure to quote."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Print the report as JSON on stdout (progress goes to stderr)."
    ),
    check: bool = typer.Option(
        False, "--check",
        help="Exit 1 when a target is missed or a peer's output differs from asyncgraph's.",
    ),
    rounds: int | None = typer.Option(None, min=1, help="Measured rounds per case."),
    warmup: int | None = typer.Option(None, min=0, help="Warm-up rounds, not measured."),
    loop: str = typer.Option("asyncio", help="Event loop: asyncio or uvloop."),
    threads: int = typer.Option(
        1, min=1, help="torch intra-op threads, for asyncgraph and every peer alike."
    ),
    output: Path | None = typer.Option(  # noqa: B008
        None, "--output", "-o", help="Also write the JSON report to this file."
    ),
) -> None:
    """Run asyncgraph and its peers side by side; print ratios of medians and the targets."""
    from asyncgraph.bench import suite
    from asyncgraph.bench.harness import Settings, event_loop

    try:
        chosen_loop = event_loop(loop)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--loop") from None
    if output is not None:
        from asyncgraph.cli.inputs import check_output_path

        check_output_path(output)
    try:
        names = suite.select(scenario)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scenario") from None
    settings = Settings(
        size="quick" if quick else "full", rounds=rounds, warmup=warmup, loop=chosen_loop,
        threads=threads,
    )
    console = Console(stderr=json_out, width=None if Console().is_terminal else 132)
    report = suite.run_suite(names, settings, console)
    text = suite.to_json(report)
    if output is not None:
        output.write_text(text)
    if json_out:
        print(text)
    else:
        suite.render(report, console)
    if check and (report.failures or report.mismatches):
        for line in report.failures + report.mismatches:
            Console(stderr=True).print(f"[red]{line}[/red]")
        raise typer.Exit(1)

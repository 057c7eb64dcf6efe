"""`asyncgraph compile MODEL.pt2 -o OUT.pt2 [--segments auto|whole] [--autotune] [--threads N]`.

Compiles the program's runs of CPU aten nodes with AOTInductor (asyncgraph/compiled) and prints
what it did: segments, nodes compiled of all, segments left interpreted and why, compile time
and package size, then (unless --no-compare) whether the package runs faster than the plain
graph on this machine, timed on the example inputs (compare.py). Load the result with
`asyncgraph.load(path, trust_compiled=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from asyncgraph.cli.options import ImportsOpt

SegmentsOpt = Annotated[
    str,
    typer.Option(
        "--segments",
        help="auto: only runs long or costly enough to gain from fusion; whole: every run "
             "of compilable nodes.",
    ),
]


def compile_command(
    model: Annotated[Path, typer.Argument(help="The .pt2 written by torch.export.save.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The package to write.")],
    segments: SegmentsOpt = "auto",
    autotune: Annotated[
        bool,
        typer.Option(
            "--autotune",
            help="Compile each segment with max-autotune too (inductor's C++ GEMM: minutes "
                 "more of compile), time both here (at the example's size and, for dynamic "
                 "dimensions, a larger one) and keep the autotuned one only where it is faster "
                 "at both. Weights stay swappable; a segment whose packed weights cannot be "
                 "traced is reported frozen.",
        ),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", min=1,
            help="The intra-op thread count the kernels are built for: the one each worker "
                 "thread will run them with (default: as the commands that run a model "
                 "default it, CPUs / worker threads, at least 1; at 1 the kernels have no "
                 "OpenMP regions).",
            show_default=False,
        ),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare/--no-compare",
            help="Time the package against the plain graph on the example inputs (a few "
                 "seconds) and say whether it is faster on this machine.",
        ),
    ] = True,
    imports: ImportsOpt = None,
) -> None:
    """Compile a program's hot runs of nodes with AOTInductor into MODEL.aoti.pt2."""
    from asyncgraph.compiled import compare_with_plain, compile_program
    from asyncgraph.compiled.segments import MODES

    if segments not in MODES:
        raise typer.BadParameter(f"expected one of {', '.join(MODES)}, got {segments!r}",
                                 param_hint="--segments")
    console = Console()
    report = compile_program(model, output, segments, autotune=autotune, threads=threads,
                             progress=lambda message: console.print(message, markup=False))
    table = Table(title=f"asyncgraph compile: {model.name} -> {output.name}")
    for column in ("segments", "nodes compiled", "left interpreted", "threads", "compile s",
                   "package MB"):
        table.add_column(column, justify="right")
    table.add_row(
        str(len(report.segments)),
        f"{report.nodes_compiled}/{report.nodes_total}",
        str(len(report.failed)),
        str(report.threads),
        f"{report.compile_s:.1f}",
        f"{report.package_bytes / 1e6:.2f}",
    )
    console.print(table)
    for segment in report.segments:
        if segment.frozen:
            console.print(f"{segment.name}: weights frozen ({segment.frozen})", markup=False)
    for failed in report.failed:
        console.print(f"left interpreted ({failed.nodes[0]} .. {failed.nodes[-1]}): "
                      f"{failed.reason}", markup=False)
    if compare and report.segments:
        console.print("timing the package against the plain graph", markup=False)
        console.print(compare_with_plain(output).describe(), markup=False)

"""The suite: run scenarios in one process, show progress, print tables, emit JSON, check.

`asyncgraph bench` is a thin typer command over `run_suite`, `render` and `to_json`; the same
functions run under pytest in the smoke test with `Settings(size="tiny")`.

The default scenarios are modules of this package, so an installed `asyncgraph[cli]` runs
them without a source checkout. The two run only when named (`OPTIONAL`) are scripts of a
checkout's benchmarks/ folder (they share ONNX Runtime's and nativert's workloads with the
scripts there): they are imported when named, and where no checkout is in reach the scenario
reports one case, skipped, saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import pathlib
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from asyncgraph.bench import (
    chain,
    concurrency,
    memory,
    steady_state,
    transformer,
    wide,
)
from asyncgraph.bench.harness import (
    CaseResult,
    Context,
    Settings,
    environment,
    skipped_case,
    torch_threads,
)

SCENARIOS: dict[str, ModuleType] = {
    m.NAME: m for m in (chain, transformer, wide, concurrency, memory, steady_state)
}
# Run only when named (`-s onnxruntime`, `-s perf-analyzer`), by the module of a source
# checkout that holds each: peers from the onnxruntime extra or an external binary
# (perf_analyzer), and exports that take seconds; a scenario whose dependency is missing
# reports one case, skipped, saying why.
OPTIONAL: dict[str, str] = {
    "onnxruntime": "benchmarks.ort",
    "perf-analyzer": "benchmarks.perf_analyzer",
}
# The root of the source checkout this package sits in, when it sits in one (an editable
# install): where `asyncgraph bench` finds OPTIONAL's modules when `benchmarks` is not
# importable already (the console script's sys.path has no checkout on it).
CHECKOUT = pathlib.Path(__file__).resolve().parents[2]

Scenario = Callable[[Context], Awaitable[list[CaseResult]]]


@dataclass
class Report:
    environment: dict[str, Any]
    settings: dict[str, Any]
    cases: list[CaseResult] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def failures(self) -> list[str]:
        """Targets missed, and peers whose output did not match asyncgraph's."""
        out = []
        for case in self.cases:
            for t in case.targets:
                if not t.met:
                    out.append(f"target {t.number} missed: {t.name} = {_fmt(t.value)} "
                               f"(needs {t.op} {t.limit:g})")
        return out

    @property
    def mismatches(self) -> list[str]:
        return [f"{c.case}: {p.name}: {p.error or 'mismatch'}"
                for c in self.cases for p in c.peers if p.matched is False]

    def as_dict(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "settings": self.settings,
            "elapsed_s": self.elapsed_s,
            "ok": not self.failures,
            "failures": self.failures,
            "mismatches": self.mismatches,
            "cases": [c.as_dict() for c in self.cases],
        }


def select(names: Iterable[str] | None) -> list[str]:
    """Scenario names in suite order (the optional ones, named only, last); raises ValueError
    naming the unknown ones."""
    if not names:
        return list(SCENARIOS)
    names = list(names)
    known = {**SCENARIOS, **OPTIONAL}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    return [n for n in known if n in names]


def scenario(name: str) -> Scenario:
    """The `run` of the scenario `name` (one of `select`'s): a default scenario's, an optional
    one's from its checkout module, or, where that module is out of reach, a run that reports
    one case, skipped, saying why."""
    if name in SCENARIOS:
        run: Scenario = SCENARIOS[name].run
        return run
    try:
        module = checkout_module(OPTIONAL[name])
    except LookupError as exc:
        why = str(exc)

        async def skipped(ctx: Context) -> list[CaseResult]:
            return [skipped_case(name, why)]

        return skipped
    run = module.run
    return run


def checkout_module(dotted: str) -> ModuleType:
    """The module `dotted` of a source checkout's benchmarks/ folder: imported as it is where
    `benchmarks` is importable (`python -m` from the checkout's root, the tests), else from
    CHECKOUT, put on sys.path. Raises LookupError naming the module and where it was looked
    for when neither has it (an install from a wheel)."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name not in (dotted, dotted.partition(".")[0]):
            raise
    script = CHECKOUT.joinpath(*dotted.split(".")).with_suffix(".py")
    if not script.is_file():
        raise LookupError(
            f"{dotted} is a script of asyncgraph's source checkout (benchmarks/), run there "
            f"with `python -m {dotted}`; none is importable here or next to the package "
            f"({CHECKOUT})"
        )
    sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(dotted)


async def run_scenarios(
    names: Sequence[str],
    settings: Settings,
    start_task: Callable[[str, int], Callable[[], None]] | None = None,
) -> Report:
    """Run the named scenarios one after the other in the running event loop."""
    report = Report(environment(), asdict(settings))
    ctx = Context(settings, start_task)
    start = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        for name in select(names):
            report.cases.extend(await scenario(name)(ctx))
    finally:
        torch.set_num_threads(before)
    report.elapsed_s = time.perf_counter() - start
    report.environment["torch_threads"] = settings.threads
    report.environment["load_average_end"] = environment()["load_average"]
    return report


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory of a run's `Settings.loop` (None: asyncio's default loop)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run_suite(
    names: Sequence[str] | None, settings: Settings, console: Console | None = None
) -> Report:
    """Run the suite in a fresh event loop (asyncio or uvloop), with progress bars on `console`."""
    factory = loop_factory(settings.loop)
    chosen = select(names)
    if console is None:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(run_scenarios(chosen, settings))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    # No auto-refresh: its thread would take the GIL (and allocate) in the middle of timed
    # work; the bars are redrawn when a round ends instead, outside the timed regions.
    with Progress(*columns, console=console, auto_refresh=False) as progress:

        def start_task(description: str, total: int) -> Callable[[], None]:
            task = progress.add_task(description, total=total)
            progress.refresh()

            def advance() -> None:
                progress.advance(task)
                progress.refresh()

            return advance

        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(run_scenarios(chosen, settings, start_task))


# -- a scenario run as its own script (python -m benchmarks.ort, benchmarks.nativert_compare) --


def standalone_parser(description: str, graphs: Sequence[str]) -> argparse.ArgumentParser:
    """The options every standalone scenario takes; the script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="few rounds: a look, not a figure")
    parser.add_argument("--rounds", type=int, help="measured rounds (15; 5 with --quick)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds dropped (3; 1 with --quick)")
    parser.add_argument("--graph", action="append", choices=graphs,
                        help="only these graphs (repeatable); all by default")
    parser.add_argument("--json", action="store_true", help="JSON on stdout, progress on stderr")
    parser.add_argument("-o", "--output", type=pathlib.Path,
                        help="also write the JSON report here")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the event loop the scenario runs on (uvicorn's default: uvloop)")
    return parser


def run_standalone(
    args: argparse.Namespace,
    cases: Callable[[Context], Coroutine[Any, Any, list[CaseResult]]],
    width: int,
) -> int:
    """Run one scenario's `cases` on `--loop` with progress lines on stderr, then print its
    report (JSON with --json, else tables `width` columns wide when not on a terminal)."""
    settings = Settings(size="quick" if args.quick else "full", rounds=args.rounds,
                        warmup=args.warmup, loop=getattr(args, "loop", "asyncio"))

    def start_task(description: str, total: int) -> Callable[[], None]:
        print(f"{description}: {total} rounds", file=sys.stderr, flush=True)
        return lambda: None

    report = Report(environment(), asdict(settings))
    start = time.perf_counter()
    with torch_threads(settings.threads), asyncio.Runner(
            loop_factory=loop_factory(settings.loop)) as loop:
        report.cases = loop.run(cases(Context(settings, start_task)))
    report.elapsed_s = time.perf_counter() - start
    report.environment["torch_threads"] = settings.threads
    report.environment["load_average_end"] = environment()["load_average"]
    text = to_json(report)
    if args.output is not None:
        args.output.write_text(text)
    if args.json:
        print(text)
    else:
        render(report, Console(width=None if sys.stdout.isatty() else width))
    return 0


# -- output ----------------------------------------------------------------------------------


def to_json(report: Report) -> str:
    return json.dumps(report.as_dict(), indent=2, default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def render(report: Report, console: Console) -> None:
    """One table per case, then the targets."""
    for case in report.cases:
        console.print(_case_table(case))
        for note in case.notes:
            console.print(f"  {note}")
        if case.metrics:
            console.print("  " + ", ".join(f"{k} = {_fmt(v)}" for k, v in case.metrics.items()))
    console.print(_targets_table(report))
    env = report.environment
    console.print(
        f"torch {env['torch']}, python {env['python']}, {env['cpu_count']} CPUs, "
        f"{env['torch_threads']} intra-op thread(s), load average "
        f"{_fmt_load(env.get('load_average'))} at the start, "
        f"{_fmt_load(env.get('load_average_end'))} at the end; {report.settings['size']} run "
        f"({report.settings['loop']} loop) in {report.elapsed_s:.0f} s. "
        "Ratios are of medians measured alternately in this run; on a shared machine they "
        "move by several percent between runs. A target's rounds p10-p90 is the same ratio "
        "taken within each round."
    )
    for line in report.mismatches:
        console.print(f"[red]MISMATCH[/red] {line}")


def _case_table(case: CaseResult) -> Table:
    params = ", ".join(f"{k}={v}" for k, v in case.params.items())
    table = Table(title=f"{case.case}: {case.description}", caption=params, title_justify="left")
    table.add_column("peer")
    if case.columns == "time":
        for col in ("median ms", "p10-p90 ms", "asyncgraph / peer", "calls x samples"):
            table.add_column(col, justify="right")
    else:
        keys: list[str] = []
        for p in case.peers:
            keys += [k for k in p.extra if k not in keys]
        for k in keys:
            table.add_column(k, justify="right")
    table.add_column("output")
    reference = case.peers[0].median_s if case.peers else None
    for p in case.peers:
        status = "ok" if p.matched else "[red]ERROR[/red]" if p.failed else "[red]MISMATCH[/red]"
        if case.columns == "time":
            if p.median_s is None:
                cells = ["-", "-", "-", "-"]
            else:
                ratio = reference / p.median_s if reference else float("nan")
                cells = [
                    f"{p.median_s * 1e3:.3f}",
                    f"{(p.p10_s or 0) * 1e3:.3f}-{(p.p90_s or 0) * 1e3:.3f}",
                    f"{ratio:.2f}",
                    f"{p.calls_per_sample}x{p.samples}",
                ]
        else:
            cells = [_fmt(p.extra.get(k)) for k in keys]
        table.add_row(p.name, *cells, status if not p.error else f"{status} {p.error[:60]}")
    return table


def _targets_table(report: Report) -> Table:
    table = Table(title="targets", title_justify="left")
    for col, justify in (("#", "right"), ("target", "left"), ("measured", "right"),
                         ("rounds p10-p90", "right"), ("needs", "right"), ("met", "center")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for case in report.cases:
        for t in case.targets:
            spread = f"{_fmt(t.rounds[0])}-{_fmt(t.rounds[1])}" if t.rounds else "-"
            table.add_row(
                str(t.number), t.name, _fmt(t.value) + t.unit, spread,
                f"{t.op} {t.limit:g}{t.unit}", "[green]yes[/green]" if t.met else "[red]no[/red]",
            )
    return table


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0 or abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3g}" if abs(v) >= 0.01 else f"{v:.2e}"
    return str(v)


def _fmt_load(load: Any) -> str:
    if not load:
        return "-"
    return "/".join(f"{x:.1f}" for x in load)

"""The `asyncgraph` console script (typer + rich).

The command line is the `cli` extra (`pip install 'asyncgraph[cli]'`, which brings the `serve`
extra for `asyncgraph serve`); the core install has only the library. Without the extra, the
console script says so in one line instead of a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import typer
    from rich.console import Console
    from rich.table import Table
    from typer.core import TyperGroup

    from asyncgraph.cli import bench, run, serve, stress
    from asyncgraph.cli import compile as compile_cli
    from asyncgraph.cli.options import ThreadsOpt
    from asyncgraph.tools import check, profile
except ModuleNotFoundError as missing:
    _CLI_EXTRA_MODULES = {
        "typer", "rich", "click", "starlette", "uvicorn", "uvloop", "prometheus_client",
        "safetensors",
    }
    _top_level = (missing.name or "").partition(".")[0]
    if _top_level not in _CLI_EXTRA_MODULES:
        raise
    raise SystemExit(
        f"asyncgraph's command line needs the cli extra ({_top_level} is not installed): "
        "pip install 'asyncgraph[cli]'"
    ) from None

from asyncgraph.errors import AsyncGraphError


def _control_flow_exceptions() -> tuple[type[BaseException], ...]:
    """What the CLI library raises to exit, show help or report a usage error: not errors of
    ours. typer >= 0.29 vendors click (its exceptions derive from TyperException); older
    versions raise click's own."""
    found: list[type[BaseException]] = [typer.Exit, typer.Abort]
    vendored = getattr(typer, "TyperException", None)
    if isinstance(vendored, type) and issubclass(vendored, BaseException):
        found.append(vendored)
    try:
        import click
    except ImportError:
        return tuple(found)
    return (*found, click.ClickException, click.exceptions.Exit, click.Abort)


_CONTROL_FLOW = _control_flow_exceptions()


class _OneLineErrors(TyperGroup):
    """Every command's errors as one line on stderr and exit status 1; --debug re-raises.

    A user of the CLI needs the message (which file, which input, expected vs actual), not
    asyncgraph's stack; the traceback is one flag away.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            Console(stderr=True).print(
                f"error: {error_line(exc)}", markup=False, highlight=False, soft_wrap=True
            )
            raise typer.Exit(1) from None


def error_line(exc: BaseException) -> str:
    """An exception as one line: its message, and the node it came from when it has one."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(exc, (AsyncGraphError, OSError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    notes = [n.splitlines()[0] for n in getattr(exc, "__notes__", []) if n.strip()]
    if notes:
        text += f" ({notes[0]})"
    if len(lines) > 1:
        text += " [--debug for details]"
    return text


app = typer.Typer(
    cls=_OneLineErrors,
    help="Run dataflow graphs - above all torch.export programs - from async Python.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help="Show full tracebacks instead of one-line errors."
    ),
) -> None:
    """asyncgraph: an asyncio-native dataflow executor for torch.export programs."""


@app.command()
def demo(
    executions: int = typer.Option(400, help="Executions to run."),
    concurrency: int = typer.Option(32, help="Concurrent callers."),
    threads: ThreadsOpt = None,
) -> None:
    """Export a small transformer block, run it from concurrent callers, check against eager."""
    from asyncgraph.cli.demo import run_demo

    with console.status("exporting and running the demo model..."):
        result = asyncio.run(run_demo(executions, concurrency, threads=threads))
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


# -- commands defined in their own modules (one registration line each, sorted) ---------------
app.command("bench")(bench.bench)
app.command("check")(check.check)
app.command("compile")(compile_cli.compile_command)
app.command("profile")(profile.profile)
app.command("run")(run.run)
app.command("serve")(serve.serve)
app.command("stress")(stress.stress)
app.command("trace")(run.trace)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

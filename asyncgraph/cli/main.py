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
    from typer.core import TyperCommand, TyperGroup

    from asyncgraph.cli import bench, check, profile, run, serve, stress
    from asyncgraph.cli import compile as compile_cli
    from asyncgraph.cli.options import ThreadsOpt
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


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """The CLI library's usage errors (a bad option value, a missing argument)."""
    found: list[type[BaseException]] = []
    for module in (typer, getattr(typer, "core", None)):
        for name in ("UsageError", "BadParameter"):
            kind = getattr(module, name, None)
            if isinstance(kind, type) and issubclass(kind, BaseException):
                found.append(kind)
    try:
        import click
    except ImportError:
        return tuple(found)
    return (*found, click.UsageError)


_USAGE_ERRORS = _usage_error_types()


def _print_error(text: str) -> None:
    Console(stderr=True).print(f"error: {text}", markup=False, highlight=False, soft_wrap=True)


class _OneLineErrors(TyperGroup):
    """Every command's errors as one line on stderr and exit status 1; --debug re-raises.

    A user of the CLI needs the message (which file, which input, expected vs actual), not
    asyncgraph's stack; the traceback is one flag away. Usage errors of a command (a bad
    option value) are errors too: one line that points at the command's --help.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            _flag_without_type(param)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _USAGE_ERRORS as exc:
            if ctx.params.get("debug"):
                raise
            path = getattr(getattr(exc, "ctx", None), "command_path", None) or ""
            command = " ".join(["asyncgraph", *path.split()[1:]])  # the program as documented
            _print_error(f"{exc.format_message()} (see '{command} --help')")  # type: ignore[attr-defined]
            raise typer.Exit(1) from None
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            _print_error(error_line(exc))
            raise typer.Exit(1) from None

    def get_help_option(self, ctx: Any) -> Any:
        return _flag_without_type(super().get_help_option(ctx))


class _Command(TyperCommand):
    """A command whose help reads like the rest of the CLI: `Usage: asyncgraph run [OPTIONS]
    MODEL`, and flags (--random, --help) without a `<bool>` value they do not take."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            _flag_without_type(param)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = (param.metavar or param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def get_help_option(self, ctx: Any) -> Any:
        return _flag_without_type(super().get_help_option(ctx))


def _flag_without_type(param: Any) -> Any:
    if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""
    return param


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


@app.command(cls=_Command)
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
app.command("bench", cls=_Command)(bench.bench)
app.command("check", cls=_Command)(check.check)
app.command("compile", cls=_Command)(compile_cli.compile_command)
app.command("profile", cls=_Command)(profile.profile)
app.command("run", cls=_Command)(run.run)
app.command("serve", cls=_Command)(serve.serve)
app.command("stress", cls=_Command)(stress.stress)
app.command("trace", cls=_Command)(run.trace)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

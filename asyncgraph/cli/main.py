"""The `asyncgraph` console script (typer + rich).

The command line is the `cli` extra (`pip install 'asyncgraph[cli]'`, which brings the `serve`
extra for `asyncgraph serve`); the core install has only the library. Without the extra, the
console script says so in one line instead of a traceback.

Its own import cost stays small: this module and the command modules import no torch at module
level (`asyncgraph --help` and `--version` never import it; tests/integration/test_cli.py
checks), and each command imports what it runs when it runs. `--debug` is taken before or
after the command's name.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, NoReturn

try:
    import typer
    from rich.console import Console
    from rich.table import Table
    from typer.core import TyperCommand, TyperGroup

    from asyncgraph.cli import bench, check, profile, run, serve, stress
    from asyncgraph.cli import compile as compile_cli
    from asyncgraph.cli.options import OLD_SPELLINGS, ThreadsOpt
except ModuleNotFoundError as missing:
    _CLI_EXTRA_MODULES = {
        "typer", "rich", "click", "starlette", "uvicorn", "uvloop", "prometheus_client",
        "safetensors", "google",  # google.protobuf: the serve extra's
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
    """The CLI library's usage errors (a bad option value, a missing argument, an unknown
    option). typer >= 0.29 exports only BadParameter of its vendored click; UsageError, the
    base of them all (NoSuchOption too), is found through it."""
    found: list[type[BaseException]] = []
    for module in (typer, getattr(typer, "core", None)):
        for name in ("UsageError", "BadParameter"):
            kind = getattr(module, name, None)
            if isinstance(kind, type) and issubclass(kind, BaseException):
                found.append(kind)
    for kind in list(found):
        found += [base for base in kind.__mro__ if base.__name__ == "UsageError"]
    try:
        import click
    except ImportError:
        return tuple(found)
    return (*found, click.UsageError)


_USAGE_ERRORS = _usage_error_types()


def _print_error(text: str) -> None:
    Console(stderr=True).print(f"error: {text}", markup=False, highlight=False, soft_wrap=True)


def _print_note(text: str) -> None:
    Console(stderr=True).print(f"note: {text}", markup=False, highlight=False, soft_wrap=True)


_DEBUG = "asyncgraph.debug"  # ctx.meta key (shared by a command's context and the root's)


def _debug(ctx: Any, exc: BaseException | None = None) -> bool:
    """Whether --debug was given, before the command's name or after it."""
    if ctx.params.get("debug") or ctx.meta.get(_DEBUG):
        return True
    failed = getattr(exc, "ctx", None)  # a usage error of a command: what it parsed so far
    return bool(failed is not None and failed.params.get("debug"))


def _usage_error(exc: Any) -> NoReturn:
    """A usage error as one line that points at the command's --help; exits with status 1."""
    path = getattr(getattr(exc, "ctx", None), "command_path", None) or ""
    command = " ".join(["asyncgraph", *path.split()[1:]])  # the program as documented
    _print_error(f"{exc.format_message()} (see '{command} --help')")
    raise typer.Exit(1) from None


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
        # every command takes --debug too (`asyncgraph run m.pt2 --debug`); _Command.invoke
        # moves its value into ctx.meta, since the command's function has no such parameter
        debug = next((p for p in self.params if p.name == "debug"), None)
        if debug is not None:
            for command in self.commands.values():
                if isinstance(command, _Command) and all(p.name != "debug" for p in command.params):
                    command.params.append(copy.copy(debug))

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        """The root's own usage errors (`asyncgraph --bogus`) as one line too."""
        try:
            return super().make_context(*args, **kwargs)
        except _USAGE_ERRORS as exc:
            given = args[1] if len(args) > 1 else kwargs.get("args", ())
            if "--debug" in given or type(exc).__name__ == "NoArgsIsHelpError":
                raise  # a bare `asyncgraph` shows the help, as before
            _usage_error(exc)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except _USAGE_ERRORS as exc:
            if _debug(ctx, exc):
                raise
            _usage_error(exc)
        except _CONTROL_FLOW:
            raise
        except Exception as exc:
            if _debug(ctx):
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

    def invoke(self, ctx: Any) -> Any:
        if ctx.params.pop("debug", False):
            ctx.meta[_DEBUG] = True
        return super().invoke(ctx)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._current_spellings(args))

    def _current_spellings(self, args: list[str]) -> list[str]:
        """`args` with the option spellings of earlier releases (options.OLD_SPELLINGS, such
        as --frames) replaced by this command's current ones, each noted once on stderr.
        Not shown in help; they go in a later release."""
        known = {opt for p in self.params for opt in getattr(p, "opts", ())}
        out: list[str] = []
        for i, arg in enumerate(args):
            if arg == "--":
                return out + args[i:]
            name, eq, value = arg.partition("=")
            current = OLD_SPELLINGS.get(name)
            if current is not None and current in known and name not in known:
                _print_note(f"{name} is now spelled {current}; the old spelling goes in a "
                            f"later release")
                arg = current + eq + value
            out.append(arg)
        return out

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
    # click's plain help: it wraps to the terminal, 80 columns included, and reads the same in
    # a pipe; rich's panels cut long option names short there (`--max-request-by…`)
    rich_markup_mode=None,
)
console = Console()


def version_line() -> str:
    """asyncgraph's version and the torch it runs with, read from the installed packages'
    metadata: torch is not imported."""
    from importlib import metadata

    try:
        ours = metadata.version("asyncgraph")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from asyncgraph import __version__ as ours
    try:
        torch = f"torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch = "torch not installed"
    return f"asyncgraph {ours} ({torch})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help="Show full tracebacks instead of one-line errors."
    ),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_show_version,
        help="Print asyncgraph's version and torch's, and exit.",
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
    from asyncgraph.cli import fast_exit

    try:
        app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        fast_exit.leave_if_requested(code)
        raise
    fast_exit.leave_if_requested(0)


if __name__ == "__main__":
    main()

"""`asyncgraph serve --model-repository DIR`: serve a Triton-style model repository with model
control (asyncgraph/serve/model_control.py, repository.py).

    asyncgraph serve --model-repository models/                      # every model loaded
    asyncgraph serve --model-repository models/ --model-control explicit --load-model enc

`none` (the default, as Triton's): every model of the repository is loaded at start and load
and unload requests are refused; `explicit`: only the `--load-model` ones are, and the
repository endpoints load, reload (hot swap) and unload models while the server runs. The
repository and the models to load at start are checked before the server starts: a bad layout
or a file that does not load is one error line (exit 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from asyncgraph.cli import fast_exit

if TYPE_CHECKING:
    from asyncgraph.runtime.config import ExecutorConfig

CONTROL_MODES = ("none", "explicit")


def metrics_title(app: Any, host: str, metrics_port: int) -> str:
    """Serve `app`'s metrics on `metrics_port` too; the banner's words for it."""
    from asyncgraph.serve.metrics_port import add_metrics_port

    add_metrics_port(app, host, metrics_port)
    return f" and metrics on {host}:{metrics_port}/metrics"


def serve_repository(
    sock: socket.socket,
    root: Path,
    *,
    control_mode: str,
    load_models: list[str],
    version_policy: str,
    config: ExecutorConfig,
    trust_compiled: bool,
    app_options: dict[str, Any],
    host: str,
    grpc_port: int | None,
    metrics_port: int | None = None,
    run_options: dict[str, Any],
    console: Console,
    error: type[Exception],
) -> None:
    """Load the repository's start-up models, then run the server on `sock` until it stops.
    `error` is the command's configuration error (one line, exit 1)."""
    from asyncgraph.cli.options import load_executor
    from asyncgraph.errors import AsyncGraphError
    from asyncgraph.serve import create_app, run
    from asyncgraph.serve.model_control import add_model_control
    from asyncgraph.serve.repository import ModelRepository, RepositoryError, VersionPolicy
    from asyncgraph.serve.runner import url_of

    if control_mode not in CONTROL_MODES:
        raise error(f"--model-control: expected one of {', '.join(CONTROL_MODES)}, got "
                    f"{control_mode!r}")
    explicit = control_mode == "explicit"
    if load_models and not explicit:
        raise error("--load-model needs --model-control explicit (in 'none' mode every model "
                    "of the repository is loaded)")
    try:
        policy = VersionPolicy.parse(version_policy)
        repository = ModelRepository(root, policy)
        names = load_models if explicit else repository.models()
    except (ValueError, RepositoryError) as exc:
        raise error(str(exc)) from None

    def load(path: Path, **options: Any) -> Any:
        """The command's loader; `options`: the ExecutorConfig fields a config.pbtxt sets."""
        return load_executor(path, dataclasses.replace(config, **options), trust_compiled)

    models: dict[str, Any] = {}
    app = create_app(models, close_executors=False, freeze_heap=True, **app_options)
    control = add_model_control(app, repository, load, explicit=explicit)
    with console.status(f"loading {', '.join(names) or 'no model'} from {root} ..."):
        try:
            control.preload(names)
        except (RepositoryError, AsyncGraphError, OSError) as exc:
            raise error(str(exc)) from None
    title = f"asyncgraph serve on {url_of(sock)} (model repository {root}, " \
            f"model control {control_mode}, default version policy {policy})"
    if grpc_port is not None:
        from asyncgraph.serve.grpc_server import add_grpc

        endpoint = add_grpc(app, host, grpc_port, grace_s=run_options["graceful_shutdown_s"])
        title += f" and gRPC on {endpoint.address}"
    if metrics_port is not None:
        title += metrics_title(app, host, metrics_port)
    table = Table(title=title)
    for column in ("model", "version", "policy", "file", "inputs", "outputs"):
        table.add_column(column)
    for name, versions in control.loaded.items():
        for number, entry in sorted(versions.items()):
            iface = entry.served.interface
            table.add_row(
                name, str(number), str(repository.policy_for(name)), str(entry.path),
                ", ".join(f"{i.name} {i.datatype}{i.shape}" for i in iface.inputs),
                ", ".join(f"{o.name} {o.datatype}{o.shape}" for o in iface.outputs),
            )
    console.print(table)
    with contextlib.suppress(KeyboardInterrupt):  # as serve.py: Ctrl+C is a normal end
        run(app, host, sock=sock, **run_options)
    console.print("server stopped")
    fast_exit.request()  # everything is closed: the process may end without its teardown

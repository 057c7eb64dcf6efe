"""`asyncgraph serve`: one or more .pt2 models over the Open Inference Protocol on uvicorn.

The address is bound first, then the models are loaded, before the server starts: a port in
use or a bad file is one error line (exit 1), and nothing half-started. The app owns its
executors and closes them when uvicorn shuts down: SIGINT and SIGTERM both drain the requests
in flight (within --shutdown-timeout-s), close the executors and exit 0.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from asyncgraph.cli import fast_exit
from asyncgraph.cli.options import (
    ImportsOpt,
    MaxConcurrentExecutionsOpt,
    MaxParallelOpsOpt,
    ScriptSegmentsOpt,
    SegmentsOpt,
    ThreadsOpt,
    TrustCompiledOpt,
    chosen_segments,
    executor_config,
    load_executor,
)
from asyncgraph.errors import AsyncGraphError

if TYPE_CHECKING:
    from asyncgraph.runtime.config import ExecutorConfig

console = Console()


class ServeConfigError(AsyncGraphError, ValueError):
    """The serve command cannot start as asked: its model list is inconsistent (a name given
    twice, no model), or its address cannot be bound (a port in use)."""


def model_specs(
    model: Path | None, name: str | None, models: list[str] | None
) -> dict[str, Path]:
    """NAME -> PATH from the positional model, --name and repeated --model NAME=PATH."""
    specs: dict[str, Path] = {}
    if model is not None:
        specs[name or model.stem] = model
    elif name is not None:
        raise ServeConfigError("--name names the positional MODEL; with --model use NAME=PATH")
    for item in models or []:
        key, sep, path = item.partition("=")
        if not sep or not key or not path:
            raise ServeConfigError(f"--model {item!r}: expected NAME=PATH")
        if key in specs:
            raise ServeConfigError(f"--model {item!r}: model name {key!r} is given twice")
        specs[key] = Path(path)
    if not specs:
        raise ServeConfigError("no model to serve: give MODEL.pt2 or --model NAME=PATH")
    return specs


def serve(
    model: Annotated[
        Path | None,
        typer.Argument(metavar="MODEL", help="A .pt2 file to serve (named after the file)."),
    ] = None,
    name: Annotated[str | None, typer.Option(help="The name to serve MODEL under.")] = None,
    models: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", metavar="NAME=PATH",
                     help="Another model as NAME=PATH; repeatable."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: a free one).")] = 8000,
    grpc_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Also serve the protocol over gRPC "
                                 "(inference.GRPCInferenceService, what tritonclient.grpc "
                                 "calls) on this port of --host; off when not given. Needs "
                                 "asyncgraph[grpc].")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(min=0, max=65535, help="Also serve /metrics on this port of "
                                 "--host (Triton's 8002); the HTTP port keeps /metrics too. "
                                 "Off when not given.")
    ] = None,
    max_queue: Annotated[
        int, typer.Option(min=0, help="Hard cap for memory: requests that may wait per model "
                          "beyond the free execution slots; more get 503.")
    ] = 4096,
    max_queue_bytes: Annotated[
        int, typer.Option(min=0, help="Hard cap for memory: request body bytes that may wait "
                          "per model; more get 503 (0: 4 x --max-request-bytes).")
    ] = 0,
    timeout_ms: Annotated[
        float, typer.Option(min=0, help="Each request's deadline (0: none): a request that "
                            "cannot make it is refused with 503 at once, one past it is "
                            "cancelled with 504. A request's parameters.timeout (us) may "
                            "shorten it.")
    ] = 0,
    max_request_bytes: Annotated[
        int, typer.Option(min=1, help="Larger request bodies get 413.")
    ] = 64 << 20,
    max_json_bytes: Annotated[
        int, typer.Option(min=1, help="JSON parsed whole per request (all but flat or evenly "
                          "nested numeric data arrays, which are parsed in pieces) may be at "
                          "most this long; more gets 413.")
    ] = 1 << 20,
    max_response_bytes: Annotated[
        int, typer.Option(min=1, help="A response estimated larger (outputs x their encoded "
                          "size) gets 400.")
    ] = 64 << 20,
    body_timeout_s: Annotated[
        float, typer.Option(min=0.001, help="Seconds a request body may take to arrive after "
                            "its headers; a slower one gets 408.")
    ] = 30.0,
    max_concurrent_executions: MaxConcurrentExecutionsOpt = 8,
    max_parallel_ops: MaxParallelOpsOpt = None,
    pin_workers: Annotated[
        bool, typer.Option(help="Pin each worker thread to a CPU of its own (Linux; for a "
                           "machine the service has to itself).")
    ] = False,
    worker_idle: Annotated[
        bool, typer.Option(help="Run the worker threads under SCHED_IDLE (Linux), for a machine "
                           "the service has to itself: the event loop's thread takes a core "
                           "from them the moment it wakes, but any busy thread of another "
                           "process comes first.")
    ] = False,  # ExecutorConfig's default (tests/integration/test_cli.py checks they agree)
    worker_nice: Annotated[
        int, typer.Option(min=0, max=19, help="Nice levels the worker threads run below the "
                          "event loop's thread, so the loop is seldom kept waiting for a core "
                          "(Linux; 0 runs them as equals, for a machine shared with other "
                          "services).")
    ] = 5,  # ExecutorConfig's default
    worker_yield_s: Annotated[
        float, typer.Option(min=0, help="A worker thread that has run for this many seconds "
                            "steps aside (sched_yield) so the event loop's thread gets a core "
                            "soon after it wakes (0: never, for throughput alone).")
    ] = 0.002,  # ExecutorConfig's default
    max_batch_size: Annotated[
        int, typer.Option(min=0, help="Dynamic batching: stack concurrent requests into "
                          "executions of up to this many rows (0: off). Needs a program "
                          "exported with a dynamic batch dimension 0.")
    ] = 0,
    batch_delay_ms: Annotated[
        float, typer.Option(min=0, help="How long a batch that is not full may wait for "
                            "more requests.")
    ] = 0,
    threads: ThreadsOpt = None,
    trust_compiled: TrustCompiledOpt = False,
    imports: ImportsOpt = None,
    script_segments: ScriptSegmentsOpt = False,
    segments: SegmentsOpt = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    loop: Annotated[
        str, typer.Option(help="Event loop: uvloop, or asyncio (refuses a sustained overload "
                          "of new connections sooner: docs/serving.md).")
    ] = "uvloop",
    shutdown_timeout_s: Annotated[
        int, typer.Option(min=0, help="On SIGTERM or SIGINT, seconds the requests in flight "
                          "get to finish before they are cancelled (keep it below the "
                          "container runtime's grace period).")
    ] = 8,
    ray: Annotated[
        bool, typer.Option("--ray", help="Serve on Ray Serve (needs asyncgraph[ray]): "
                           "replicas behind Serve's HTTP proxy, docs/scale-out.md.")
    ] = False,
    address: Annotated[
        str | None, typer.Option(help="With --ray: the Ray cluster to join ('auto', "
                                 "'HOST:PORT', 'ray://...'); left out, a local Ray "
                                 "instance is started.")
    ] = None,
    replicas: Annotated[
        int, typer.Option(min=1, help="With --ray: replicas, each with its own executors.")
    ] = 1,
    model_repository: Annotated[
        Path | None, typer.Option(help="Serve a model repository laid out as Triton's "
                                  "(DIR/<model>/<version>/model.pt2 or DIR/<model>/<version>"
                                  ".pt2) instead of MODEL/--model, with the repository "
                                  "endpoints (docs/serving.md 'Model control').")
    ] = None,
    model_control: Annotated[
        str, typer.Option(help="With --model-repository: 'none' loads every model at start "
                          "and refuses load/unload requests; 'explicit' loads only "
                          "--load-model ones and serves load/unload (hot reload).")
    ] = "none",
    load_model: Annotated[
        list[str] | None, typer.Option(help="With --model-control explicit: a model to load "
                                       "at start; repeatable.")
    ] = None,
    version_policy: Annotated[
        str | None, typer.Option(help="With --model-repository: the versions served, "
                                 "'latest:N', 'specific:1,3' or 'all' (a model's config.json "
                                 "may set its own).  [default: latest:1]",
                                 show_default=False)
    ] = None,
) -> None:
    """Serve models over the Open Inference Protocol (KServe v2 REST) on uvicorn + uvloop.

    Endpoints: /v2/health/live, /v2/health/ready, /v2/models/NAME, /v2/models/NAME/ready,
    /v2/models/NAME/config (Triton's model configuration), POST /v2/models/NAME/infer (JSON
    and Triton's binary tensor data) and /metrics (also on --metrics-port). The stock
    tritonclient.http client works with its defaults.
    """
    from asyncgraph.runtime.config import BatchingConfig
    from asyncgraph.runtime.executor import Executor
    from asyncgraph.serve import create_app, run
    from asyncgraph.serve.runner import LOOPS, bind, url_of

    if loop not in LOOPS:
        raise typer.BadParameter(f"expected one of {', '.join(LOOPS)}, got {loop!r}",
                                 param_hint="--loop")
    _check_values(model_control, version_policy)
    if model_repository is not None:
        if model is not None or name is not None or models:
            raise ServeConfigError("--model-repository serves the repository's models: give "
                                   "no MODEL, --name or --model with it")
        if ray:
            raise ServeConfigError("--model-repository is served by the local server, not "
                                   "on --ray")
        specs: dict[str, Path] = {}
    elif load_model or model_control != "none" or version_policy is not None:
        raise ServeConfigError("--model-control, --load-model and --version-policy need "
                               "--model-repository")
    else:
        specs = model_specs(model, name, models)
    config: dict[str, Any] = {"max_concurrent_executions": max_concurrent_executions}
    if max_parallel_ops is not None:
        config["max_parallel_ops"] = max_parallel_ops
    if pin_workers:
        config["pin_workers"] = True
    config["worker_idle"] = worker_idle
    config["worker_nice"] = worker_nice
    config["worker_yield_s"] = worker_yield_s
    chosen = chosen_segments(segments, script_segments)
    if chosen:
        config["segments"] = chosen
    if max_batch_size:
        config["batching"] = BatchingConfig(max_batch_size, batch_delay_ms / 1000)
    elif batch_delay_ms:
        raise ServeConfigError("--batch-delay-ms needs --max-batch-size (batching is off)")
    if ray:
        if grpc_port is not None:
            raise ServeConfigError("--grpc-port serves the local server; Ray Serve's gRPC "
                                   "proxy is not wired (docs/scale-out.md)")
        if loop != "uvloop":
            raise ServeConfigError("--loop applies to the local server; Ray Serve runs its own")
        if metrics_port is not None:
            raise ServeConfigError("--metrics-port serves the local server's metrics; not "
                                   "on --ray")
        _serve_on_ray(
            specs, executor_config(threads, **config), address=address, replicas=replicas,
            host=host, port=port, trust_compiled=trust_compiled, imports=tuple(imports or ()),
            server_options={"max_queue": max_queue, "timeout_ms": timeout_ms or None,
                            "max_request_bytes": max_request_bytes,
                            "server_options": {"max_queue_bytes": max_queue_bytes or None}},
        )
        return
    if address is not None or replicas != 1:
        raise ServeConfigError("--address and --replicas need --ray")
    if grpc_port is not None:
        _check_grpc(host, grpc_port, port, bind)
    if metrics_port is not None:
        _check_metrics_port(host, metrics_port, (port, grpc_port), bind)
    sock = _bind(host, port, bind)  # before loading: a port in use is one line, nothing loaded
    if model_repository is not None:
        from asyncgraph.cli.serve_repository import serve_repository

        with sock:
            serve_repository(
                sock, model_repository, control_mode=model_control,
                load_models=load_model or [], version_policy=version_policy or "latest:1",
                config=executor_config(threads, **config), trust_compiled=trust_compiled,
                app_options={
                    "max_queue": max_queue, "max_queue_bytes": max_queue_bytes or None,
                    "timeout_ms": timeout_ms or None, "max_request_bytes": max_request_bytes,
                    "max_json_bytes": max_json_bytes, "max_response_bytes": max_response_bytes,
                    "body_timeout_s": body_timeout_s,
                },
                host=host, grpc_port=grpc_port, metrics_port=metrics_port,
                run_options={"log_level": log_level, "access_log": access_log, "loop": loop,
                             "graceful_shutdown_s": shutdown_timeout_s},
                console=console, error=ServeConfigError,
            )
        return
    with sock:  # closed on every path (run closes it too)
        executors: dict[str, Executor] = {}
        for key, path in specs.items():
            with console.status(f"loading {key} from {path} ..."):
                executors[key] = load_executor(path, executor_config(threads, **config),
                                               trust_compiled)
        app = create_app(
            executors,
            max_queue=max_queue,
            max_queue_bytes=max_queue_bytes or None,
            timeout_ms=timeout_ms or None,
            max_request_bytes=max_request_bytes,
            max_json_bytes=max_json_bytes,
            max_response_bytes=max_response_bytes,
            body_timeout_s=body_timeout_s,
            close_executors=True,
            freeze_heap=True,  # the process is the server's: its full collections stay short
        )
        title = f"asyncgraph serve on {url_of(sock)}"
        if grpc_port is not None:
            from asyncgraph.serve.grpc_server import add_grpc

            endpoint = add_grpc(app, host, grpc_port, grace_s=shutdown_timeout_s)
            title += f" and gRPC on {endpoint.address}"
        if metrics_port is not None:
            from asyncgraph.cli.serve_repository import metrics_title

            title += metrics_title(app, host, metrics_port)
        table = Table(title=title)
        for column in ("model", "file", "nodes", "inputs", "outputs"):
            table.add_column(column)
        interfaces = app.state.asyncgraph
        for key, ex in executors.items():
            iface = interfaces.served(key).interface
            table.add_row(
                key, str(specs[key]), str(ex.plan.num_nodes),
                ", ".join(f"{i.name} {i.datatype}{i.shape}" for i in iface.inputs),
                ", ".join(f"{o.name} {o.datatype}{o.shape}" for o in iface.outputs),
            )
        console.print(table)
        # uvicorn shuts down gracefully on SIGINT, then re-raises it for the caller to see;
        # the shutdown is complete by then, so Ctrl+C is a normal end, not an error (SIGTERM
        # ends the same way: runner.run)
        with contextlib.suppress(KeyboardInterrupt):
            run(app, host, port, log_level=log_level, access_log=access_log, loop=loop,
                sock=sock, graceful_shutdown_s=shutdown_timeout_s)
    console.print("server stopped")
    fast_exit.request()  # everything is closed: the process may end without its teardown


def _check_values(model_control: str, version_policy: str | None) -> None:
    """Every option's value is checked whether or not it applies here, so a typo is an
    error now rather than when the option first matters."""
    from asyncgraph.cli.serve_repository import CONTROL_MODES
    from asyncgraph.serve.repository import VersionPolicy

    if model_control not in CONTROL_MODES:
        raise ServeConfigError(f"--model-control: expected one of {', '.join(CONTROL_MODES)}, "
                               f"got {model_control!r}")
    if version_policy is not None:
        try:
            VersionPolicy.parse(version_policy)
        except ValueError as exc:
            raise ServeConfigError(f"--version-policy: {exc}") from None


def _bind(host: str, port: int, bind: Callable[[str, int], socket.socket]) -> socket.socket:
    """The server's socket, bound before anything is loaded: one error line if it cannot be."""
    try:
        return bind(host, port)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            why = f"port {port} is in use by another process (choose another with --port)"
        raise ServeConfigError(f"cannot listen on {host}:{port}: {why}") from None


def _check_grpc(
    host: str, grpc_port: int, port: int, bind: Callable[[str, int], socket.socket]
) -> None:
    """--grpc-port: grpcio is installed and the port is free now (one error line, nothing
    loaded). gRPC binds it itself when the server starts: a process that takes the port in
    between makes the start fail instead."""
    if grpc_port == port and port != 0:
        raise ServeConfigError(f"--grpc-port {grpc_port}: the same port as --port")
    try:
        import grpc  # noqa: F401
    except ImportError as exc:
        raise ServeConfigError(
            f"--grpc-port needs grpcio: pip install 'asyncgraph[grpc]' ({exc})"
        ) from None
    if grpc_port:
        try:
            bind(host, grpc_port).close()
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.errno == errno.EADDRINUSE:
                why = f"port {grpc_port} is in use by another process (choose another with " \
                      f"--grpc-port)"
            raise ServeConfigError(f"cannot listen on {host}:{grpc_port} (gRPC): {why}") from None


def _check_metrics_port(
    host: str, metrics_port: int, others: tuple[int | None, ...],
    bind: Callable[[str, int], socket.socket],
) -> None:
    """--metrics-port: not another option's port, and free now (one error line)."""
    if metrics_port and metrics_port in others:
        raise ServeConfigError(f"--metrics-port {metrics_port}: the same port as --port or "
                               f"--grpc-port")
    if metrics_port:
        try:
            bind(host, metrics_port).close()
        except OSError as exc:
            raise ServeConfigError(
                f"cannot listen on {host}:{metrics_port} (metrics): {exc.strerror or exc}"
            ) from None


def _serve_on_ray(
    specs: dict[str, Path],
    config: ExecutorConfig,
    *,
    address: str | None,
    replicas: int,
    host: str,
    port: int,
    trust_compiled: bool,
    imports: tuple[str, ...],
    server_options: dict[str, Any],
) -> None:
    """`--ray`: the archives are checked here first (one error line, nothing started), then
    asyncgraph.ray runs the app until SIGINT/SIGTERM; each replica checks them again."""
    from asyncgraph.graph.archive import check_pt2_archive, is_compiled_package

    try:
        from asyncgraph.ray import ModelSource, build_app
        from asyncgraph.ray.run import serve_on_ray
    except ImportError as exc:
        raise ServeConfigError(
            f"--ray needs Ray Serve: pip install 'asyncgraph[ray]' ({exc})"
        ) from None
    for path in specs.values():
        if not (trust_compiled and is_compiled_package(path)):
            check_pt2_archive(path)

    def build(shipped: bool) -> Any:
        source = ModelSource.shipped if shipped else ModelSource.shared
        return build_app(
            {key: source(path, imports) for key, path in specs.items()}, num_replicas=replicas,
            executor_config=config, trust_compiled=trust_compiled, **server_options,
        )

    where = "a local Ray instance" if address is None else f"the Ray cluster at {address}"
    console.print(f"starting {replicas} replica(s) on {where} ...")
    serve_on_ray(build, address=address, host=host, port=port,
                 on_ready=lambda url: console.print(f"asyncgraph serve --ray on {url}: "
                                                    f"{', '.join(specs)} (Ctrl+C stops)"))
    console.print("server stopped")
    fast_exit.request()  # everything is closed: the process may end without its teardown

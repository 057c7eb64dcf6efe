"""Run an app on uvicorn: in the foreground (the CLI), or in the background of a running loop.

`run` is what `asyncgraph serve` does: uvicorn with uvloop and h11, until SIGINT or SIGTERM.
`running_server` starts the same server inside the current event loop on a socket bound
beforehand (port 0 picks a free one, with no window for another process to take it), yields its
URL, and stops it on exit: tests and notebooks talk to a real HTTP server with no subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LOOPS = ("uvloop", "asyncio")


def run(
    app: ASGIApp,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    log_level: str = "info",
    access_log: bool = False,
    graceful_shutdown_s: float = 10.0,
    loop: str = "uvloop",
) -> None:
    """Serve `app` on uvicorn until interrupted (blocks). `loop`: "uvloop" (the default: the
    faster loop) or "asyncio" (see docs/serving.md on overload from a new connection per
    request)."""
    if loop not in LOOPS:
        raise ValueError(f"loop: expected one of {', '.join(LOOPS)}, got {loop!r}")
    config = uvicorn.Config(
        app, host=host, port=port, loop=loop, http="h11", ws="none", lifespan="on",
        log_level=log_level, access_log=access_log, log_config=log_config(log_level),
        timeout_graceful_shutdown=int(graceful_shutdown_s),
    )
    uvicorn.Server(config).run()


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging set-up with asyncgraph's loggers on its console handler.

    Without it, `asyncgraph serve` showed only warnings from asyncgraph (Python's last-resort
    handler): the start-up calibration's INFO line and the like were lost. `log_level` applies
    to both, as a user setting `--log-level` expects.
    """
    config: dict[str, Any] = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["asyncgraph"] = {
        "handlers": ["default"], "level": log_level.upper(), "propagate": False,
    }
    return config


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handlers alone: the host program owns them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def running_server(
    app: ASGIApp,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    log_level: str = "warning",
    start_timeout_s: float = 10.0,
    stop_timeout_s: float = 10.0,
    **config: Any,
) -> AsyncIterator[str]:
    """Serve `app` from this event loop while the block runs; yields `http://host:port`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    server = _EmbeddedServer(uvicorn.Config(
        app, http="h11", ws="none", lifespan="on", log_level=log_level,
        timeout_graceful_shutdown=int(stop_timeout_s), **config,
    ))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="asyncgraph-uvicorn")
    try:
        async with asyncio.timeout(start_timeout_s):
            while not server.started:
                if task.done():
                    break
                await asyncio.sleep(0.01)
        if task.done():
            _raise_startup_failure(task)
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        try:
            async with asyncio.timeout(stop_timeout_s + 5):
                await asyncio.shield(task)
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        except SystemExit:
            pass
        finally:
            sock.close()


def _raise_startup_failure(task: asyncio.Task[None]) -> None:
    try:
        task.result()
    except SystemExit:  # uvicorn exits the process when the app's lifespan startup fails
        raise RuntimeError("the server did not start: the app's lifespan startup failed") from None
    raise RuntimeError("the server stopped while starting")

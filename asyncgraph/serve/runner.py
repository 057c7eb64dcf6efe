"""Run an app on uvicorn: in the foreground (the CLI), or in the background of a running loop.

`run` is what `asyncgraph serve` does: uvicorn with uvloop and h11 on a socket `bind` bound
beforehand, until SIGINT or SIGTERM. The CLI binds before it loads anything, so a port in use is
one error line, not a loaded and calibrated model and then uvicorn's exit 3; the socket is bound
once and handed to uvicorn, so nothing can take the port between a check and the bind. It listens
only once the app has started (calibrated), so a client meanwhile is refused, not queued.

SIGTERM (what container runtimes send to stop a service) and SIGINT both shut down gracefully:
no new connections, in-flight requests finish within `graceful_shutdown_s` (the rest are
cancelled), the app's lifespan ends (closing its executors), and `run` returns. uvicorn re-raises
the signal once it has shut down; SIGTERM's default action would then end the process with 143,
so `run` holds a handler for it that ignores that second delivery.

`running_server` starts the same server inside the current event loop on a socket bound
beforehand (port 0 picks a free one, with no window for another process to take it), yields its
URL, and stops it on exit: tests and notebooks talk to a real HTTP server with no subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LOOPS = ("uvloop", "asyncio")


def bind(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one), not yet listening: `run` listens
    on it once the app has started. Raises OSError (errno EADDRINUSE when the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn binds: a port whose old connections linger in TIME_WAIT can be reused
        # (Linux still refuses a port another socket listens on)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (the port it got, when it asked for 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(
    app: ASGIApp,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    log_level: str = "info",
    access_log: bool = False,
    graceful_shutdown_s: float = 10.0,
    loop: str = "uvloop",
    sock: socket.socket | None = None,
) -> None:
    """Serve `app` on uvicorn until SIGINT or SIGTERM (blocks), then return once it has shut
    down gracefully (see the module docstring). `sock`: a socket from `bind` (then `host` and
    `port` are not used); without one, host:port is bound first. `loop`: "uvloop" (the
    default: the faster loop) or "asyncio" (see docs/serving.md on overload from a new
    connection per request)."""
    if loop not in LOOPS:
        raise ValueError(f"loop: expected one of {', '.join(LOOPS)}, got {loop!r}")
    if sock is None:
        sock = bind(host, port)
    config = uvicorn.Config(
        app, loop=loop, http="h11", ws="none", lifespan="on",
        log_level=log_level, access_log=access_log, log_config=log_config(log_level),
        timeout_graceful_shutdown=int(graceful_shutdown_s),
    )
    try:
        with _sigterm_ends_normally():
            _ForegroundServer(config).run(sockets=[sock])
    finally:
        sock.close()


@contextlib.contextmanager
def _sigterm_ends_normally() -> Iterator[None]:
    """While uvicorn runs it handles SIGTERM itself (a graceful shutdown); afterwards it
    restores the handler it found and delivers the signal again. The handler it finds is this
    one, which ignores it: the shutdown is done, so the process ends normally (exit 0)
    instead of by the signal (143). Signal handlers belong to the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: An app's `state` attribute listing coroutine functions to start when the server's shutdown
#: begins (the gRPC endpoint's drain, grpc_server.py): they drain alongside the HTTP side
#: instead of after it, when the app's lifespan ends.
DRAINS_KEY = "asyncgraph_drains"


class _DrainingServer(uvicorn.Server):
    """uvicorn that starts the app's other drains (`DRAINS_KEY`) as its own shutdown begins."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.config.app, "state", None)
        drains = [asyncio.ensure_future(drain()) for drain in getattr(state, DRAINS_KEY, ())]
        try:
            await super().shutdown(sockets=sockets)
        finally:
            await asyncio.gather(*drains, return_exceptions=True)


class _ForegroundServer(_DrainingServer):
    """uvicorn on sockets bound beforehand: it logs the address it runs on only for the
    sockets it binds itself, so this says it, once the app has started."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s (Press CTRL+C to quit)",
                ", ".join(url_of(s) for s in sockets),
            )


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


class _EmbeddedServer(_DrainingServer):
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

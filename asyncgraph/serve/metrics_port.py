"""`--metrics-port`: the server's Prometheus metrics on a port of their own, as Triton serves
them on 8002; the HTTP port keeps `/metrics` too.

    app = create_app({"mlp": executor})
    add_metrics_port(app, "127.0.0.1", 8002)   # GET http://127.0.0.1:8002/metrics

A second uvicorn server (runner.running_server: it leaves signal handlers to the main one)
runs inside the app's lifespan, so it starts once the app has started and stops when it ends;
it answers `/metrics` only, with the same text (metrics.ServerMetrics.render). It leaves the
process's logging as the main server set it (a uvicorn Config with a log config would reset
it, and the main server's "Uvicorn running on" line would be lost).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncgraph.serve import metrics as m
from asyncgraph.serve.core import InferenceServer
from asyncgraph.serve.runner import running_server


class MetricsPort:
    """The metrics server of an app on host:port (0: a free one); `url` once started."""

    def __init__(self, server: InferenceServer, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.url = ""

        async def metrics(request: Request) -> Response:
            return Response(server.metrics.render(), media_type=m.CONTENT_TYPE)

        self.app = Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def add_metrics_port(app: Starlette, host: str = "127.0.0.1", port: int = 8002) -> MetricsPort:
    """Serve `app`'s metrics (an app from create_app) on host:port too, from its lifespan."""
    endpoint = MetricsPort(app.state.asyncgraph, host, port)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(parent: Starlette) -> AsyncIterator[Any]:
        # the main server's logging kept as it is: no log_config, its own level
        level = logging.getLevelName(logging.getLogger("uvicorn.error").getEffectiveLevel())
        async with (
            inner(parent) as state,
            running_server(endpoint.app, host, port, log_level=level.lower(), log_config=None)
            as url,
        ):
            endpoint.url = url
            yield state

    app.router.lifespan_context = lifespan
    app.state.metrics_port = endpoint
    return endpoint

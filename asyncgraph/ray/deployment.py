"""The Ray Serve deployment: one replica holds one Executor per model behind `create_app`.

Ray Serve runs the replicas (actors, on any node), their restarts, autoscaling, the HTTP proxy
and the routing of requests to replicas. asyncgraph adds nothing to that: a replica is the
Starlette app of `asyncgraph serve` (`asyncgraph.serve.create_app`), so it speaks the same Open
Inference Protocol, binary tensor data included, with the same codec, admission gate, batching,
frame pool and metrics, each replica its own.

The app reaches Serve through `@serve.ingress()` in its late-bound form: the replica's
constructor loads the executors, then Serve calls `__serve_build_asgi_app__` for the ASGI app
and runs its lifespan (startup now, shutdown when the replica stops, which closes the
executors). Serve forwards the raw ASGI messages (body bytes included) to the replica, so
nothing is re-encoded on the way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig
from ray.serve.deployment import Application
from starlette.types import ASGIApp

from asyncgraph.ray.metrics import RayMetricsBridge
from asyncgraph.ray.source import ModelSource
from asyncgraph.runtime.config import ExecutorConfig, requested_batching
from asyncgraph.runtime.executor import Executor
from asyncgraph.serve.admission import capacity_for
from asyncgraph.serve.app import create_app
from asyncgraph.serve.core import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("asyncgraph.ray")

#: The deployment's name in Serve (its replicas are named after it).
DEPLOYMENT_NAME = "asyncgraph"

#: Requests Serve's router may hold per proxy while every replica is busy; more get 503.
DEFAULT_MAX_QUEUED_REQUESTS = 1024

#: Default max_ongoing_requests per request of admission capacity. Serve's router waits for a
#: replica with room by polling with backoff (25-500 ms), so with max_ongoing_requests equal to
#: the capacity one replica served 22 req/s of a ~5 ms model, and 111 req/s at 4x
#: (benchmarks/ray_serve.py): requests should queue at the replica's event-driven gate.
ONGOING_PER_CAPACITY = 4

#: Seconds between two copies of a replica's metrics into Ray's metrics (see metrics.py).
DEFAULT_METRICS_INTERVAL_S = 5.0


class ModelReplica:
    """One Serve replica: an Executor per model, served by the app of `asyncgraph serve`."""

    def __init__(
        self,
        models: Mapping[str, ModelSource],
        executor_config: ExecutorConfig,
        server_options: Mapping[str, Any],
        trust_compiled: bool = False,
        metrics_interval_s: float | None = DEFAULT_METRICS_INTERVAL_S,
    ) -> None:
        from asyncgraph.cli.options import apply_threads

        apply_threads(executor_config)  # a replica owns its process, as the CLI does
        # a model that fails to load (or fails the archive checks) fails the constructor, and
        # Serve discards this replica's process with whatever it had loaded
        self.executors: dict[str, Executor] = {
            name: source.load(executor_config, trust_compiled=trust_compiled)
            for name, source in models.items()
        }
        self.server_options = dict(server_options)
        self.metrics_interval_s = metrics_interval_s
        self._bridge_task: asyncio.Task[None] | None = None
        logger.info("replica %d: serving %s", os.getpid(), ", ".join(self.executors))

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app = create_app(self.executors, close_executors=True, **self.server_options)
        if self.metrics_interval_s:
            bridge = RayMetricsBridge(app.state.asyncgraph.metrics.registry)
            # it ends once the app's lifespan shutdown has closed the executors
            self._bridge_task = asyncio.get_running_loop().create_task(
                bridge.run(self.metrics_interval_s, until=self._closed),
                name="asyncgraph-ray-metrics",
            )
        return app

    def _closed(self) -> bool:
        return any(ex.statistics().closed for ex in self.executors.values())

    def check_health(self) -> None:
        """Serve's health check: a replica whose executor closed is replaced."""
        closed = [n for n, ex in self.executors.items() if ex.statistics().closed]
        if closed:
            raise RuntimeError(f"executor(s) closed: {', '.join(closed)}")


def build_app(
    models: Mapping[str, str | os.PathLike[str] | ModelSource],
    *,
    num_replicas: int | None = None,
    autoscaling_config: Mapping[str, Any] | AutoscalingConfig | None = None,
    executor_config: ExecutorConfig | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    timeout_ms: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trust_compiled: bool = False,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    ray_actor_options: Mapping[str, Any] | None = None,
    metrics_interval_s: float | None = DEFAULT_METRICS_INTERVAL_S,
    server_options: Mapping[str, Any] | None = None,
    **deployment_options: Any,
) -> Application:
    """A Ray Serve application serving `models` over the Open Inference Protocol.

    Run it with `serve.run(app, route_prefix="/")`; the endpoints are those of
    `asyncgraph serve` (docs/serving.md) on Serve's HTTP proxy.

    Args:
        models: name -> model. A path is read by every replica where it runs (a shared
            filesystem or one machine); `ModelSource.shipped(path)` sends the file through
            Ray's object store instead.
        num_replicas: a fixed number of replicas (default 1); not with autoscaling_config.
        autoscaling_config: Serve's autoscaling (min_replicas, max_replicas,
            target_ongoing_requests, ...); docs/scale-out.md says how it meets batching.
        executor_config: each replica's ExecutorConfig, the same for every model.
        max_queue, timeout_ms, max_request_bytes: each replica's server limits, as for
            `create_app`.
        trust_compiled: load packages made by `asyncgraph compile` (native code).
        max_ongoing_requests: requests Serve sends one replica at once; default
            ONGOING_PER_CAPACITY x the sum of the models' admission capacities (frames, or
            frames x max_batch_size): requests then wait at the replica's own FIFO gate, not
            in Serve's router, which waits for a full replica by polling with backoff.
        max_queued_requests: requests Serve's router holds per proxy while every replica is
            full; more get 503 (Serve's BackPressureError). -1: no bound.
        ray_actor_options: the replica actors' resources (num_cpus, num_gpus, ...).
        metrics_interval_s: how often each replica copies its metrics into Ray's metrics
            (None: not at all; /metrics on a replica still works).
        server_options: any other `create_app` option for each replica (max_queue_bytes).
        deployment_options: any other `serve.deployment` option (graceful_shutdown_timeout_s,
            health_check_period_s, max_replicas_per_node, ...).
    """
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if not models:
        raise ValueError("no model to serve")
    config = executor_config if executor_config is not None else ExecutorConfig()
    sources = {
        name: src if isinstance(src, ModelSource) else ModelSource.shared(src)
        for name, src in models.items()
    }
    if max_ongoing_requests is None:
        capacity = capacity_for(config, requested_batching(config))
        max_ongoing_requests = ONGOING_PER_CAPACITY * capacity * len(sources)
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        **deployment_options,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = 1 if num_replicas is None else num_replicas
    if ray_actor_options is not None:
        options["ray_actor_options"] = dict(ray_actor_options)
    app_options = {
        "max_queue": max_queue, "timeout_ms": timeout_ms, "max_request_bytes": max_request_bytes,
        **(server_options or {}),
    }
    deployment: Any = serve.deployment(serve.ingress()(ModelReplica))
    app: Application = deployment.options(**options).bind(
        sources, config, app_options, trust_compiled, metrics_interval_s
    )
    return app

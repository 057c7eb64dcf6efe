"""asyncgraph on Ray Serve: the Open Inference Protocol server, scaled out across a cluster.

    from ray import serve
    from asyncgraph.ray import build_app
    serve.run(build_app({"mlp": "mlp.pt2"}, num_replicas=2), route_prefix="/")

Ray Serve runs the replicas, restarts them, autoscales them, routes requests to them through
its HTTP proxy; each replica is the app of `asyncgraph serve` with an Executor per model
(asyncgraph/ray/deployment.py). `asyncgraph serve MODEL.pt2 --ray` runs it from the command
line. Needs the `ray` extra: `pip install asyncgraph[ray]`. docs/scale-out.md has the rest.

This package is named `asyncgraph.ray`; its modules import the `ray` library by absolute
import, which always finds the top-level `ray`, never this package.
"""

from asyncgraph.ray.deployment import (
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEPLOYMENT_NAME,
    ModelReplica,
    build_app,
)
from asyncgraph.ray.metrics import RayMetricsBridge
from asyncgraph.ray.source import ModelSource

__all__ = [
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "DEPLOYMENT_NAME",
    "ModelReplica",
    "ModelSource",
    "RayMetricsBridge",
    "build_app",
]
